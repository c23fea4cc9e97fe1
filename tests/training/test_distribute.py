"""Strategy selection, and model.fit under MirroredStrategy and MultiWorkerMirroredStrategy.

The strategies that need TensorFlow unconfigured (logical CPUs, collectives) run in worker
subprocesses (`tests/helpers/training_worker.py`), each with a timeout.
"""

import json
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from helpers import HELPERS, subprocess_env

from keras_vit.training.runs import distribute

WORKER = str(HELPERS / "training_worker.py")
TIMEOUT = 180


def test_get_strategy_default_and_auto_on_one_cpu(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert distribute.get_strategy("default") is tf.distribute.get_strategy()
    assert distribute.get_strategy("auto") is tf.distribute.get_strategy()
    one = distribute.get_strategy("one_device", devices=["/cpu:0"])
    assert isinstance(one, tf.distribute.OneDeviceStrategy)
    assert distribute.is_chief(one)


def test_get_strategy_errors(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(distribute.StrategyError, match="Unknown strategy 'gpu'"):
        distribute.get_strategy("gpu")
    with pytest.raises(distribute.StrategyError, match="TF_CONFIG"):
        distribute.get_strategy("multi_worker")
    with pytest.raises(distribute.StrategyError, match="No TPU found"):
        distribute.get_strategy("tpu")
    with pytest.raises(distribute.StrategyError, match="exactly one device"):
        distribute.get_strategy("one_device", devices=["/cpu:0", "/cpu:1"])
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(distribute.StrategyError, match="not a JSON object"):
        distribute.tf_config_workers()


def test_tf_config_workers_counts_chief_and_workers(monkeypatch):
    cluster = {"chief": ["a:1"], "worker": ["b:1", "c:1"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    assert distribute.tf_config_workers() == 3
    monkeypatch.delenv("TF_CONFIG")
    assert distribute.tf_config_workers() == 0


def test_fixes_are_version_gated_and_idempotent(monkeypatch):
    from keras.src.backend.tensorflow import optimizer, trainer

    assert distribute.fix_multi_worker_fit() is True  # Keras 3.15 is affected
    assert distribute.fix_distributed_clipping() is True
    patched = trainer.reduce_per_replica, optimizer.TFOptimizer._clip_gradients
    assert distribute.fix_multi_worker_fit() and distribute.fix_distributed_clipping()
    assert (trainer.reduce_per_replica, optimizer.TFOptimizer._clip_gradients) == patched  # once
    monkeypatch.setattr(distribute, "_keras_version", lambda: (3, 16))
    assert distribute.fix_multi_worker_fit() is False
    assert distribute.fix_distributed_clipping() is False


def test_clipping_fix_leaves_one_replica_alone():
    """Without several replicas the patched clipping is Keras's own global-norm clipping."""
    import keras

    distribute.fix_distributed_clipping()
    sgd = keras.optimizers.SGD(1.0, global_clipnorm=1.0)
    grads = [tf.constant([3.0, 4.0]), None, tf.constant([0.0])]
    clipped = sgd._clip_gradients(grads)
    np.testing.assert_allclose(clipped[0].numpy(), [0.6, 0.8], rtol=1e-6)
    assert clipped[1] is None


@pytest.mark.slow
def test_mirrored_two_cpus_matches_one_device(tmp_path):
    out = tmp_path / "mirrored.json"
    subprocess.run(
        [sys.executable, WORKER, "mirrored", str(out)],
        check=True,
        timeout=TIMEOUT,
        env=subprocess_env(),
        cwd=tmp_path,
    )
    result = json.loads(out.read_text())
    assert result["one_device"]["replicas"] == 1 and result["mirrored"]["replicas"] == 2
    assert result["mirrored"]["jit_compile"] is False  # jit_compile="auto": no XLA across replicas
    # Same global batch of 32 (16 per replica), SGD with clipping at global norm 1: the losses
    # agree to float32 rounding of the cross-replica gradient sum. Tolerance: rtol 1e-6 on the
    # losses, 1e-6 on the weights (measured: equal losses, weights within 2e-9). Clipping each
    # replica's half-gradient (Keras without `fix_distributed_clipping`) gives 1e-5 and 6e-5.
    np.testing.assert_allclose(result["mirrored"]["loss"], result["one_device"]["loss"], rtol=1e-6)
    assert result["max_weight_gap"] < 1e-6


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


@pytest.mark.slow
def test_multi_worker_fit_two_processes(tmp_path):
    workers = [f"127.0.0.1:{port}" for port in _free_ports(2)]
    processes, outputs = [], []
    for index in range(2):
        out = tmp_path / f"worker{index}" / "weights.npz"
        out.parent.mkdir()
        tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        processes.append(
            subprocess.Popen(
                [sys.executable, WORKER, "multi_worker", str(out)],
                env=subprocess_env(TF_CONFIG=json.dumps(tf_config)),
                cwd=out.parent,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        outputs.append(out)
    try:
        logs = [process.communicate(timeout=TIMEOUT)[0] for process in processes]
    finally:
        for process in processes:  # a worker left alone waits for its peer forever
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, log in zip(processes, logs, strict=True):
        assert process.returncode == 0, log[-3000:]
    first, second = (np.load(out) for out in outputs)
    assert int(first["replicas"]) == 2 and int(second["replicas"]) == 2
    assert int(first["steps"]) == int(second["steps"]) == 6
    names = [name for name in first.files if name.startswith("w")]
    assert len(names) > 10
    for name in names:
        np.testing.assert_array_equal(first[name], second[name])
    np.testing.assert_array_equal(first["loss"], second["loss"])
    assert np.all(np.isfinite(first["loss"]))
    # Only the chief (worker 0) writes the model and report.
    assert (outputs[0].parent / "run" / "model.keras").exists()
    assert not (outputs[1].parent / "run" / "model.keras").exists()

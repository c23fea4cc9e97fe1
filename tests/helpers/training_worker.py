"""Subprocess worker for the distribution and resume tests (each mode needs a fresh TensorFlow).

python tests/helpers/training_worker.py mirrored OUT.json
    2 logical CPUs (configured before TensorFlow initialises its devices); trains the tiny
    model (SGD recipe) on /cpu:0 alone and under MirroredStrategy over /cpu:0 and /cpu:1
    with the same global batch; writes both loss histories and the largest weight gap.
python tests/helpers/training_worker.py multi_worker OUT.npz
    one worker of the cluster in TF_CONFIG: trains under MultiWorkerMirroredStrategy
    (through `keras_vit.training.train`), then writes its final weights and losses.
python tests/helpers/training_worker.py slow-cli CLI_ARGS...
    `keras-vit` with every training step slowed by 0.3 s, so a test can kill it mid-run.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

TINY = dict(patch_size=8, hidden_size=32, depth=2, num_heads=2, mlp_dim=64, image_size=16)
TRAIN = dict(batch_size=32, steps=6, steps_per_epoch=3, learning_rate=3e-3, verbose=0, seed=0)


def _tiny_config():
    from keras_vit.registry.variants import ViTConfig

    return ViTConfig("vit_tiny_test", **TINY)


def mirrored(out: str) -> None:
    import json
    import tempfile

    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    from keras_vit.training import classification as training

    results = {}
    for name, strategy, jit_compile in (
        # Without XLA on one device too, so that both runs have the same kernels; under
        # MirroredStrategy "auto" must choose no XLA (it fails on logical CPU devices).
        ("one_device", tf.distribute.OneDeviceStrategy("/cpu:0"), False),
        ("mirrored", tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), "auto"),
    ):
        with tempfile.TemporaryDirectory() as output_dir:
            # SGD (the fine-tuning recipe, clipping at norm 1 included) is linear in the
            # gradient, so float32 rounding stays rounding; Adam's g / sqrt(v) can enlarge it.
            result = training.train(
                _tiny_config(),
                output_dir=output_dir,
                strategy=strategy,
                recipe="finetune",
                jit_compile=jit_compile,
                **TRAIN,
            )
        results[name] = {
            "loss": result.report["history"]["loss"],
            "replicas": result.report["replicas"],
            "jit_compile": bool(result.model.jit_compile),
            "weights": [w.tolist() for w in result.model.get_weights()],
        }
    gap = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(results["one_device"]["weights"], results["mirrored"]["weights"], strict=True)
    )
    summary = {name: {k: v for k, v in r.items() if k != "weights"} for name, r in results.items()}
    with open(out, "w") as file:
        json.dump({**summary, "max_weight_gap": gap}, file)


def multi_worker(out: str) -> None:
    import json

    import numpy as np

    from keras_vit.training import classification as training
    from keras_vit.training.runs.distribute import get_strategy

    strategy = get_strategy("multi_worker")  # before any TensorFlow op
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    result = training.train(
        _tiny_config(), output_dir=os.path.join(os.path.dirname(out), "run"), strategy=strategy, **TRAIN
    )
    arrays = {f"w{i}": w for i, w in enumerate(result.model.get_weights())}
    np.savez(
        out,
        loss=np.asarray(result.report["history"]["loss"]),
        replicas=result.report["replicas"],
        task=task,
        steps=result.report["steps"],
        **arrays,
    )


def slow_cli(argv: list[str]) -> int:
    import keras

    from keras_vit import cli
    from keras_vit.training import classification as training

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.3)

    original = training.train

    def slow_train(*args, **kwargs):
        return original(*args, callbacks=[Slow()], **kwargs)

    training.train = slow_train
    return cli.main(argv)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "mirrored":
        mirrored(rest[0])
    elif mode == "multi_worker":
        multi_worker(rest[0])
    elif mode == "slow-cli":
        sys.exit(slow_cli(rest))
    else:
        sys.exit(f"unknown mode {mode!r}")

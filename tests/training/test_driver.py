"""The training driver: planning, EMA, mixed precision, exact resume after SIGKILL, `keras-vit train`."""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest
from helpers import HELPERS, backup_epoch, sigkill_after_an_epoch, subprocess_env

import keras_vit
from keras_vit.registry.variants import ViTConfig
from keras_vit.training import classification as training
from keras_vit.training import recipes, runs
from keras_vit.training.runs.backup import sign_state

WORKER = str(HELPERS / "training_worker.py")
TIMEOUT = 180
TINY = ViTConfig(
    "vit_tiny_test", patch_size=8, hidden_size=32, depth=2, num_heads=2, mlp_dim=64, image_size=16
)
TINY_CLI = [
    "train",
    "--patch-size", "8",
    "--hidden-size", "32",
    "--depth", "2",
    "--heads", "2",
    "--mlp-dim", "64",
    "--image-size", "16",
    "--batch-size", "32",
    "--steps", "16",
    "--steps-per-epoch", "4",
    "--learning-rate", "3e-3",
    "--dropout", "0.1",  # dropout seed states must be restored too
    "--ema", "0.9",  # and the EMA averages
    "--verbose", "0",
]  # fmt: skip


def test_plan_steps():
    assert runs.plan_steps(22, None, 40, None) == (22, 40)
    assert runs.plan_steps(22, None, 2.5, 10) == (10, 6)  # 55 steps rounded up to whole epochs
    assert runs.plan_steps(22, 100, None, None) == (20, 5)  # longest divisor of 100 up to a pass
    assert runs.plan_steps(5000, 3000, None, None) == (1000, 3)  # epochs capped at 1000 steps
    with pytest.raises(ValueError, match="not a multiple of steps_per_epoch 4"):
        runs.plan_steps(22, 10, None, 4)
    with pytest.raises(ValueError, match="not both"):
        runs.plan_steps(22, 10, 1, None)


def test_model_config_overrides_and_errors():
    assert training.model_config("vit_digits") is keras_vit.VARIANTS["vit_digits"]
    assert training.model_config("vit_b16", depth=None) is keras_vit.VARIANTS["vit_b16"]
    custom = training.model_config("vit_digits", hidden_size=32, depth=2)
    assert (custom.name, custom.hidden_size, custom.depth) == ("vit_digits_custom", 32, 2)
    with pytest.raises(ValueError, match="Unknown model 'vit_x'"):
        training.model_config("vit_x")


def test_load_dataset_errors(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(ValueError, match="needs a train/ and a test/"):
        training.load_dataset(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        training.load_dataset(tmp_path / "missing")
    with pytest.raises(ValueError, match="finetune starts from a checkpoint"):
        training.finetune("vit_ti16", pretrained=False)
    with pytest.raises(ValueError, match="jit_compile must be True, False or 'auto'"):
        training.train(TINY, output_dir=tmp_path, jit_compile="yes")


def test_run_description_is_the_same_in_every_process():
    """Backups compare run arguments: sources and arrays are described without object addresses."""
    first, second = keras_vit.data.tfdata.load_digits(), keras_vit.data.tfdata.load_digits()
    assert (
        runs.describe(first)
        == runs.describe(second)
        == [
            "Source(1438 examples, 10 classes)",
            "Source(359 examples, 10 classes)",
        ]
    )
    images = np.zeros((2, 8, 8), "uint8")
    assert runs.describe(images) == runs.describe(images.copy()) != runs.describe(images + 1)


def test_backup_refuses_another_run(tmp_path):
    backup = runs.EpochBackup(tmp_path, {"steps": 16})
    assert backup.epoch == 0
    (tmp_path / "epoch-000002.weights.h5").write_bytes(b"weights")
    checksums = {"epoch-000002.weights.h5": runs.file_sha256(tmp_path / "epoch-000002.weights.h5")}
    state = {"epoch": 2, "weights": "epoch-000002.weights.h5", "sha256": checksums, "run": {"steps": 16}}
    (tmp_path / "state.json").write_text(json.dumps(sign_state(state)))
    assert runs.EpochBackup(tmp_path, {"steps": 16}).epoch == 2
    with pytest.raises(ValueError, match=r"other arguments \(steps\).*--overwrite"):
        runs.EpochBackup(tmp_path, {"steps": 32})


class _RecordWeights(keras.callbacks.Callback):
    """The raw trainable weights after every step."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append([keras.ops.convert_to_numpy(v) for v in self.model.trainable_variables])


@pytest.mark.slow
def test_ema_weights_differ_from_raw_and_are_saved(tmp_path):
    momentum = 0.5
    record = _RecordWeights()
    result = training.train(
        TINY, output_dir=tmp_path, steps=4, steps_per_epoch=2, batch_size=32, learning_rate=3e-3,
        ema_momentum=momentum, callbacks=[record], steps_per_execution=1, verbose=0,
    )  # fmt: skip
    assert result.report["steps"] == 4 and len(record.steps) == 4
    # Keras's EMA: the first step copies the weights, then average = m * average + (1 - m) * w.
    expected = record.steps[0]
    for weights in record.steps[1:]:
        expected = [momentum * a + (1 - momentum) * w for a, w in zip(expected, weights, strict=True)]
    final = [keras.ops.convert_to_numpy(v) for v in result.model.trainable_variables]
    for average, value in zip(expected, final, strict=True):
        np.testing.assert_allclose(value, average, rtol=1e-5, atol=1e-7)
    gaps = [np.max(np.abs(raw - value)) for raw, value in zip(record.steps[-1], final, strict=True)]
    assert max(gaps) > 1e-4  # the saved weights are not the raw ones
    saved = keras.saving.load_model(tmp_path / "model.keras")
    for loaded, value in zip(saved.get_weights(), result.model.get_weights(), strict=True):
        np.testing.assert_array_equal(loaded, value)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ema"] is True and report["accuracy"] == result.report["accuracy"]
    assert not (tmp_path / "backup").exists()  # removed once the run is complete


def test_execution_steps():
    assert (
        runs.execution_steps(22) == 22 and runs.execution_steps(1000) == 25 and runs.execution_steps(37) == 1
    )
    assert runs.execution_steps(22, 11) == 11 and runs.execution_steps(22, replicas=2) == 1
    for bad in (0, 3, True, "2"):
        with pytest.raises(ValueError, match="steps_per_execution"):
            runs.execution_steps(22, bad)


def test_cli_refuses_bad_steps_per_execution(capsys):
    from keras_vit.cli import build_parser

    for bad in ("0", "-2", "many"):
        with pytest.raises(SystemExit) as stopped:
            build_parser().parse_args(["train", "--steps-per-execution", bad])
        assert stopped.value.code == 2
        assert "expected 'auto' or a positive integer" in capsys.readouterr().err
    assert build_parser().parse_args(["train", "--steps-per-execution", "11"]).steps_per_execution == 11


@pytest.mark.slow
def test_steps_per_execution_gives_the_same_run(tmp_path):
    """Several steps per call (the default) trains exactly as one step per call."""
    results = [
        training.train(
            TINY,
            output_dir=tmp_path / str(n),
            steps=4,
            steps_per_epoch=4,
            batch_size=32,
            steps_per_execution=n,
            verbose=0,
        )  # fmt: skip
        for n in (1, "auto")
    ]
    assert [r.report["hyperparameters"]["steps_per_execution"] for r in results] == [1, 4]
    for one, many in zip(*(r.model.get_weights() for r in results), strict=True):
        np.testing.assert_array_equal(one, many)


@pytest.mark.slow
def test_mixed_precision_trains(tmp_path):
    result = training.train(
        TINY, output_dir=tmp_path, steps=1, steps_per_epoch=1, batch_size=32, precision="mixed_bfloat16",
        verbose=0,
    )  # fmt: skip
    model = result.model
    assert model.get_layer("block_0").compute_dtype == "bfloat16"
    assert model.jit_compile is True  # jit_compile="auto" on one replica: XLA
    # From scratch, stochastic depth defaults to the recipe's (growing to it over the blocks).
    assert model.get_layer("block_1").drop_path == pytest.approx(recipes.FROM_SCRATCH.drop_path_rate)
    assert model.get_layer("block_0").fc1.kernel.dtype == "float32"  # float32 master weights
    assert keras.config.dtype_policy().name == "float32"  # the global policy is restored
    assert result.report["steps"] == 1 and np.isfinite(result.report["history"]["loss"][0])
    assert np.any(model.get_layer("head").kernel.numpy() != 0)  # the zero head took its step
    assert model(np.zeros((1, 16, 16, 3), "float32")).dtype == "float32"


@pytest.mark.slow
def test_cli_train_sigkill_resume_is_bit_identical(tmp_path):
    """`keras-vit train` end to end; a run killed mid-way and restarted ends bit-identical."""
    cli = [sys.executable, "-m", "keras_vit.cli"]
    reference_dir, resumed_dir = tmp_path / "reference", tmp_path / "resumed"
    reference = subprocess.Popen(
        [*cli, *TINY_CLI, "--output-dir", str(reference_dir)],
        env=subprocess_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    killed = subprocess.Popen(
        [sys.executable, WORKER, "slow-cli", *TINY_CLI, "--output-dir", str(resumed_dir)],
        env=subprocess_env(), cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        sigkill_after_an_epoch(killed, resumed_dir / "backup", TIMEOUT)
        reference_log = reference.communicate(timeout=TIMEOUT)[0]
    finally:
        for process in (reference, killed):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert reference.returncode == 0, reference_log[-3000:]
    assert "held-out accuracy" in reference_log
    killed_at = backup_epoch(resumed_dir / "backup")
    assert 1 <= killed_at < 4 and not (resumed_dir / "model.keras").exists()

    resumed = subprocess.run(
        [*cli, *TINY_CLI, "--output-dir", str(resumed_dir)],
        env=subprocess_env(), cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert f"resuming the unfinished run in {resumed_dir} after epoch {killed_at}" in resumed.stderr

    first = json.loads((reference_dir / "report.json").read_text())
    second = json.loads((resumed_dir / "report.json").read_text())
    # Nothing lost, nothing repeated: 16 optimizer steps in all, the restart ran only the rest.
    assert first["steps"] == second["steps"] == 16
    assert (first["resumed_from_epoch"], first["steps_this_run"]) == (0, 16)
    assert (second["resumed_from_epoch"], second["steps_this_run"]) == (killed_at, 16 - 4 * killed_at)
    assert second["history"] == first["history"] and len(first["history"]["loss"]) == 4
    assert first["accuracy"] == second["accuracy"] and first["arguments"]["dropout"] == 0.1
    reference_model = keras.saving.load_model(reference_dir / "model.keras")
    resumed_model = keras.saving.load_model(resumed_dir / "model.keras")
    for a, b in zip(reference_model.get_weights(), resumed_model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert (reference_dir / "logs").is_dir()
    assert not (resumed_dir / "backup").exists()

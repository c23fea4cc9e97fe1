"""The training driver on JAX and PyTorch: classification and masked patch pre-training run without
TensorFlow, their PyDataset input (`keras_vit.data.pyinput`) deterministic in (seed, epoch, index), exact
resume on JAX after SIGKILL, a backbone pre-trained on JAX fine-tuned there.

The runs are subprocesses with `KERAS_BACKEND` set and TensorFlow blocked
(`tests/helpers/backend_training_worker.py`); the input tests run in this process (NumPy).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import HELPERS, backup_epoch, sigkill_after_an_epoch, subprocess_env

from keras_vit.data import datasets, pyinput

WORKER = HELPERS / "backend_training_worker.py"
TIMEOUT = 600
TINY_MODEL = {
    "name": "vit_tiny_test",
    "patch_size": 8,
    "hidden_size": 32,
    "depth": 2,
    "num_heads": 2,
    "mlp_dim": 64,
    "image_size": 16,
}
# The digits, the from-scratch recipe (AdamW, mixup, stochastic depth, dropout 0.1): 4 epochs of 2 steps.
TINY_RUN = {"model": TINY_MODEL, "batch_size": 16, "steps": 8, "steps_per_epoch": 2, "verbose": 0}
# Masked patch prediction of the digits' images (16 patches of 4x4 pixels): 4 epochs of 2 steps.
TINY_PRETRAINING = {**TINY_RUN, "task": "pretrain", "model": {**TINY_MODEL, "patch_size": 4}}


def _worker(backend: str, arguments: dict, folder: Path, *mode: str, **env) -> subprocess.Popen:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "arguments.json").write_text(json.dumps(arguments))
    command = [sys.executable, str(WORKER), str(folder / "arguments.json"), str(folder / "out.json"), *mode]
    return subprocess.Popen(
        command,
        env=subprocess_env(KERAS_BACKEND=backend, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finished(process: subprocess.Popen, folder: Path) -> dict:
    log = process.communicate(timeout=TIMEOUT)[0]
    assert process.returncode == 0, log[-3000:]
    return json.loads((folder / "out.json").read_text())


@pytest.mark.parametrize(
    "backend, devices, extra, distribution",
    [
        ("jax", 2, {}, ("DataParallel", 2, {"shape": [2], "axis_names": ["batch"]})),
        (
            "jax",
            4,
            {"model_parallel": 2},
            ("ModelParallel", 2, {"shape": [2, 2], "axis_names": ["batch", "model"]}),
        ),
        ("torch", 1, {}, ("default (one device)", 1, None)),
    ],
    ids=["jax-data-parallel", "jax-model-parallel", "torch"],
)
def test_digits_run_without_tensorflow(backend, devices, extra, distribution, tmp_path):
    """A short run of the main job's data trains, saves and reports without importing TensorFlow.
    On JAX (forced CPU devices) it is data parallel over every device by default, or model
    parallel with `model_parallel=2` (`--model-parallel 2`)."""
    output_dir = tmp_path / "run"
    process = _worker(
        backend,
        {**TINY_RUN, "output_dir": str(output_dir), "steps": 4, **extra},
        tmp_path,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    result = _finished(process, tmp_path)
    assert result["tensorflow_imported"] == [] and result["tensorflow_import_attempts"] == []
    assert sorted(os.listdir(output_dir)) == ["labels.txt", "model.keras", "report.json"]
    report = json.loads((output_dir / "report.json").read_text())
    assert report["backend"] == backend == result["backend_in_process"]
    assert (report["strategy"], report["replicas"], report.get("mesh")) == distribution
    assert len(report["devices"]) == devices
    assert report["steps"] == 4 and 0.0 <= report["accuracy"] <= 1.0
    assert report["hyperparameters"]["mixup_alpha"] > 0  # the recipe's mixup ran through the PyDataset


@pytest.mark.parametrize(
    "backend, flags, message",
    [
        ("jax", ["--strategy", "tpu"], "strategy 'tpu' is TensorFlow's"),
        ("jax", ["--model-parallel", "3"], "does not divide"),  # not the 4 devices
        ("jax", ["--model-parallel", "8"], "device"),  # more than the 4 devices
        ("jax", ["--model-parallel", "2", "--strategy", "default"], "leave strategy at 'auto'"),
        ("torch", ["--model-parallel", "2"], "needs the JAX backend"),
    ],
    ids=["tpu-strategy", "heads-not-divided", "too-few-devices", "with-a-strategy", "torch"],
)
def test_a_distribution_that_cannot_run_is_one_error_and_writes_nothing(backend, flags, message, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "keras_vit.cli", "train", *flags, "--output-dir", "run"],
        env=subprocess_env(KERAS_BACKEND=backend, XLA_FLAGS="--xla_force_host_platform_device_count=4"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("keras-vit: error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "backend, devices, distribution",
    [("jax", 2, ("DataParallel", 2)), ("torch", 1, ("default (one device)", 1))],
    ids=["jax-data-parallel", "torch"],
)
def test_pretraining_runs_without_tensorflow(backend, devices, distribution, tmp_path):
    """`pretrain()` (`keras-vit pretrain`) trains, saves the backbone and reports without importing
    TensorFlow: data parallel over every (forced CPU) device on JAX, one device on PyTorch."""
    output_dir = tmp_path / "run"
    process = _worker(
        backend,
        {**TINY_PRETRAINING, "output_dir": str(output_dir), "steps": 4},
        tmp_path,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    result = _finished(process, tmp_path)
    assert result["tensorflow_imported"] == [] and result["tensorflow_import_attempts"] == []
    assert sorted(os.listdir(output_dir)) == ["backbone.keras", "report.json"]
    report = json.loads((output_dir / "report.json").read_text())
    assert report["backend"] == backend == result["backend_in_process"]
    assert (report["strategy"], report["replicas"]) == distribution and len(report["devices"]) == devices
    assert report["steps"] == 4 and report["data"]["labels_used"] is False
    assert 0.0 < report["loss"] < 2 * report["chance_loss"] and 0.0 <= report["patch_accuracy"] <= 1.0


@pytest.mark.slow
def test_data_parallel_pretraining_is_one_device_pretraining_on_jax(tmp_path):
    """On JAX each data-parallel step sees the global batch: the corruption (its patches, and the
    random patches drawn from the whole batch) and the loss are those of one device, so the run
    is one device's up to float rounding (the same patch accuracies, losses within 1e-5)."""
    histories = {}
    for strategy in ("default", "auto"):
        folder = tmp_path / strategy
        process = _worker(
            "jax",
            {**TINY_PRETRAINING, "output_dir": str(folder / "run"), "steps": 6, "strategy": strategy},
            folder,
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
        )
        result = _finished(process, folder)
        assert result["replicas"] == (1 if strategy == "default" else 2)
        histories[strategy] = result["history"]
    one_device, data_parallel = histories["default"], histories["auto"]
    assert data_parallel["patch_accuracy"] == one_device["patch_accuracy"]
    np.testing.assert_allclose(data_parallel["loss"], one_device["loss"], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_backbone_pretrained_on_jax_fine_tunes_on_jax(tmp_path):
    """`keras-vit pretrain` then `keras-vit finetune --pretrained backbone.keras`, both on JAX and
    without TensorFlow: the fine-tuned classifier is the pre-trained backbone's (its model config)."""
    pretrained = _finished(
        _worker(
            "jax", {**TINY_PRETRAINING, "output_dir": str(tmp_path / "mpp"), "steps": 4}, tmp_path / "mpp_log"
        ),
        tmp_path / "mpp_log",
    )
    assert pretrained["backend"] == "jax"
    backbone = tmp_path / "mpp" / "backbone.keras"
    fine_tuning = {
        **TINY_RUN,
        "task": "finetune",
        "pretrained": str(backbone),
        "output_dir": str(tmp_path / "ft"),
    }
    result = _finished(_worker("jax", {**fine_tuning, "steps": 4}, tmp_path / "ft_log"), tmp_path / "ft_log")
    assert result["tensorflow_import_attempts"] == [] and result["backend"] == "jax"
    report = json.loads((tmp_path / "ft" / "report.json").read_text())
    checkpoint = hashlib.sha256(backbone.read_bytes()).hexdigest()
    assert report["recipe"] == "finetune" and report["checkpoint"]["sha256"] == checkpoint
    assert report["model_config"]["patch_size"] == 4  # the backbone's, not TINY_RUN's model
    assert report["steps"] == 4 and 0.0 <= report["accuracy"] <= 1.0


@pytest.fixture(scope="module")
def digits():
    return pyinput.load_digits()[0]


def _pipeline(source, **overrides):
    arguments = dict(image_size=16, batch_size=8, seed=3, steps_per_epoch=5, mixup_alpha=0.2)
    return pyinput.train_pipeline(source, **{**arguments, **overrides})


@pytest.mark.parametrize("start_epoch", [0, 2])
def test_batches_are_a_function_of_seed_epoch_and_index(digits, start_epoch):
    """Batch i of epoch e is the same read in any order, from a pipeline built at any epoch."""
    reference = _pipeline(digits)
    resumed = _pipeline(digits, start_epoch=start_epoch)
    for epoch, index in [(3, 4), (2, 0), (3, 1)]:  # out of order
        expected = reference[epoch * 5 + index]
        for got in (resumed[(epoch - start_epoch) * 5 + index], resumed.batch(epoch, index)):
            np.testing.assert_array_equal(got[0], expected[0])
            np.testing.assert_array_equal(got[1], expected[1])
    other_seed = _pipeline(digits, seed=4).batch(3, 4)
    assert not np.array_equal(other_seed[0], reference.batch(3, 4)[0])
    assert not np.array_equal(reference.batch(3, 3)[0], reference.batch(3, 4)[0])


def test_passes_are_permutations_and_mixup_mixes_labels(digits):
    plain = _pipeline(digits, mixup_alpha=0.0, augment=False, batch_size=digits.num_examples // 2)
    labels = np.concatenate([plain.batch(0, 0)[1], plain.batch(0, 1)[1]])
    # One pass: every example once (the pass is a permutation), so the label counts are the source's.
    assert np.bincount(labels, minlength=10).tolist() == list(digits.class_counts)
    images, mixed = _pipeline(digits).batch(1, 2)
    assert images.shape == (8, 16, 16, 3) and images.dtype == np.float32 and mixed.shape == (8, 10)
    # Mixup's own random stream: the unmixed batch is the same examples, blended with their reverse.
    unmixed_images, labels = _pipeline(digits, mixup_alpha=0.0).batch(1, 2)
    one_hot = np.eye(10, dtype="float32")[labels]
    difference = (one_hot - one_hot[::-1]).ravel()
    weight = float(np.dot(mixed.ravel() - one_hot[::-1].ravel(), difference) / np.dot(difference, difference))
    assert 0.0 < weight < 1.0
    np.testing.assert_allclose(mixed, weight * one_hot + (1 - weight) * one_hot[::-1], atol=1e-6)
    expected = weight * unmixed_images + (1 - weight) * unmixed_images[::-1]
    np.testing.assert_allclose(images, expected, atol=1e-5)


def test_augmentation_follows_the_source_and_the_options():
    """The digits: no flips and gentle crops; a flip-only run of a half-black image is mirrored
    about half the time; without augmentation the batch is the plain resize (the evaluation's)."""
    image = np.zeros((1, 8, 8, 3), "uint8")
    image[:, :, :4] = 255  # the left half white
    source = pyinput.from_arrays(np.repeat(image, 64, axis=0), np.arange(64) % 2)
    assert pyinput.load_digits()[0].augmentation() == {"crop_scale": (0.7, 1.0), "flip": False}
    flipping = pyinput.train_pipeline(
        source, image_size=8, batch_size=64, seed=0, crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip=True
    )
    left_white = flipping.batch(0, 0)[0][:, 4, 1, 0] > 0
    assert 10 < left_white.sum() < 54  # mirrored for some examples, not for others
    plain = pyinput.train_pipeline(source, image_size=8, batch_size=64, seed=0, augment=False).batch(0, 0)[0]
    spec = pyinput.Preprocessing(8, crop_pct=None, interpolation="bilinear")
    evaluated = pyinput.eval_pipeline(source, spec, batch_size=64)[0][0]
    np.testing.assert_allclose(plain, evaluated, atol=1e-6)


def test_pretraining_batches_are_the_images_of_the_training_batches(digits):
    """Pre-training's input off TensorFlow: batch i is `(images,)`, the images of the training
    pipeline's batch i (labels dropped), so it is as deterministic in (seed, epoch, index)."""
    reference = _pipeline(digits, mixup_alpha=0.0)
    resumed = pyinput.images_only(_pipeline(digits, mixup_alpha=0.0, start_epoch=2))
    assert resumed.num_batches is None and resumed.workers == reference.workers
    for epoch, index in [(3, 4), (2, 0)]:
        (images,) = resumed[(epoch - 2) * 5 + index]
        np.testing.assert_array_equal(images, reference.batch(epoch, index)[0])


def test_unlabeled_data_reads_without_tensorflow(monkeypatch, tmp_path):
    """`load_unlabeled` with the JAX and PyTorch reader (`keras_vit.data.pyinput`): the digits' train
    split, an image folder (its train/), a pyinput source and uint8 arrays; tf.data's source is
    one clear error."""
    from PIL import Image

    from keras_vit.data import tfdata as data

    monkeypatch.setattr(datasets, "input_module", lambda: pyinput)
    digits = datasets.load_unlabeled("digits")
    assert isinstance(digits, pyinput.Source) and digits.num_examples == pyinput.load_digits()[0].num_examples
    for name in ("a", "b"):
        (tmp_path / "images" / "train" / name).mkdir(parents=True)
        Image.fromarray(np.full((6, 5, 3), 9, "uint8")).save(tmp_path / "images" / "train" / name / "1.png")
    folder = datasets.load_unlabeled(str(tmp_path / "images"))
    assert isinstance(folder, pyinput.Source) and folder.files[0].endswith("train/a/1.png")
    arrays = datasets.load_unlabeled(np.zeros((3, 4, 4), "uint8"))
    assert isinstance(arrays, pyinput.Source) and arrays.read(2)[0].shape == (4, 4, 3)
    assert datasets.load_unlabeled(digits) is digits
    with pytest.raises(ValueError, match="keras_vit.data.pyinput.from_arrays"):
        datasets.load_unlabeled(data.from_arrays(np.zeros((2, 4, 4), "uint8"), np.zeros(2, "int32")))


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,run,saved_file",
    [
        ("jax", TINY_RUN, "model.keras"),
        ("torch", TINY_RUN, "model.keras"),
        ("jax", TINY_PRETRAINING, "backbone.keras"),
    ],
    ids=["jax-train", "torch-train", "jax-pretrain"],
)
def test_sigkill_resume_is_bit_identical(backend, run, saved_file, tmp_path):
    """A JAX or PyTorch run (training, or pre-training with its corruption's seed state) killed after
    an epoch and started again ends with the same weights, bit for bit, and the same history as an
    uninterrupted run: its input restarts at the epoch (pure in (seed, epoch, index)) and its state
    comes from the backup."""
    reference_dir, resumed_dir = tmp_path / "reference", tmp_path / "resumed"
    reference = _worker(backend, {**run, "output_dir": str(reference_dir / "run")}, reference_dir)
    killed = _worker(backend, {**run, "output_dir": str(resumed_dir / "run")}, resumed_dir, "slow")
    try:
        sigkill_after_an_epoch(killed, resumed_dir / "run" / "backup", TIMEOUT)
        first = _finished(reference, reference_dir)
    finally:
        for process in (reference, killed):
            if process.poll() is None:
                process.kill()
                process.wait()
    killed_at = backup_epoch(resumed_dir / "run" / "backup")
    assert 1 <= killed_at < 4 and not (resumed_dir / "run" / saved_file).exists()
    second = _finished(
        _worker(backend, {**run, "output_dir": str(resumed_dir / "run")}, resumed_dir), resumed_dir
    )
    assert second["resumed_from_epoch"] == killed_at and first["resumed_from_epoch"] == 0
    assert first["steps"] == second["steps"] == 8 and second["history"] == first["history"]
    assert first["weights_sha256"] == second["weights_sha256"]
    assert first.get("accuracy") == second.get("accuracy")
    assert second["tensorflow_import_attempts"] == []


def test_image_folder_reads_as_tf_data_reads_it(tmp_path):
    """An image folder without TensorFlow: the same classes, files, labels and pixels as
    `keras_vit.data.tfdata.from_directory` (Pillow decodes; TensorFlow decodes as Pillow does), and a
    damaged file is refused by both, naming it."""
    from PIL import Image

    from keras_vit.data import tfdata as data

    rng = np.random.default_rng(0)
    for index, name in enumerate(["cat", "cat", "dog", "dog", "dog"]):
        (tmp_path / "images" / name).mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (12 + index, 10, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / "images" / name / f"{index}.png")
    Image.fromarray(pixels).save(tmp_path / "images" / "dog" / "5.jpg", quality=90)
    ours, theirs = pyinput.from_directory(tmp_path / "images"), data.from_directory(tmp_path / "images")
    assert (ours.class_names, ours.files, ours.class_counts) == (theirs.class_names, theirs.files, (2, 4))
    for index, (image, label) in enumerate(theirs.dataset.as_numpy_iterator()):
        np.testing.assert_array_equal(ours.read(index)[0], image)
        assert ours.read(index)[1] == label == ours.labels[index]
    (tmp_path / "images" / "dog" / "6.png").write_bytes(b"not an image")
    for reader in (pyinput.from_directory, data.from_directory):
        with pytest.raises(ValueError, match="6.png"):
            reader(tmp_path / "images")

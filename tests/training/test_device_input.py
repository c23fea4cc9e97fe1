"""uint8 to the device (issue 35 item 2): both readers ship uint8 training batches (mixup as one weight
per row), the training driver fits a `DeviceInput` that normalises and mixes them on the device, and a
mixup step there equals the host's float32 mixup within float rounding on every backend."""

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import HELPERS, REPO, subprocess_env

from keras_vit.data import pyinput
from keras_vit.data import tfdata as data
from keras_vit.data.pyinput import PIXELS
from keras_vit.registry.catalog import normalize
from keras_vit.registry.variants import model_config
from keras_vit.training import classification
from keras_vit.training.device_input import DeviceInput, unwrapped
from keras_vit.training.options import ClassifierOptions
from keras_vit.training.recipes import FROM_SCRATCH

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)


def _arrays(count=40, size=20):
    images = np.random.default_rng(0).integers(0, 256, (count, size, size, 3), dtype="uint8")
    return images, np.arange(count)  # a label per image: the order reads off the labels


@pytest.mark.parametrize("mixup_alpha", [0.0, 0.4])
def test_pyinput_uint8_batches_are_the_float_batches_before_normalising(mixup_alpha):
    """`pixels="uint8"`: the same crops and flips as the float32 batches, unnormalised (normalising them
    gives the float32 batch bit for bit), int32 labels, and with mixup the batch's weight on every row."""
    source = pyinput.from_arrays(*_arrays())
    options = dict(image_size=12, batch_size=8, mean=MEAN, std=STD, seed=3, mixup_alpha=mixup_alpha)
    pixels = pyinput.train_pipeline(source, pixels="uint8", **options)
    floats = pyinput.train_pipeline(source, **{**options, "mixup_alpha": 0.0})
    for epoch, index in [(0, 0), (1, 3), (4, 2)]:
        x, labels = pixels.batch(epoch, index)
        images = x["images"] if mixup_alpha else x
        assert images.dtype == np.uint8 and images.shape == (8, 12, 12, 3) and labels.dtype == np.int32
        host, host_labels = floats.batch(epoch, index)
        np.testing.assert_array_equal(normalize(images, MEAN, STD), host)
        np.testing.assert_array_equal(labels, host_labels)
        if mixup_alpha:
            weight = pixels.mixup_weight(epoch * pixels.steps + index)
            np.testing.assert_array_equal(x["mixup_weight"], np.full(8, weight, "float32"))
            assert x["mixup_weight"].dtype == np.float32 and 0.0 < weight < 1.0
        # a process's rows of the global batch (multi-process runs), partners not read
        rows = pyinput.train_pipeline(source, pixels="uint8", rows=slice(4, 8), **options).batch(epoch, index)
        piece = rows[0]["images"] if mixup_alpha else rows[0]
        np.testing.assert_array_equal(piece, images[4:])
    with pytest.raises(ValueError, match="pixels"):
        pyinput.train_pipeline(source, pixels="float16", **options)


@pytest.mark.filterwarnings("ignore:Skipped image file")  # the bad file: counted in `bad_images`
def test_uint8_evaluation_batches_are_the_float_batches_before_normalising(tmp_path, monkeypatch):
    """`eval_pipeline(pixels="uint8")` of both readers: uint8 pixels whose normalisation is the float32
    batch bit for bit, the same labels; pyinput's padded last batch and the blank in place of a file
    that fails when read too."""
    spec = pyinput.Preprocessing(12, MEAN, STD, None, "bicubic", resampler="tensorflow")
    arrays = _arrays(count=13)
    options = dict(batch_size=4, pad=True, workers=0)
    for source in (pyinput.from_arrays(*arrays), _folder_with_a_bad_file(tmp_path, arrays[0], monkeypatch)):
        floats, pixels = (pyinput.eval_pipeline(source, spec, pixels=kind, **options) for kind in PIXELS)
        assert len(pixels) == len(floats) == 4
        for index in range(4):
            (images, labels), (host, host_labels) = pixels[index], floats[index]
            assert images.dtype == np.uint8 and images.shape == (4, 12, 12, 3) and labels.dtype == np.int32
            np.testing.assert_array_equal(normalize(images, MEAN, STD), host)
            np.testing.assert_array_equal(labels, host_labels)
    assert source.bad_images.indices == {1} and (pixels[0][0][1] == 0).all()

    tf_source = data.from_arrays(*arrays)
    tf_floats, tf_pixels = (
        list(data.eval_pipeline(tf_source, spec, batch_size=4, pixels=kind)) for kind in PIXELS
    )
    assert [int(labels.shape[0]) for _, labels in tf_pixels] == [4, 4, 4, 1]
    for (images, labels), (host, host_labels) in zip(tf_pixels, tf_floats, strict=True):
        assert images.dtype.name == "uint8"
        np.testing.assert_array_equal(normalize(images.numpy(), MEAN, STD), host.numpy())
        np.testing.assert_array_equal(labels.numpy(), host_labels.numpy())
    with pytest.raises(ValueError, match="pixels"):
        pyinput.eval_pipeline(source, spec, batch_size=4, pixels="int8")
    with pytest.raises(ValueError, match="pixels"):
        data.eval_pipeline(tf_source, spec, batch_size=4, pixels="int8")


def _folder_with_a_bad_file(root, images, monkeypatch) -> pyinput.Source:
    """`images` as a one-class folder of PNGs read with `on_bad_image="skip"`, the second cut after
    its header (the listing's check let through: it fails when read)."""
    from PIL import Image

    (root / "a").mkdir()
    for index, image in enumerate(images):
        Image.fromarray(image).save(root / "a" / f"{index:02d}.png")
    (root / "a" / "01.png").write_bytes((root / "a" / "01.png").read_bytes()[:100])
    monkeypatch.setattr(pyinput, "image_problem", lambda path, max_pixels: None)
    return pyinput.from_directory(root, on_bad_image="skip")


def test_tfdata_uint8_batches_are_the_float_batches_rounded():
    """tf.data's `pixels="uint8"`: its float32 batches' pixels rounded (within half a level once
    normalised), the same labels, and with mixup the weights the float32 mixup blends with."""
    source = data.from_arrays(*_arrays())
    options = dict(image_size=12, batch_size=8, mean=MEAN, std=STD, seed=3)
    plain = list(data.train_pipeline(source, **options).take(3))
    pixels = list(data.train_pipeline(source, pixels="uint8", **options).take(3))
    mixed = list(data.train_pipeline(source, mixup_alpha=0.4, **options).take(3))
    weighted = list(data.train_pipeline(source, mixup_alpha=0.4, pixels="uint8", **options).take(3))
    half_level = 0.5 / 255 / np.asarray(STD, "float32") + 1e-6
    for (host, labels), (images, uint8_labels), (_, targets), (x, mixed_labels) in zip(
        plain, pixels, mixed, weighted, strict=True
    ):
        assert images.dtype == np.uint8 and x["images"].dtype == np.uint8
        assert np.all(np.abs(normalize(images.numpy(), MEAN, STD) - host.numpy()) <= half_level)
        np.testing.assert_array_equal(x["images"], images)
        np.testing.assert_array_equal(labels, uint8_labels)
        np.testing.assert_array_equal(labels, mixed_labels)
        weight = targets.numpy()[0, labels[0]]
        np.testing.assert_allclose(x["mixup_weight"], np.full(8, weight), atol=1e-6)
    images_only = next(
        iter(data.images_only(data.train_pipeline(source, mixup_alpha=0.4, pixels="uint8", **options)))
    )
    assert images_only.dtype == np.uint8 and images_only.shape == (8, 12, 12, 3)


def test_training_driver_fits_uint8_batches_and_saves_the_float_model(tmp_path, monkeypatch):
    """A `train` run (TensorFlow, tf.data) never normalises or mixes images on the host: its training
    batches are uint8 with mixup weights, the model fitted is a `DeviceInput`, and the model saved and
    returned is the ViT with its float input; the JAX/PyTorch reader's batches the same."""
    normalised = []
    real_normaliser = data._normaliser

    def spied_normaliser(mean, std):
        function = real_normaliser(mean, std)
        return lambda image: normalised.append(image) or function(image)

    monkeypatch.setattr(data, "_normaliser", spied_normaliser)
    fitted, specs = [], []
    real_train_data = classification.ClassificationTask.train_data

    def spied_train_data(self, network, start_epoch, steps_per_epoch):
        fitted.append(network)
        batches = real_train_data(self, network, start_epoch, steps_per_epoch)
        specs.append(batches.element_spec)
        return batches

    monkeypatch.setattr(classification.ClassificationTask, "train_data", spied_train_data)
    result = classification.train(steps=2, batch_size=16, output_dir=str(tmp_path / "run"), verbose=0)
    assert normalised == [] and isinstance(fitted[0], DeviceInput)
    ((x_spec, label_spec),) = specs
    assert x_spec["images"].dtype.name == "uint8" and x_spec["mixup_weight"].dtype.name == "float32"
    assert label_spec.dtype.name == "int32" and result.report["hyperparameters"]["mixup_alpha"] > 0
    assert result.model is unwrapped(fitted[0]) and result.model.input.dtype == "float32"
    assert json.loads((tmp_path / "run" / "report.json").read_text())["model"] == result.model.name

    options = ClassifierOptions(batch_size=16, mixup_alpha=0.2)
    task = classification.ClassificationTask(model_config("vit_digits"), "digits", FROM_SCRATCH, options)
    monkeypatch.setattr(classification, "input_module", lambda: pyinput)
    monkeypatch.setattr(classification, "load_dataset", lambda *args, **kwargs: pyinput.load_digits())
    steps = task.prepare(16)
    x, labels = real_train_data(task, task.build(), 0, steps)[0]
    assert (
        x["images"].dtype == np.uint8 and x["mixup_weight"].dtype == np.float32 and labels.dtype == np.int32
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_device_input_equals_the_host_float_input_in_training_and_evaluation(backend):
    """One mixup batch: `DeviceInput` on the uint8 batch and its weights against the ViT on the host's
    normalised, mixed float32 batch (the same initial weights): the same loss and accuracy within float
    rounding (measured: equal on TensorFlow and PyTorch, 1e-7 relative on JAX) and the same weights
    after one SGD step (measured: equal, 1.3e-7 on JAX) while the step moved them by ~0.2-0.35. The
    driver's held-out metrics, from uint8 batches through `DeviceInput`, are the returned ViT's on
    normalised float32 batches (measured: equal on every backend)."""
    command = [sys.executable, str(HELPERS / "device_input_worker.py")]
    env = subprocess_env(KERAS_BACKEND=backend, PYTHONPATH=f"{REPO}{':'}{REPO / 'tests'}")
    output = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert output.returncode == 0, output.stderr[-3000:]
    result = json.loads(output.stdout.strip().splitlines()[-1])
    assert result["backend"] == backend
    assert result["host_images_dtype"] == "float32" and result["device_images_dtype"] == "uint8"
    assert result["device_loss"] == pytest.approx(result["host_loss"], rel=1e-6)
    assert result["device_accuracy"] == result["host_accuracy"]
    assert result["step_moved_weights_by"] > 0.05 and result["weight_difference"] <= 1e-5
    assert result["evaluation_dtype"] == "float32"
    assert result["reported_loss"] == pytest.approx(result["float_loss"], rel=1e-6)
    assert result["reported_accuracy"] == pytest.approx(result["float_accuracy"], abs=1e-6)


def test_device_input_passes_float_batches_and_refuses_mixing_a_uint8_model():
    """Evaluation's normalised float batches pass through unchanged; a model that normalises itself
    (`image_dtype="uint8"`) gets the uint8 pixels, and mixup for it is one clear error."""
    from keras_vit.models.build import build_vit

    config = model_config("vit_digits", image_size=16, patch_size=4)
    network = build_vit(config, num_classes=10, classifier_activation=None)
    trainer = DeviceInput(network, MEAN, STD, num_classes=10)
    floats = np.random.default_rng(0).normal(size=(2, 16, 16, 3)).astype("float32")
    np.testing.assert_array_equal(np.asarray(trainer.images(floats)), floats)
    pixels = np.random.default_rng(1).integers(0, 256, (2, 16, 16, 3), dtype="uint8")
    np.testing.assert_array_equal(np.asarray(trainer.images(pixels)), normalize(pixels, MEAN, STD))
    uint8_model = build_vit(config, num_classes=10, classifier_activation=None, image_dtype="uint8")
    uint8_trainer = DeviceInput(uint8_model, MEAN, STD, num_classes=10)
    assert uint8_trainer.images(pixels) is pixels
    with pytest.raises(ValueError, match="mixup needs a model with a float input"):
        uint8_trainer.images({"images": pixels, "mixup_weight": np.full(2, 0.3, "float32")})

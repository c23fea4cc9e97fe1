"""`image_dtype="uint8"`: pixels normalised inside the model equal normalising on the host.

A uint8 model and a float model with the same weights: `predict(uint8 pixels)` against
`predict(preprocess_input(pixels))`, the normalised pixels bit for bit and the logits within
1e-6, under float32 and mixed bfloat16; in this process (TensorFlow in the suite) and, through
this file run as a script, on JAX in a subprocess.

    KERAS_BACKEND=jax python tests/models/test_uint8_input.py OUT.json
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import ViTConfig
from keras_vit.data.preprocessing import Preprocessing

CONFIG = ViTConfig("tiny_uint8", 4, 32, 2, 2, 64, image_size=(16, 12))
STATISTICS = {"google": None, "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))}


def compare(policy: str, statistics: str) -> dict:
    """Largest differences between the uint8 model and host normalisation + the float model."""
    keras.config.set_dtype_policy(policy)
    try:
        mean, std = STATISTICS[statistics] or (None, None)
        uint8 = keras_vit.build_vit(
            CONFIG,
            num_classes=5,
            classifier_activation=None,
            image_dtype="uint8",
            image_mean=mean,
            image_std=std,
        )
        floats = keras_vit.build_vit(CONFIG, num_classes=5, classifier_activation=None)
    finally:
        keras.config.set_dtype_policy("float32")
    rng = np.random.default_rng(0)
    for weight in floats.weights:
        weight.assign(rng.normal(0, 0.2, weight.shape).astype("float32"))
    uint8.set_weights(floats.get_weights())
    pixels = rng.integers(0, 256, (4, *CONFIG.image_hw, 3)).astype("uint8")
    pixels[0, 0, 0], pixels[0, 0, 1] = 0, 255  # both ends of the table
    spec = Preprocessing(CONFIG.image_hw, mean=uint8.image_mean, std=uint8.image_std)
    normalised = keras_vit.preprocess_input(pixels, spec)
    on_device = keras.Model(uint8.input, uint8.get_layer("pixel_normalization").output)
    device_pixels = on_device.predict(pixels, verbose=0)
    return {
        "backend": keras.backend.backend(),
        "input_dtype": str(uint8.input.dtype),
        "pixels_dtype": str(device_pixels.dtype),
        "pixel_diff": float(np.abs(device_pixels - normalised).max()),
        "logit_diff": float(
            np.abs(uint8.predict(pixels, verbose=0) - floats.predict(normalised, verbose=0)).max()
        ),
        "logit_scale": float(np.abs(floats.predict(normalised, verbose=0)).max()),
        "mean": list(uint8.image_mean),
    }


CASES = [(policy, statistics) for policy in ("float32", "mixed_bfloat16") for statistics in STATISTICS]


def check(result: dict, statistics: str) -> None:
    assert result["input_dtype"] == "uint8"
    assert result["pixels_dtype"] == "float32"
    assert result["pixel_diff"] == 0.0  # bit for bit
    assert result["logit_scale"] > 0.1
    assert result["logit_diff"] <= 1e-6
    expected_mean = STATISTICS[statistics][0] if STATISTICS[statistics] else (0.5, 0.5, 0.5)
    np.testing.assert_allclose(result["mean"], expected_mean)


@pytest.mark.parametrize(("policy", "statistics"), CASES)
def test_uint8_input_equals_normalising_on_the_host(policy, statistics):
    check(compare(policy, statistics), statistics)


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="no jax")
@pytest.mark.skipif(keras.backend.backend() == "jax", reason="runs on JAX in this process already")
def test_uint8_input_equals_normalising_on_the_host_on_jax(tmp_path):
    from helpers import subprocess_env

    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, __file__, str(out)],
        env=subprocess_env(KERAS_BACKEND="jax"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert len(results) == len(CASES)
    for (_, statistics), result in zip(CASES, results, strict=True):
        assert result["backend"] == "jax"
        check(result, statistics)


def test_statistics_come_from_the_catalog_checkpoint_of_the_name(monkeypatch):
    """A model built from a catalog tag (its name) normalises with that row's mean and std (every row
    has Google's 0.5 today: one is given ImageNet's statistics here), any other with the default."""
    import dataclasses

    from keras_vit.registry import catalog

    tag = keras_vit.list_pretrained()[0]
    mean, std = STATISTICS["imagenet"]
    entry = dataclasses.replace(catalog.get_entry(tag), mean=mean, std=std)
    monkeypatch.setattr(catalog, "get_entry", lambda name, variant=None: entry)
    model = keras_vit.build_vit(CONFIG, num_classes=5, image_dtype="uint8", name=tag)
    assert (model.image_mean, model.image_std) == (mean, std)
    default = keras_vit.build_vit(CONFIG, num_classes=5, image_dtype="uint8", name="mine")
    assert (default.image_mean, default.image_std) == ((0.5,) * 3, (0.5,) * 3)


def test_uint8_model_round_trips_and_refuses_float_images(tmp_path):
    model = keras_vit.build_vit(CONFIG, num_classes=5, image_dtype="uint8", image_mean=0.4, image_std=0.2)
    model.save(tmp_path / "model.keras")
    loaded = keras_vit.load_model(tmp_path / "model.keras")
    assert (loaded.image_dtype, loaded.image_mean, loaded.image_std) == ("uint8", (0.4,) * 3, (0.2,) * 3)
    pixels = np.random.default_rng(0).integers(0, 256, (2, *CONFIG.image_hw, 3)).astype("uint8")
    np.testing.assert_array_equal(loaded.predict(pixels, verbose=0), model.predict(pixels, verbose=0))
    with pytest.raises(ValueError, match=r"takes uint8 pixels in \[0, 255\].*got float32 images"):
        model.predict(pixels.astype("float32"), verbose=0)


def test_bad_image_dtype_arguments_are_refused():
    with pytest.raises(ValueError, match=r"image_dtype must be one of \('float32', 'uint8'\)"):
        keras_vit.build_vit(CONFIG, image_dtype="float16")
    with pytest.raises(ValueError, match=r"normalise a uint8 input: pass image_dtype='uint8'"):
        keras_vit.build_vit(CONFIG, image_mean=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match=r"std must be positive"):
        keras_vit.build_vit(CONFIG, image_dtype="uint8", image_std=0)


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps([compare(policy, statistics) for policy, statistics in CASES]))

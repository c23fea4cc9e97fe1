"""ONNX and LiteRT export: the files run in onnxruntime and the LiteRT interpreter with Keras's logits."""

import os

import keras
import numpy as np
import onnxruntime as ort
import pytest
from ai_edge_litert import interpreter as litert
from helpers import random_images

import keras_vit
from keras_vit import cli
from keras_vit.data.preprocessing import Preprocessing, preprocess_input
from keras_vit.registry.variants import ViTConfig

TINY = ViTConfig("tiny_vit", 4, 32, 2, 2, 64, image_size=32)
# Max |logit difference|, float32 runtimes vs Keras: about twice the largest gap measured
TOLERANCE = {"onnx": 6e-7, "onnx, one image or uint8": 4e-7, "litert": 1e-6}  # gaps 3e-7, 1.8e-7, 4.8e-7


@pytest.fixture(scope="module")
def tiny():
    model = keras_vit.build_vit(TINY, num_classes=5, classifier_activation=None)
    rng = np.random.default_rng(0)
    for variable in model.weights:
        noise = rng.normal(0, 0.1, variable.shape) + (1.0 if variable.path.endswith("gamma") else 0.0)
        variable.assign(noise.astype("float32"))
    return model


def run_onnx(path, images):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (feed,) = session.get_inputs()
    assert feed.name == "images"
    return session.run(None, {feed.name: images})[0]


def run_litert(path, images):
    interpreter = litert.Interpreter(model_path=str(path))
    (feed,) = interpreter.get_input_details()
    interpreter.resize_tensor_input(feed["index"], images.shape)
    interpreter.allocate_tensors()
    interpreter.set_tensor(feed["index"], images)
    interpreter.invoke()
    return interpreter.get_tensor(interpreter.get_output_details()[0]["index"])


def uint8_images(model, batch=2):
    rng = np.random.default_rng(1)
    return rng.integers(0, 256, (batch, *model.input_shape[1:]), dtype=np.uint8)


def test_onnx_runs_in_onnxruntime(tiny, tmp_path, parity):
    images = random_images(3, TINY.image_hw)
    path = keras_vit.export_onnx(tiny, tmp_path / "tiny.onnx")
    parity(
        run_onnx(path, images), keras.ops.convert_to_numpy(tiny(images)), TOLERANCE["onnx"], "ONNX float32"
    )

    pixels = uint8_images(tiny)
    path = keras_vit.export_onnx(tiny, tmp_path / "tiny.onnx", preprocessing=True, overwrite=True)
    expected = tiny(preprocess_input(pixels.astype("float32"), Preprocessing.for_model(tiny)))
    parity(
        run_onnx(path, pixels),
        keras.ops.convert_to_numpy(expected),
        TOLERANCE["onnx, one image or uint8"],
        "ONNX, uint8 pixels",
    )


def test_litert_runs_in_the_interpreter(tiny, tmp_path, parity):
    images = random_images(3, TINY.image_hw)
    path = keras_vit.export_litert(tiny, tmp_path / "tiny.tflite")
    expected = keras.ops.convert_to_numpy(tiny(images))
    parity(run_litert(path, images), expected, TOLERANCE["litert"], "LiteRT float32")

    pixels = uint8_images(tiny)
    quantized = keras_vit.export_litert(tiny, tmp_path / "int8.tflite", preprocessing=True, int8=True)
    # int8 kernels (a tiny model's file is mostly graph and float biases: 60% here, 26% for ViT-S/16)
    assert os.path.getsize(quantized) < 0.75 * os.path.getsize(path)
    expected = keras.ops.convert_to_numpy(
        tiny(preprocess_input(pixels.astype("float32"), Preprocessing.for_model(tiny)))
    )
    # int8 weights: ~1e-2 on logits of magnitude ~1 for this model, far from float32 parity but close.
    largest = np.abs(expected).max()
    label = f"LiteRT int8 weights, uint8 pixels (largest logit {largest:.2f})"
    deviation = parity(run_litert(quantized, pixels), expected, 0.1 * largest, label)
    assert deviation > 1e-5  # the weights really are int8


def test_export_refuses_to_overwrite_and_wrong_suffix(tiny, tmp_path):
    existing = tmp_path / "model.onnx"
    existing.write_bytes(b"keep")
    with pytest.raises(FileExistsError, match="overwrite"):
        keras_vit.export_onnx(tiny, existing)
    assert existing.read_bytes() == b"keep"
    with pytest.raises(ValueError, match=r"should end in \.tflite"):
        keras_vit.export_litert(tiny, tmp_path / "model.onnx")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.onnx"]


def test_cli_export_formats(tiny, tmp_path, capsys, parity):
    saved = tmp_path / "tiny.keras"
    tiny.save(saved)
    images = random_images(1, TINY.image_hw)
    expected = keras.ops.convert_to_numpy(tiny(images))
    assert cli.main(["export", str(tmp_path / "m.onnx"), "--format", "onnx", "--model", str(saved)]) == 0
    assert "wrote" in capsys.readouterr().out
    parity(
        run_onnx(tmp_path / "m.onnx", images),
        expected,
        TOLERANCE["onnx, one image or uint8"],
        "ONNX from the CLI",
    )
    assert cli.main(["export", str(tmp_path / "m.onnx"), "--format", "onnx", "--model", str(saved)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (
        cli.main(["export", str(tmp_path / "m2.onnx"), "--format", "onnx", "--model", str(saved), "--int8"])
        == 1
    )
    assert "--int8 applies to --format litert" in capsys.readouterr().err

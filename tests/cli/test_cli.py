"""The `keras-vit` command line and the README's main job (examples/classify.py), offline."""

import json
import runpy
import subprocess
import sys

import keras
import numpy as np
import pytest
from helpers import REPO, subprocess_env
from helpers.checkpoint_writers import random_timm_vit, save_timm_safetensors, to_torch
from PIL import Image

import keras_vit
from keras_vit import cli

EXAMPLE = REPO / "examples" / "classify.py"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random timm ViT-Ti/16 in timm's hub format, and the reference model."""
    reference = random_timm_vit("vit_ti16")
    path = save_timm_safetensors(reference, tmp_path_factory.mktemp("ckpt") / "model.safetensors")
    return path, reference


@pytest.fixture(scope="module")
def photo(tmp_path_factory):
    from skimage import data

    path = tmp_path_factory.mktemp("img") / "cat.png"
    Image.fromarray(data.chelsea()).save(path)
    return path


def _top_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("  ")]


def test_predict_matches_reference(checkpoint, photo, capsys):
    path, reference = checkpoint
    assert cli.main(["predict", str(photo), "--model", "vit_ti16", "--weights", str(path), "--top", "3"]) == 0
    lines = _top_lines(capsys.readouterr().out)
    assert len(lines) == 3
    pixels = keras_vit.preprocess_input(keras_vit.load_image(photo, 224, 0.9)[None])
    with __import__("torch").no_grad():
        expected = reference(to_torch(pixels)).softmax(-1).numpy()[0]
    # random weights: near-ties among the top classes, so each printed class's probability is
    # checked against the reference (printed to 0.01%), and no unprinted class may beat it
    third = np.sort(expected)[-3]
    for line in lines:
        percent, index = line.split()[:2]
        probability = expected[int(index)]
        assert abs(float(percent.rstrip("%")) / 100 - probability) <= 5.1e-5, (line, probability)
        assert probability >= third - 1e-6, (line, third)


def test_convert_and_checkpoint_info(checkpoint, tmp_path, capsys, parity):
    path, reference = checkpoint
    assert cli.main(["checkpoint", str(path)]) == 0
    out = capsys.readouterr().out
    assert "format: timm" in out and "hidden_size: 192" in out
    # the .keras file computes the checkpoint's logits (up to the factory's softmax on top)
    target = tmp_path / "ti.keras"
    assert cli.main(["convert", str(target), "--model", "vit_ti16", "--weights", str(path)]) == 0
    model = keras.models.load_model(target)
    images = keras_vit.preprocess_input(np.random.default_rng(0).integers(0, 256, (2, 224, 224, 3)))
    with __import__("torch").no_grad():
        expected = reference(to_torch(images)).log_softmax(-1).numpy()
    parity(np.log(keras.ops.convert_to_numpy(model(images))), expected, 1e-5, "log-probabilities")
    # another class count: a new head on the same features
    target = tmp_path / "tiny.keras"
    args = ["convert", str(target), "--model", "vit_ti16", "--weights", str(path), "--num-classes", "5"]
    assert cli.main(args) == 0
    model = keras.models.load_model(target)
    assert model.output_shape == (None, 5)


def test_listings(capsys):
    assert cli.main(["models"]) == 0
    assert "vit_h14" in capsys.readouterr().out
    assert cli.main(["pretrained", "vit_b16"]) == 0
    assert "vit_b16.augreg2_in21k_ft_in1k" in capsys.readouterr().out


def test_errors_are_one_line_messages(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # empty cache
    image = tmp_path / "x.png"
    image.write_bytes(b"")  # checked to exist before the model is built
    assert cli.main(["predict", str(image), "--model", "vit_ti16"]) == 1  # offline, empty cache
    err = capsys.readouterr().err
    assert err.startswith("keras-vit: error:") and "timm/vit_tiny_patch16_224" in err


def test_example_classifies_the_cat_photo(checkpoint, monkeypatch, capsys):
    path, _ = checkpoint
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--model", "vit_ti16", "--weights", str(path)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "chelsea" in out and len(_top_lines(out)) == 5


@pytest.mark.parametrize(
    ("command", "function"), [("train", "training.train"), ("pretrain", "training.pretrain.pretrain")]
)
def test_cli_defaults_are_the_library_defaults(command, function):
    """Every default is declared once (keras_vit.utils.defaults): the CLI passes the library's own values."""
    import functools
    import inspect

    signature = inspect.signature(functools.reduce(getattr, function.split("."), keras_vit))
    args = cli.build_parser().parse_args([command])
    renamed = {"ema": "ema_momentum", "drop_path": "drop_path_rate", "model": "model"}
    checked = 0
    for flag, value in vars(args).items():
        parameter = signature.parameters.get(renamed.get(flag, flag))
        if parameter is None or parameter.default is inspect.Parameter.empty or value is None:
            continue
        if flag == "jit_compile":
            value = {"on": True, "off": False}.get(value, value)
        assert value == parameter.default, (flag, value, parameter.default)
        checked += 1
    assert checked >= 12, checked


def test_refusals_come_before_the_backend_is_imported(tmp_path):
    """A missing file or a flag the mode cannot honour is refused before TensorFlow, Keras or
    another backend is imported: the error comes in a fraction of a second, not after the imports."""
    missing = str(tmp_path / "missing")
    refused = {
        "predict": ["predict", missing + ".jpg"],
        "inspect": ["inspect", missing + ".jpg"],
        "checkpoint": ["checkpoint", missing + ".npz"],
        "convert": ["convert", missing + ".keras", str(tmp_path / "out"), "--to", "timm"],
        "export": ["export", str(tmp_path / "export"), "--format", "onnx", "--version", "2"],
        "push": ["push", missing + ".keras", "user/name", "--model", "vit_ti16"],
    }
    code = (
        "import contextlib, io, json, sys\n"
        "from keras_vit.cli import main\n"
        "results = {}\n"
        f"for name, argv in {refused!r}.items():\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        status = main(argv)\n"
        "    results[name] = [status, err.getvalue().strip()]\n"
        "heavy = sorted(m for m in ('tensorflow', 'keras', 'torch', 'jax') if m in sys.modules)\n"
        "print(json.dumps({'results': results, 'imported': heavy}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=subprocess_env()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["imported"] == []
    for name, (status, message) in report["results"].items():
        assert status == 1 and message.startswith("keras-vit: error: ") and "\n" not in message, name
    assert "does not exist" in report["results"]["predict"][1]
    assert "--version cannot be used with --format onnx" in report["results"]["export"][1]
    assert (
        "--model cannot be used" in report["results"]["push"][1]
        or "does not exist" in report["results"]["push"][1]
    )

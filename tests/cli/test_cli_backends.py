"""`keras-vit` under each Keras backend: no crash, one clear line, TensorFlow only where it is needed.

With torch 2.14.1, importing TensorFlow before torch crashes the process (exit status 139,
a segmentation fault, no message): the command line must import the backend first, through
Keras, and TensorFlow only on the TensorFlow backend. Each case runs in a fresh process.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO

# Runs `keras-vit ARGV` in-process and then says whether TensorFlow got imported.
_SCRIPT = (
    "import sys\n"
    "from keras_vit import cli\n"
    "try:\n"
    "    status = cli.main(sys.argv[1:])\n"
    "except SystemExit as stop:\n"
    "    status = stop.code\n"
    "print('tensorflow imported:', 'tensorflow' in sys.modules)\n"
    "sys.exit(status)\n"
)


def _keras_vit(argv: list[str], backend: str, cwd: Path) -> subprocess.CompletedProcess:
    environment = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT, *argv],
        env=environment,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
@pytest.mark.parametrize(
    "argv",
    [["--help"], ["inspect", "--help"], ["train", "--help"], ["models"]],
    ids=" ".join,
)
def test_help_and_listings_import_no_backend(argv, backend, tmp_path):
    done = _keras_vit(argv, backend, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "tensorflow imported: False" in done.stdout
    assert ("vit_b16" if argv == ["models"] else "usage: keras-vit") in done.stdout


@pytest.mark.parametrize("backend", ["torch", "jax"])
@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "missing.png", "--model", "vit_ti16", "--weights", "random"], "missing.png"),
        (["predict", "missing.png", "--model", "vit_ti16", "--weights", "false"], "missing.png"),
        (["train", "--dataset", "mnist", "--steps", "1"], "needs the TensorFlow backend (tf.data)"),
        (["pretrain", "--dataset", "mnist", "--steps", "1"], "needs the TensorFlow backend (tf.data)"),
    ],
    ids=lambda value: " ".join(value[:2]) if isinstance(value, list) else "",
)
def test_commands_on_other_backends_stop_with_one_line_and_no_tensorflow(argv, message, backend, tmp_path):
    """Under torch these exited 139 before (TensorFlow imported before torch)."""
    done = _keras_vit(argv, backend, tmp_path)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    errors = [line for line in done.stderr.splitlines() if line.startswith("keras-vit: error:")]
    assert len(errors) == 1 and message in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "tensorflow imported: False" in done.stdout
    assert os.listdir(tmp_path) == []  # nothing written


def test_predict_and_inspect_work_under_torch(tmp_path):
    """The backend table's promise: predict and inspect run on PyTorch (random weights: offline)."""
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (48, 48, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "photo.png")
    predicted = _keras_vit(
        ["predict", "photo.png", "--model", "vit_ti16", "--weights", "false"], "torch", tmp_path
    )
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    assert len([line for line in predicted.stdout.splitlines() if line.startswith("  ")]) == 5
    argv = ["inspect", "photo.png", "--model", "vit_ti16", "--weights", "random", "--out", "pictures"]
    inspected = _keras_vit(argv, "torch", tmp_path)
    assert inspected.returncode == 0, inspected.stderr[-2000:]
    assert (
        "tensorflow imported: False" in predicted.stdout and "tensorflow imported: False" in inspected.stdout
    )
    assert "attention_rollout.png" in os.listdir(tmp_path / "pictures")

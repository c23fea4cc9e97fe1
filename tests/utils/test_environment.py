"""TensorFlow's oneDNN CPU kernels: the command line turns them on, parity holds on and off.

The setting is read when TensorFlow is imported, so each case runs in a fresh process.
"""

import subprocess
import sys

import pytest
from helpers import subprocess_env

from keras_vit.utils.environment import ONEDNN_VARIABLE, onednn_enabled

_REPORT = "from keras_vit.utils.environment import onednn_enabled; import tensorflow; print(onednn_enabled())"


def _run(code: str, **env) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in subprocess_env(**env).items() if key != ONEDNN_VARIABLE}
    environment.update({key: value for key, value in env.items() if value is not None})
    return subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("given,expected", [(None, "True"), ("0", "False")])
def test_cli_turns_onednn_on_unless_the_user_said_otherwise(given, expected):
    done = _run(f"from keras_vit import cli; cli.main(['models']); {_REPORT}", **{ONEDNN_VARIABLE: given})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == expected


def _after_tensorflow_without_onednn(setup: str, statement: str) -> str:
    """Output of `print(statement, warnings)` in a process whose TensorFlow was imported with the
    kernels off (the variable unset since), `setup` run before warnings are recorded."""
    code = (
        f"import os, warnings, tensorflow; os.environ.pop('TF_ENABLE_ONEDNN_OPTS'); {setup}\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        f"    warnings.simplefilter('always'); value = {statement}\n"
        "print(value, [str(w.message) for w in caught])"
    )
    done = _run(code, **{ONEDNN_VARIABLE: "0"})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_notes_tensorflow_imported_with_onednn_off():
    """TensorFlow already imported with the kernels off (variable unset since): one clear note."""
    out = _after_tensorflow_without_onednn("pass", "__import__('keras_vit')")
    assert "oneDNN CPU kernels off" in out and "keras_vit.enable_onednn()" in out


def test_enable_onednn_after_tensorflow_says_it_is_too_late():
    out = _after_tensorflow_without_onednn("import keras_vit", "keras_vit.enable_onednn()")
    assert out.startswith("False") and "set TF_ENABLE_ONEDNN_OPTS=1" in out


def test_parity_holds_with_onednn_the_other_way():
    """The suite runs with TensorFlow's default; this reruns plain and hybrid parity the other way."""
    other = "0" if onednn_enabled() else "1"
    selection = [
        "tests/checkpoints/test_formats.py::test_timm_safetensors_parity",
        "tests/checkpoints/test_formats.py::test_google_npz_parity",
        "tests/checkpoints/test_formats.py::test_hf_parity_safetensors_and_bin",
        "tests/models/test_hybrid.py::test_logits_match_timm",
    ]
    done = subprocess.run(
        # -n 0: in this one process (setup.cfg's `-n auto` would start test workers inside a test worker)
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "not slow",
         *selection],
        env=subprocess_env(**{ONEDNN_VARIABLE: other}), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout

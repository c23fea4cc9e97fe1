"""Test helpers shared by the test modules (fixtures stay in `tests/conftest.py`).

pytest puts `tests/` on `sys.path` (its default "prepend" import mode, `tests/` has no
`__init__.py`), so test modules import these as `from helpers import random_images` and the
reference writers as `from helpers import checkpoint_writers as writers`. `tests/conftest.py`
imports PyTorch, timm and transformers before anything imports TensorFlow.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import keras
import numpy as np

from keras_vit.checkpoints.format_timm import TIMM_ARCHITECTURES

HELPERS = Path(__file__).resolve().parent  # workers run as subprocesses live here
TESTS = HELPERS.parent
REPO = TESTS.parent  # the clone: README.md, docs/, examples/, setup.cfg

# keras_vit variant -> timm model name of the same architecture at 224 px (1000-class head).
TIMM_NAMES = TIMM_ARCHITECTURES
HYBRID_TIMM_NAMES = {
    "vit_r50_b16": "vit_base_r50_s16_224",
    "vit_r50_l32": "vit_large_r50_s32_224",
    "vit_r26_b32": "vit_base_r26_s32_224",
    "vit_r26_s32": "vit_small_r26_s32_224",
    "vit_r_ti16": "vit_tiny_r_s16_p8_224",
}


def random_images(batch=2, size=(224, 224), channels=3, seed=0) -> np.ndarray:
    """NHWC float32 images, uniform in [-1, 1] (the models' input range), from a fixed seed."""
    return np.random.default_rng(seed).uniform(-1, 1, (batch, *size, channels)).astype("float32")


def subprocess_env(**extra) -> dict:
    """The environment for a test's Python subprocess: no TF_CONFIG, quiet TensorFlow, offline hub."""
    env = {key: value for key, value in os.environ.items() if key != "TF_CONFIG"}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", HF_HUB_OFFLINE="1", **extra)
    return env


def count_params_without_weights(build) -> int:
    """`build().count_params()` without allocating or initialising any weight.

    Variables created in a Keras stateless scope that does not initialise them on exit get their
    shapes but no values, so even ViT-H/14 (632M parameters) takes a fraction of a second and no memory.
    `clear_session` then drops the scope's list of uninitialised variables.
    """
    with keras.StatelessScope(initialize_variables=False):
        model = build()
    try:
        return model.count_params()
    finally:
        del model
        keras.backend.clear_session()


def load_into_scrambled(model: keras.Model, source, **kwargs) -> keras.Model:
    """`load_checkpoint(model, source, **kwargs)` into weights first set to random values, then
    assert that every weight changed: a tensor the converter maps but never assigns cannot pass.
    """
    from keras_vit.checkpoints import load_checkpoint

    rng = np.random.default_rng(20261126)
    before = {}
    for variable in model.weights:
        value = rng.normal(0.0, 1.0, variable.shape).astype(keras.backend.standardize_dtype(variable.dtype))
        variable.assign(value)
        before[variable.path] = value
    load_checkpoint(model, source, **kwargs)
    unmoved = [
        variable.path
        for variable in model.weights
        if np.array_equal(keras.ops.convert_to_numpy(variable), before[variable.path])
    ]
    assert unmoved == [], f"weights the load left as they were: {unmoved}"
    return model


def keras_vit_train_on_jax(
    flags: Sequence[str], cwd: str | os.PathLike, devices: int = 2
) -> subprocess.Popen:
    """`keras-vit train FLAGS` started in `cwd` on JAX with `devices` CPU devices, stdout and stderr piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "keras_vit.cli", "train", *flags],
        cwd=cwd,
        env=subprocess_env(
            KERAS_BACKEND="jax", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}"
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def backup_epoch(backup: str | os.PathLike) -> int:
    """The epoch a run's `backup/state.json` has reached (0 while there is none, or it is being written)."""
    try:
        with open(os.path.join(backup, "state.json")) as file:
            return json.load(file)["epoch"]
    except (OSError, ValueError, KeyError):
        return 0


def sigkill_after_an_epoch(process, backup: str | os.PathLike, timeout: float) -> None:
    """SIGKILL the training run `process` (a `subprocess.Popen`) once it has backed up an epoch."""
    deadline = time.monotonic() + timeout
    while backup_epoch(backup) < 1 and process.poll() is None:
        assert time.monotonic() < deadline, "the slowed run never finished an epoch"
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL

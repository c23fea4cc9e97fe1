"""Shared test setup: quiet TensorFlow, float32 everywhere, deterministic seeds, and common helpers.

tests/ is not a package: pytest puts this directory on `sys.path` (its default "prepend" import
mode), so test modules import the plain helpers below with `from conftest import ...`, as they
import `checkpoint_writers`.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network

# torchvision (imported by timm) segfaults when loaded after TensorFlow on this stack
# (TF 2.21 + torch 2.14.1): the reference libraries must be imported first.
try:
    import timm  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError:  # the references are test extras; tests that need them skip
    pass

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from keras_vit.converters.write_timm import TIMM_ARCHITECTURES  # noqa: E402

TEST_WORKERS_CAP = 4  # each worker imports TensorFlow, PyTorch and the references (~2 GB), 2-thread ops


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (setup.cfg): one worker per CPU this process may use, at most TEST_WORKERS_CAP.

    Much of the suite's time is single-threaded (imports, subprocesses, Python-side model
    building), so two workers on a 2-core machine finish well before one process.
    """
    return max(1, min(len(os.sched_getaffinity(0)), TEST_WORKERS_CAP))


@pytest.fixture(autouse=True)
def _float32_policy():
    """Every test starts (and ends) under the float32 policy with fixed seeds."""
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


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

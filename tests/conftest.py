"""Shared test setup: quiet TensorFlow, float32 everywhere, deterministic seeds."""

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

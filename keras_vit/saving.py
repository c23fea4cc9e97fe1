"""Loading `.keras` files of keras_vit models: every keras_vit Keras class registered first."""

from __future__ import annotations

import importlib
import os

# Modules whose classes a saved keras_vit model or training run can reference.
_SERIALIZABLE_MODULES = ("layers", "hybrid", "models", "recipes", "masked_patch")


def register() -> None:
    """Import the modules that register keras_vit's layers, models, losses and schedules with Keras."""
    for module in _SERIALIZABLE_MODULES:
        importlib.import_module(f"keras_vit.{module}")


def load_model(path: str | os.PathLike, **kwargs):
    """`keras.saving.load_model(path, **kwargs)` with keras_vit's classes registered (incl. pre-training)."""
    register()
    import keras

    return keras.saving.load_model(path, **kwargs)

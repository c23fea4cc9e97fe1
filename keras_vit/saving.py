"""Loading `.keras` files of keras_vit models: every keras_vit Keras class registered first."""

from __future__ import annotations

import importlib
import os

from keras_vit.utils.files import load_keras_file

# Modules whose classes a saved keras_vit model or training run can reference.
_SERIALIZABLE_MODULES = (
    "models.layers",
    "models.hybrid",
    "models.vit",
    "training.optimization",
    "training.masked_patch",
)


def register() -> None:
    """Import the modules that register keras_vit's layers, models, losses and schedules with Keras."""
    for module in _SERIALIZABLE_MODULES:
        importlib.import_module(f"keras_vit.{module}")


def load_model(path: str | os.PathLike, **kwargs):
    """`keras.saving.load_model(path, **kwargs)` with keras_vit's classes registered (incl. pre-training).

    A local `.keras` file that is missing, not a zip archive, or damaged inside (its config,
    its weights) raises one error naming the file (`FileNotFoundError`, else `ValueError`).
    """
    register()
    return load_keras_file(path, **kwargs)

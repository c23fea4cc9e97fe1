"""Loading `.keras` files of keras_vit models: every keras_vit Keras class registered first."""

from __future__ import annotations

import importlib
import json
import os
import zipfile
import zlib

# Modules whose classes a saved keras_vit model or training run can reference.
_SERIALIZABLE_MODULES = ("layers", "hybrid", "models", "optimization", "masked_patch")
# What reading a damaged `.keras` archive raises inside Keras (zip, JSON, h5py errors).
_DAMAGE_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, KeyError, json.JSONDecodeError, OSError)


def register() -> None:
    """Import the modules that register keras_vit's layers, models, losses and schedules with Keras."""
    for module in _SERIALIZABLE_MODULES:
        importlib.import_module(f"keras_vit.{module}")


def _damaged(path: str, reason: str) -> ValueError:
    return ValueError(
        f"Cannot load the model file {path}: {reason}. It is damaged, e.g. truncated by an interrupted "
        "save, copy or download: save, copy or download it again."
    )


def _check_keras_archive(path: str) -> None:
    """A local `.keras` file must exist and be a zip archive with a `config.json` (Keras's own errors
    for these cases are a misleading "File not found" or a raw `BadZipFile` / `KeyError`)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"No model file at {path}: check the path.")
    if not zipfile.is_zipfile(path):
        raise _damaged(path, "it is not a zip archive, as every .keras file is")
    with zipfile.ZipFile(path) as archive:
        if "config.json" not in archive.namelist():
            raise _damaged(path, "the archive has no config.json")


def load_model(path: str | os.PathLike, **kwargs):
    """`keras.saving.load_model(path, **kwargs)` with keras_vit's classes registered (incl. pre-training).

    A local `.keras` file that is missing, not a zip archive, or damaged inside (its config,
    its weights) raises one error naming the file (`FileNotFoundError`, else `ValueError`).
    """
    register()
    import keras

    location = os.fspath(path)
    if not (location.endswith(".keras") and "://" not in location):
        return keras.saving.load_model(path, **kwargs)  # other formats and remote files: Keras's errors
    _check_keras_archive(location)
    try:
        return keras.saving.load_model(path, **kwargs)
    except _DAMAGE_ERRORS as error:
        raise _damaged(location, f"{type(error).__name__}: {error}") from None

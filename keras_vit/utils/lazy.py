"""Package faces that load on first use (PEP 562): a package's `__init__` names what it offers and
where each name lives, and importing the package imports none of its modules (so `import keras_vit`
and `import keras_vit.training.options` stay free of TensorFlow and Keras)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping

from keras_vit.utils.environment import tensorflow_loads_quietly


def lazy_exports(
    package: str, exports: Mapping[str, str], submodules: tuple[str, ...] = (), forward: str | None = None
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package`: `exports` maps a public name to its module (relative to
    `package`), `submodules` are reachable as attributes, and every name in the `__all__` of the
    submodule `forward` is offered too (looked up when first asked for). A loaded name is cached in
    the package."""

    def __getattr__(name: str):
        if name in submodules:
            with tensorflow_loads_quietly():
                return importlib.import_module(f"{package}.{name}")
        module = exports.get(name)
        if module is None and forward is not None and not name.startswith("__"):
            if name in importlib.import_module(f"{package}.{forward}").__all__:
                module = forward
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        with tensorflow_loads_quietly():  # the first use of a model imports Keras, maybe TensorFlow
            value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports) | set(submodules))

    return __getattr__, __dir__

"""How `keras-vit` starts: the backend imported first and quietly, and errors as one line.

Import order matters: with some PyTorch builds, importing TensorFlow before torch crashes the
process (a segmentation fault). So the command line imports nothing heavy while it parses;
then `load_backend` imports Keras's own backend first, through Keras (torch under
`KERAS_BACKEND=torch`, JAX under `jax`), and TensorFlow only when it is the backend, with the
C++ lines it prints while loading hidden. A command that needs TensorFlow on another backend
stops with one clear line before importing it.
"""

from __future__ import annotations

import logging
import os
import sys

from keras_vit.utils.environment import install_hint, keras_backend, tensorflow_loads_quietly

__all__ = ["error_message", "load_backend", "op_error_message", "quiet_logging"]


def quiet_logging() -> None:
    """TensorFlow's C++ logs hidden (unless the user set their level); Python-side logs at errors only."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    for name in ("tensorflow", "absl", "h5py"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging  # TensorFlow's (and tensorflow-datasets') Python logging
    except ImportError:
        return
    absl_logging.set_verbosity(absl_logging.ERROR)


def load_backend(debug: bool) -> str:
    """Import Keras and its backend, that backend first (see the module docstring); return its name."""
    backend = keras_backend()
    if backend == "tensorflow" and not debug:
        with tensorflow_loads_quietly(level="3"):
            import tensorflow  # noqa: F401
    if not debug:
        quiet_logging()
    import keras  # noqa: F401  (imports the backend: torch before anything could import TensorFlow)

    return backend


def op_error_message(message: str) -> str:
    """The reason in a TensorFlow op error, without the graph-node lines around it."""
    noise = ("Graph execution error", "Detected at node", "<stack traces unavailable>", "\t [[")
    return " ".join(
        line.strip() for line in message.splitlines() if line.strip() and not line.startswith(noise)
    )


def error_message(error: BaseException) -> str:
    """What the user reads of a failed command: one line.

    Our own errors (`ValueError`, `OSError`, `ImportError`, `RuntimeError`) say what to do, so
    their message is enough; a TensorFlow op error (e.g. an unreadable image met by the input
    pipeline) is cut to its reason; anything else is named by its type.
    """
    debug_hint = "(keras-vit --debug shows the full error)"
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(error, tf.errors.OpError):
        return f"TensorFlow: {op_error_message(error.message)} {debug_hint}"
    if isinstance(error, ModuleNotFoundError) and error.name in ("tensorflow", "tensorflow_datasets"):
        if "needs TensorFlow" in str(error):  # keras_vit's own (`import_tensorflow`)
            return str(error)
        return f"This command needs TensorFlow, which is not installed: {install_hint('tensorflow')}."
    if isinstance(error, (ValueError, OSError, ImportError, RuntimeError)):
        return str(error)
    return f"{type(error).__name__}: {error} {debug_hint}"

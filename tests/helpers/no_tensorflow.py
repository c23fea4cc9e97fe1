"""TensorFlow made unimportable in a worker process, as where it is not installed.

The workers that run under `KERAS_BACKEND=jax|torch` (`backend_training_worker.py`,
`checkpoint_worker.py`, started as scripts, so this folder is on `sys.path`) call
`block_tensorflow` before anything else is imported.
"""

import importlib.abc
import importlib.machinery
import sys

# Every import of TensorFlow tried (not a mere look-up), even one whose ImportError was caught.
ATTEMPTS: list[str] = []


class _NoTensorFlow(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """TensorFlow's modules are found (PyTorch's dynamo only looks them up) but cannot be imported."""

    def __init__(self, why: str):
        self.why = why

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "tensorflow":
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        ATTEMPTS.append(spec.name)
        raise ImportError(f"{spec.name} is blocked: {self.why}")

    def exec_module(self, module):  # never reached (create_module raises); makes imports call create_module
        raise ImportError(f"{module.__name__} is blocked")


def block_tensorflow(why: str) -> list[str]:
    """Block every later TensorFlow import (`why` ends the ImportError's message); returns the
    list of the imports tried, filled as they come."""
    sys.meta_path.insert(0, _NoTensorFlow(why))
    return ATTEMPTS

"""Rehearsals of the GPU mode (`run_gpu.sh --rehearse`): TensorFlow is not there, as on the GPU machines.

On `PYTHONPATH`, Python imports this at start-up in every process (the workers too). The path
finder then reports `tensorflow` (and `tensorflow_text`, `tf_keras`) as not installed:
`importlib.util.find_spec` gives `None` (what torch and Keras probe) and `import` raises
`ModuleNotFoundError`.
"""

import importlib.machinery
import sys

BLOCKED = ("tensorflow", "tensorflow_text", "tf_keras")


class _PathFinderWithoutTensorFlow(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return super().find_spec(name, path, target)


sys.meta_path[:] = [
    _PathFinderWithoutTensorFlow if finder is importlib.machinery.PathFinder else finder
    for finder in sys.meta_path
]

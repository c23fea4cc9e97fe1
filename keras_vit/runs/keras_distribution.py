"""The JAX and PyTorch side of a run: its `keras.distribution` (JAX) or single device (PyTorch).

It answers the questions the driver asks `keras_vit.runs.strategy` on TensorFlow (start the
run, how many replicas, is this the chief, where does a worker write, which devices), and
imports no TensorFlow. On JAX a run is data parallel over every local device by default
(`keras_vit.parallel.make_distribution`, as `tf.distribute.MirroredStrategy` is on TensorFlow);
a `keras.distribution.DataParallel` or `ModelParallel` given as the `strategy` option (e.g.
`make_distribution(model_parallel=2, model="vit_b16")`) is used as it is. PyTorch trains on
Keras's one device (the first GPU, else the CPU): Keras 3 has no distribution for it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import keras

from keras_vit.defaults import PRECISIONS

__all__ = [
    "KerasRun",
    "check_run",
    "activated",
    "describe_distribution",
    "is_chief",
    "model_parallel",
    "start_run",
    "tensorflow_unseen",
    "worker_dir",
]

# The strategy names (`keras_vit.defaults.STRATEGIES`) that mean something off TensorFlow.
_DATA_PARALLEL = ("auto", "mirrored")
_ONE_DEVICE = ("default", "one_device")
# keras.distribution's public distributions (their base class is not public in Keras 3.15).
_DISTRIBUTIONS = (keras.distribution.DataParallel, keras.distribution.ModelParallel)


@dataclass
class KerasRun:
    """A run's distribution off TensorFlow: `distribution` (`None`: one device) and its replicas."""

    distribution: keras.distribution.DataParallel | keras.distribution.ModelParallel | None
    num_replicas_in_sync: int
    devices: list[str]

    def scope(self) -> contextlib.AbstractContextManager:
        """Where the model is built (a no-op: the distribution is active for the whole run, `activated`)."""
        return contextlib.nullcontext()


def _refuse(strategy) -> None:
    backend = keras.backend.backend()
    distribution = (
        ", or a keras.distribution.DataParallel or ModelParallel (keras_vit.parallel.make_distribution)"
    )
    raise ValueError(
        f"strategy {strategy!r} is TensorFlow's (tf.distribute); on {backend} use 'auto' (data parallel "
        f"over every local device on JAX) or 'default'{distribution if backend == 'jax' else ''}."
    )


def model_parallel(size: int, strategy, config) -> keras.distribution.ModelParallel:
    """The distribution of `model_parallel=size` (> 1): keras_vit's Megatron-style `ModelParallel`
    over every device (`keras_vit.parallel.make_distribution`), checked against the model's
    `config`; JAX only, and with the default strategy (this is the run's distribution)."""
    backend = keras.backend.backend()
    if backend != "jax":
        raise ValueError(
            f"model_parallel={size} needs the JAX backend (keras.distribution), but Keras runs on "
            f"{backend!r}: run with KERAS_BACKEND=jax, or leave model_parallel at 1."
        )
    if not (isinstance(strategy, str) and strategy in _DATA_PARALLEL):
        raise ValueError(
            f"model_parallel={size} makes the run's distribution: leave strategy at 'auto', not {strategy!r}."
        )
    from keras_vit.parallel import make_distribution

    return make_distribution(size, model=config)


def check_run(precision: str, batch_size: int) -> None:
    """The checks every backend's `start_run` begins with (this module's and `keras_vit.runs.strategy`'s)."""
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}: use one of {PRECISIONS}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")


def start_run(strategy, precision: str, batch_size: int, seed: int) -> KerasRun:
    """Check the run's precision and batch, choose the distribution, seed everything.

    A strategy other than `"auto"`, `"mirrored"`, `"default"`, `"one_device"` or (JAX) a
    `keras.distribution.DataParallel` or `ModelParallel` is one clear error, before anything is built.
    """
    check_run(precision, batch_size)
    backend = keras.backend.backend()
    distribution = None
    if backend == "jax" and isinstance(strategy, _DISTRIBUTIONS):
        distribution = strategy
    elif not isinstance(strategy, str) or strategy not in _DATA_PARALLEL + _ONE_DEVICE:
        _refuse(strategy)
    elif backend == "jax" and strategy in _DATA_PARALLEL and len(keras.distribution.list_devices()) > 1:
        from keras_vit.parallel import make_distribution

        distribution = make_distribution()
    if distribution is None:
        replicas, devices = 1, [_one_device()]
    else:
        mesh = distribution.device_mesh
        replicas = _replicas(distribution)
        devices = [str(device) for device in mesh.devices.flatten()]
    if batch_size % replicas:
        raise ValueError(f"batch_size {batch_size} must be divisible by the {replicas} replicas.")
    with tensorflow_unseen():
        keras.utils.set_random_seed(seed)
    return KerasRun(distribution, replicas, devices)


@contextlib.contextmanager
def tensorflow_unseen() -> Iterator[None]:
    """Keras sees no TensorFlow while a JAX or PyTorch run lasts (unless it is imported already).

    Keras 3.15's backend-neutral code imports TensorFlow whenever it is installed:
    `keras.utils.set_random_seed` seeds it and `serialize_keras_object` (optimizer configs,
    `.keras` saving) checks for `tf.TensorShape`. A run off TensorFlow needs neither, and the
    import is slow and crashes a process that imported PyTorch first. Keras's lazy module is
    marked unavailable for the run, and restored after.
    """
    from keras.src.utils import module_utils

    lazy = module_utils.tensorflow
    if lazy.module is not None or "tensorflow" in sys.modules:
        yield
        return
    available = lazy._available
    lazy._available = False
    try:
        yield
    finally:
        lazy._available = available


def _one_device() -> str:
    if keras.backend.backend() == "torch":
        from keras.src.backend.torch.core import get_device

        return str(get_device())
    return str(keras.distribution.list_devices()[0])


def _replicas(distribution) -> int:
    """How many parts each batch is split into: the size of the mesh's batch axis."""
    mesh = distribution.device_mesh
    batch_axis = getattr(distribution, "batch_dim_name", None) or mesh.axis_names[0]
    return int(mesh.shape[mesh.axis_names.index(batch_axis)])


@contextlib.contextmanager
def activated(run: KerasRun) -> Iterator[None]:
    """The run's distribution active while it builds, fits, evaluates and saves (then the previous
    one), and Keras without TensorFlow (`tensorflow_unseen`)."""
    with tensorflow_unseen(), run.distribution.scope() if run.distribution else contextlib.nullcontext():
        yield


def is_chief(run: KerasRun) -> bool:
    """Process 0 writes the run's files (every process, with `keras.distribution.initialize`)."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.process_index() == 0
    return True


def worker_dir(root: str, run: KerasRun) -> str:
    """`root` for the chief; a per-process sub-folder for the others."""
    if is_chief(run):
        return root
    import jax

    return os.path.join(root, f"worker-{jax.process_index()}")


def describe_distribution(run: KerasRun) -> dict:
    """How the run was distributed, for report.json: the distribution, its mesh, replicas and devices."""
    described = {
        "strategy": type(run.distribution).__name__ if run.distribution else "default (one device)",
        "replicas": run.num_replicas_in_sync,
        "devices": run.devices,
    }
    if run.distribution is not None:
        mesh = run.distribution.device_mesh
        described["mesh"] = {"shape": list(mesh.shape), "axis_names": list(mesh.axis_names)}
    return described

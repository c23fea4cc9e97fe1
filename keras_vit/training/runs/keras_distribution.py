"""The JAX and PyTorch side of a run: its `keras.distribution` (JAX) or single device (PyTorch).

It answers the questions the driver asks `keras_vit.training.runs.strategy` on TensorFlow (start the
run, how many replicas, is this the chief, where does a worker write, which devices), and
imports no TensorFlow. On JAX a run is data parallel over every local device by default
(`keras_vit.models.parallel.make_distribution`, as `tf.distribute.MirroredStrategy` is on TensorFlow);
a `keras.distribution.DataParallel` or `ModelParallel` given as the `strategy` option (e.g.
`make_distribution(model_parallel=2, model="vit_b16")`) is used as it is. PyTorch trains on
Keras's one device (the first GPU, else the CPU): Keras 3 has no distribution for it.

Several processes (hosts, or one per GPU) on JAX: `join_processes` first has them agree on the
run's arguments (`keras_vit.training.runs.agreement`), then runs `jax.distributed.initialize`
with bounded timeouts (JAX's gloo collectives on CPU); the run is then
data (or model) parallel over every process's devices, each process feeding its own rows of
every global batch (`keras_vit.data.processes.process_rows`: the input pipelines of
`keras_vit.data.pyinput` read them), so
that the global batch and the results are the one-process run's.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import keras

from keras_vit.data.processes import process_count
from keras_vit.training.options import Processes
from keras_vit.training.runs.agreement import Partners, agree
from keras_vit.utils.defaults import PRECISIONS

__all__ = [
    "KerasRun",
    "check_run",
    "activated",
    "describe_distribution",
    "ends_together",
    "finished",
    "is_chief",
    "join_processes",
    "model_parallel",
    "predictions_in_every_process",
    "saved_alone",
    "same_in_every_process",
    "start_run",
    "tensorflow_unseen",
    "worker_dir",
]

# The strategy names (`keras_vit.utils.defaults.STRATEGIES`) that mean something off TensorFlow.
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
    parallel = "keras.distribution.DataParallel or ModelParallel (keras_vit.models.make_distribution)"
    raise ValueError(
        f"strategy {strategy!r} is TensorFlow's (tf.distribute); on {backend} use 'auto' (data parallel "
        f"over every local device on JAX) or 'default'{', or a ' + parallel if backend == 'jax' else ''}."
    )


def model_parallel(size: int, strategy, config) -> keras.distribution.ModelParallel:
    """The distribution of `model_parallel=size` (> 1): keras_vit's Megatron-style `ModelParallel`
    over every device (`keras_vit.models.parallel.make_distribution`), checked against the model's
    `config`; JAX only, with the default strategy (this is the run's distribution), and in a
    multi-process run within each process (a replica split between processes could not be saved)."""
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
    import jax

    local = jax.local_device_count()
    if jax.process_count() > 1 and local % size:
        raise ValueError(
            f"model_parallel={size} would split each model replica between processes, whose devices "
            f"(here {local} per process) cannot read or save such weights alone: in a multi-process run "
            "use a model_parallel that divides each process's devices."
        )
    from keras_vit.models.parallel import make_distribution

    return make_distribution(size, model=config)


# The other processes of this process's multi-process run, watched while it lasts (`join_processes`).
_partners: Partners | None = None


def finished() -> None:
    """This process's multi-process run ended well: the others stop watching it (no-op otherwise)."""
    if _partners is not None:
        _partners.finish()


def join_processes(
    processes: Processes | None,
    run: dict | None = None,
    names: dict[str, str] | None = None,
    wait: float = 30,
) -> None:
    """Join this process to a multi-process JAX run; `None`: one process.

    First the processes agree (`keras_vit.training.runs.agreement.agree`: all come within `wait`
    seconds, each with its own id, with the same `run` arguments; else every process stops with
    one error naming the difference); then `jax.distributed.initialize` (what
    `keras.distribution.initialize` calls) with `wait` as its start, heartbeat and shutdown
    timeouts: a process that dies mid-run stops the others within about `wait` seconds. SIGTERM
    keeps the handler it had (JAX's preemption notifier would otherwise swallow it). Called
    before anything touches JAX's devices; on CPU the cross-process collectives are gloo's (JAX's
    default since 0.5; set here where an older JAX has none). A process already joined (a
    second run in it) must have joined the same way.
    """
    if processes is None:
        return
    import jax

    if jax.distributed.is_initialized():
        joined = (jax.process_count(), jax.process_index())
        if joined != (processes.num_processes, processes.process_id):
            raise ValueError(
                f"This process already joined a run of {joined[0]} processes as process {joined[1]}: a "
                f"process joins one multi-process run only (asked: {processes.num_processes} processes, "
                f"process {processes.process_id})."
            )
        return
    if jax.config.jax_cpu_collectives_implementation in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    global _partners
    _partners = agree(
        processes.job_addresses, processes.num_processes, processes.process_id, run or {}, names, wait
    )
    seconds = max(int(math.ceil(wait)), 1)
    sigterm = (
        signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    )
    try:
        jax.distributed.initialize(
            processes.job_addresses.split(",")[0].strip(),
            processes.num_processes,
            processes.process_id,
            initialization_timeout=seconds,
            heartbeat_timeout_seconds=seconds,
            shutdown_timeout_seconds=seconds,
        )
    except RuntimeError as error:
        if "before any JAX" not in str(error):
            raise
        raise RuntimeError(
            "A multi-process run must start before JAX runs anything in the process, and JAX has run "
            "already: start the run in a new Python process (train(...) or keras-vit train first)."
        ) from None
    if sigterm is not None:
        signal.signal(signal.SIGTERM, sigterm)


def check_run(precision: str, batch_size: int) -> None:
    """The checks every backend's `start_run` begins with (this module's and `strategy`'s)."""
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
        from keras_vit.models.parallel import make_distribution

        distribution = make_distribution()
    if process_count() > 1:
        if distribution is None:
            raise ValueError(
                f"A multi-process run is spread over every process's devices: leave strategy at 'auto', "
                f"not {strategy!r}."
            )
        distribution.auto_shard_dataset = False  # the PyDatasets feed each process's rows (`process_rows`)
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


@contextlib.contextmanager
def predictions_in_every_process(network: keras.Model) -> Iterator[None]:
    """`network.predict` readable in every process of a multi-process run (elsewhere as it is).

    Keras leaves each batch's predictions split between the processes' devices, and then no
    process can read them ("Fetching value for `jax.Array` that spans non-addressable (non
    process local) devices is not possible"): while this lasts, `predict_step` replicates its
    outputs on every device (an all-gather of the predictions, inside the compiled step).
    """
    distribution = keras.distribution.distribution()
    if process_count() == 1 or distribution is None:
        yield
        return
    import jax

    mesh, replicated = distribution.device_mesh.backend_mesh, jax.sharding.PartitionSpec()
    everywhere = jax.sharding.NamedSharding(mesh, replicated)
    predict_step = network.predict_step

    def replicated_step(state, data):
        outputs, state = predict_step(state, data)
        return jax.tree.map(lambda value: jax.lax.with_sharding_constraint(value, everywhere), outputs), state

    network.predict_step, network.predict_function = replicated_step, None
    try:
        yield
    finally:
        del network.predict_step  # the class's again
        network.predict_function = None


@contextlib.contextmanager
def saved_alone() -> Iterator[None]:
    """Where the chief of a multi-process run saves the model by itself: outside the distribution.

    Keras's saving makes a throwaway optimizer, and under a multi-process distribution making a
    variable is a collective that every process must join (`jax.device_put` compares the value
    across processes): the chief alone would wait for the others forever. The trained weights
    are read as they are (replicated, or whole within each process).
    """
    if process_count() == 1:
        yield
        return
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(previous)


# What a cross-process collective raises when another process died (its connection closed).
_LOST_PARTNER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "heartbeat timeout")


@contextlib.contextmanager
def ends_together() -> Iterator[None]:
    """A multi-process run that fails here ends its process at once (elsewhere nothing changes).

    An error from a collective because another process died becomes one clear error; and a
    failed process exits (status 1; interrupted: 130) without JAX's shutdown barrier, which would
    wait for the dead process and then abort with a stack trace. The backups are written
    atomically: the last complete one stays for the resume.
    """
    try:
        yield
    except BaseException as error:
        if process_count() == 1:
            raise
        # after the error is reported, before JAX's own exit handler; interrupted (Ctrl-C): as a shell says
        atexit.register(_exit_now, 130 if isinstance(error, KeyboardInterrupt) else 1)
        lost = isinstance(error, Exception) and any(sign in str(error) for sign in _LOST_PARTNER)
        if _partners is not None and not lost:
            _partners.fail()  # the others wait a moment for an error of their own (the same refusal)
        if lost:
            raise RuntimeError(
                "Another process of this multi-process run stopped (its connection was lost: "
                f"{str(error).splitlines()[0][:160]}), so this one stops too. Its last complete backup is "
                "kept: start every process again with the same arguments to resume."
            ) from None
        raise


def _exit_now(status: int = 1) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def same_in_every_process(name: str, value: int) -> None:
    """A clear error unless every process of a multi-process run has the same `value` (e.g. the
    epoch its backup resumes), instead of processes that wait for each other forever."""
    if process_count() == 1:
        return
    import numpy as np
    from jax.experimental import multihost_utils

    values = np.asarray(multihost_utils.process_allgather(np.int64(value))).ravel().tolist()
    if len(set(values)) > 1:
        raise ValueError(
            f"The processes of this run disagree on {name}: {values} (by process). Start every process "
            "with the same output folder and arguments; processes stopped at different moments may have "
            "backed up different epochs: then remove the run's backup folder to start over."
        )


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
    if process_count() > 1:
        described["processes"] = process_count()
    return described

"""Picking a `tf.distribute` strategy, and two Keras fixes for `model.fit` under tf.distribute.

Build the model, optimizer and metrics inside `strategy.scope()` and call `model.fit` as
usual: that is the whole recipe, from one CPU to a TPU pod (`keras_vit.training.classification` does it).

`get_strategy("auto")` picks, in order: `TPUStrategy` when a TPU cluster resolves,
`MultiWorkerMirroredStrategy` when `TF_CONFIG` names several workers, `MirroredStrategy`
when this machine has several GPUs, else the default strategy (one device).

Multi-worker strategies must be created before TensorFlow runs any op (TensorFlow raises
`Collective ops must be configured at program startup` otherwise), so call `get_strategy`
first thing in a worker program.

Two Keras 3 (3.0 to 3.15) bugs under tf.distribute are fixed here, each by a small patch
applied only on those versions (`get_strategy` and `keras_vit.training.train` apply them):

* `fix_multi_worker_fit`: `model.fit` fails under `MultiWorkerMirroredStrategy`
  (https://github.com/keras-team/keras/issues/20585).
* `fix_distributed_clipping`: gradient clipping (`global_clipnorm`, the paper's "clip at
  global norm 1") is applied to each replica's share of the gradient before the replicas
  are summed, so clipped training under MirroredStrategy differs from one device.
"""

from __future__ import annotations

import json
import os

import keras
import tensorflow as tf

from keras_vit.utils.defaults import STRATEGIES

__all__ = [
    "STRATEGIES",
    "StrategyError",
    "fix_distributed_clipping",
    "fix_multi_worker_fit",
    "get_strategy",
    "is_chief",
    "tf_config_workers",
]


# Keras versions with the bugs fixed below, checked against the source of 3.15.1; raise the
# upper bound only after checking that a newer release still has them.
_KERAS_20585 = ((3, 0), (3, 16))
_KERAS_REPLICA_CLIPPING = ((3, 0), (3, 16))


class StrategyError(ValueError):
    """A strategy was asked for that this machine or this `TF_CONFIG` cannot provide."""


def tf_config_workers() -> int:
    """How many tasks (chief + workers) the `TF_CONFIG` environment variable names; 0 if unset."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return 0
    try:
        cluster = json.loads(raw).get("cluster", {})
    except (json.JSONDecodeError, AttributeError):
        raise StrategyError(
            f"TF_CONFIG is not a JSON object: {raw[:200]!r}. Set it to e.g. "
            '{"cluster": {"worker": ["host1:port", "host2:port"]}, "task": {"type": "worker", "index": 0}}.'
        ) from None
    return len(cluster.get("chief", [])) + len(cluster.get("worker", []))


def _resolve_tpu(tpu: str | None):
    """A connected TPU cluster resolver, or None when no TPU is reachable."""
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
    except ValueError:  # "Please provide a TPU Name to connect to": not on a TPU host
        return None
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    return resolver


def get_strategy(
    name: str = "auto", *, devices: list[str] | None = None, tpu: str | None = None
) -> tf.distribute.Strategy:
    """The `tf.distribute` strategy `name` (one of `STRATEGIES`) for this machine or cluster.

    Args:
        name: `"auto"` (see the module docstring), `"default"` (no distribution),
            `"one_device"` (`devices[0]`, default the first GPU or the CPU), `"mirrored"`
            (all local GPUs, or `devices`), `"multi_worker"` (the cluster in `TF_CONFIG`),
            `"tpu"` (the TPU named by `tpu`, or the local one).
        devices: device strings for `"mirrored"` / `"one_device"`, e.g. `["/cpu:0", "/cpu:1"]`.
        tpu: TPU name or address for `"tpu"` / `"auto"`.

    Raises:
        StrategyError: unknown name, or the hardware/cluster for it is missing.
    """
    if name not in STRATEGIES:
        raise StrategyError(f"Unknown strategy {name!r}: use one of {', '.join(STRATEGIES)}.")
    fix_distributed_clipping()
    if name == "auto":
        resolver = _resolve_tpu(tpu)
        if resolver is not None:
            return tf.distribute.TPUStrategy(resolver)
        if tf_config_workers() > 1:
            return get_strategy("multi_worker")
        if devices is not None and len(devices) > 1:
            return tf.distribute.MirroredStrategy(devices)
        if len(tf.config.list_physical_devices("GPU")) > 1:
            return tf.distribute.MirroredStrategy()
        return tf.distribute.get_strategy()
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        if devices is not None and len(devices) != 1:
            raise StrategyError(f"'one_device' takes exactly one device, got {devices}.")
        device = devices[0] if devices else ("/gpu:0" if tf.config.list_physical_devices("GPU") else "/cpu:0")
        return tf.distribute.OneDeviceStrategy(device)
    if name == "mirrored":
        return tf.distribute.MirroredStrategy(devices)
    if name == "tpu":
        resolver = _resolve_tpu(tpu)
        if resolver is None:
            raise StrategyError(
                "No TPU found: run on a TPU VM, or pass tpu='<name or grpc://address>'. "
                "Use strategy 'auto' to fall back to GPUs/CPU."
            )
        return tf.distribute.TPUStrategy(resolver)
    # multi_worker
    if tf_config_workers() < 1:
        raise StrategyError(
            "'multi_worker' needs the cluster in the TF_CONFIG environment variable, e.g. "
            '{"cluster": {"worker": ["host1:port", "host2:port"]}, "task": {"type": "worker", "index": 0}}, '
            "set on every worker before the program starts."
        )
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    except RuntimeError as error:
        raise StrategyError(
            f"Cannot start MultiWorkerMirroredStrategy ({error}): create the strategy before any "
            "TensorFlow op runs, i.e. call get_strategy() first thing in the program."
        ) from error
    fix_multi_worker_fit()
    return strategy


def is_chief(strategy: tf.distribute.Strategy | None = None) -> bool:
    """Whether this process writes shared outputs (model, report): always, unless multi-worker.

    In a multi-worker cluster the chief is the `chief` task, or worker 0 when there is none.
    """
    strategy = strategy or tf.distribute.get_strategy()
    resolver = getattr(strategy, "cluster_resolver", None)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type in (None, "chief"):
        return True
    return task_type == "worker" and task_id == 0 and "chief" not in resolver.cluster_spec().as_dict()


def _keras_version() -> tuple[int, int]:
    major, minor = keras.__version__.split(".")[:2]
    return int(major), int(minor)


def fix_multi_worker_fit() -> bool:
    """Make `fit` / `evaluate` / `predict` work under `MultiWorkerMirroredStrategy` (Keras 3.0-3.15).

    keras-team/keras#20585 has two parts in `keras.src.backend.tensorflow.trainer`:

    1. `TensorFlowTrainer._maybe_symbolic_build` calls `strategy.reduce("MEAN", batch)` on
       the whole `(x, y)` tuple, which multi-worker collectives reject (`ValueError:
       Attempt to convert a value (PerReplica...)`). The build only needs shapes and
       dtypes, so the fix hands it this worker's first replica batch instead.
    2. `reduce_per_replica` averages the scalar step logs (loss, metrics) with
       `strategy.reduce("MEAN", v, axis=0)`, which fails on a scalar (`Invalid reduction
       dimension 0`). The fix averages scalars across replicas with `axis=None`, the
       intended result; every other case goes to the original function.

    Both wrappers act only when the trainer's strategy runs multi-worker collectives. The
    patch is applied once, only on the affected Keras versions; returns whether it is active.
    """
    from keras.src.backend.tensorflow import trainer as tf_trainer

    low, high = _KERAS_20585
    if not low <= _keras_version() < high:
        return False
    if getattr(tf_trainer, "_keras_vit_20585_fixed", False):
        return True
    original_reduce = tf_trainer.reduce_per_replica
    original_build = tf_trainer.TensorFlowTrainer._maybe_symbolic_build

    def multi_worker(strategy) -> bool:
        return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and bool(
            strategy.extended._in_multi_worker_mode()
        )

    def reduce_per_replica(values, strategy, reduction):
        averaging = reduction == "mean" or (
            reduction == "auto" and not isinstance(strategy, tf.distribute.TPUStrategy)
        )
        if not (averaging and multi_worker(strategy)):
            return original_reduce(values, strategy, reduction)

        def reduce_one(value):
            local = strategy.experimental_local_results(value)[0]
            if local.shape.rank == 0:
                return strategy.reduce("MEAN", value, axis=None)
            return original_reduce(value, strategy, reduction)

        return tf.nest.map_structure(reduce_one, values)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if iterator is not None and strategy is not None and multi_worker(strategy):
            for _, _, batches in iterator:
                data_batch = tf.nest.map_structure(
                    lambda value: strategy.experimental_local_results(value)[0], next(batches)
                )
                break
            iterator = None
        return original_build(self, iterator=iterator, data_batch=data_batch)

    tf_trainer.reduce_per_replica = reduce_per_replica
    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    tf_trainer._keras_vit_20585_fixed = True
    return True


def fix_distributed_clipping() -> bool:
    """Clip the summed gradient, not each replica's share of it, under tf.distribute (Keras 3.0-3.15).

    Keras's TensorFlow optimizers clip (`clipnorm`, `global_clipnorm`, `clipvalue`) in
    `_backend_apply_gradients`, inside the replica function, and only then all-reduce the
    gradients in `_backend_update_step`. With several replicas each one clips its partial
    gradient, which is not what the options mean (and not what one device computes:
    the losses part after a few epochs of clipped SGD). The fix: with more
    than one replica in sync and a clipping option set, `_clip_gradients` first all-reduces
    the gradients (SUM), clips the total, and hands each replica `total / replicas`, which the
    optimizer's own all-reduce sums back to the clipped total (exactly for a power-of-two
    replica count, else to float rounding). It costs one more all-reduce per step, only then.
    Applied once, only on the affected Keras versions; returns whether it is active.
    """
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    low, high = _KERAS_REPLICA_CLIPPING
    if not low <= _keras_version() < high:
        return False
    optimizer_class = tf_optimizer.TFOptimizer
    if getattr(optimizer_class, "_keras_vit_clipping_fixed", False):
        return True
    original_clip = optimizer_class._clip_gradients

    def _clip_gradients(self, grads):
        replica = tf.distribute.get_replica_context()
        clips = any(
            bool(option) and option > 0 for option in (self.clipnorm, self.global_clipnorm, self.clipvalue)
        )
        if not clips or replica is None or replica.num_replicas_in_sync == 1:
            return original_clip(self, grads)
        present = [grad for grad in grads if grad is not None]
        totals = iter(original_clip(self, replica.all_reduce(tf.distribute.ReduceOp.SUM, present)))
        share = 1.0 / replica.num_replicas_in_sync
        return [None if grad is None else next(totals) * tf.cast(share, grad.dtype) for grad in grads]

    optimizer_class._clip_gradients = _clip_gradients
    optimizer_class._keras_vit_clipping_fixed = True
    return True

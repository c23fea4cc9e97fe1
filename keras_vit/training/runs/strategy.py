"""The TensorFlow side of a run: the tf.distribute strategy, its devices and each worker's folder.

The driver (`keras_vit.training.runs.driver`) asks this module only to start the run (`start_run`)
and to name the replicas' devices; on JAX and PyTorch `keras_vit.training.runs.keras_distribution`
answers the same questions.
"""

from __future__ import annotations

import contextlib
import os

import keras
import tensorflow as tf

from keras_vit.training.runs.distribute import (
    fix_distributed_clipping,
    fix_multi_worker_fit,
    get_strategy,
    is_chief,
)
from keras_vit.training.runs.keras_distribution import check_run

__all__ = [
    "activated",
    "describe_distribution",
    "devices",
    "is_chief",
    "start_run",
    "strategy_name",
    "worker_dir",
]


def start_run(
    strategy: str | tf.distribute.Strategy, precision: str, batch_size: int, seed: int
) -> tf.distribute.Strategy:
    """Check the run's precision and batch, make the strategy (with the Keras fixes), seed everything."""
    check_run(precision, batch_size)
    # A multi-worker strategy must exist before TensorFlow runs any op (data sources do).
    if not isinstance(strategy, tf.distribute.Strategy):
        strategy = get_strategy(strategy)
    fix_distributed_clipping()
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        fix_multi_worker_fit()
    if batch_size % strategy.num_replicas_in_sync:
        raise ValueError(
            f"batch_size {batch_size} must be divisible by the {strategy.num_replicas_in_sync} replicas."
        )
    keras.utils.set_random_seed(seed)
    return strategy


def activated(strategy: tf.distribute.Strategy) -> contextlib.AbstractContextManager:
    """Nothing to activate for the whole run: the model is built in `strategy.scope()`, fit takes the rest."""
    return contextlib.nullcontext()


def worker_dir(root: str, strategy: tf.distribute.Strategy) -> str:
    """`root` for the chief; a per-worker sub-folder for the other workers of a cluster."""
    if is_chief(strategy):
        return root
    return os.path.join(root, f"worker-{strategy.cluster_resolver.task_id}")


def strategy_name(strategy: tf.distribute.Strategy) -> str:
    """The public name of a strategy's class (the default strategy's class is private)."""
    name = type(strategy).__name__
    if name == "_DefaultDistributionStrategy":
        return "default (no distribution: tf.distribute.get_strategy())"
    return name


def devices(strategy: tf.distribute.Strategy) -> list[str]:
    """The devices the replicas run on (the default strategy: TensorFlow's default placement)."""
    try:
        return [str(device) for device in strategy.extended.worker_devices]
    except RuntimeError:  # the default strategy has no device list: the first GPU, else the CPU
        logical = tf.config.list_logical_devices("GPU")[:1] or tf.config.list_logical_devices("CPU")[:1]
        return [device.name for device in logical]


def describe_distribution(strategy: tf.distribute.Strategy) -> dict:
    """How the run was distributed, for report.json: the strategy, its replicas and their devices."""
    return {
        "strategy": strategy_name(strategy),
        "replicas": int(strategy.num_replicas_in_sync),
        "devices": devices(strategy),
    }

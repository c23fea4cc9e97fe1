"""What every training run shares (`keras_vit.training.train`, `keras_vit.training.pretrain.pretrain`).

One room per responsibility:

* `keras_vit.training.runs.driver`: `fit_task`, the one training driver that runs any `Task`
  (classification, masked patch prediction) with the same features, and `fit_checked`;
* `keras_vit.training.runs.plan`: the length plan (steps per epoch, epochs, steps per call);
* `keras_vit.training.runs.backup`: exact resume (`EpochBackup`: the complete training state written
  atomically after each epoch) and the atomic JSON writer;
* `keras_vit.training.runs.report`: arguments named the same way in every process, for report.json;
* `keras_vit.training.runs.strategy`: the tf.distribute strategy a run starts under on TensorFlow,
  `keras_vit.training.runs.keras_distribution` its keras.distribution on JAX (one device on PyTorch).

What a run takes is declared in `keras_vit.training.options`, how it trains in
`keras_vit.training.recipes`, and
the augmentation that suits its data in `keras_vit.data.tfdata.Source`. The names below stay importable
from `keras_vit.training.runs`.
"""

from keras_vit.training.runs.backup import EpochBackup, file_sha256, remove_backup, write_json
from keras_vit.training.runs.driver import (
    NonFiniteLossError,
    RunResult,
    StopOnNonFiniteLoss,
    Task,
    fit_checked,
    fit_task,
    tensorboard_callbacks,
    verbosity,
)
from keras_vit.training.runs.plan import MAX_STEPS_PER_EPOCH, execution_steps, plan_steps
from keras_vit.training.runs.report import (
    describe,
    json_safe,
    optimizer_summary,
    resolve_paths,
    run_arguments,
)

_TENSORFLOW_NAMES = (
    "start_run",
    "strategy_name",
    "worker_dir",
)  # keras_vit.training.runs.strategy's: imported on use


def __getattr__(name: str):
    """`start_run`, `strategy_name`, `worker_dir`: TensorFlow's, loaded on first use only."""
    if name in _TENSORFLOW_NAMES:
        from keras_vit.training.runs import strategy

        return getattr(strategy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MAX_STEPS_PER_EPOCH",
    "EpochBackup",
    "NonFiniteLossError",
    "RunResult",
    "StopOnNonFiniteLoss",
    "Task",
    "describe",
    "execution_steps",
    "file_sha256",
    "fit_checked",
    "fit_task",
    "json_safe",
    "optimizer_summary",
    "plan_steps",
    "remove_backup",
    "resolve_paths",
    "run_arguments",
    "start_run",
    "strategy_name",
    "tensorboard_callbacks",
    "verbosity",
    "worker_dir",
    "write_json",
]

"""The one training driver: `fit_task` runs any `Task` with `model.fit`, resumable exactly, and reports it.

A task (classification in `keras_vit.training`, masked patch prediction in
`keras_vit.pretrain`) says what is trained: its data, model, recipe and metrics. The driver
gives every task the same run from its `keras_vit.options.RunOptions`: the strategy and seeds
(`keras_vit.runs.strategy`), the length plan (`keras_vit.runs.plan`), exact resume from the
per-epoch backup (`keras_vit.runs.backup`), the dtype policy, XLA, TensorBoard logs, a stop
on a non-finite loss, and `report.json`.

`report.json` records what the run really used, not only what was typed: `arguments` (as given,
`None` where a default applied; the exact-resume check compares these) and, resolved, the model
(`model`, `model_config`), the task's `recipe`, `checkpoint` (source, file, sha256),
`hyperparameters` (every value as used, and the optimizer's own configuration), `data` sizes,
the strategy and its replicas, `versions` and `machine` (CPU model, GPUs), wall times and the
final metrics.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import keras
import tensorflow as tf

from keras_vit import data, environment
from keras_vit.defaults import LABELS_FILE
from keras_vit.options import RunOptions
from keras_vit.preprocessing import write_labels
from keras_vit.recipes import Recipe
from keras_vit.runs.backup import EpochBackup, remove_backup, write_json
from keras_vit.runs.plan import execution_steps, plan_steps
from keras_vit.runs.report import now, resolve_paths, run_report
from keras_vit.runs.strategy import describe_distribution, is_chief, start_run, worker_dir

__all__ = [
    "NonFiniteLossError",
    "RunResult",
    "StopOnNonFiniteLoss",
    "Task",
    "fit_checked",
    "fit_task",
    "tensorboard_callbacks",
    "verbosity",
]

# Options that do not change the run's results: a resumed run may change them.
_FREE_ON_RESUME = ("strategy", "verbose", "steps_per_execution")


def tensorboard_callbacks(log_dir: str) -> list[keras.callbacks.Callback]:
    """The TensorBoard callback, or none (with a notice) when the `tensorboard` package is missing."""
    try:
        import tensorboard  # noqa: F401  (tf.summary needs it to write scalars)
    except ImportError:
        print(
            "keras_vit: no TensorBoard logs (the tensorboard package is not installed: "
            f"{environment.install_hint('train')}).",
            file=sys.stderr,
        )
        return []
    return [keras.callbacks.TensorBoard(log_dir, write_graph=False)]


def verbosity(verbose: int | str) -> int:
    if verbose == "auto":
        return 1 if sys.stdout.isatty() else 2
    return int(verbose)


class Task(Protocol):
    """What one kind of training run adds to the shared driver `fit_task`.

    `fit_task` calls, in order: `prepare(batch_size)` once the strategy exists (read the data;
    return the steps of one pass), `build()` inside `strategy.scope()` and the run's dtype
    policy (the Keras model to fit), `compile(network, total_steps, jit_compile,
    steps_per_execution)` (Keras's `compile` arguments of the same names),
    `train_data(network, start_epoch, steps_per_epoch)`; after `fit`, `finish(network,
    history)` (the task's metrics for the report, `history` being the whole run's per-epoch
    logs), `saved_model(network)` (what the chief saves as `output_dir/<saved_file>`) and
    `describe(network)`: the values the run used, for the report (`recipe`, `checkpoint`,
    `hyperparameters`, `data`; `class_names`, when known, are also written to `labels.txt`).
    `sources()`: the `keras_vit.data.Source`s read so far, to name files that fail to decode.
    """

    recipe: Recipe  # its default length (`recipe.epochs`), optimizer and schedule
    saved_file: str

    def prepare(self, batch_size: int) -> int: ...

    def build(self) -> keras.Model: ...

    def compile(
        self, network: keras.Model, total_steps: int, jit_compile: bool, steps_per_execution: int
    ) -> None: ...

    def train_data(self, network: keras.Model, start_epoch: int, steps_per_epoch: int) -> tf.data.Dataset: ...

    def finish(self, network: keras.Model, history: dict[str, list[float]]) -> dict: ...

    def saved_model(self, network: keras.Model) -> keras.Model: ...

    def describe(self, network: keras.Model) -> dict: ...

    def sources(self) -> list[data.Source]: ...


@dataclass
class RunResult:
    """What `fit_task` returns: the trained Keras model and the report it wrote (`report.json`)."""

    model: keras.Model
    report: dict


def fit_task(
    task: Task,
    arguments: dict,
    options: RunOptions,
    callbacks: Sequence[keras.callbacks.Callback] = (),
) -> RunResult:
    """The one training driver: `model.fit` of `task` under a tf.distribute strategy, resumable exactly.

    Every task gets the same run from `options`: strategy and seeds (`start_run`), the length
    plan (`plan_steps`; default `task.recipe.epochs` passes), exact resume from the per-epoch
    `EpochBackup` in `output_dir/backup` (a run started again with the same `arguments`
    continues bit for bit), the dtype policy `precision` while building, XLA (`jit_compile`
    `"auto"`: on for a single replica), several steps per call (`steps_per_execution`, see
    `execution_steps`; results are the same for any value, so resuming may change it),
    TensorBoard logs and progress, and a report with the task's metrics, timings, versions
    and the arguments.
    """
    environment.require_tensorflow_backend("The training driver (keras_vit.training, keras_vit.pretrain)")
    options.check()  # every value before anything runs: NaN or 0 never reach the plan
    batch_size, precision, seed = options.batch_size, options.precision, options.seed
    run_started, started_at = time.perf_counter(), now()
    strategy = start_run(options.strategy, precision, batch_size, seed)
    jit_compile = options.jit_compile
    if jit_compile == "auto":
        jit_compile = strategy.num_replicas_in_sync == 1
    epochs = options.epochs
    if options.steps is None and epochs is None:
        epochs = task.recipe.epochs
    steps_per_epoch, fit_epochs = plan_steps(
        task.prepare(batch_size), options.steps, epochs, options.steps_per_epoch
    )
    total_steps = steps_per_epoch * fit_epochs
    steps_per_execution = execution_steps(
        steps_per_epoch, options.steps_per_execution, strategy.num_replicas_in_sync
    )
    output_dir = os.fspath(options.output_dir)
    chief = is_chief(strategy)
    run = {key: value for key, value in arguments.items() if key not in _FREE_ON_RESUME}
    backup = EpochBackup(worker_dir(os.path.join(output_dir, "backup"), strategy), resolve_paths(run))
    start_epoch = min(backup.epoch, fit_epochs)

    previous_policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        with strategy.scope():
            network = task.build()
            task.compile(network, total_steps, jit_compile, steps_per_execution)
            # Eagerly: optimizer variables made inside fit's first trace are slow to create.
            network.optimizer.build(network.trainable_variables)
    finally:
        keras.config.set_dtype_policy(previous_policy)

    fit_callbacks = [backup, *callbacks]
    if chief:
        fit_callbacks.extend(tensorboard_callbacks(os.path.join(output_dir, "logs")))
    started = time.perf_counter()
    network.fit(
        task.train_data(network, start_epoch, steps_per_epoch),
        epochs=fit_epochs,
        steps_per_epoch=steps_per_epoch,
        initial_epoch=start_epoch,
        callbacks=fit_callbacks,
        shuffle=False,  # the pipelines shuffle (reproducibly, per epoch)
        verbose=verbosity(options.verbose),
    )
    fit_seconds = time.perf_counter() - started
    # fit() ends by copying the EMA averages (if enabled) into the model: they are evaluated and saved.
    metrics = task.finish(network, backup.history)
    saved = task.saved_model(network)
    resolved = task.describe(network)
    report = run_report(
        network=network,
        saved=saved,
        metrics=metrics,
        resolved=resolved,
        history=backup.history,
        steps_per_epoch=steps_per_epoch,
        epochs=fit_epochs,
        start_epoch=start_epoch,
        steps_per_execution=steps_per_execution,
        jit_compile=jit_compile,
        batch_size=batch_size,
        precision=precision,
        seed=seed,
        distribution=describe_distribution(strategy),
        fit_seconds=fit_seconds,
        seconds=time.perf_counter() - started,
        started_at=started_at,
        arguments=arguments,
    )
    class_names = resolved.get("class_names")
    if class_names:
        report["labels_file"] = LABELS_FILE
    if chief:
        os.makedirs(output_dir, exist_ok=True)
        saved.save(os.path.join(output_dir, task.saved_file))
        if class_names:
            write_labels(os.path.join(output_dir, LABELS_FILE), class_names)
    report.update(finished_at=now(), wall_seconds=round(time.perf_counter() - run_started, 3))
    if chief:
        write_json(os.path.join(output_dir, "report.json"), report)
    remove_backup(backup.backup_dir)
    return RunResult(network, report)


class NonFiniteLossError(ValueError):
    """The training loss became NaN or infinite: the run stopped and saved no model."""


class StopOnNonFiniteLoss(keras.callbacks.Callback):
    """Stop `fit` with `NonFiniteLossError` at the first NaN or infinite training loss.

    Unlike `keras.callbacks.TerminateOnNaN`, which ends `fit` normally (so the diverged model
    would be saved as the result), this raises: the caller saves nothing. It checks after each
    call of `steps_per_execution` steps; raised in Keras's callback thread, the error stops
    `fit` at the next step or at the latest when the epoch ends, before its backup is written.
    """

    async_safe = True
    epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            raise NonFiniteLossError(
                f"The training loss became {float(loss)} in epoch {self.epoch + 1} (by step {batch + 1} of "
                "it): training diverged and stopped; no model was saved. Lower the learning rate, "
                "check the data for NaN or infinite values, or keep float32 (--precision float32)."
            )


def fit_checked(
    task: Task, arguments: dict, options: RunOptions, callbacks: Sequence[keras.callbacks.Callback] = ()
) -> RunResult:
    """`fit_task` that stops on a non-finite loss and names unreadable image files.

    A non-finite loss (`NonFiniteLossError`) writes `report.json` with `"status": "failed"`
    and the reason, and no model. A TensorFlow decoding error met while reading an image
    folder becomes `keras_vit.data.BadImageError` naming the files that fail to decode.
    """
    output_dir = os.fspath(options.output_dir)
    try:
        return fit_task(task, arguments, options, [*callbacks, StopOnNonFiniteLoss()])
    except NonFiniteLossError as error:
        os.makedirs(output_dir, exist_ok=True)
        write_json(
            os.path.join(output_dir, "report.json"),
            {"status": "failed", "error": str(error), "finished_at": None, "arguments": arguments},
        )
        raise
    except tf.errors.InvalidArgumentError:
        bad = [item for source in task.sources() for item in data.undecodable_files(source)]
        if not bad:
            raise
        listed = "; ".join(f"{path} ({reason})" for path, reason in bad[:5])
        raise data.BadImageError(
            f"TensorFlow cannot decode {len(bad)} image file(s): {listed}. Remove or replace them."
        ) from None

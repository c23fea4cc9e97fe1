"""The one training driver: `fit_task` runs any `Task` with `model.fit`, resumable exactly, and reports it.

A task (classification in `keras_vit.training.classification`, masked patch prediction in
`keras_vit.training.pretrain`) says what is trained: its data, model, recipe and metrics. The driver
gives every task the same run from its `keras_vit.training.options.RunOptions`: the strategy and seeds
(`keras_vit.training.runs.strategy`), the length plan (`keras_vit.training.runs.plan`), exact resume from the
per-epoch backup (`keras_vit.training.runs.backup`), the dtype policy, XLA, TensorBoard logs, a stop
on a non-finite loss, and `report.json`.

`report.json` records what the run really used, not only what was typed: `arguments` (as given,
`None` where a default applied; the exact-resume check compares these) and, resolved, the model
(`model`, `model_config`), the task's `recipe`, `checkpoint` (source, file, sha256),
`hyperparameters` (every value as used, and the optimizer's own configuration), `data` sizes,
the strategy and its replicas, `versions` and `machine` (CPU model, GPUs), wall times and the
final metrics.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import keras

from keras_vit.data.preprocessing import write_labels
from keras_vit.registry.variants import ViTConfig
from keras_vit.training.options import RunOptions, option_fields
from keras_vit.training.recipes import Recipe
from keras_vit.training.runs import keras_distribution
from keras_vit.training.runs.backup import (
    BackupMismatchError,
    EpochBackup,
    check_backup_folder,
    refuse_links,
    remove_backup,
    write_json,
)
from keras_vit.training.runs.plan import execution_steps, plan_steps
from keras_vit.training.runs.report import now, resolve_paths, run_report
from keras_vit.utils import environment
from keras_vit.utils.defaults import LABELS_FILE
from keras_vit.utils.files import RunLock, refuse_link, refuse_overlap, replace_file

__all__ = [
    "NonFiniteLossError",
    "RunResult",
    "StopOnNonFiniteLoss",
    "Task",
    "fit_checked",
    "fit_task",
    "new_run_folder",
    "open_run_folder",
    "tensorboard_callbacks",
    "verbosity",
]

# Options that do not change the run's results: a resumed run may change them.
_FREE_ON_RESUME = (
    "strategy",
    "verbose",
    "steps_per_execution",
    "overwrite",
    "coordinator",
    "num_processes",
    "process_id",
    "join_timeout",
)
# Arguments that may name an input file or folder: the output folder must not hold them.
_INPUT_ARGUMENTS = ("dataset", "pretrained")
REPORT_FILE = "report.json"
# Where TensorBoard writes under output_dir/logs, and what: the event files a run wrote there are named in
# its backup state and report (`LOG_FILES`); a replaced run's are removed, nothing else under logs/.
_LOG_FOLDERS = ("train", "validation")
_EVENT_FILE = re.compile(r"events\.out\.tfevents\.[^/]+")
LOG_FILES = "log_files"


def _event_files(output_dir: str) -> set[str]:
    """The TensorBoard event files (regular files) under `output_dir/logs/{train,validation}`, as
    paths relative to `output_dir`."""
    found = set()
    for folder in _LOG_FOLDERS:
        path = os.path.join(output_dir, "logs", folder)
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        for name in os.listdir(path):
            if _EVENT_FILE.fullmatch(name) and not os.path.islink(os.path.join(path, name)):
                found.add(f"logs/{folder}/{name}")
    return found


def _remove_logs(output_dir: str, report: dict) -> int:
    """Remove the event files a finished run's `report` names (`LOG_FILES`), and the log folders they
    leave empty; returns how many were removed. Other files, and names outside the log folders, stay."""
    named = report.get(LOG_FILES) if isinstance(report, dict) else None
    removed = 0
    for name in named if isinstance(named, list) else []:
        parts = name.split("/") if isinstance(name, str) else []
        if (
            len(parts) != 3
            or parts[0] != "logs"
            or parts[1] not in _LOG_FOLDERS
            or not _EVENT_FILE.fullmatch(parts[2])
        ):
            continue
        path = os.path.join(output_dir, *parts)
        if os.path.islink(os.path.join(output_dir, "logs")) or os.path.islink(os.path.dirname(path)):
            continue
        if os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)
            removed += 1
    for folder in [*(os.path.join("logs", name) for name in _LOG_FOLDERS), "logs"]:
        with contextlib.suppress(OSError):  # not empty (the user's files), a link, or not there
            if not os.path.islink(os.path.join(output_dir, folder)):
                os.rmdir(os.path.join(output_dir, folder))
    return removed


def _read_report(output_dir: str) -> dict:
    try:
        with open(os.path.join(output_dir, REPORT_FILE), encoding="utf-8") as file:
            report = json.load(file)
    except (OSError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}


def tensorboard_callbacks(log_dir: str) -> list[keras.callbacks.Callback]:
    """The TensorBoard callback, or none (with a notice) off TensorFlow or without `tensorboard`."""
    backend = keras.backend.backend()
    if backend != "tensorflow":  # Keras's TensorBoard callback writes through tf.summary
        _say(f"no TensorBoard logs on {backend} (Keras writes them through TensorFlow).")
        return []
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
    `train_data(network, start_epoch, steps_per_epoch)` (a tf.data dataset on TensorFlow, a
    `keras.utils.PyDataset` elsewhere); after `fit`, `finish(network,
    history)` (the task's metrics for the report, `history` being the whole run's per-epoch
    logs), `saved_model(network)` (what the chief saves as `output_dir/<saved_file>`) and
    `describe(network)`: the values the run used, for the report (`recipe`, `checkpoint`,
    `hyperparameters`, `data`; `class_names`, when known, are also written to `labels.txt`).
    `sources()`: the `keras_vit.data.tfdata.Source`s read so far, to name files that fail to decode.
    """

    recipe: Recipe  # its default length (`recipe.epochs`), optimizer and schedule
    config: ViTConfig  # the model's architecture (a model-parallel mesh is checked against it)
    saved_file: str

    def prepare(self, batch_size: int) -> int: ...

    def build(self) -> keras.Model: ...

    def compile(
        self, network: keras.Model, total_steps: int, jit_compile: bool, steps_per_execution: int
    ) -> None: ...

    def train_data(self, network: keras.Model, start_epoch: int, steps_per_epoch: int): ...

    def finish(self, network: keras.Model, history: dict[str, list[float]]) -> dict: ...

    def saved_model(self, network: keras.Model) -> keras.Model: ...

    def describe(self, network: keras.Model) -> dict: ...

    def sources(self) -> list: ...


def distribution_module():
    """Where a run's distribution comes from: `keras_vit.training.runs.strategy` (tf.distribute) on
    TensorFlow, `keras_vit.training.runs.keras_distribution` (keras.distribution, JAX) elsewhere."""
    if keras.backend.backend() == "tensorflow":
        from keras_vit.training.runs import strategy

        return strategy
    return keras_distribution


def _say(message: str) -> None:
    print(f"keras_vit: {message}", file=sys.stderr)


def _finished_outputs(output_dir: str, saved_file: str) -> list[str]:
    """The files of a finished run in `output_dir` (a failed run's report does not count)."""
    found = [
        name
        for name in (saved_file, REPORT_FILE, LABELS_FILE)
        if os.path.isfile(os.path.join(output_dir, name))
    ]
    if found == [REPORT_FILE]:
        try:
            with open(os.path.join(output_dir, REPORT_FILE), encoding="utf-8") as file:
                if json.load(file).get("status") == "failed":
                    return []
        except (OSError, ValueError, AttributeError):
            pass
    return found


def new_run_folder(base: str, saved_file: str) -> str:
    """`base`, or else the first of `base-2`, `base-3`, ... that holds no finished run (the folder a
    command run without an output folder writes to: each run its own, an unfinished one resumed)."""
    folder, number = base, 1
    while _finished_outputs(folder, saved_file):
        number += 1
        folder = f"{base}-{number}"
    if folder != base:
        _say(f"{base} holds a finished run: this run writes to {folder} (--output-dir chooses the folder).")
    return folder


def open_run_folder(
    output_dir: str, backup_dir: str, saved_file: str, run: dict, overwrite: bool, chief: bool
) -> EpochBackup:
    """Decide what a run does with its folder, say it, and return its backup.

    An unfinished run's backup made with the same `run` arguments: resume it. One made with
    other arguments: refused, or with `overwrite` discarded. No backup but a finished run's
    files (`saved_file`, report.json, labels.txt): refused, or with `overwrite` those files and
    its TensorBoard logs are removed first. The folder's other files are never touched, and a link
    under a name the run writes is refused before anything is written (`refuse_link`).
    """
    if chief:
        for name in (saved_file, REPORT_FILE, f"{REPORT_FILE}.partial", LABELS_FILE):
            refuse_link(os.path.join(output_dir, name))
    refuse_links(backup_dir)
    try:
        backup = EpochBackup(backup_dir, run)
    except BackupMismatchError:
        if not overwrite:
            raise
        remove_backup(backup_dir)
        if chief:
            _say(f"discarded the unfinished run's backup in {backup_dir} (other arguments; overwrite).")
        backup = EpochBackup(backup_dir, run)
    if backup.epoch:
        if chief:
            _say(f"resuming the unfinished run in {output_dir} after epoch {backup.epoch} (its backup).")
        return backup
    finished = _finished_outputs(output_dir, saved_file) if chief else []
    if finished and not overwrite:
        raise FileExistsError(
            f"{output_dir} holds a finished run ({', '.join(finished)}): choose another output folder, or "
            "pass overwrite=True (--overwrite) to replace its model, report and logs."
        )
    if finished:
        report = _read_report(output_dir)
        for name in finished:
            os.remove(os.path.join(output_dir, name))
        logs = _remove_logs(output_dir, report)
        _say(
            f"replacing the finished run in {output_dir} (overwrite): removed {', '.join(finished)} "
            f"and its {logs} TensorBoard log file(s) (the folder's other files are kept)."
        )
    return backup


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
    """The one training driver: `model.fit` of `task` on any backend, resumable exactly.

    Every task gets the same run from `options`: the distribution and seeds (`start_run`: a
    tf.distribute strategy on TensorFlow, keras.distribution on JAX, one device on PyTorch;
    see `distribution_module`), the length plan (`plan_steps`; default `task.recipe.epochs`
    passes), exact resume from the per-epoch `EpochBackup` in `output_dir/backup` (a run
    started again with the same `arguments` continues bit for bit), the dtype policy
    `precision` while building, XLA (`jit_compile` `"auto"`: on TensorFlow for a single
    replica, always on JAX, off on PyTorch), several steps per call (`steps_per_execution`,
    see `execution_steps`; results are the same for any value, so resuming may change it),
    TensorBoard logs (TensorFlow) and progress, and a report with the task's metrics,
    timings, versions, the backend and its devices, and the arguments.

    The output folder is locked while the run writes to it (`keras_vit.utils.files.RunLock`: a
    second run there stops with an error naming the first one's process) and must not hold
    the data or the checkpoint; what the run does with what the folder holds (resume, start,
    refuse, replace with `overwrite`) is `open_run_folder`'s decision, printed to stderr.
    """
    options.check()  # every value before anything runs: NaN or 0 never reach the plan
    run = {key: value for key, value in arguments.items() if key not in _FREE_ON_RESUME}
    flags = {field.name: spec.flags(field.name)[0] for field, spec in option_fields(type(options))}
    # before anything touches JAX's devices; the processes agree on the run's arguments first (the
    # model as the architecture it names: a variant name and its ViTConfig are the same model)
    agreed = {**resolve_paths(run), "model": task.config.to_dict()}
    keras_distribution.join_processes(options.processes(), agreed, flags, options.join_timeout)
    with keras_distribution.ends_together():
        result = _run_locked(task, arguments, options, callbacks, run)
    keras_distribution.finished()
    return result


def _run_locked(
    task: Task, arguments: dict, options: RunOptions, callbacks: Sequence[keras.callbacks.Callback], run: dict
) -> RunResult:
    """`fit_task` once the processes joined: the distribution, the locked run folder, the fit."""
    run_started, started_at = time.perf_counter(), now()
    distribution = distribution_module()
    strategy = options.strategy
    if options.model_parallel > 1:
        strategy = keras_distribution.model_parallel(options.model_parallel, strategy, task.config)
    strategy = distribution.start_run(strategy, options.precision, options.batch_size, options.seed)
    output_dir = os.fspath(options.output_dir)
    chief = distribution.is_chief(strategy)
    backup_dir = distribution.worker_dir(os.path.join(output_dir, "backup"), strategy)
    refuse_overlap(output_dir, [arguments.get(name) for name in _INPUT_ARGUMENTS])
    check_backup_folder(output_dir, backup_dir)
    with RunLock(output_dir if chief else backup_dir):  # released however the run ends
        backup = open_run_folder(
            output_dir, backup_dir, task.saved_file, resolve_paths(run), options.overwrite, chief
        )
        keras_distribution.same_in_every_process("the epoch their backups resume after", backup.epoch)
        with distribution.activated(strategy):
            result = _fit(
                task, arguments, options, callbacks, distribution, strategy, backup, (run_started, started_at)
            )
    if not chief:
        remove_backup(backup_dir)  # the worker's lock file was in it
        with contextlib.suppress(OSError):  # the chief's backup folder, once every process is done
            os.rmdir(os.path.dirname(backup_dir))
    return result


def _schedule(task: Task, options: RunOptions, strategy) -> tuple[bool, int, int, int]:
    """`(jit_compile, steps_per_epoch, epochs, steps_per_execution)` of a run, its options resolved."""
    jit_compile = options.jit_compile
    # "auto": TensorFlow for one replica; JAX always (un-jitted steps are slow); PyTorch off (torch.compile
    # starts slowly).
    if jit_compile == "auto":
        backend = keras.backend.backend()
        jit_compile = backend == "jax" or (backend == "tensorflow" and strategy.num_replicas_in_sync == 1)
    epochs = options.epochs
    if options.steps is None and epochs is None:
        epochs = task.recipe.epochs
    steps_per_epoch, fit_epochs = plan_steps(
        task.prepare(options.batch_size), options.steps, epochs, options.steps_per_epoch
    )
    requested_steps = options.steps_per_execution
    if keras.backend.backend() == "torch":  # Keras's PyTorch trainer runs one step per call
        if requested_steps not in ("auto", 1):
            raise ValueError(
                f"steps_per_execution {requested_steps} is not possible on PyTorch (Keras runs one step "
                "per call there): leave it 'auto' or pass 1."
            )
        requested_steps = 1
    steps_per_execution = execution_steps(steps_per_epoch, requested_steps, strategy.num_replicas_in_sync)
    return jit_compile, steps_per_epoch, fit_epochs, steps_per_execution


def _fit(
    task: Task,
    arguments: dict,
    options: RunOptions,
    callbacks: Sequence[keras.callbacks.Callback],
    distribution,
    strategy,
    backup: EpochBackup,
    timing: tuple[float, str],
) -> RunResult:
    """`fit_task` once the run folder is locked and its backup read (`distribution`: the module that
    made `strategy`; `timing`: the run's start)."""
    batch_size, precision, seed = options.batch_size, options.precision, options.seed
    run_started, started_at = timing
    output_dir = os.fspath(options.output_dir)
    chief = distribution.is_chief(strategy)
    jit_compile, steps_per_epoch, fit_epochs, steps_per_execution = _schedule(task, options, strategy)
    total_steps = steps_per_epoch * fit_epochs
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
        logging = tensorboard_callbacks(os.path.join(output_dir, "logs"))
        fit_callbacks.extend(logging)
        if logging:  # the event files this run writes (earlier sessions' in the backup), for its records
            present = _event_files(output_dir)
            backup.written = lambda: sorted(_event_files(output_dir) - present)
    train_data = task.train_data(network, start_epoch, steps_per_epoch)
    if chief and start_epoch == 0:  # said once the data and model are ready: a refusal before is one line
        _say(f"starting a new run in {output_dir}.")
    started = time.perf_counter()
    network.fit(
        train_data,
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
        distribution={"backend": keras.backend.backend(), **distribution.describe_distribution(strategy)},
        fit_seconds=fit_seconds,
        seconds=time.perf_counter() - started,
        started_at=started_at,
        arguments=arguments,
    )
    class_names = resolved.get("class_names")
    if class_names:
        report["labels_file"] = LABELS_FILE
    if chief and backup.log_files():
        report[LOG_FILES] = backup.log_files()
    if chief:
        os.makedirs(output_dir, exist_ok=True)
        with keras_distribution.saved_alone():
            replace_file(os.path.join(output_dir, task.saved_file), saved.save)
        if class_names:
            replace_file(os.path.join(output_dir, LABELS_FILE), lambda path: write_labels(path, class_names))
    report.update(finished_at=now(), wall_seconds=round(time.perf_counter() - run_started, 3))
    if chief:
        write_json(os.path.join(output_dir, REPORT_FILE), report)
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
    folder becomes `keras_vit.data.tfdata.BadImageError` naming the files that fail to decode.
    """
    output_dir = os.fspath(options.output_dir)
    decoding_errors = ()  # what reading a changed image file raises, off TensorFlow: Pillow's own error
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        decoding_errors = (tf.errors.InvalidArgumentError,)
    try:
        return fit_task(task, arguments, options, [*callbacks, StopOnNonFiniteLoss()])
    except NonFiniteLossError as error:
        os.makedirs(output_dir, exist_ok=True)
        write_json(
            os.path.join(output_dir, REPORT_FILE),
            {"status": "failed", "error": str(error), "finished_at": None, "arguments": arguments},
        )
        raise
    except decoding_errors:
        from keras_vit.data import tfdata as data

        bad = [item for source in task.sources() for item in data.undecodable_files(source)]
        if not bad:
            raise
        listed = "; ".join(f"{path} ({reason})" for path, reason in bad[:5])
        raise data.BadImageError(
            f"TensorFlow cannot decode {len(bad)} image file(s): {listed}. Remove or replace them."
        ) from None

"""What every training run shares (`keras_vit.training.train`, `keras_vit.pretrain.pretrain`).

The run's length plan, its start (strategy, precision, seeds), exact resume (`EpochBackup`:
the complete training state written atomically after each epoch), argument digests for
reports, TensorBoard logs and the data augmentation defaults, and `fit_task`: the one training
driver that runs any `Task` (classification in `keras_vit.training`, masked patch prediction
in `keras_vit.pretrain`) with the same features.

`report.json` records what the run really used, not only what was typed: `arguments` (as given,
`None` where a default applied; the exact-resume check compares these) and, resolved, the model
(`model`, `model_config`), the task's `recipe`, `checkpoint` (source, file, sha256),
`hyperparameters` (every value as used, and the optimizer's own configuration), `data` sizes,
the strategy and its replicas, `versions` and `machine` (CPU model, GPUs), wall times and the
final metrics.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import keras
import numpy as np
import tensorflow as tf

from keras_vit import data, environment
from keras_vit import validation as check
from keras_vit.defaults import (
    BAD_IMAGE_ACTIONS,
    JIT_CHOICES,
    LABELS_FILE,
    PRECISIONS,
    STEPS_PER_EXECUTION,
    STEPS_PER_EXECUTION_CAP,
    WARMUP_FRACTION,
)
from keras_vit.distribute import fix_distributed_clipping, fix_multi_worker_fit, get_strategy, is_chief
from keras_vit.preprocessing import write_labels

__all__ = [
    "MAX_STEPS_PER_EPOCH",
    "NonFiniteLossError",
    "StopOnNonFiniteLoss",
    "EpochBackup",
    "RunResult",
    "Task",
    "fit_task",
    "augmentation",
    "check_run_arguments",
    "describe",
    "fit_checked",
    "execution_steps",
    "file_sha256",
    "json_safe",
    "optimizer_summary",
    "plan_steps",
    "remove_backup",
    "resolve_paths",
    "start_run",
    "strategy_name",
    "tensorboard_callbacks",
    "verbosity",
    "warmup_steps",
    "worker_dir",
    "write_json",
]

MAX_STEPS_PER_EPOCH = 1000  # at most this many steps are lost to a kill (they are redone)


def plan_steps(
    steps_per_pass: int, steps: int | None, epochs: float | None, steps_per_epoch: int | None
) -> tuple[int, int]:
    """`(steps_per_epoch, epochs)` of `fit` for `steps` total or `epochs` passes over the data."""
    if steps is not None and epochs is not None:
        raise ValueError("Give the training length as steps or as epochs, not both.")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}.")
    if epochs is not None and epochs <= 0:
        raise ValueError(f"epochs must be positive, got {epochs!r}.")
    if steps_per_epoch is not None and steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be a positive int, got {steps_per_epoch!r}.")
    if steps is None:
        per_epoch = steps_per_epoch or min(steps_per_pass, MAX_STEPS_PER_EPOCH)
        return per_epoch, max(1, math.ceil(epochs * steps_per_pass / per_epoch))
    if steps_per_epoch is None:
        # The longest epoch up to one pass that divides `steps`, if not much shorter.
        cap = min(steps_per_pass, MAX_STEPS_PER_EPOCH, steps)
        steps_per_epoch = next((n for n in range(cap, cap // 2, -1) if steps % n == 0), cap)
    if steps % steps_per_epoch:
        low = steps // steps_per_epoch * steps_per_epoch
        raise ValueError(
            f"steps {steps} is not a multiple of steps_per_epoch {steps_per_epoch} (backups are taken "
            f"between epochs): use steps={max(low, steps_per_epoch)} or {low + steps_per_epoch}, or "
            "another steps_per_epoch."
        )
    return steps_per_epoch, steps // steps_per_epoch


def execution_steps(
    steps_per_epoch: int, requested: int | str = STEPS_PER_EXECUTION, replicas: int = 1
) -> int:
    """Train steps per call into TensorFlow: `requested`, or for `"auto"` the largest divisor of
    `steps_per_epoch` up to `STEPS_PER_EXECUTION_CAP` (epochs, hence backups, end on a call).

    `"auto"` with several replicas is 1: Keras 3.15's multi-step loop fails under
    MirroredStrategy ("You must feed a value for placeholder tensor 'while/cond/Placeholder'").
    """
    if requested == "auto" and replicas > 1:
        return 1
    if requested == "auto":
        return max(
            n for n in range(1, min(steps_per_epoch, STEPS_PER_EXECUTION_CAP) + 1) if steps_per_epoch % n == 0
        )
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"steps_per_execution must be a positive int or 'auto', got {requested!r}.")
    if steps_per_epoch % requested:
        raise ValueError(
            f"steps_per_execution {requested} does not divide steps_per_epoch {steps_per_epoch}: backups "
            "are taken between epochs; use a divisor, or 'auto'."
        )
    return requested


class EpochBackup(keras.callbacks.Callback):
    """Saves the whole training state after every epoch, atomically, checksummed, and restores it.

    `backup_dir/state.json` names the epoch and its weights file (`model.save_weights`
    format: model and optimizer variables, EMA averages included) with the file's SHA-256, and
    holds the seed-generator states (dropout, stochastic depth: not in the weights file) and
    the per-epoch logs. Each file is written under a temporary name and renamed, the state file
    last: a kill at any point leaves the previous complete backup. The backup before it is kept
    too (`state-previous.json` and its weights file). On resume each state is verified (its
    JSON, its weights' checksum): a damaged latest backup is reported by file name and the
    previous one used; if none is intact the run stops with an error that says what to do.
    The training driver reads `epoch` before `fit` (to start the input stream there and pass
    `initial_epoch`); `on_train_begin` restores.
    """

    STATE = "state.json"
    PREVIOUS = "state-previous.json"

    def __init__(self, backup_dir: str | os.PathLike, run: dict | None = None):
        """`run`: JSON-able description of the run (its arguments); a backup of another run is refused."""
        super().__init__()
        self.backup_dir = os.fspath(backup_dir)
        self.run = run or {}
        self.state = self._read_state()
        if self.state and self.state.get("run", {}) != json.loads(json.dumps(self.run)):
            changed = sorted(
                key
                for key in set(self.run) | set(self.state.get("run", {}))
                if self.run.get(key) != self.state.get("run", {}).get(key)
            )
            raise ValueError(
                f"{self.backup_dir} holds the backup of a run with other arguments ({', '.join(changed)}): "
                "resume with the same arguments, or use another output directory."
            )
        self.history: dict[str, list[float]] = dict(self.state.get("history", {}))

    @property
    def epoch(self) -> int:
        """Epochs completed by the backed-up run (0: none)."""
        return int(self.state.get("epoch", 0))

    def _read_state(self) -> dict:
        """The newest intact backup's state (`{}`: none); a damaged one is reported by file name."""
        damaged = []
        for name in (self.STATE, self.PREVIOUS):
            path = os.path.join(self.backup_dir, name)
            if not os.path.exists(path):
                continue
            problem, state = self._verify(path)
            if problem is None:
                if damaged:
                    warnings.warn(
                        f"Damaged backup ignored: {'; '.join(damaged)}. Resuming from the previous backup "
                        f"{path} (epoch {state['epoch']}).",
                        stacklevel=3,
                    )
                return state
            damaged.append(f"{path} {problem}")
        if damaged:
            raise ValueError(
                f"The training backup in {self.backup_dir} is damaged and cannot be resumed: "
                f"{'; '.join(damaged)}. Delete {self.backup_dir} to start the run over (its finished epochs "
                "are lost), or use another output directory."
            )
        return {}

    def _verify(self, path: str) -> tuple[str | None, dict]:
        """`(None, state)` for an intact state file and weights, else `(what is wrong, {})`."""
        try:
            with open(path, encoding="utf-8") as file:
                state = json.load(file)
        except (OSError, ValueError) as error:
            return f"cannot be read ({type(error).__name__}: {error})", {}
        if not isinstance(state, dict) or not isinstance(state.get("sha256"), dict):
            return "has no checksums (not written by this version of keras_vit, or damaged)", {}
        checksums, weights, epoch = state["sha256"], state.get("weights"), state.get("epoch")
        if not (
            isinstance(epoch, int)
            and epoch >= 1
            and isinstance(weights, str)
            and weights in checksums
            and all(isinstance(name, str) and name == os.path.basename(name) for name in checksums)
            and all(isinstance(state.get(key, {}), dict) for key in ("seed_states", "history", "run"))
        ):
            return "is not a backup state (epoch, weights file, checksums)", {}
        for name, digest in checksums.items():
            file_path = os.path.join(self.backup_dir, name)
            if not os.path.isfile(file_path):
                return f"names {name}, which is missing", {}
            if file_sha256(file_path) != digest:
                return f"names {name}, which does not match its SHA-256 checksum (changed or damaged)", {}
        return None, state

    def _seed_variables(self) -> dict[str, keras.Variable]:
        weights = {id(variable) for variable in self.model.weights}
        return {variable.path: variable for variable in self.model.variables if id(variable) not in weights}

    def on_train_begin(self, logs=None):
        if not self.state:
            return
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        weights = os.path.join(self.backup_dir, self.state["weights"])
        try:
            self.model.load_weights(weights)
        except (OSError, KeyError, ValueError) as error:
            raise ValueError(
                f"The backup {weights} does not fit this model ({type(error).__name__}: {error}): it was "
                f"written by a different configuration; delete {self.backup_dir} or use another output "
                "directory."
            ) from None
        variables = self._seed_variables()
        for path, value in self.state.get("seed_states", {}).items():
            if path not in variables:
                raise ValueError(
                    f"The backup in {self.backup_dir} has seed state {path!r}, which this model lacks: it "
                    "was written by a different configuration; use another output directory."
                )
            variables[path].assign(np.asarray(value, dtype=variables[path].dtype))

    def on_epoch_end(self, epoch, logs=None):
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(float(value))
        os.makedirs(self.backup_dir, exist_ok=True)
        name = f"epoch-{epoch + 1:06d}.weights.h5"
        temporary = os.path.join(self.backup_dir, f"partial-{name}")
        self.model.save_weights(temporary, overwrite=True)
        fsync(temporary)
        os.replace(temporary, os.path.join(self.backup_dir, name))
        state = {
            "epoch": epoch + 1,
            "weights": name,
            "sha256": {name: file_sha256(os.path.join(self.backup_dir, name))},
            "steps": int(self.model.optimizer.iterations.numpy()),
            "seed_states": {
                path: keras.ops.convert_to_numpy(variable).tolist()
                for path, variable in self._seed_variables().items()
            },
            "history": self.history,
            "run": self.run,
        }
        keep = {name}
        if self.state:  # the last backup becomes the previous one, kept in case the new one is damaged
            write_json(os.path.join(self.backup_dir, self.PREVIOUS), self.state)
            keep.add(self.state["weights"])
        write_json(os.path.join(self.backup_dir, self.STATE), state)
        self.state = json.loads(json.dumps(state))  # as read back on resume (history copied)
        for entry in os.listdir(self.backup_dir):
            if entry.endswith(".weights.h5") and entry not in keep:
                os.remove(os.path.join(self.backup_dir, entry))


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, hex."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def fsync(path: str) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def write_json(path: str, content: dict) -> None:
    """Write `content` to `path` atomically (temporary file, fsync, rename)."""
    temporary = f"{path}.partial"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(content, file, indent=2)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def describe(value):
    """A JSON-able value naming an argument the same way in every process (backups compare them)."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (tuple, list)):
        return [describe(item) for item in value]
    if isinstance(value, np.ndarray):
        digest = hashlib.sha1(np.ascontiguousarray(value).tobytes()).hexdigest()[:16]
        return f"array{value.shape} {value.dtype} sha1 {digest}"
    if isinstance(value, data.Source):  # its repr names functions by their (per-process) address
        return f"Source({value.num_examples} examples, {value.num_classes} classes)"
    if isinstance(value, keras.Model):
        return f"Model({value.name}, {value.count_params()} parameters)"
    return repr(value)


# Arguments that may name a file or folder: a backup compares them resolved (`./runs/x` is `runs/x`).
_PATH_ARGUMENTS = ("output_dir", "dataset", "pretrained", "data_dir")


def resolve_paths(arguments: dict) -> dict:
    """`arguments` with paths resolved, as an exact resume compares them.

    `output_dir` is always resolved; the other path arguments when they name an existing path
    (a dataset or checkpoint name that is no path stays as typed).
    """
    resolved = dict(arguments)
    for key in _PATH_ARGUMENTS:
        value = resolved.get(key)
        if isinstance(value, str) and (key == "output_dir" or os.path.exists(os.path.expanduser(value))):
            resolved[key] = os.path.realpath(os.path.expanduser(value))
    return resolved


def json_safe(value):
    """`value` with everything JSON cannot hold as its repr (for configs in reports)."""
    return json.loads(json.dumps(value, default=repr))


def optimizer_summary(optimizer: keras.optimizers.Optimizer) -> dict:
    """The optimizer's class and configuration as used: schedule, weight decay, clipping, momenta."""
    return {"class": type(optimizer).__name__, **json_safe(optimizer.get_config())}


def strategy_name(strategy: tf.distribute.Strategy) -> str:
    """The public name of a strategy's class (the default strategy's class is private)."""
    name = type(strategy).__name__
    if name == "_DefaultDistributionStrategy":
        return "default (no distribution: tf.distribute.get_strategy())"
    return name


def _devices(strategy: tf.distribute.Strategy) -> list[str]:
    """The devices the replicas run on (the default strategy: TensorFlow's default placement)."""
    try:
        return [str(device) for device in strategy.extended.worker_devices]
    except RuntimeError:  # the default strategy has no device list: the first GPU, else the CPU
        logical = tf.config.list_logical_devices("GPU")[:1] or tf.config.list_logical_devices("CPU")[:1]
        return [device.name for device in logical]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def start_run(
    strategy: str | tf.distribute.Strategy, precision: str, batch_size: int, seed: int
) -> tf.distribute.Strategy:
    """Check the run's precision and batch, make the strategy (with the Keras fixes), seed everything."""
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}: use one of {PRECISIONS}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
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


def worker_dir(root: str, strategy: tf.distribute.Strategy) -> str:
    """`root` for the chief; a per-worker sub-folder for the other workers of a cluster."""
    if is_chief(strategy):
        return root
    return os.path.join(root, f"worker-{strategy.cluster_resolver.task_id}")


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


def augmentation(is_digits: bool, crop_scale: Sequence[float] | None, flip: bool | None) -> dict:
    """`train_pipeline`'s crop range and flips: gentle crops and no flips for the digits."""
    return dict(
        crop_scale=tuple(((0.7, 1.0) if is_digits else (0.08, 1.0)) if crop_scale is None else crop_scale),
        flip=(not is_digits) if flip is None else flip,
    )


def remove_backup(backup_dir: str) -> None:
    """Delete a finished run's backup files (only those `EpochBackup` writes)."""
    if not os.path.isdir(backup_dir):
        return
    for entry in os.listdir(backup_dir):
        if entry.endswith((".weights.h5", ".json", ".partial")):
            os.remove(os.path.join(backup_dir, entry))
    if not os.listdir(backup_dir):
        os.rmdir(backup_dir)


def warmup_steps(requested: int | None, total_steps: int, cap: int) -> int:
    """The warm-up length: as requested, else `defaults.WARMUP_FRACTION` of the steps, at most `cap`."""
    if requested is not None:
        return requested
    return min(cap, int(total_steps * WARMUP_FRACTION))


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
    """

    default_epochs: float
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


@dataclass
class RunResult:
    """What `fit_task` returns: the trained Keras model and the report it wrote (`report.json`)."""

    model: keras.Model
    report: dict


def fit_task(
    task: Task,
    arguments: dict,
    *,
    output_dir: str | os.PathLike,
    batch_size: int,
    steps: int | None,
    epochs: float | None,
    steps_per_epoch: int | None,
    strategy: str | tf.distribute.Strategy,
    precision: str,
    jit_compile: bool | str,
    seed: int,
    callbacks: Sequence[keras.callbacks.Callback],
    verbose: int | str,
    steps_per_execution: int | str = STEPS_PER_EXECUTION,
) -> RunResult:
    """The one training driver: `model.fit` of `task` under a tf.distribute strategy, resumable exactly.

    Every task gets the same run: strategy and seeds (`start_run`), the length plan
    (`plan_steps`; default `task.default_epochs` passes), exact resume from the per-epoch
    `EpochBackup` in `output_dir/backup` (a run started again with the same `arguments`
    continues bit for bit), the dtype policy `precision` while building, XLA (`jit_compile`
    `"auto"`: on for a single replica), several steps per call (`steps_per_execution`, see
    `execution_steps`; results are the same for any value, so resuming may change it),
    TensorBoard logs and progress, and a report with the task's metrics, timings, versions
    and the arguments.
    """
    environment.require_tensorflow_backend("The training driver (keras_vit.training, keras_vit.pretrain)")
    if jit_compile not in JIT_CHOICES:
        raise ValueError(f"jit_compile must be True, False or 'auto', got {jit_compile!r}.")
    # Checked before anything runs (keras_vit.validation): NaN or 0 never reach the plan.
    check.positive_int("batch_size", batch_size)
    check.optional(check.positive_int, "steps", steps)
    check.optional(check.positive_number, "epochs", epochs)
    check.optional(check.positive_int, "steps_per_epoch", steps_per_epoch)
    check.non_negative_int("seed", seed)
    check.one_of("verbose", verbose, ("auto", 0, 1, 2))
    run_started, started_at = time.perf_counter(), _now()
    strategy = start_run(strategy, precision, batch_size, seed)
    if jit_compile == "auto":
        jit_compile = strategy.num_replicas_in_sync == 1
    if steps is None and epochs is None:
        epochs = task.default_epochs
    steps_per_epoch, fit_epochs = plan_steps(task.prepare(batch_size), steps, epochs, steps_per_epoch)
    total_steps = steps_per_epoch * fit_epochs
    steps_per_execution = execution_steps(steps_per_epoch, steps_per_execution, strategy.num_replicas_in_sync)
    output_dir = os.fspath(output_dir)
    chief = is_chief(strategy)
    run = {
        key: value
        for key, value in arguments.items()
        if key not in ("strategy", "verbose", "steps_per_execution")
    }
    backup = EpochBackup(worker_dir(os.path.join(output_dir, "backup"), strategy), resolve_paths(run))
    start_epoch = min(backup.epoch, fit_epochs)

    previous_policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        with strategy.scope():
            network = task.build()
            task.compile(network, total_steps, jit_compile, steps_per_execution)
            # Eagerly: inside fit's first trace, each optimizer variable costs ~0.1 s to create.
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
        verbose=verbosity(verbose),
    )
    fit_seconds = time.perf_counter() - started
    # fit() ends by copying the EMA averages (if enabled) into the model: they are evaluated and saved.
    metrics = task.finish(network, backup.history)
    steps_this_run = (fit_epochs - start_epoch) * steps_per_epoch
    saved = task.saved_model(network)
    height, width = saved.input_shape[1:3]
    resolved = task.describe(network) if hasattr(task, "describe") else {}
    train_examples = resolved.get("data", {}).get("train_examples")
    hyperparameters = {
        **resolved.pop("hyperparameters", {}),
        "batch_size": batch_size,
        "steps": total_steps,
        "epochs": fit_epochs,
        "steps_per_epoch": steps_per_epoch,
        "passes_over_data": round(total_steps * batch_size / train_examples, 3) if train_examples else None,
        "precision": precision,
        "jit_compile": bool(jit_compile),
        "steps_per_execution": steps_per_execution,
        "seed": seed,
        "optimizer": optimizer_summary(network.optimizer),
    }
    config = getattr(saved, "config", None)
    report = {
        **metrics,
        "steps": int(network.optimizer.iterations.numpy()),
        "planned_steps": total_steps,
        "steps_per_epoch": steps_per_epoch,
        "epochs": fit_epochs,
        "resumed_from_epoch": start_epoch,
        "steps_this_run": steps_this_run,
        "seconds": round(time.perf_counter() - started, 3),
        "fit_seconds": round(fit_seconds, 3),
        "images_per_second": round(steps_this_run * batch_size / fit_seconds, 1) if steps_this_run else None,
        "history": backup.history,
        "final_training_metrics": {key: values[-1] for key, values in backup.history.items() if values},
        "model": saved.name,
        "model_config": config.to_dict() if hasattr(config, "to_dict") else None,
        "parameters": int(saved.count_params()),
        "image_size": [int(height), int(width)],
        **resolved,
        "hyperparameters": hyperparameters,
        "strategy": strategy_name(strategy),
        "replicas": int(strategy.num_replicas_in_sync),
        "devices": _devices(strategy),
        "jit_compile": bool(jit_compile),
        "precision": precision,
        "versions": environment.versions(),
        "machine": environment.machine(),
        "started_at": started_at,
        "finished_at": None,
        "wall_seconds": None,  # strategy, data, build, fit, evaluation and saving
        "arguments": arguments,
    }
    class_names = resolved.get("class_names")
    if class_names:
        report["labels_file"] = LABELS_FILE
    if chief:
        os.makedirs(output_dir, exist_ok=True)
        saved.save(os.path.join(output_dir, task.saved_file))
        if class_names:
            write_labels(os.path.join(output_dir, LABELS_FILE), class_names)
    report.update(finished_at=_now(), wall_seconds=round(time.perf_counter() - run_started, 3))
    if chief:
        write_json(os.path.join(output_dir, "report.json"), report)
    remove_backup(backup.backup_dir)
    return RunResult(network, report)


def check_run_arguments(
    *, image_size, learning_rate, warmup_steps, weight_decay, dropout, crop_scale, on_bad_image
) -> None:
    """Check the arguments `train` and `keras_vit.pretrain.pretrain` share (`ValueError` naming one)."""
    check.optional(check.image_size, "image_size", image_size)
    check.optional(check.positive_number, "learning_rate", learning_rate)
    check.optional(check.non_negative_int, "warmup_steps", warmup_steps)
    check.number("weight_decay", weight_decay, minimum=0)
    check.fraction("dropout", dropout)
    check.optional(check.crop_scale, "crop_scale", crop_scale)
    check.one_of("on_bad_image", on_bad_image, BAD_IMAGE_ACTIONS)


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


def fit_checked(task, arguments: dict, **fit_arguments) -> RunResult:
    """`fit_task` that stops on a non-finite loss and names unreadable image files.

    A non-finite loss (`NonFiniteLossError`) writes `report.json` with `"status": "failed"`
    and the reason, and no model. A TensorFlow decoding error met while reading an image
    folder becomes `keras_vit.data.BadImageError` naming the files that fail to decode.
    """
    fit_arguments["callbacks"] = [*fit_arguments.get("callbacks", ()), StopOnNonFiniteLoss()]
    output_dir = os.fspath(fit_arguments["output_dir"])
    try:
        return fit_task(task, arguments, **fit_arguments)
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

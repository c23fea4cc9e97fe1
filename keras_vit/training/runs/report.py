"""What report.json says about a run: arguments named the same way in every process, resolved paths.

`run_report` assembles the report of a finished run from what the driver measured and what
the task and the distribution describe; `describe` turns an argument into a JSON value (the
exact-resume check compares them), `resolve_paths` spells paths one way, `optimizer_summary`
records the optimizer as used. Backend-neutral: a distribution describes itself (a
`keras_vit.training.runs.strategy.describe_distribution` record).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os

import keras
import numpy as np

from keras_vit.utils import environment

__all__ = [
    "describe",
    "json_safe",
    "now",
    "optimizer_summary",
    "resolve_paths",
    "run_arguments",
    "run_report",
]


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
    if isinstance(value, keras.Model):
        return f"Model({value.name}, {value.count_params()} parameters)"
    return repr(value)


def run_arguments(options, **given) -> dict:
    """A run's arguments as report.json records them (`describe`d): `given` (the model, the
    dataset, ...) and every run option, `None` where a default applies."""
    return {key: describe(value) for key, value in {**given, **options.arguments()}.items()}


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


def now() -> str:
    """The time now, UTC, to the second (report.json's `started_at`, `finished_at`)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_report(
    *,
    network: keras.Model,
    saved: keras.Model,
    metrics: dict,
    resolved: dict,
    history: dict[str, list[float]],
    steps_per_epoch: int,
    epochs: int,
    start_epoch: int,
    steps_per_execution: int,
    jit_compile: bool,
    batch_size: int,
    precision: str,
    seed: int,
    distribution: dict,
    fit_seconds: float,
    seconds: float,
    started_at: str,
    arguments: dict,
) -> dict:
    """report.json of a finished run (before its end time and wall time are known).

    `metrics` are the task's (`Task.finish`), `resolved` what the task used (`Task.describe`:
    recipe, checkpoint, data, hyper-parameters), `distribution` how the run was spread over
    devices; the rest is the driver's plan and timings.
    """
    total_steps = steps_per_epoch * epochs
    steps_this_run = (epochs - start_epoch) * steps_per_epoch
    resolved = dict(resolved)
    train_examples = resolved.get("data", {}).get("train_examples")
    hyperparameters = {
        **resolved.pop("hyperparameters", {}),
        "batch_size": batch_size,
        "steps": total_steps,
        "epochs": epochs,
        "steps_per_epoch": steps_per_epoch,
        "passes_over_data": round(total_steps * batch_size / train_examples, 3) if train_examples else None,
        "precision": precision,
        "jit_compile": bool(jit_compile),
        "steps_per_execution": steps_per_execution,
        "seed": seed,
        "optimizer": optimizer_summary(network.optimizer),
    }
    height, width = saved.input_shape[1:3]
    config = getattr(saved, "config", None)
    return {
        **metrics,
        "steps": int(keras.ops.convert_to_numpy(network.optimizer.iterations)),
        "planned_steps": total_steps,
        "steps_per_epoch": steps_per_epoch,
        "epochs": epochs,
        "resumed_from_epoch": start_epoch,
        "steps_this_run": steps_this_run,
        "seconds": round(seconds, 3),
        "fit_seconds": round(fit_seconds, 3),
        "images_per_second": round(steps_this_run * batch_size / fit_seconds, 1) if steps_this_run else None,
        "history": history,
        "final_training_metrics": {key: values[-1] for key, values in history.items() if values},
        "model": saved.name,
        "model_config": config.to_dict() if hasattr(config, "to_dict") else None,
        "parameters": int(saved.count_params()),
        "image_size": [int(height), int(width)],
        **resolved,
        "hyperparameters": hyperparameters,
        **distribution,
        "jit_compile": bool(jit_compile),
        "precision": precision,
        "versions": environment.versions(),
        "machine": environment.machine(),
        "started_at": started_at,
        "finished_at": None,
        "wall_seconds": None,  # strategy, data, build, fit, evaluation and saving
        "arguments": arguments,
    }

"""What report.json says about a run: arguments named the same way in every process, resolved paths.

`describe` turns an argument into a JSON value (the exact-resume check compares them),
`resolve_paths` spells paths one way, `optimizer_summary` records the optimizer as used.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os

import keras
import numpy as np

__all__ = ["describe", "json_safe", "now", "optimizer_summary", "resolve_paths"]


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

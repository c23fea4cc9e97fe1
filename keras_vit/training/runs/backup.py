"""Exact resume: the complete training state backed up after every epoch, atomically and checksummed.

`EpochBackup` (a Keras callback) writes and restores the backup; `write_json` is the atomic
writer it (and the report) use, `keras_vit.utils.files` the checksums; `remove_backup` clears a
finished run's backup.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from collections.abc import Callable

import keras
import numpy as np

from keras_vit.utils.files import file_sha256, json_sha256, open_for_writing, refuse_link

__all__ = [
    "BackupMismatchError",
    "EpochBackup",
    "check_backup_folder",
    "file_sha256",
    "fsync",
    "remove_backup",
    "write_json",
]

STATE_CHECKSUM = "state_sha256"
# The names `EpochBackup` writes: its states, each epoch's weights, and their staging names.
_OWN_NAMES = re.compile(r"(state|state-previous)\.json(\.partial)?|(partial-)?epoch-\d{6}\.weights\.h5")


class BackupMismatchError(ValueError):
    """The folder holds the backup of a run with other arguments."""


def sign_state(state: dict) -> dict:
    """`state` with the SHA-256 of its own content (`state_sha256`): an edited state file is detected."""
    content = {key: value for key, value in state.items() if key != STATE_CHECKSUM}
    return {**content, STATE_CHECKSUM: json_sha256(content)}


class EpochBackup(keras.callbacks.Callback):
    """Saves the whole training state after every epoch, atomically, checksummed, and restores it.

    `backup_dir/state.json` names the epoch and its weights file (`model.save_weights`
    format: model and optimizer variables, EMA averages included) with the file's SHA-256,
    holds the seed-generator states (dropout, stochastic depth: not in the weights file) and
    the per-epoch logs, and records the SHA-256 of its own content (`sign_state`). Each file
    is written under a temporary name and renamed, the state file last: a kill at any point
    leaves the previous complete backup. The backup before it is kept too
    (`state-previous.json` and its weights file). On resume each state is verified (its JSON,
    its own checksum, its weights' checksum): a damaged or edited latest backup is reported
    by file name and the previous one used; if none is intact the run stops with an error
    that says what to do.
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
            raise BackupMismatchError(
                f"{self.backup_dir} holds the backup of an unfinished run with other arguments "
                f"({', '.join(changed)}): resume it with the same arguments, use another output directory, "
                "or pass overwrite=True (--overwrite) to discard it and start over."
            )
        # Copied: the state stays as read (it becomes the previous backup, checksummed).
        self.history = {key: list(values) for key, values in self.state.get("history", {}).items()}
        # The files the run wrote outside the backup (TensorBoard's), named in each state: the earlier
        # sessions' here, this session's from `written` (set by the driver).
        recorded = self.state.get("log_files", [])
        self.earlier_files = (
            [name for name in recorded if isinstance(name, str)] if isinstance(recorded, list) else []
        )
        self.written: Callable[[], list[str]] | None = None

    def log_files(self) -> list[str]:
        """The files the run wrote outside its backup so far (relative to the output folder)."""
        return sorted({*self.earlier_files, *(self.written() if self.written else ())})

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
        if state.get(STATE_CHECKSUM) != sign_state(state)[STATE_CHECKSUM]:
            return "does not match its own SHA-256 checksum (edited or damaged)", {}
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
        refuse_link(temporary)  # h5py would write through it
        self.model.save_weights(temporary, overwrite=True)
        fsync(temporary)
        os.replace(temporary, os.path.join(self.backup_dir, name))
        state = sign_state(
            {
                "epoch": epoch + 1,
                "weights": name,
                "sha256": {name: file_sha256(os.path.join(self.backup_dir, name))},
                "steps": int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)),
                "seed_states": {
                    path: keras.ops.convert_to_numpy(variable).tolist()
                    for path, variable in self._seed_variables().items()
                },
                "history": self.history,
                "run": self.run,
                **({"log_files": self.log_files()} if self.log_files() else {}),
            }
        )
        keep = {name}
        if self.state:  # the last backup becomes the previous one, kept in case the new one is damaged
            write_json(os.path.join(self.backup_dir, self.PREVIOUS), self.state)
            keep.add(self.state["weights"])
        write_json(os.path.join(self.backup_dir, self.STATE), state)
        self.state = json.loads(json.dumps(state))  # as read back on resume (history copied)
        for entry in _own_files(self.backup_dir):
            if entry.endswith(".weights.h5") and entry not in keep:
                os.remove(os.path.join(self.backup_dir, entry))


def fsync(path: str) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def write_json(path: str, content: dict) -> None:
    """Write `content` to `path` atomically (temporary file, fsync, rename)."""
    temporary = f"{path}.partial"
    with open_for_writing(temporary, encoding="utf-8") as file:
        json.dump(content, file, indent=2)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def _own_files(backup_dir: str) -> list[str]:
    """The files in `backup_dir` that `EpochBackup` wrote: regular files (never a link) of its names."""
    paths = {entry: os.path.join(backup_dir, entry) for entry in os.listdir(backup_dir)}
    return sorted(
        entry
        for entry, path in paths.items()
        if _OWN_NAMES.fullmatch(entry) and os.path.isfile(path) and not os.path.islink(path)
    )


def check_backup_folder(output_dir: str, backup_dir: str) -> None:
    """`ValueError` if `backup_dir`, or a folder between it and `output_dir`, is a symbolic link: the
    backup is written, and later removed, only inside the output folder."""
    folder = os.path.abspath(backup_dir)
    top = os.path.abspath(output_dir)
    while folder.startswith(top + os.sep):
        if os.path.islink(folder):
            raise ValueError(
                f"{folder} is a symbolic link (to {os.readlink(folder)}): keras_vit writes and removes its "
                "backup only in a real folder inside the output folder. Remove the link, or choose another "
                "output folder."
            )
        folder = os.path.dirname(folder)


def refuse_links(backup_dir: str) -> None:
    """`FileExistsError` when a file under a name `EpochBackup` writes in `backup_dir` is a link
    (`keras_vit.utils.files.refuse_link`): the backup is never written through one."""
    if not os.path.isdir(backup_dir) or os.path.islink(backup_dir):
        return
    for entry in sorted(os.listdir(backup_dir)):
        if _OWN_NAMES.fullmatch(entry):
            refuse_link(os.path.join(backup_dir, entry))


def remove_backup(backup_dir: str) -> None:
    """Delete a finished run's backup: only the files `EpochBackup` wrote (its names, regular files),
    then the folder if that left it empty. A folder that is a symbolic link is not entered. The
    other processes of a multi-process run finish beside it (each its own `worker-N` folder inside
    the chief's), and any of them may remove the chief's folder once it is empty: a folder still
    holding something, or already gone, is left as it is."""
    if os.path.islink(backup_dir) or not os.path.isdir(backup_dir):
        return
    for entry in _own_files(backup_dir):
        os.remove(os.path.join(backup_dir, entry))
    with contextlib.suppress(OSError):  # not empty (a user's file, a partner's folder) or removed already
        os.rmdir(backup_dir)

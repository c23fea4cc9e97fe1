"""Writing without losing a user's files: owned writes, no output over an input, the run lock, checksums.

Every keras_vit writer (`save_pretrained`, `keras-vit convert`, `export`, the training driver)
goes through here:

* `write_owned` writes a set of files into a folder as one step, replacing only the writer's
  own earlier output (the names it lists), never the folder's other contents;
* `refuse_overlap` refuses, before anything is written, an output that is or holds an input;
* `RunLock` keeps a second training run out of a run folder while one writes to it;
* `file_sha256` and `json_sha256` are the checksums that backups and `keras_vit.json` record.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

__all__ = [
    "LOCK_FILE",
    "ChecksumError",
    "RunInUseError",
    "RunLock",
    "file_sha256",
    "json_sha256",
    "refuse_link",
    "refuse_overlap",
    "replace_file",
    "load_keras_file",
    "write_owned",
]

LOCK_FILE = ".keras_vit-run.lock"


def refuse_link(path: str | os.PathLike) -> None:
    """`FileExistsError` when `path` is a symbolic link, a hard link or not a regular file: a writer
    about to write (or replace) a file of its own there would write through it, or drop a name it
    did not make. Nothing there, or a plain file: no error."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        what = f"a symbolic link (to {os.readlink(path)})"
    elif not stat.S_ISREG(info.st_mode):
        what = "not a regular file"
    elif info.st_nlink > 1:
        what = f"a hard link ({info.st_nlink} names for one file)"
    else:
        return
    raise FileExistsError(
        f"{os.fspath(path)} is {what}, not a file keras_vit wrote: it writes its files only as files of its "
        "own, never through a link. Remove it (what it points to is left as it is), or choose another "
        "output folder."
    )


def open_for_writing(path: str | os.PathLike, mode: str = "w", **kwargs):
    """`open(path, mode)` for a file of the writer's own, `mode` "w" or "a" (text or "b"): refused
    (`refuse_link`) when a link is there, and opened without following one (`O_NOFOLLOW`) where the
    system has it."""
    if mode.replace("b", "") not in ("w", "a"):
        raise ValueError(f"open_for_writing writes ('w') or appends ('a'), not mode {mode!r}.")
    refuse_link(path)
    ending = os.O_APPEND if "a" in mode else os.O_TRUNC
    flags = os.O_WRONLY | os.O_CREAT | ending | getattr(os, "O_NOFOLLOW", 0)
    return open(os.open(path, flags, 0o666), mode, **kwargs)


class ChecksumError(ValueError):
    """A file does not match the SHA-256 checksum recorded for it: it was changed or damaged."""


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, hex."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def json_sha256(content) -> str:
    """The SHA-256 of JSON content in one canonical spelling (sorted keys, no spaces): the same
    value after a JSON write and read, whatever the indentation."""
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def refuse_overlap(output: str | os.PathLike, inputs: Iterable[str | os.PathLike | None]) -> None:
    """`ValueError` if the output path is, or is a folder that holds, one of the existing `inputs`."""
    target = os.path.realpath(os.path.expanduser(os.fspath(output)))
    for given in inputs:
        if given is None or not isinstance(given, (str, os.PathLike)):
            continue
        source = os.path.realpath(os.path.expanduser(os.fspath(given)))
        if not os.path.exists(source):
            continue
        if source == target or source.startswith(target.rstrip(os.sep) + os.sep):
            relation = "is" if source == target else "holds"
            raise ValueError(
                f"The output {os.fspath(output)} {relation} the input {os.fspath(given)}: writing there "
                "could replace or mix with it. Choose an output outside the input."
            )


def _writable_folder(directory: Path) -> None:
    """Make `directory`'s parent, naming the place the user gave when that fails."""
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{directory} exists and is not a folder: choose another path.")
    file_above = next((folder for folder in directory.parents if folder.is_file()), None)
    if file_above is not None:
        raise NotADirectoryError(f"Cannot create {directory}: {file_above} is a file, not a folder.")
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(error.errno, f"Cannot create {directory}: {error.strerror}") from None


@contextlib.contextmanager
def _named_as(directory: Path):
    """An `OSError` raised inside names `directory`, the place the user gave, never a staging name.

    safetensors reports a failed write as a `SafetensorError` naming no file ("I/O error: No
    space left on device (os error 28)"): it becomes the same `OSError`.
    """
    from safetensors import SafetensorError

    try:
        yield
    except OSError as error:
        reason = error.strerror or str(error)
        raise OSError(error.errno, f"Cannot write into {directory}: {reason}") from None
    except SafetensorError as error:
        code = re.search(r"\(os error (\d+)\)", str(error))
        if code is None:
            raise
        number = int(code.group(1))
        raise OSError(number, f"Cannot write into {directory}: {os.strerror(number)}") from None


def write_owned(
    directory: str | os.PathLike,
    names: Collection[str],
    fill: Callable[[Path], None],
    *,
    earlier: Collection[str] = (),
    overwrite: bool = False,
    last: str | None = None,
) -> Path:
    """Write the files `names` (made by `fill(staging folder)`) into `directory`; returns the folder.

    `earlier`: the names this writer wrote into `directory` before (its own earlier output):
    with `overwrite` they are replaced (those no longer written are removed), without it their
    presence is a `FileExistsError`. A file of another name is never touched; one of the
    `names` that is there but not in `earlier` (not the writer's) is a `FileExistsError` even
    with `overwrite`. Both checks run before anything is written. A new folder is written
    beside its place and renamed into it; in an existing folder each file is written under a
    hidden staging folder and renamed onto its name, `last` (a manifest) last.
    """
    directory = Path(directory).expanduser()
    _writable_folder(directory)
    names, earlier = set(names), set(earlier)
    if directory.is_dir():
        foreign = sorted(name for name in names - earlier if (directory / name).exists())
        if foreign:
            raise FileExistsError(
                f"{directory} already has {', '.join(foreign)}, not written by keras_vit or changed since "
                "(overwrite replaces only keras_vit's own earlier output): move them away, or choose another "
                "folder."
            )
        own = sorted(name for name in earlier if (directory / name).exists())
        if own and not overwrite:
            raise FileExistsError(
                f"{directory} already holds keras_vit output ({', '.join(own)}): choose another folder, or "
                "pass overwrite=True (--overwrite) to replace those files (the folder's others are kept)."
            )
    into_existing = directory.is_dir()
    with _named_as(directory):
        staging = Path(
            tempfile.mkdtemp(
                prefix=f".{directory.name}.tmp-", dir=directory if into_existing else directory.parent
            )
        )
    try:
        with _named_as(directory):  # a full disk, a folder made read-only meanwhile, ...
            fill(staging)
            written = set(os.listdir(staging))
            if written != names:
                raise RuntimeError(f"keras_vit wrote {sorted(written)} where it declared {sorted(names)}.")
            if not into_existing:
                os.replace(staging, directory)
                return directory
            for name in sorted(names - {last}) + ([last] if last in names else []):
                os.replace(staging / name, directory / name)
            for name in earlier - names:
                if (directory / name).is_file():
                    os.remove(directory / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def replace_file(path: str | os.PathLike, write: Callable[[str], None]) -> str:
    """`write(temporary path)` beside `path` (same suffix), then renamed onto it: no half-written file."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(path)[1], dir=folder)
    os.close(handle)
    try:
        write(staging)
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    return path


class RunInUseError(RuntimeError):
    """Another process is writing to the run folder."""


class RunLock:
    """An exclusive lock on a run folder while a run writes to it (`with RunLock(folder): ...`).

    `folder/.keras_vit-run.lock` held with `fcntl.flock`: the operating system releases it when
    the process ends, however it ends (SIGKILL included), so a lock left by a dead run is taken
    over by the next one. The file is opened without following links (`O_NOFOLLOW`): a link
    planted under its name is refused, never written through. The file records the holder (pid,
    host, start time) for the error a second run gets; it is removed when the run ends, and so is
    the folder if the lock made it and nothing else was written there.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        self.path = os.path.join(self.folder, LOCK_FILE)
        self._descriptor: int | None = None
        self._made_folder = False

    def _holder(self) -> str:
        try:
            with open(self.path, encoding="utf-8") as file:
                holder = json.load(file)
            return f"pid {holder['pid']} on {holder['host']}, started {holder['started_at']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "a process that is starting"

    def _open(self) -> int:
        """The lock file, opened without following a link; a link, or a file with other names (hard
        links), is refused: the lock's record would be written into someone else's file."""
        try:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as error:
            if not os.path.islink(self.path):
                raise
            raise FileExistsError(
                f"{self.path} is a symbolic link (to {os.readlink(self.path)}), not keras_vit's run lock: "
                "remove the link (its target is left as it is), or choose another output folder."
            ) from error
        if os.fstat(descriptor).st_nlink > 1:
            os.close(descriptor)
            raise FileExistsError(
                f"{self.path} has other names (hard links), so it is not keras_vit's run lock: remove it "
                "(the other names keep the file), or choose another output folder."
            )
        return descriptor

    def acquire(self) -> RunLock:
        import datetime
        import fcntl

        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise NotADirectoryError(f"The output folder {self.folder} is a file: give a folder.")
        self._made_folder = not os.path.isdir(self.folder)
        os.makedirs(self.folder, exist_ok=True)
        while True:
            descriptor = self._open()
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(descriptor)
                raise RunInUseError(
                    f"{self.folder} is in use by another training run ({self._holder()}): wait for it to end "
                    "or stop it, or choose another output folder."
                ) from None
            try:  # the last holder may have removed the file between our open and our lock
                same = os.path.samestat(os.fstat(descriptor), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(descriptor)
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_at": started})
        os.ftruncate(descriptor, 0)
        os.write(descriptor, record.encode("utf-8"))
        os.fsync(descriptor)
        self._descriptor = descriptor
        return self

    def release(self) -> None:
        if self._descriptor is None:
            return
        try:
            os.remove(self.path)  # while held: a waiting process then sees another file and retries
        except FileNotFoundError:
            pass
        os.close(self._descriptor)
        self._descriptor = None
        if self._made_folder:
            with contextlib.suppress(OSError):  # not empty: the run wrote there
                os.rmdir(self.folder)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# What reading a damaged `.keras` archive raises inside Keras (zip, JSON, h5py errors).
_DAMAGE_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, KeyError, json.JSONDecodeError, OSError)


def _damaged(path: str, reason: str) -> ValueError:
    return ValueError(
        f"Cannot load the model file {path}: {reason}. It is damaged, e.g. truncated by an interrupted "
        "save, copy or download: save, copy or download it again."
    )


def _check_keras_archive(path: str) -> None:
    """A local `.keras` file must exist and be a zip archive with a `config.json` (Keras's own errors
    for these cases are a misleading "File not found" or a raw `BadZipFile` / `KeyError`)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"No model file at {path}: check the path.")
    if not zipfile.is_zipfile(path):
        raise _damaged(path, "it is not a zip archive, as every .keras file is")
    with zipfile.ZipFile(path) as archive:
        if "config.json" not in archive.namelist():
            raise _damaged(path, "the archive has no config.json")


def load_keras_file(path: str | os.PathLike, **kwargs):
    """`keras.saving.load_model(path, **kwargs)` where a local `.keras` file that is missing, not a zip
    archive, or damaged inside (its config, its weights) raises one error naming the file
    (`FileNotFoundError`, else `ValueError`). The caller registers the classes the file needs."""
    import keras

    location = os.fspath(path)
    if not (location.endswith(".keras") and "://" not in location):
        return keras.saving.load_model(path, **kwargs)  # other formats and remote files: Keras's errors
    _check_keras_archive(location)
    try:
        return keras.saving.load_model(path, **kwargs)
    except _DAMAGE_ERRORS as error:
        raise _damaged(location, f"{type(error).__name__}: {error}") from None

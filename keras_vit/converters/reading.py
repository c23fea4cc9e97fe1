"""Read checkpoint files into `{name: numpy array}` without importing torch or jax.

Google `.npz` files are read with `np.load(allow_pickle=False)`, `.safetensors` with
`safetensors.numpy`, and PyTorch `.bin` / `.pt` / `.pth` files (the zip format `torch.save` has
written since PyTorch 1.6) with a restricted unpickler that knows only the tensor-rebuild
functions, the storage classes and `collections.OrderedDict`: anything else in the pickle (a
custom class, `os.system`, ...) is refused before it is called, so reading a file never runs code.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file as _load_safetensors

from keras_vit.converters.errors import CheckpointError

__all__ = ["read_checkpoint", "resolve_checkpoint_file", "TORCH_SUFFIXES"]

TORCH_SUFFIXES = (".bin", ".pt", ".pth")
# Files looked for, in this order, when a directory (a Hugging Face / timm snapshot) is given.
DIRECTORY_FILES = ("model.safetensors", "pytorch_model.bin")

_STORAGE_DTYPES = {
    "DoubleStorage": np.float64,
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}
_READ_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, KeyError)


def _corrupt(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"Cannot read the checkpoint {path} ({type(error).__name__}: {error}). The file is truncated "
        "or corrupt, e.g. by an interrupted download: delete it and download it again."
    )


def resolve_checkpoint_file(path: str | os.PathLike) -> Path:
    """The checkpoint file at `path`; for a directory, its `model.safetensors` or `pytorch_model.bin`."""
    path = Path(path)
    if path.is_dir():
        for name in DIRECTORY_FILES:
            if (path / name).is_file():
                return path / name
        raise CheckpointError(
            f"The directory {path} holds none of {list(DIRECTORY_FILES)}: pass the checkpoint file itself."
        )
    if not path.is_file():
        raise CheckpointError(f"No checkpoint file at {path}: check the path.")
    return path


def read_checkpoint(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of a `.npz`, `.safetensors` or PyTorch `.bin`/`.pt`/`.pth` checkpoint, by name.

    Arrays keep their stored dtype (bfloat16 as `ml_dtypes.bfloat16`). A directory is read
    through the file `resolve_checkpoint_file` picks. Raises `CheckpointError` for an unknown
    suffix, a truncated or corrupt file, or a pickle that holds anything but tensors.
    """
    path = resolve_checkpoint_file(path)
    suffix = path.suffix.lower()
    if suffix == ".npz":
        return _read_npz(path)
    if suffix == ".safetensors":
        try:
            return _load_safetensors(str(path))
        except (SafetensorError, OSError, ValueError, TypeError) as error:
            raise _corrupt(path, error) from None
    if suffix in TORCH_SUFFIXES:
        return _read_torch(path)
    raise CheckpointError(
        f"Unknown checkpoint file type {path.name!r}: use a .npz (Google), .safetensors, or PyTorch "
        f"{'/'.join(TORCH_SUFFIXES)} file."
    )


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        archive = np.load(path, allow_pickle=False)
    except _READ_ERRORS as error:
        raise _corrupt(path, error) from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise CheckpointError(f"{path} holds a single .npy array, not a .npz archive of named arrays.")
    with archive:
        try:
            return {name: archive[name] for name in archive.files}
        except _READ_ERRORS as error:
            raise _corrupt(path, error) from None


def _read_torch(path: Path) -> dict[str, np.ndarray]:
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as file:
            head = file.read(2)
        if head[:1] == b"\x80":
            raise CheckpointError(
                f"{path} is in the legacy (pre-zip, PyTorch < 1.6) torch.save format, which is not read "
                "here: use the checkpoint's .safetensors file, or re-save it with a recent torch."
            )
        raise _corrupt(path, zipfile.BadZipFile("not a zip archive"))
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.rpartition("/")[2] == "data.pkl"]
            if len(pickles) != 1:
                raise CheckpointError(
                    f"{path} is a zip archive but not a torch.save file ({len(pickles)} data.pkl records)."
                )
            root = pickles[0][: -len("data.pkl")]
            byteorder = "little"
            if f"{root}byteorder" in archive.namelist():
                byteorder = archive.read(f"{root}byteorder").decode("ascii").strip()
            state = _TensorUnpickler(archive, root, byteorder, path).load()
    except CheckpointError:
        raise
    except Exception as error:  # anything a malformed pickle or zip record can raise
        raise _corrupt(path, error) from None
    return _state_dict_of(state, path)


def _state_dict_of(obj, path: Path) -> dict[str, np.ndarray]:
    """The flat `{name: array}` state dict, unwrapped from a `{"state_dict": ...}` or `{"model": ...}`."""
    if isinstance(obj, dict):
        for holder in ("state_dict", "model"):
            if isinstance(obj.get(holder), dict):
                obj = obj[holder]
                break
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a state dict of tensors.")
    others = [str(key) for key, value in obj.items() if not isinstance(value, np.ndarray)]
    if others:
        raise CheckpointError(f"{path} is not a plain state dict: entries {others[:10]} are not tensors.")
    return {str(key): value for key, value in obj.items()}


@dataclass(frozen=True)
class _StorageType:
    """What `torch.FloatStorage` & co. unpickle to: the element dtype, nothing callable."""

    dtype: np.dtype


class _TensorUnpickler(pickle.Unpickler):
    """Unpickles a torch.save state dict into numpy arrays; refuses every other global."""

    def __init__(self, archive: zipfile.ZipFile, root: str, byteorder: str, path: Path):
        super().__init__(io.BytesIO(archive.read(f"{root}data.pkl")))
        if byteorder not in ("little", "big"):
            raise CheckpointError(f"{path} declares an unknown byte order {byteorder!r}.")
        self._archive = archive
        self._root = root
        self._byteorder = "<" if byteorder == "little" else ">"
        self._path = path
        self._storages: dict[str, np.ndarray] = {}

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return self._rebuild_parameter
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(np.dtype(_STORAGE_DTYPES[name]))
        raise CheckpointError(
            f"Refusing to load {self._path}: its pickle refers to {module}.{name}, which is not a tensor "
            "(unpickling it could run arbitrary code). Only plain tensor state dicts are read: use a "
            ".safetensors file or a state dict saved with torch.save(model.state_dict(), ...)."
        )

    def persistent_load(self, pid):
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
            and isinstance(pid[4], int)
        ):
            raise CheckpointError(f"{self._path} has an unexpected storage record {pid!r}.")
        _, storage_type, key, _location, numel = pid
        if key not in self._storages:
            dtype = storage_type.dtype.newbyteorder(self._byteorder)
            data = self._archive.read(f"{self._root}data/{key}")
            if numel < 0 or len(data) < numel * dtype.itemsize:
                raise _corrupt(
                    self._path, EOFError(f"storage {key} holds {len(data)} bytes, needs {numel} elements")
                )
            self._storages[key] = np.frombuffer(data, dtype=dtype, count=numel)
        return self._storages[key]

    def _rebuild_tensor(
        self, storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None
    ):
        """`torch._utils._rebuild_tensor_v2` for numpy, with every index checked against the storage."""
        valid = (
            any(storage is known for known in self._storages.values())  # 1-D, from the zip's records
            and isinstance(storage_offset, int)
            and isinstance(size, tuple)
            and isinstance(stride, tuple)
            and len(size) == len(stride)
            and all(isinstance(n, int) and n >= 0 for n in (storage_offset, *size, *stride))
        )
        if not valid:
            raise CheckpointError(
                f"{self._path} has a malformed tensor record (size {size!r}, stride {stride!r})."
            )
        native = storage.dtype.newbyteorder("=")
        if 0 in size:
            return np.zeros(size, dtype=native)
        last = storage_offset + sum((n - 1) * step for n, step in zip(size, stride, strict=True))
        if last >= storage.size:
            raise _corrupt(self._path, EOFError(f"a tensor of size {size} reaches past its storage"))
        view = np.lib.stride_tricks.as_strided(
            storage[storage_offset:],
            shape=size,
            strides=[step * storage.itemsize for step in stride],
            writeable=False,
        )
        return np.array(view, dtype=native)

    def _rebuild_parameter(self, data, requires_grad=False, hooks=None):
        """`torch._utils._rebuild_parameter`: a Parameter is just its tensor here.

        A bound method (like `_rebuild_tensor`), so the pickle cannot set attributes on it.
        """
        if not isinstance(data, np.ndarray):
            raise CheckpointError(f"{self._path} has a parameter record without a tensor.")
        return data

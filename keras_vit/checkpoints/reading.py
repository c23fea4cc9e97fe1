"""Read checkpoint files into `{name: numpy array}` without importing torch or jax.

Google `.npz` files are read with `np.load(allow_pickle=False)`, `.safetensors` with
`safetensors.numpy`, and PyTorch `.bin` / `.pt` / `.pth` files (the zip format `torch.save` has
written since PyTorch 1.6) with a restricted unpickler that knows only the tensor-rebuild
functions, the storage classes and `collections.OrderedDict`: anything else in the pickle (a
custom class, `os.system`, ...) is refused before it is called, so reading a file never runs code.

Memory is bounded by the file: every size a file declares (a zip member's uncompressed size, a
`.npy` header's shape, a safetensors header's offsets, a PyTorch tensor's shape and strides) is
checked against the bytes that can hold it before anything is allocated, so a small crafted
file (e.g. a broadcast tensor of 10**9 elements over one stored float) is refused, not expanded.
"""

from __future__ import annotations

import collections
import io
import json
import math
import os
import pickle
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file as _load_safetensors

from keras_vit.checkpoints.errors import CheckpointError

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
# Deflate expands at most ~1032x: a zip member declaring more than this per stored byte is forged.
_MAX_DEFLATE_RATIO = 1032
# All tensors of a PyTorch file together may take this many times its storages' bytes (views of one
# storage under several names are copied apart).
_MAX_TORCH_EXPANSION = 4
_SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


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


def _check_member(archive: zipfile.ZipFile, name: str, path: Path) -> zipfile.ZipInfo:
    """The zip member `name`, refused if its declared size cannot come from its stored bytes."""
    info = archive.getinfo(name)
    file_bytes = os.path.getsize(path)
    if info.compress_type == zipfile.ZIP_STORED:
        limit = info.compress_size
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        limit = _MAX_DEFLATE_RATIO * info.compress_size + 1024
    else:
        raise CheckpointError(
            f"{path}: record {name} uses zip compression method {info.compress_type}: "
            "only stored and deflated records are read."
        )
    if info.compress_size > file_bytes or info.file_size > limit:
        raise CheckpointError(
            f"{path}: record {name} declares {info.file_size} bytes, more than its {info.compress_size} "
            f"stored bytes (the file has {file_bytes}) can hold: the file is corrupt or forged."
        )
    return info


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
            _check_safetensors_header(path)
            return _load_safetensors(str(path))
        except CheckpointError:
            raise
        except (SafetensorError, OSError, ValueError, TypeError, KeyError, AttributeError, EOFError) as error:
            raise _corrupt(path, error) from None
    if suffix in TORCH_SUFFIXES:
        return _read_torch(path)
    raise CheckpointError(
        f"Unknown checkpoint file type {path.name!r}: use a .npz (Google), .safetensors, or PyTorch "
        f"{'/'.join(TORCH_SUFFIXES)} file."
    )


def _check_safetensors_header(path: Path) -> None:
    """Each tensor's shape x dtype against its byte range and the file's size, naming the tensor."""
    file_bytes = os.path.getsize(path)
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            raise EOFError("no safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > file_bytes - 8:
            raise EOFError(f"the header declares {length} bytes, the file has {file_bytes}")
        header = json.loads(file.read(length))
    data_bytes = file_bytes - 8 - length
    for name, entry in header.items():
        itemsize = _SAFETENSORS_DTYPE_BYTES.get(entry.get("dtype")) if name != "__metadata__" else None
        if itemsize is None:  # metadata, or a dtype the library judges
            continue
        shape, (start, end) = entry["shape"], entry["data_offsets"]
        declared = math.prod(shape) * itemsize
        if not 0 <= start <= end <= data_bytes or end - start != declared:
            raise CheckpointError(
                f"{path}: tensor {name!r} declares shape {shape} {entry['dtype']} ({declared} bytes) in "
                f"bytes {start}..{end} of the file's {data_bytes} data bytes: the file is truncated or "
                "corrupt, e.g. by an interrupted download: delete it and download it again."
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
            for name in archive.files:
                _check_npy_member(archive.zip, name, path)
            return {name: archive[name] for name in archive.files}
        except CheckpointError:
            raise
        except _READ_ERRORS as error:
            raise _corrupt(path, error) from None


def _check_npy_member(archive: zipfile.ZipFile, name: str, path: Path) -> None:
    """The `.npy` header's shape x dtype against the record's size, before numpy allocates the array."""
    info = _check_member(archive, f"{name}.npy", path)
    with archive.open(info) as member:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(member)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(member)
        else:
            raise CheckpointError(f"{path}: array {name!r} is in .npy format {version}, not read here.")
        available = info.file_size - member.tell()
    if dtype.hasobject:
        raise CheckpointError(f"{path}: array {name!r} holds Python objects (a pickle): refused.")
    declared = math.prod(shape) * dtype.itemsize
    if declared > available:
        raise CheckpointError(
            f"{path}: array {name!r} declares shape {shape} {dtype} ({declared} bytes) but its record holds "
            f"{available}: the file is truncated or corrupt, e.g. by an interrupted download: delete it "
            "and download it again."
        )


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
                byteorder = archive.read(_check_member(archive, f"{root}byteorder", path))
                byteorder = byteorder.decode("ascii").strip()
            unpickler = _TensorUnpickler(archive, root, byteorder, path)
            state = _state_dict_of(unpickler.load(), path)
    except CheckpointError:
        raise
    except Exception as error:  # anything a malformed pickle or zip record can raise
        raise _corrupt(path, error) from None
    budget = _MAX_TORCH_EXPANSION * sum(storage.nbytes for storage in unpickler.storages.values())
    tensors = {}
    for name, record in state.items():
        tensors[name] = record.materialise(name, path)
        budget -= tensors[name].nbytes
        if budget < 0:
            raise CheckpointError(
                f"{path}: its tensors take more than {_MAX_TORCH_EXPANSION}x its stored bytes (at tensor "
                f"{name!r}): many tensors share storages. Save each tensor once (e.g. as .safetensors)."
            )
    return tensors


def _state_dict_of(obj, path: Path) -> dict[str, _TensorRecord]:
    """The flat `{name: tensor}` state dict, unwrapped from a `{"state_dict": ...}` or `{"model": ...}`."""
    if isinstance(obj, dict):
        for holder in ("state_dict", "model"):
            if isinstance(obj.get(holder), dict):
                obj = obj[holder]
                break
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a state dict of tensors.")
    others = [str(key) for key, value in obj.items() if not isinstance(value, _TensorRecord)]
    if others:
        raise CheckpointError(f"{path} is not a plain state dict: entries {others[:10]} are not tensors.")
    return {str(key): value for key, value in obj.items()}


@dataclass(frozen=True)
class _StorageType:
    """What `torch.FloatStorage` & co. unpickle to: the element dtype, nothing callable."""

    dtype: np.dtype


@dataclass(frozen=True)
class _TensorRecord:
    """A tensor as the pickle declares it (a strided view of a storage), copied out once checked."""

    storage: np.ndarray
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def materialise(self, name: str, path: Path) -> np.ndarray:
        """The tensor as a native-order array; a `CheckpointError` naming it if the storage cannot hold it.

        A tensor must lie inside its storage and hold no more elements than it: overlapping
        strides (a broadcast `expand`ed tensor has stride 0) could declare any size over a few
        stored bytes, so they are refused before anything is allocated.
        """
        storage, native = self.storage, self.storage.dtype.newbyteorder("=")
        numel = math.prod(self.size)
        if numel == 0:
            return np.zeros(self.size, dtype=native)
        last = self.offset + sum((n - 1) * step for n, step in zip(self.size, self.stride, strict=True))
        if last >= storage.size:
            raise _corrupt(path, EOFError(f"tensor {name!r} of size {self.size} reaches past its storage"))
        if numel > storage.size:
            raise CheckpointError(
                f"{path}: tensor {name!r} declares {numel} elements (size {self.size}, strides "
                f"{self.stride}) over a storage of {storage.size}: a broadcast (expanded, stride 0) view, "
                "refused rather than expanded in memory. Save a copy: tensor.contiguous() or .clone()."
            )
        view = np.lib.stride_tricks.as_strided(
            storage[self.offset :],
            shape=self.size,
            strides=[step * storage.itemsize for step in self.stride],
            writeable=False,
        )
        return np.array(view, dtype=native)


class _TensorUnpickler(pickle.Unpickler):
    """Unpickles a torch.save state dict into `_TensorRecord`s; refuses every other global."""

    def __init__(self, archive: zipfile.ZipFile, root: str, byteorder: str, path: Path):
        super().__init__(io.BytesIO(archive.read(_check_member(archive, f"{root}data.pkl", path))))
        if byteorder not in ("little", "big"):
            raise CheckpointError(f"{path} declares an unknown byte order {byteorder!r}.")
        self._archive = archive
        self._root = root
        self._byteorder = "<" if byteorder == "little" else ">"
        self._path = path
        self.storages: dict[str, np.ndarray] = {}  # by record key, as read

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
        if key not in self.storages:
            dtype = storage_type.dtype.newbyteorder(self._byteorder)
            info = _check_member(self._archive, f"{self._root}data/{key}", self._path)
            if numel < 0 or info.file_size < numel * dtype.itemsize:
                raise _corrupt(
                    self._path,
                    EOFError(f"storage {key} holds {info.file_size} bytes, needs {numel} elements"),
                )
            self.storages[key] = np.frombuffer(self._archive.read(info), dtype=dtype, count=numel)
        return self.storages[key]

    def _rebuild_tensor(
        self, storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None
    ):
        """`torch._utils._rebuild_tensor_v2`, as a record of a storage (from the zip) and its view."""
        valid = (
            any(storage is known for known in self.storages.values())  # 1-D, from the zip's records
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
        return _TensorRecord(storage, storage_offset, size, stride)

    def _rebuild_parameter(self, data, requires_grad=False, hooks=None):
        """`torch._utils._rebuild_parameter`: a Parameter is just its tensor here.

        A bound method (like `_rebuild_tensor`), so the pickle cannot set attributes on it.
        """
        if not isinstance(data, _TensorRecord):
            raise CheckpointError(f"{self._path} has a parameter record without a tensor.")
        return data

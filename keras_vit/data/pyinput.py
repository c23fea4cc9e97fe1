"""Input without TensorFlow: NumPy sources and `keras.utils.PyDataset` pipelines for JAX and PyTorch.

The training driver reads its data here on every backend but TensorFlow (which keeps tf.data:
`keras_vit.data.tfdata`). The names mirror `keras_vit.data.tfdata`'s, so a task calls the same functions on
either module: `load_digits`, `from_arrays`, `from_directory` (Pillow decodes the files),
`epoch_steps`, `train_pipeline`, `eval_pipeline`, `is_folder_name`. Which preprocessing a model
needs (mean, std, interpolation) is the catalog's answer: `keras_vit.registry.catalog.preprocessing_for`.
tensorflow-datasets names stay TensorFlow's (`keras_vit.data.datasets` says so).

`train_pipeline` gives the same augmentation as `keras_vit.data.tfdata.train_pipeline`, in NumPy and
Pillow: inception crop (area in `crop_scale`, aspect ratio in `crop_ratio`, the whole image if
10 draws fail), antialiased resize of the crop (Pillow's filters on the uint8 image, as timm's
transforms resize), random horizontal flip, all in uint8, then `(x / 255 - mean) / std` of the
batch, and mixup
of each batch with itself reversed at a `Beta(alpha, alpha)` weight. Its random numbers are
NumPy's, so its batches are not TensorFlow's, but they follow the same plan: the examples are
read in passes, pass `p` a permutation drawn from `(seed, p)`, each example's crop and flip
drawn from `(seed, p, position in pass)` and each batch's mixup weight from `(seed, global
batch index)`. Batch `i` of epoch `e` is global batch `e * steps + i` of that stream: a pure
function of `(seed, e, i)`, whatever ran before, which makes exact resume hold.
With `pixels="uint8"` (what the training driver reads) the batches stop before normalising: uint8
pixels and, with mixup, the batch's weight on every row, which the training step applies on the
device (`keras_vit.training.device_input`).

This module imports neither TensorFlow nor tf.data.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import keras
import numpy as np

from keras_vit.data.preprocessing import GOOGLE_MEAN, GOOGLE_STD
from keras_vit.data.processes import process_rows
from keras_vit.data.workers import PooledItems
from keras_vit.registry.catalog import DEFAULT_INTERPOLATION, INTERPOLATIONS, Preprocessing, normalize
from keras_vit.utils.defaults import BAD_IMAGE_ACTIONS, MAX_PIXELS
from keras_vit.utils.environment import install_hint
from keras_vit.utils.validation import (
    check_pixel_count,
    non_negative_int,
    one_of,
    optional,
    positive_int,
    positive_number,
)
from keras_vit.utils.validation import image_size as size_pair

__all__ = [
    "IMAGES",
    "IMAGE_EXTENSIONS",
    "INTERPOLATIONS",
    "MIXUP_WEIGHT",
    "PIXELS",
    "BadImageError",
    "BadImages",
    "BatchedImages",
    "Preprocessing",
    "Source",
    "TrainBatches",
    "checked_arrays",
    "digits_arrays",
    "digits_sources",
    "epoch_steps",
    "eval_pipeline",
    "from_arrays",
    "from_directory",
    "image_problem",
    "images_only",
    "is_folder_name",
    "list_image_folder",
    "load_digits",
    "train_pipeline",
    "training_augmentation",
]

IMAGE_EXTENSIONS = (".bmp", ".gif", ".jpeg", ".jpg", ".png")
# `train_pipeline(pixels=...)`: normalised (and mixed) float32 images made here, or uint8 pixels that
# the training step normalises and mixes on the device (`keras_vit.training.device_input`).
PIXELS = ("float32", "uint8")
# The input names of a uint8 batch with mixup: `({IMAGES: uint8, MIXUP_WEIGHT: float32 (B,)}, labels)`.
IMAGES, MIXUP_WEIGHT = "images", "mixup_weight"
# Independent random streams derived from the user's seed (as keras_vit.data.tfdata's).
_SHUFFLE_STREAM, _AUGMENT_STREAM, _MIXUP_STREAM = 0, 1, 2


class SourceInfo:
    """What every labelled image source answers, whatever reads it (`Source` here, `tfdata.Source`).

    Needs the fields `num_examples`, `num_classes`, `class_names`, `class_counts`, `crop_scale`, `flip`.
    """

    def augmentation(self, crop_scale: Sequence[float] | None = None, flip: bool | None = None) -> dict:
        """`train_pipeline`'s `crop_scale` and `flip`: as given, else this source's own."""
        return {
            "crop_scale": tuple(self.crop_scale if crop_scale is None else crop_scale),
            "flip": self.flip if flip is None else flip,
        }

    def __repr__(self) -> str:  # the same in every process (not the functions' addresses): reports compare it
        return f"Source({self.num_examples} examples, {self.num_classes} classes)"

    def images_per_class(self) -> dict[str, int] | None:
        """`{class name: examples}` where the counts are known (the report's), else None."""
        if self.class_counts is None:
            return None
        names = self.class_names or tuple(str(index) for index in range(self.num_classes))
        return dict(zip(names, self.class_counts, strict=True))

    def missing_classes(self) -> list[str]:
        """The classes with no example (by name where known), or `[]` if unknown or none."""
        if self.class_counts is None:
            return []
        names = self.class_names or tuple(str(index) for index in range(self.num_classes))
        return [name for name, count in zip(names, self.class_counts, strict=True) if count == 0]


class BadImageError(ValueError):
    """Image files or class folders of a dataset folder that cannot be used (the message names them)."""


_SKIP_ADVICE = "or skip such files (on_bad_image='skip', keras-vit --on-bad-image skip)"


class BadImages:
    """An image folder's `on_bad_image` policy, applied when a file is read, and what it met.

    `"stop"`: a file that fails to decode raises `BadImageError` naming it. `"skip"`: the file
    is recorded (`files`: path -> why), one warning names it, and the reader carries on without
    it. Readers that cannot name what they skipped (tf.data) add a counter (`add_counter`).
    `summary()` is what the run's report says. Thread-safe (reader threads share it).
    """

    def __init__(self, root: str, action: str):
        self.root, self.action = root, one_of("on_bad_image", action, BAD_IMAGE_ACTIONS)
        self.files: dict[str, str] = {}
        self.indices: set[int] = set()
        self.reads = 0
        self._counters: list[Callable[[], int]] = []
        self._lock = threading.Lock()

    def met(self, path: str, index: int, reason: str) -> None:
        """File `path` (example `index`) failed to decode when read, for `reason`."""
        if self.action == "stop":
            raise BadImageError(
                f"Image file {path} cannot be read ({reason}): remove or replace it, {_SKIP_ADVICE}."
            )
        with self._lock:
            new = path not in self.files
            self.files[path] = reason
            self.reads += 1
            self.indices.add(index)
        if new:
            warnings.warn(f"Skipped image file {path}, which cannot be read ({reason}).", stacklevel=2)

    def __getstate__(self) -> dict:  # a worker process's copy starts empty, with a lock of its own
        return {"root": self.root, "action": self.action}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["root"], state["action"])

    def add_counter(self, counter: Callable[[], int]) -> None:
        """Count skips that a reader sees but cannot name (`counter()`: how many so far)."""
        self._counters.append(counter)

    @property
    def count(self) -> int:
        """How many reads were skipped (a file is read once per pass): named and counted ones."""
        return self.reads + sum(int(counter()) for counter in self._counters)

    def summary(self) -> dict:
        """The report's record: the policy, how many reads were skipped, the files named (tf.data
        names none: `keras_vit.data.tfdata.undecodable_files` does)."""
        return {"on_bad_image": self.action, "reads_skipped": self.count, "files": sorted(self.files)}


@dataclass(frozen=True, repr=False)
class Source(SourceInfo):
    """A labelled image set read without TensorFlow: `read(index) -> (uint8 (H, W, 3), int label)`,
    `labels` every example's label in order (int32).

    `crop_scale` and `flip` are the augmentation that suits these images (see `keras_vit.data.tfdata.Source`).
    """

    num_examples: int
    num_classes: int
    class_names: tuple[str, ...] | None
    read: Callable[[int], tuple[np.ndarray, int]]
    labels: np.ndarray
    class_counts: tuple[int, ...] | None = None
    files: tuple[str, ...] | None = None
    crop_scale: tuple[float, float] = (0.08, 1.0)
    flip: bool = True
    bad_images: BadImages | None = None  # a folder's policy for files that fail to decode when read

    def load(self, index: int) -> tuple[np.ndarray, int] | None:
        """`read(index)`, or None for a folder's file that fails to decode (`bad_images` decides:
        stop naming it, or skip it counted)."""
        if self.bad_images is None:
            return self.read(index)
        try:
            return self.read(index)
        except Exception as error:  # anything a damaged file makes Pillow raise
            self.bad_images.met(self.files[index], index, f"{type(error).__name__}: {error}")
            return None

    def load_resized(
        self,
        index: int,
        box_for: Callable[[int, int], tuple[int, int, int, int]],
        size: tuple[int, int],
        resample,
    ) -> tuple[np.ndarray, int] | None:
        """Example `index`'s `box_for(height, width)` box resized to `size`, uint8, and its label (None:
        skipped, as `load`). A folder's JPEG is decoded at a reduced scale where the box allows it
        (`_read_box`); anything else is read whole, then resized."""
        if self.files is None:
            image, label = self.read(index)
            return _resize_pixels(image, box_for(*image.shape[:2]), size, resample), label
        try:
            return _read_box(self.files[index], box_for, size, resample), int(self.labels[index])
        except Exception as error:  # anything a damaged file makes Pillow raise
            if self.bad_images is None:
                raise
            self.bad_images.met(self.files[index], index, f"{type(error).__name__}: {error}")
            return None


def checked_arrays(
    images, labels, num_classes: int | None = None, class_names: Sequence[str] | None = None
) -> tuple[np.ndarray, np.ndarray, int, tuple[str, ...] | None]:
    """`from_arrays`'s checks: `(uint8 (N, H, W, 1 or 3) images, int32 labels, num_classes, class_names)`."""
    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(f"images must be (N, H, W), (N, H, W, 1) or (N, H, W, 3), got shape {images.shape}.")
    if images.dtype != np.uint8:
        if not np.issubdtype(images.dtype, np.number) or images.dtype == bool:
            raise ValueError(f"images must be numeric pixel values in [0, 255], got dtype {images.dtype}.")
        if np.issubdtype(images.dtype, np.floating) and not np.isfinite(images).all():
            bad = int(np.count_nonzero(~np.isfinite(images)))
            raise ValueError(
                f"images hold {bad} NaN or infinite pixel value(s): pixels must be finite values in "
                "[0, 255]; fix or drop those images first."
            )
        low, high = float(images.min()), float(images.max())
        if low < 0 or high > 255:
            raise ValueError(f"images must have pixel values in [0, 255], got [{low:g}, {high:g}].")
        if np.issubdtype(images.dtype, np.floating) and 0 < high <= 1:
            raise ValueError(
                f"These float images lie in [{low:g}, {high:g}], which looks like [0, 1] scaling; "
                "sources take pixel values in [0, 255]: multiply by 255 first."
            )
        images = np.round(images).astype("uint8")
    if class_names is not None:
        class_names = tuple(str(name) for name in class_names)
        num_classes = len(class_names) if num_classes is None else num_classes
        if len(class_names) != num_classes:
            raise ValueError(f"{len(class_names)} class_names for num_classes={num_classes}.")
    count = len(images)
    if labels.shape != (count,) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"labels must be {count} integer class indices (shape ({count},)), got dtype {labels.dtype} "
            f"and shape {labels.shape}: convert one-hot labels with labels.argmax(-1)."
        )
    if count == 0:
        raise ValueError("The source has no examples.")
    num_classes = int(labels.max()) + 1 if num_classes is None else int(num_classes)
    if labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(
            f"labels must lie in [0, num_classes) = [0, {num_classes}), got [{labels.min()}, {labels.max()}]."
        )
    return images, labels.astype("int32"), num_classes, class_names


def from_arrays(
    images, labels, *, num_classes: int | None = None, class_names: Sequence[str] | None = None
) -> Source:
    """A source over in-memory images and labels, checked as `tfdata.from_arrays` checks them."""
    images, labels, num_classes, class_names = checked_arrays(images, labels, num_classes, class_names)
    if images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)

    counts = tuple(int(count) for count in np.bincount(labels, minlength=num_classes))
    read = _ArrayReader(images, labels)
    return Source(len(images), num_classes, class_names, read, labels, class_counts=counts)


# JPEG frame headers (SOF0-SOF15 but DHT, JPG and DAC), which hold the image's size.
_JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg_size(file) -> tuple[int, int] | None:
    """A JPEG's `(height, width)` from its frame header, read by walking the segments before it
    (a few small reads: ~5x faster than Pillow's header parse); None where anything is unusual,
    so that Pillow decides."""
    if file.read(2) != b"\xff\xd8":
        return None
    while len(segment := file.read(4)) == 4 and segment[0] == 0xFF:
        marker, length = segment[1], int.from_bytes(segment[2:], "big")
        if marker in _JPEG_FRAMES:
            frame = file.read(5)
            height, width = int.from_bytes(frame[1:3], "big"), int.from_bytes(frame[3:5], "big")
            return (height, width) if len(frame) == 5 and height and width else None
        if not 0xE0 <= marker <= 0xFE and marker not in (0xC4, 0xCC, 0xDB, 0xDD) or length < 2:
            return None  # a scan before the frame, a stand-alone marker, fill bytes: Pillow's to judge
        file.seek(length - 2, os.SEEK_CUR)
    return None


def image_problem(path: str, max_pixels: int | None) -> str | None:
    """Why the image file at `path` cannot be used, or None: a check of its header and structure.

    A JPEG's size is read from its frame header (`_jpeg_size`; the pixel limit is checked
    there) and it must end with its end-of-image marker; one that does not (a truncated
    download) is decoded in full to be sure. Other files, and JPEGs whose header is unusual,
    are opened by Pillow, which reads the header and `verify()`s the file's structure (PNG
    chunk checksums, ...) without decoding it. Nothing else is decoded: a file damaged within
    is found when read (`BadImages`).
    """
    from PIL import Image

    try:
        with open(path, "rb") as file:
            size = _jpeg_size(file)
            file.seek(max(file.seek(0, os.SEEK_END) - 2, 0))
            complete = file.read() == b"\xff\xd9"
        if size is not None and complete:
            check_pixel_count("it", *size, max_pixels)
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                check_pixel_count("it", image.height, image.width, max_pixels)
                if image.format != "JPEG":
                    image.verify()
                elif not complete:
                    image.load()
    except Exception as error:  # anything a damaged file makes Pillow raise
        return f"{type(error).__name__}: {error}"
    return None


def _bad_image_message(root: str, bad: list[tuple[str, str]], total: int) -> str:
    shown = "; ".join(f"{path} ({reason})" for path, reason in bad[:5])
    more = f"; and {len(bad) - 5} more" if len(bad) > 5 else ""
    return f"{len(bad)} of the {total} image files in {root} cannot be read: {shown}{more}."


def _class_folders(root: str, on_bad_image: str) -> list[str]:
    """The class folders of `root` (sub-folders, alphanumeric order) that hold images and are their own.

    A class folder that resolves to another class's folder (a link to it, into it or over it:
    its images would be trained under two labels) or that holds no image file (a class that can
    never be learned) is refused, or with `on_bad_image="skip"` left out with one warning.
    """
    names = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    real = {name: os.path.realpath(os.path.join(root, name)) for name in names}

    def overlaps(name: str, other: str) -> bool:
        mine, theirs = real[name], real[other]
        return mine == theirs or mine.startswith(theirs + os.sep) or theirs.startswith(mine + os.sep)

    problems = {}
    for name in names:
        others = [other for other in names if other != name and overlaps(name, other)]
        if others and os.path.islink(os.path.join(root, name)):
            problems[name] = f"resolves to {real[name]}, the folder of class {others[0]!r}"
        elif not any(
            file.lower().endswith(IMAGE_EXTENSIONS) for _, _, files in os.walk(real[name]) for file in files
        ):
            problems[name] = "holds no image file"
    if problems and len(problems) < len(names):
        listed = "; ".join(f"{name!r} {why}" for name, why in problems.items())
        if on_bad_image == "stop":
            raise BadImageError(
                f"Class folders of {root} that cannot be a class: {listed}. Remove them, {_SKIP_ADVICE}."
            )
        warnings.warn(f"Skipped class folders of {root}: {listed}.", stacklevel=4)
    return [name for name in names if name not in problems]


def list_image_folder(
    root: str, on_bad_image: str, max_pixels: int | None
) -> tuple[list[str], list[int], list[str]]:
    """The image files of a class-per-folder `root` that pass a header check: `(paths, labels, class_names)`.

    Classes are the sub-folders in alphanumeric order (`_class_folders`: each its own and not
    empty); images the files below each (searched recursively) with an `IMAGE_EXTENSIONS`
    extension, in sorted order. Nothing is decoded: every file gets `image_problem`'s header
    check only (thousands of files a second); a file that fails to decode later is handled
    when read (`BadImages`). `on_bad_image="stop"` raises `BadImageError` naming the bad files,
    `"skip"` leaves them out with one warning.
    """
    on_bad_image = one_of("on_bad_image", on_bad_image, BAD_IMAGE_ACTIONS)
    max_pixels = optional(positive_int, "max_pixels", max_pixels)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"Image folder {root!r} does not exist.")
    class_names = _class_folders(root, on_bad_image)
    paths, labels = [], []
    for label, name in enumerate(class_names):
        for folder, _, files in sorted(os.walk(os.path.join(root, name))):
            for file in sorted(files):
                if file.lower().endswith(IMAGE_EXTENSIONS):
                    paths.append(os.path.join(folder, file))
                    labels.append(label)
    if not paths:
        raise ValueError(
            f"No images found in {root!r}: expected one sub-folder per class holding "
            f"{'/'.join(IMAGE_EXTENSIONS)} files, e.g. {root}/cat/1.jpg, {root}/dog/2.jpg."
        )
    bad = [(file, problem) for file in paths if (problem := image_problem(file, max_pixels)) is not None]
    if bad and on_bad_image == "stop":
        raise BadImageError(
            f"{_bad_image_message(root, bad, len(paths))} Remove or replace them, {_SKIP_ADVICE}."
        )
    if bad:
        warnings.warn(f"Skipped: {_bad_image_message(root, bad, len(paths))}", stacklevel=3)
        skipped = {file for file, _ in bad}
        kept = [(file, label) for file, label in zip(paths, labels, strict=True) if file not in skipped]
        if not kept:
            raise BadImageError(f"No readable image in {root}: {_bad_image_message(root, bad, len(paths))}")
        paths, labels = (list(column) for column in zip(*kept, strict=True))
    return paths, labels, class_names


@dataclass(frozen=True)
class _ArrayReader:
    """`Source.read` over in-memory arrays (a class, not a closure: worker processes unpickle it)."""

    images: np.ndarray
    labels: np.ndarray

    def __call__(self, index: int) -> tuple[np.ndarray, int]:
        return self.images[index], int(self.labels[index])


@dataclass(frozen=True)
class _FileReader:
    """`Source.read` over image files, decoded by Pillow (picklable, as `_ArrayReader`)."""

    paths: tuple[str, ...]
    labels: tuple[int, ...]

    def __call__(self, index: int) -> tuple[np.ndarray, int]:
        return _decode_file(self.paths[index]), self.labels[index]


def _decode_file(path: str) -> np.ndarray:
    """The file's pixels as Pillow decodes them, RGB uint8 `(H, W, 3)` (a GIF's first frame)."""
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def from_directory(
    path: str | os.PathLike, *, on_bad_image: str = BAD_IMAGE_ACTIONS[0], max_pixels: int | None = MAX_PIXELS
) -> Source:
    """A source over an image folder with one sub-folder per class, decoded by Pillow when read.

    The same files, classes, checks and `on_bad_image` choices as `keras_vit.data.tfdata.from_directory`
    (`list_image_folder`: a header check of each file, nothing decoded); a file that fails to
    decode when read is handled then (`BadImages`: stop naming it, or skip it counted).
    """
    root = os.fspath(path)
    paths, labels, class_names = list_image_folder(root, on_bad_image, max_pixels)

    read = _FileReader(tuple(paths), tuple(labels))
    counts = tuple(labels.count(label) for label in range(len(class_names)))
    label_array = np.asarray(labels, dtype="int32")
    return Source(
        len(paths),
        len(class_names),
        tuple(class_names),
        read,
        label_array,
        counts,
        tuple(paths),
        bad_images=BadImages(root, on_bad_image),
    )


def digits_arrays(test_fraction: float = 0.2, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's digits as `(uint8 images (N, 8, 8), int32 labels, test mask)`: see `load_digits`."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise ImportError(
            f"load_digits needs scikit-learn: {install_hint('train')} (or pip install scikit-learn)."
        ) from None
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}.")
    digits = sklearn_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype("uint8")
    labels = digits.target.astype("int32")
    rng = np.random.default_rng(seed)
    test = np.zeros(len(labels), dtype=bool)
    for label in range(10):
        members = rng.permutation(np.flatnonzero(labels == label))
        test[members[: round(test_fraction * len(members))]] = True
    return images, labels, test


# 8x8 strokes: a crop must keep most of the digit, and a flipped digit is another symbol.
DIGITS_AUGMENTATION = {"crop_scale": (0.7, 1.0), "flip": False}


def digits_sources(from_arrays: Callable, test_fraction: float, seed: int) -> tuple:
    """The digits' `(train, test)` sources, made by `from_arrays` (this module's, or
    `tfdata`'s for tf.data): one split (`digits_arrays`) and one augmentation for both readers."""
    images, labels, test = digits_arrays(test_fraction, seed)
    names = tuple(str(label) for label in range(10))
    return tuple(
        dataclasses.replace(from_arrays(images[part], labels[part], class_names=names), **DIGITS_AUGMENTATION)
        for part in (~test, test)
    )


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Source, Source]:
    """scikit-learn's handwritten digits as `(train, test)` sources: `tfdata.load_digits`'s split."""
    return digits_sources(from_arrays, test_fraction, seed)


def is_folder_name(dataset: str | os.PathLike) -> bool:
    """Whether a `dataset` argument names a folder rather than a tensorflow-datasets name.

    A path object is a folder; a string is one if it exists or looks like a path (starts with
    `.`, `/` or `~`, or the platform's separator). Anything else goes to tensorflow-datasets,
    including names with a config or a version: `imagenette/320px`, `mnist:3.0.1`,
    `imagenette/320px:1.0.0`. (A folder named like a tfds dataset is read as a folder when
    it exists: write `./imagenette` to be explicit.)
    """
    if not isinstance(dataset, str):
        return isinstance(dataset, os.PathLike)
    return os.path.exists(os.path.expanduser(dataset)) or dataset.startswith((".", "/", "~", os.sep))


def epoch_steps(source, batch_size: int, steps_per_epoch: int | None = None) -> int:
    """Batches per epoch of `train_pipeline`: `steps_per_epoch`, or one pass `num_examples // batch_size`."""
    if steps_per_epoch is not None:
        if int(steps_per_epoch) < 1:
            raise ValueError(f"steps_per_epoch must be a positive int, got {steps_per_epoch!r}.")
        return int(steps_per_epoch)
    if source.num_examples < batch_size:
        raise ValueError(
            f"batch_size {batch_size} exceeds the {source.num_examples} examples of the source: "
            "use a smaller batch or pass steps_per_epoch."
        )
    return source.num_examples // batch_size


def _resampling(interpolation: str):
    from PIL import Image

    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"Unknown interpolation {interpolation!r}: use one of {INTERPOLATIONS}.")
    return {
        "bilinear": Image.Resampling.BILINEAR,
        "bicubic": Image.Resampling.BICUBIC,
    }[interpolation]


def _resize(image: np.ndarray, box: tuple[int, int, int, int], size: tuple[int, int], resample) -> np.ndarray:
    """The `box = (top, left, height, width)` of a uint8 image resized to `size`: float32 in [0, 255].

    Pillow's antialiased filters on float32 channels (mode "F"): no rounding, as TensorFlow's
    `tf.image.resize(..., antialias=True)` in the tf.data pipeline.
    """
    from PIL import Image

    top, left, height, width = box
    out_height, out_width = size
    channels = [
        np.asarray(
            Image.fromarray(np.ascontiguousarray(image[..., channel], dtype="float32"), mode="F").resize(
                (out_width, out_height), resample, box=(left, top, left + width, top + height)
            )
        )
        for channel in range(image.shape[-1])
    ]
    return np.clip(np.stack(channels, axis=-1), 0.0, 255.0)


def _resize_pixels(
    image: np.ndarray, box: tuple[int, int, int, int], size: tuple[int, int], resample
) -> np.ndarray:
    """The `box = (top, left, height, width)` of a uint8 image resized to `size`, uint8: one Pillow call
    on the RGB image (antialiased, rounded to uint8 as timm's transforms resize)."""
    from PIL import Image

    top, left, height, width = box
    resized = Image.fromarray(np.ascontiguousarray(image)).resize(
        (size[1], size[0]), resample, box=(left, top, left + width, top + height)
    )
    return np.asarray(resized)


def _read_box(
    path: str, box_for: Callable[[int, int], tuple[int, int, int, int]], size: tuple[int, int], resample
) -> np.ndarray:
    """The `box_for(height, width)` box of the image file at `path` resized to `size`, uint8 RGB.

    Decode less: a JPEG whose box is at least twice `size` is decoded at 1/2, 1/4 or 1/8 scale by
    libjpeg's DCT scaling (Pillow's `draft`), never below `size`, and the box is resized from that;
    the result equals the full decode's within a few levels (`tests/data/test_image_folders.py`).
    """
    from PIL import Image

    with Image.open(path) as image:
        width, height = image.size
        top, left, box_height, box_width = box_for(height, width)
        reduction = min(box_height / size[0], box_width / size[1])
        if image.format == "JPEG" and reduction >= 2:
            image.draft(image.mode, (math.ceil(width / reduction), math.ceil(height / reduction)))
        x_scale, y_scale = image.size[0] / width, image.size[1] / height
        region = (left * x_scale, top * y_scale, (left + box_width) * x_scale, (top + box_height) * y_scale)
        return np.asarray(image.convert("RGB").resize((size[1], size[0]), resample, box=region))


def _crop_box(
    rng: np.random.Generator, height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[int, int, int, int]:
    """An inception crop `(top, left, height, width)`: area fraction uniform in `scale`, aspect
    ratio (width / height) uniform in `ratio`, placed uniformly; the whole image if 10 draws fail
    (`tf.image.sample_distorted_bounding_box`'s plan)."""
    area = height * width
    for _ in range(10):
        target = rng.uniform(*scale) * area
        aspect = rng.uniform(*ratio)
        crop_height = int(round(math.sqrt(target / aspect)))
        crop_width = int(round(crop_height * aspect))
        if 0 < crop_height <= height and 0 < crop_width <= width:
            fraction = crop_height * crop_width / area
            if scale[0] <= fraction <= scale[1]:
                top = int(rng.integers(0, height - crop_height + 1))
                left = int(rng.integers(0, width - crop_width + 1))
                return top, left, crop_height, crop_width
    return 0, 0, height, width


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class TrainBatches(PooledItems, keras.utils.PyDataset):
    """Endless training batches: `train_pipeline`'s result.

    `pixels="float32"`: `(float32 (B, H, W, 3) normalised, labels)`, mixed here with mixup
    (labels then float32 `(B, classes)`). `pixels="uint8"`: `(uint8 (B, H, W, 3), int32 labels)`,
    with mixup `({"images": uint8, "mixup_weight": float32 (B,)}, int32 labels)`: the host never
    makes a float image; the step normalises and mixes (`keras_vit.training.device_input`).
    `batch(epoch, index)` is batch `index` of epoch `epoch`, a pure function of `(seed, epoch,
    index)`; `self[i]` is batch `i` counted from `start_epoch` (what `model.fit` reads in turn),
    made by `workers` worker processes ahead of the reader (`keras_vit.data.workers`; 0: by the reader).
    Each is the `rows` of the global batch (`slice(0, batch_size)`: all; by default this
    process's, `process_rows`): the pieces of the processes of a run make up the global batch.
    """

    def __init__(
        self,
        source: Source,
        *,
        image_size: tuple[int, int],
        batch_size: int,
        mean: Sequence[float],
        std: Sequence[float],
        seed: int,
        start_epoch: int,
        steps: int,
        augment: bool,
        crop_scale: tuple[float, float],
        crop_ratio: tuple[float, float],
        flip: bool,
        interpolation: str,
        mixup_alpha: float,
        workers: int | None = None,
        rows: slice | None = None,
        pixels: str = PIXELS[0],
    ):
        # Keras reads the items in turn in its own thread; the worker processes make them ahead.
        super().__init__(workers=1, use_multiprocessing=False)
        self.processes = _usable_cpus() if workers is None else non_negative_int("workers", workers)
        self.pixels = one_of("pixels", pixels, PIXELS)
        self.source, self.image_size, self.batch_size = source, image_size, batch_size
        self.mean, self.std, self.seed = mean, std, int(seed)
        self.start_epoch, self.steps = int(start_epoch), steps
        self.augment, self.crop_scale, self.crop_ratio, self.flip = augment, crop_scale, crop_ratio, flip
        self.resample = _resampling(interpolation)
        self.mixup_alpha = mixup_alpha
        self.rows = list(range(batch_size)[process_rows(batch_size) if rows is None else rows])
        self._orders: dict[int, np.ndarray] = {}

    @property
    def num_batches(self) -> None:
        return None  # endless: `fit` takes `steps_per_epoch` batches per epoch

    def _order(self, pass_index: int) -> np.ndarray:
        """The permutation of pass `pass_index` (the last few kept: consecutive batches share a pass)."""
        if pass_index not in self._orders:
            rng = np.random.default_rng([self.seed, _SHUFFLE_STREAM, pass_index])
            self._orders = {key: value for key, value in self._orders.items() if key >= pass_index - 1}
            self._orders[pass_index] = rng.permutation(self.source.num_examples)
        return self._orders[pass_index]

    def example(self, position: int) -> tuple[np.ndarray, int]:
        """Example `position` of the endless stream, augmented: uint8 `(H, W, 3)` and its label."""
        count = self.source.num_examples
        pass_index, offset = divmod(position, count)
        order = self._order(pass_index)
        rng = np.random.default_rng([self.seed, _AUGMENT_STREAM, pass_index, offset])

        def box_for(height: int, width: int) -> tuple[int, int, int, int]:
            if not self.augment:
                return 0, 0, height, width
            return _crop_box(rng, height, width, self.crop_scale, self.crop_ratio)

        # A file skipped when read (`Source.load`) gives its place to the next readable one of the pass.
        reads = (
            self.source.load_resized(
                int(order[(offset + step) % count]), box_for, self.image_size, self.resample
            )
            for step in range(count)
        )
        loaded = next(filter(None, reads), None)
        if loaded is None:
            raise BadImageError(f"No image of the source can be read: {self.source.bad_images.summary()}.")
        pixels, label = loaded
        if self.augment and self.flip and rng.uniform() < 0.5:
            pixels = pixels[:, ::-1]
        return pixels, label

    def mixup_weight(self, global_index: int) -> np.float32:
        """Mixup's `Beta(alpha, alpha)` weight of global batch `global_index` (drawn from `(seed, index)`)."""
        rng = np.random.default_rng([self.seed, _MIXUP_STREAM, global_index])
        return np.float32(rng.beta(self.mixup_alpha, self.mixup_alpha))

    def batch(self, epoch: int, index: int) -> tuple:
        """`rows` of batch `index` of epoch `epoch`: global batch `epoch * steps + index` of the stream."""
        global_index = epoch * self.steps + index
        first = global_index * self.batch_size
        if self.pixels == "uint8":  # only this process's rows: their partners are mixed on the device
            examples = [self.example(first + row) for row in self.rows]
            images = np.stack([image for image, _ in examples])
            labels = np.asarray([label for _, label in examples], dtype="int32")
            if not self.mixup_alpha:
                return images, labels
            weights = np.full(len(self.rows), self.mixup_weight(global_index), dtype="float32")
            return {IMAGES: images, MIXUP_WEIGHT: weights}, labels
        partners = [self.batch_size - 1 - row for row in self.rows]  # mixup blends row r with row B - 1 - r
        needed = sorted({*self.rows, *partners}) if self.mixup_alpha else self.rows
        examples = [self.example(first + row) for row in needed]
        images = normalize(np.stack([image for image, _ in examples]), self.mean, self.std)
        labels = np.asarray([label for _, label in examples], dtype="int32")
        if not self.mixup_alpha:
            return images, labels
        weight = self.mixup_weight(global_index)
        one_hot = np.eye(self.source.num_classes, dtype="float32")[labels]
        position = {row: place for place, row in enumerate(needed)}
        own, other = ([position[row] for row in part] for part in (self.rows, partners))
        return (
            weight * images[own] + (1.0 - weight) * images[other],
            weight * one_hot[own] + (1.0 - weight) * one_hot[other],
        )

    def make_item(self, index: int) -> tuple:
        """`self[index]`, made here: batch `index` counted from `start_epoch`."""
        epoch, within = divmod(int(index), self.steps)
        return self.batch(self.start_epoch + epoch, within)


class ImageBatches(keras.utils.PyDataset):
    """The images of `(images, labels)` batches (`train_pipeline`'s): item `i` is `(batches[i][0],)`, so
    it is as pure a function of `(seed, epoch, index)` as theirs: `images_only`'s result."""

    def __init__(self, batches: keras.utils.PyDataset):
        super().__init__(workers=batches.workers, use_multiprocessing=False)
        self.batches = batches

    @property
    def num_batches(self) -> int | None:
        return self.batches.num_batches

    def __getitem__(self, index: int) -> tuple[np.ndarray]:
        images = self.batches[index][0]
        return (images[IMAGES] if isinstance(images, dict) else images,)


def images_only(batches: TrainBatches) -> ImageBatches:
    """`train_pipeline`'s batches without their labels (unlabeled pre-training)."""
    return ImageBatches(batches)


def training_augmentation(
    source: Source, crop_scale: tuple[float, float] | None, flip: bool | None, start_epoch: int
) -> tuple[tuple[float, float], bool]:
    """`crop_scale` and `flip`, the source's own where not given, checked with `start_epoch`: how
    both training pipelines (tf.data's and the PyDataset) read these arguments."""
    augmentation = source.augmentation(crop_scale, flip)
    crop_scale, flip = augmentation["crop_scale"], augmentation["flip"]
    if int(start_epoch) < 0:
        raise ValueError(f"start_epoch must be >= 0, got {start_epoch!r}.")
    if not 0.0 < crop_scale[0] <= crop_scale[1] <= 1.0:
        raise ValueError(f"crop_scale must satisfy 0 < low <= high <= 1, got {crop_scale!r}.")
    return crop_scale, flip


def train_pipeline(
    source: Source,
    *,
    image_size: int | Sequence[int],
    batch_size: int,
    mean: Sequence[float] = GOOGLE_MEAN,
    std: Sequence[float] = GOOGLE_STD,
    seed: int,
    start_epoch: int = 0,
    steps_per_epoch: int | None = None,
    augment: bool = True,
    crop_scale: tuple[float, float] | None = None,
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: bool | None = None,
    interpolation: str = DEFAULT_INTERPOLATION,
    mixup_alpha: float = 0.0,
    workers: int | None = None,
    rows: slice | None = None,
    pixels: str = PIXELS[0],
) -> TrainBatches:
    """Endless training batches as a `keras.utils.PyDataset`, resumable at any epoch.

    The arguments and augmentation of `keras_vit.data.tfdata.train_pipeline` (see the module
    docstring for how the random numbers are drawn); `workers` processes prepare batches ahead
    (default: the CPUs this process may use; 0: the reading thread makes each batch when read;
    `keras_vit.data.workers`), the same batches bit for bit.
    `rows`: the rows of each global batch of `batch_size` this pipeline yields; by default all
    of them, but in a multi-process JAX run this process's (`process_rows`).
    `pixels="uint8"`: uint8 batches (and mixup's weight per row) for a model that normalises
    and mixes on the device (`keras_vit.training.device_input.DeviceInput`, what the training
    driver fits); `"float32"` (default): normalised, mixed float32 batches (`TrainBatches`).
    """
    crop_scale, flip = training_augmentation(source, crop_scale, flip, start_epoch)
    if mixup_alpha:
        mixup_alpha = positive_number("mixup_alpha", mixup_alpha)
    return TrainBatches(
        source,
        image_size=size_pair("image_size", image_size),
        batch_size=batch_size,
        mean=mean,
        std=std,
        seed=seed,
        start_epoch=start_epoch,
        steps=epoch_steps(source, batch_size, steps_per_epoch),
        augment=augment,
        crop_scale=crop_scale,
        crop_ratio=tuple(crop_ratio),
        flip=flip,
        interpolation=interpolation,
        mixup_alpha=mixup_alpha,
        workers=workers,
        rows=rows,
        pixels=pixels,
    )


class BatchedImages(PooledItems, keras.utils.PyDataset):
    """One pass over a source in stored order, each image resized whole and rounded to uint8
    values, then normalised (`pixels="float32"`) or left uint8 for the model to normalise on the
    device (`pixels="uint8"`): `eval_pipeline`'s result. The last batch keeps the remainder, or
    with `pad` is filled up to `batch_size` with copies of the last example (every batch then
    splits evenly between data-parallel devices; drop the extra predictions). In a
    multi-process JAX run each batch is this process's rows of it (`process_rows`). Made by
    `workers` worker processes ahead of the reader, as `TrainBatches`."""

    def __init__(
        self,
        source: Source,
        spec: Preprocessing,
        batch_size: int,
        pad: bool = False,
        workers: int | None = None,
        pixels: str = PIXELS[0],
    ):
        super().__init__()
        self.source, self.spec, self.batch_size, self.pad = source, spec, batch_size, pad
        self.pixels = one_of("pixels", pixels, PIXELS)
        self.resample = _resampling(spec.interpolation)
        self.processes = _usable_cpus() if workers is None else non_negative_int("workers", workers)
        self.pool_length = len(self)
        # The rows are chosen here: a worker process has no distribution. A size that cannot be
        # split (an unpadded remainder) raises when its batch is read, as it did.
        sizes = {batch_size} if pad else {batch_size, source.num_examples - (len(self) - 1) * batch_size}
        self.rows = {}
        for size in sizes:
            try:
                self.rows[size] = process_rows(size)
            except Exception:  # noqa: BLE001 - raised again by make_item
                pass

    def __len__(self) -> int:
        return math.ceil(self.source.num_examples / self.batch_size)

    def make_item(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """`self[index]`, made here."""
        last = self.source.num_examples - 1
        indices = range(index * self.batch_size, min((index + 1) * self.batch_size, last + 1))
        if self.pad:
            indices = [*indices, *[last] * (self.batch_size - len(indices))]
        indices = indices[self.rows.get(len(indices)) or process_rows(len(indices))]
        images, labels = [], []
        for example in indices:
            loaded = self.source.load(example)
            if loaded is None:  # skipped (`Source.load`): a blank in its place, left out of the metrics
                images.append(np.zeros((*self.spec.image_size, 3), "uint8"))
                labels.append(int(self.source.labels[example]))
                continue
            image, label = loaded
            box = (0, 0, *image.shape[:2])
            images.append(np.round(_resize(image, box, self.spec.image_size, self.resample)).astype("uint8"))
            labels.append(label)
        images, labels = np.stack(images), np.asarray(labels, dtype="int32")
        if self.pixels == "uint8":
            return images, labels
        return normalize(images, self.spec.mean, self.spec.std), labels


def eval_pipeline(
    source: Source,
    spec: Preprocessing,
    *,
    batch_size: int,
    pad: bool = False,
    workers: int | None = None,
    pixels: str = PIXELS[0],
) -> BatchedImages:
    """Evaluation batches of `source` with `spec`'s size, normalisation and filter (a plain resize:
    `spec.crop_pct` must be None, as the training driver's evaluation has it); `pad`: every batch
    full (`BatchedImages`); `workers`: as `train_pipeline`'s; `pixels="uint8"`: the resized pixels,
    not normalised (for `DeviceInput` or an `image_dtype="uint8"` model; 4x fewer bytes)."""
    if spec.crop_pct is not None:
        raise ValueError(
            f"eval_pipeline without TensorFlow resizes the whole image: pass a spec with crop_pct=None, "
            f"not {spec.crop_pct}."
        )
    return BatchedImages(source, spec, batch_size, pad, workers, pixels)

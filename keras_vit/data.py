"""tf.data input pipelines: sources, a resumable training stream, evaluation, sharding.

Sources (`Source`) describe a labelled image set: `from_arrays`, `from_directory` (the
`keras.utils.image_dataset_from_directory` layout), `from_tfds` (prepared tensorflow-datasets
data) and `load_digits` (scikit-learn's 8x8 digits, the offline main job's data).
`source.dataset` gives its examples in stored order, unbatched: `(image, label)` with image
uint8 `(H, W, 3)` (grayscale repeated to RGB, as every ViT checkpoint takes RGB) and label a
SPARSE int32 class index (`keras_vit.recipes.loss` takes sparse labels).

`train_pipeline` is an endless stream of batches whose content is a pure function of
`(seed, epoch)`: the examples are read in passes, each pass a permutation drawn with
stateless random ops from `(seed, pass)`, the inception crop and flip of each example
are drawn from `(seed, pass, position in pass)`, and mixup's weight of each batch from
`(seed, batch index)`. Epoch `e` is the stretch of batches
`[e * steps, (e + 1) * steps)` of that stream, so a fresh process built with
`start_epoch=k` yields exactly what an uninterrupted run yields from epoch `k` on: the basis
of exact resume with epoch-granular backups. Nothing depends on TensorFlow's global seed.

`eval_pipeline` preprocesses with a checkpoint's `keras_vit.preprocessing.Preprocessing` spec
(resize, centre crop as timm's evaluation transform, normalisation), through the TensorFlow
implementation the exported SavedModel runs: its batches equal `load_image` +
`preprocess_input` with the same spec, exactly. `normalisation_for` reads the mean/std a
pretrained checkpoint expects. `distribute` hands a
pipeline to a `tf.distribute` strategy with the auto-shard policy of its source.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from keras_vit.catalog import model_entry
from keras_vit.defaults import BAD_IMAGE_ACTIONS, MAX_PIXELS
from keras_vit.environment import install_hint
from keras_vit.preprocessing import GOOGLE_MEAN, GOOGLE_STD, UNSET, Preprocessing, as_spec
from keras_vit.tf_preprocessing import LIBJPEG_WARNINGS, ImagePreprocessing, caught_stderr, decode_image
from keras_vit.validation import check_pixel_count, one_of, optional, positive_int, positive_number
from keras_vit.validation import image_size as size_pair

__all__ = [
    "BAD_IMAGE_ACTIONS",
    "BadImageError",
    "DataNotPreparedError",
    "Preprocessing",
    "Source",
    "distribute",
    "epoch_steps",
    "eval_pipeline",
    "from_arrays",
    "from_directory",
    "from_tfds",
    "is_folder_name",
    "load_digits",
    "normalisation_for",
    "train_pipeline",
    "undecodable_files",
]

AUTOTUNE = tf.data.AUTOTUNE
ShardPolicy = tf.data.experimental.AutoShardPolicy
IMAGE_EXTENSIONS = (".bmp", ".gif", ".jpeg", ".jpg", ".png")
INTERPOLATIONS = ("bilinear", "bicubic", "area", "nearest")
# Independent random streams derived from the user's seed.
_SHUFFLE_STREAM, _AUGMENT_STREAM, _MIXUP_STREAM = 0, 1, 2


class DataNotPreparedError(FileNotFoundError):
    """A tensorflow-datasets dataset is not prepared on disk (and is never downloaded here)."""


@dataclass(frozen=True, repr=False)
class Source:
    """A labelled image set: its examples, size, classes and how to read it.

    Random-access sources (arrays, directories) hold `lookup(index) -> (image, label)`, so a
    training pass is an exact permutation. Sequential sources (tensorflow-datasets) hold
    `records()` (raw records in stored order) and `decode(record) -> (image, label)`; a
    training pass shuffles them within windows of `shuffle_buffer` records.

    `crop_scale` and `flip` are the augmentation that suits these images, used by
    `train_pipeline` (and the training driver) unless the run gives its own: inception crops of
    8-100% of the area with flips for photos, gentler crops without flips for the digits.
    """

    num_examples: int
    num_classes: int
    class_names: tuple[str, ...] | None
    shard_policy: ShardPolicy
    lookup: Callable | None = None
    records: Callable[[], tf.data.Dataset] | None = None
    decode: Callable | None = None
    class_counts: tuple[int, ...] | None = None  # examples per class, where known
    files: tuple[str, ...] | None = None  # the image files of a folder source, in example order
    crop_scale: tuple[float, float] = (0.08, 1.0)
    flip: bool = True

    def augmentation(self, crop_scale: Sequence[float] | None = None, flip: bool | None = None) -> dict:
        """`train_pipeline`'s `crop_scale` and `flip`: as given, else this source's own."""
        return {
            "crop_scale": tuple(self.crop_scale if crop_scale is None else crop_scale),
            "flip": self.flip if flip is None else flip,
        }

    def __repr__(self) -> str:  # the same in every process (not the functions' addresses): reports compare it
        return f"Source({self.num_examples} examples, {self.num_classes} classes)"

    def missing_classes(self) -> list[str]:
        """The classes with no example (by name where known), or `[]` if unknown or none."""
        if self.class_counts is None:
            return []
        names = self.class_names or tuple(str(index) for index in range(self.num_classes))
        return [name for name, count in zip(names, self.class_counts, strict=True) if count == 0]

    @property
    def dataset(self) -> tf.data.Dataset:
        """The examples in stored order, unbatched: `(uint8 (H, W, 3), int32 label)`."""
        if self.lookup is not None:
            return tf.data.Dataset.range(self.num_examples).map(self.lookup, num_parallel_calls=AUTOTUNE)
        return self.records().map(self.decode, num_parallel_calls=AUTOTUNE)


def _as_rgb(image: tf.Tensor) -> tf.Tensor:
    """uint8 `(H, W, 1 or 3)` -> `(H, W, 3)`."""
    if image.shape[-1] == 1:
        return tf.image.grayscale_to_rgb(image)
    return image


def _check_labels(labels: np.ndarray, num_classes: int | None, count: int) -> int:
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
    return num_classes


def from_arrays(
    images,
    labels,
    *,
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
) -> Source:
    """A source over in-memory images `(N, H, W)`, `(N, H, W, 1)` or `(N, H, W, 3)` and labels `(N,)`.

    Pixel values must lie in [0, 255] (uint8, or integer/float values there: floats are
    rounded; floats within [0, 1] are refused as already scaled). `num_classes` defaults to
    `len(class_names)` or `max(labels) + 1`. The arrays become constants of the input
    pipeline, so they must fit in memory (and under 2 GB).
    """
    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(f"images must be (N, H, W), (N, H, W, 1) or (N, H, W, 3), got shape {images.shape}.")
    if images.dtype != np.uint8:
        if not np.issubdtype(images.dtype, np.number) or images.dtype == bool:
            raise ValueError(f"images must be numeric pixel values in [0, 255], got dtype {images.dtype}.")
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
    num_classes = _check_labels(labels, num_classes, len(images))
    image_table = tf.constant(images)
    label_table = tf.constant(labels.astype("int32"))

    def lookup(index):
        return _as_rgb(tf.gather(image_table, index)), tf.gather(label_table, index)

    counts = tuple(int(count) for count in np.bincount(labels, minlength=num_classes))
    return Source(len(images), num_classes, class_names, ShardPolicy.DATA, lookup=lookup, class_counts=counts)


def _decode_file(path: tf.Tensor) -> tf.Tensor:
    """Decode a file as Pillow does (JPEG with the accurate IDCT): the pixels `load_image` reads."""
    return tf.ensure_shape(decode_image(tf.io.read_file(path), channels=3), (None, None, 3))


class BadImageError(ValueError):
    """Image files of a dataset folder that cannot be read (the message names them)."""


def _image_problem(path: str, max_pixels: int | None) -> str | None:
    """Why the image file at `path` cannot be used, or None: a check of its header and structure.

    Pillow reads the header (format, size: the pixel limit is checked there) and `verify()`s
    the file's structure (PNG chunk checksums, ...) without decoding it. A JPEG that does not
    end with its end-of-image marker (a truncated download) is decoded in full to be sure.
    """
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                check_pixel_count("it", image.height, image.width, max_pixels)
                if image.format == "JPEG":
                    with open(path, "rb") as file:
                        file.seek(-2, os.SEEK_END)
                        complete = file.read() == b"\xff\xd9"
                    if not complete:
                        image.load()
                else:
                    image.verify()
    except Exception as error:  # anything a damaged file makes Pillow raise
        return f"{type(error).__name__}: {error}"
    return None


def _decode_problems(paths: Sequence[str]) -> dict[str, str]:
    """Why each file that the training's decoder (`_decode_file`) cannot fully decode is bad.

    Every file is decoded once, as training reads it: a file the decoder refuses, and a JPEG
    that libjpeg decodes only by "recovering" from damaged data (a partly grey image, e.g.
    bytes lost mid-file with the header and end marker intact), are bad.
    """
    problems = {}
    with caught_stderr() as caught:
        for path in paths:
            try:
                _decode_file(tf.constant(path))
            except tf.errors.OpError as error:
                problems[path] = error.message.splitlines()[0]
            warning = LIBJPEG_WARNINGS.search(caught())
            if warning and path not in problems:
                problems[path] = f"damaged JPEG data, libjpeg: {warning.group(0).strip()}"
    return problems


def _bad_image_message(root: str, bad: list[tuple[str, str]], total: int) -> str:
    shown = "; ".join(f"{path} ({reason})" for path, reason in bad[:5])
    more = f"; and {len(bad) - 5} more" if len(bad) > 5 else ""
    return f"{len(bad)} of the {total} image files in {root} cannot be read: {shown}{more}."


def from_directory(
    path: str | os.PathLike, *, on_bad_image: str = BAD_IMAGE_ACTIONS[0], max_pixels: int | None = MAX_PIXELS
) -> Source:
    """A source over an image folder with one sub-folder per class (`image_dataset_from_directory`).

    Classes are the sub-folders in alphanumeric order (label i = i-th folder); images are the
    files below each (searched recursively) with extension bmp, gif (first frame), jpeg, jpg
    or png, in sorted order. Files are decoded when read, so the folder can exceed memory, and
    as Pillow decodes them (`keras_vit.tf_preprocessing.decode_image`).

    Every file is checked first: Pillow reads its header and checks its structure
    (`_image_problem`), then the files are decoded once as training decodes them
    (`_decode_problems`). A file that is no image, is damaged (even mid-file, with its header
    and end marker intact) or truncated, or has more than `max_pixels` pixels (`None`: no
    limit) is bad.
    `on_bad_image="stop"` (default) raises `BadImageError` naming the bad files;
    `"skip"` leaves them out with one warning that counts them.
    """
    root = os.fspath(path)
    on_bad_image = one_of("on_bad_image", on_bad_image, BAD_IMAGE_ACTIONS)
    max_pixels = optional(positive_int, "max_pixels", max_pixels)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"Image folder {root!r} does not exist.")
    class_names = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
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
    bad = [(file, problem) for file in paths if (problem := _image_problem(file, max_pixels)) is not None]
    unread = {file for file, _ in bad}
    bad = sorted(bad + list(_decode_problems([file for file in paths if file not in unread]).items()))
    if bad and on_bad_image == "stop":
        raise BadImageError(
            f"{_bad_image_message(root, bad, len(paths))} Remove or replace them, or skip them "
            "(on_bad_image='skip', keras-vit --on-bad-image skip)."
        )
    if bad:
        warnings.warn(f"Skipped: {_bad_image_message(root, bad, len(paths))}", stacklevel=2)
        skipped = {file for file, _ in bad}
        kept = [(file, label) for file, label in zip(paths, labels, strict=True) if file not in skipped]
        if not kept:
            raise BadImageError(f"No readable image in {root}: {_bad_image_message(root, bad, len(paths))}")
        paths, labels = (list(column) for column in zip(*kept, strict=True))
    path_table = tf.constant(paths)
    label_table = tf.constant(labels, dtype=tf.int32)

    def lookup(index):
        return _decode_file(tf.gather(path_table, index)), tf.gather(label_table, index)

    # The files are read by path inside a map, not by a file-reader dataset that FILE
    # sharding could split: shard by DATA.
    counts = tuple(labels.count(label) for label in range(len(class_names)))
    return Source(
        len(paths),
        len(class_names),
        tuple(class_names),
        ShardPolicy.DATA,
        lookup=lookup,
        class_counts=counts,
        files=tuple(paths),
    )


def undecodable_files(source: Source) -> list[tuple[str, str]]:
    """`(path, TensorFlow's error)` of each file of a folder source that TensorFlow cannot decode.

    For a failure during training (a file changed after `from_directory`'s check): found by
    decoding each file once (eagerly). `[]` for sources that are not folders.
    """
    bad = []
    for path in source.files or ():
        try:
            _decode_file(tf.constant(path))
        except tf.errors.OpError as error:
            bad.append((path, error.message.splitlines()[0]))
    return bad


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


def from_tfds(name: str, split: str = "train", data_dir: str | os.PathLike | None = None) -> Source:
    """A source over a PREPARED tensorflow-datasets image classification split.

    Never downloads: when the data is not prepared under `data_dir` (default: tfds's own,
    `$TFDS_DATA_DIR` or `~/tensorflow_datasets`), it raises `DataNotPreparedError` at once
    with how to prepare it, instead of letting tfds retry the network for minutes. The
    dataset needs supervised keys `(image, label)` with a `ClassLabel` label. `split` takes
    tfds's slicing syntax, e.g. `"train[:90%]"`.
    """
    import tensorflow_datasets as tfds

    try:
        builder = tfds.builder(name, data_dir=None if data_dir is None else os.fspath(data_dir))
    except tfds.core.registered.DatasetNotFoundError as error:
        raise ValueError(
            f"tensorflow-datasets has no dataset {name!r}: {str(error).splitlines()[0]}"
        ) from None
    if not builder.is_prepared():
        where = f"data_dir {os.fspath(data_dir)!r}" if data_dir is not None else "tfds's default data_dir"
        raise DataNotPreparedError(
            f"tensorflow-datasets {name!r} is not prepared in {where} (looked for {builder.data_dir}) and "
            f"keras_vit does not download it. On a machine with network run `tfds build {name} "
            f"--data_dir=DIR` (or tfds.builder({name!r}, data_dir=DIR).download_and_prepare()), copy DIR "
            "here if needed, and point keras_vit at it: `--data-dir DIR` on the command line, "
            "data_dir=DIR in Python."
        )
    if builder.info.supervised_keys is None or len(builder.info.supervised_keys) != 2:
        raise ValueError(
            f"{name!r} has no (image, label) supervised keys: it is not an image classification set."
        )
    image_key, label_key = builder.info.supervised_keys
    image_feature, label_feature = builder.info.features[image_key], builder.info.features[label_key]
    if not isinstance(image_feature, tfds.features.Image) or not hasattr(label_feature, "num_classes"):
        raise ValueError(
            f"{name!r}: expected an Image feature and a ClassLabel, got {image_key}, {label_key}."
        )

    def records() -> tf.data.Dataset:
        # Images stay encoded until `decode`, so skipping records (resume) costs only reading.
        return builder.as_dataset(
            split=split,
            as_supervised=True,
            shuffle_files=False,
            decoders={image_key: tfds.decode.SkipDecoding()},
        )

    def decode(encoded, label):
        return _as_rgb(image_feature.decode_example(encoded)), tf.cast(label, tf.int32)

    num_examples = int(records().cardinality())
    if num_examples < 1:
        raise ValueError(f"{name!r} split {split!r} has no examples or an unknown count ({num_examples}).")
    names = tuple(label_feature.names) if getattr(label_feature, "names", None) else None
    return Source(
        num_examples, label_feature.num_classes, names, ShardPolicy.FILE, records=records, decode=decode
    )


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Source, Source]:
    """scikit-learn's handwritten digits as `(train, test)` sources: 1797 real 8x8 images, 10 classes.

    Pixel values 0..16 are scaled to uint8 0..255 (`round(v * 255 / 16)`) and repeated to
    RGB. The held-out split is fixed and stratified: within each class, the examples are
    permuted with `numpy.random.default_rng(seed)` (one generator, classes in order) and the
    first `round(test_fraction * class size)` go to test. Defaults give 1438 train / 359 test.
    Needs scikit-learn (which ships the data, so no network is used).
    """
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
    names = tuple(str(label) for label in range(10))
    # 8x8 strokes: a crop must keep most of the digit, and a flipped digit is another symbol.
    gentle = dict(crop_scale=(0.7, 1.0), flip=False)
    return (
        dataclasses.replace(from_arrays(images[~test], labels[~test], class_names=names), **gentle),
        dataclasses.replace(from_arrays(images[test], labels[test], class_names=names), **gentle),
    )


def normalisation_for(model_or_tag=None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """`(mean, std)` a checkpoint expects, from the catalog (`keras_vit.catalog`).

    Accepts a full catalog tag, a model built with `pretrained=...`, or `None`; anything not
    in the catalog gets the package default (mean = std = 0.5, inputs in [-1, 1]). The
    same values as `Preprocessing.for_model(model_or_tag)`'s `mean` and `std`.
    """
    entry = model_entry(model_or_tag)
    if entry is None:
        return GOOGLE_MEAN, GOOGLE_STD
    return tuple(entry.mean), tuple(entry.std)


def _normaliser(mean: Sequence[float], std: Sequence[float]) -> Callable[[tf.Tensor], tf.Tensor]:
    mean = np.resize(np.asarray(mean, "float32"), 3)
    std = np.resize(np.asarray(std, "float32"), 3)
    if np.any(std <= 0):
        raise ValueError(f"std must be positive, got {tuple(std.tolist())}.")

    def normalise(image: tf.Tensor) -> tf.Tensor:
        return (tf.cast(image, tf.float32) / 255.0 - mean) / std

    return normalise


def _check_interpolation(interpolation: str) -> None:
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"Unknown interpolation {interpolation!r}: use one of {INTERPOLATIONS}.")


def epoch_steps(source: Source, batch_size: int, steps_per_epoch: int | None = None) -> int:
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


def _fold(key: tf.Tensor, *values) -> tf.Tensor:
    for value in values:
        key = tf.random.experimental.stateless_fold_in(key, tf.cast(value, tf.int64))
    return key


def _pass_records(source: Source, shuffle_key: tf.Tensor, shuffle_buffer: int) -> tf.data.Dataset:
    """One pass over the source in the order drawn from `shuffle_key` (indices or raw records)."""
    if source.lookup is not None:
        noise = tf.random.stateless_uniform([source.num_examples], seed=shuffle_key)
        return tf.data.Dataset.from_tensor_slices(tf.argsort(noise, stable=True))

    def shuffle_window(window_index, window):
        noise = tf.random.stateless_uniform([tf.shape(window[0])[0]], seed=_fold(shuffle_key, window_index))
        order = tf.argsort(noise, stable=True)
        return tf.nest.map_structure(lambda part: tf.gather(part, order), window)

    windows = source.records().batch(shuffle_buffer).enumerate()
    return windows.map(shuffle_window).unbatch()


def _mixup(alpha: float, num_classes: int, key: tf.Tensor) -> Callable:
    """`(batch index, (images, labels))` -> the batch mixed with itself reversed, labels one-hot mixed."""
    alpha = positive_number("mixup_alpha", alpha)

    def mix(index, batch):
        images, labels = batch
        first, second = (
            tf.random.stateless_gamma([], seed=seed, alpha=alpha)
            for seed in tf.unstack(tf.random.experimental.stateless_split(_fold(key, index), 2))
        )
        weight = tf.math.divide_no_nan(first, first + second)  # Beta(alpha, alpha)

        def blend(tensor):
            return weight * tensor + (1.0 - weight) * tf.reverse(tensor, [0])

        return blend(images), blend(tf.one_hot(labels, num_classes))

    return mix


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
    shuffle_buffer: int = 10_000,
    augment: bool = True,
    crop_scale: tuple[float, float] | None = None,
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: bool | None = None,
    interpolation: str = "bilinear",
    mixup_alpha: float = 0.0,
) -> tf.data.Dataset:
    """Endless training batches `(float32 (B, H, W, 3), int32 (B,))`, resumable at any epoch.

    Each example: inception crop (a random box covering `crop_scale` of the area with aspect
    ratio in `crop_ratio`, the whole image if 10 draws fail), resize to `image_size`, random
    horizontal flip, then `(x / 255 - mean) / std`; `crop_scale` and `flip` default to the
    source's own (`Source.augmentation`: gentle crops without flips for the digits).
    `augment=False`: resize only.
    `mixup_alpha > 0`: mixup (Zhang et al. 2018, as DeiT and timm's batch mode), each batch
    blended with itself reversed, `w * x + (1 - w) * x[::-1]`, `w ~ Beta(alpha, alpha)` per batch,
    and its labels likewise as float32 class distributions `(B, num_classes)` (the recipes' loss
    takes them). Batches of
    `batch_size` (every batch full); each epoch is `epoch_steps(source, batch_size,
    steps_per_epoch)` batches, so pass that as `steps_per_epoch` to `model.fit`. The batches
    of epoch `e` are a pure function of `(seed, e)` (see the module docstring); build the
    pipeline with `start_epoch=k` to resume at epoch `k`. Random-access sources are shuffled
    exactly each pass; tensorflow-datasets sources within windows of `shuffle_buffer` records
    (tfds already stores examples in a shuffled order). No `cache()`: passes read the source
    in a new order each time, and array sources are in memory already.
    """
    _check_interpolation(interpolation)
    augmentation = source.augmentation(crop_scale, flip)
    crop_scale, flip = augmentation["crop_scale"], augmentation["flip"]
    if int(start_epoch) < 0:
        raise ValueError(f"start_epoch must be >= 0, got {start_epoch!r}.")
    if not 0.0 < crop_scale[0] <= crop_scale[1] <= 1.0:
        raise ValueError(f"crop_scale must satisfy 0 < low <= high <= 1, got {crop_scale!r}.")
    height, width = size_pair("image_size", image_size)
    steps = epoch_steps(source, batch_size, steps_per_epoch)
    normalise = _normaliser(mean, std)
    base_key = tf.constant([int(seed), 0], dtype=tf.int64)
    first_pass, offset = divmod(int(start_epoch) * steps * batch_size, source.num_examples)

    def one_pass(pass_index):
        records = _pass_records(source, _fold(base_key, _SHUFFLE_STREAM, pass_index), shuffle_buffer)
        return records.enumerate().map(lambda position, record: (pass_index, position, record))

    def example(pass_index, position, record):
        image, label = source.lookup(record) if source.lookup is not None else source.decode(*record)
        crop_key, flip_key = tf.unstack(
            tf.random.experimental.stateless_split(_fold(base_key, _AUGMENT_STREAM, pass_index, position), 2)
        )
        if augment:
            begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
                tf.shape(image),
                bounding_boxes=tf.zeros([1, 0, 4]),
                seed=crop_key,
                min_object_covered=0.0,
                aspect_ratio_range=crop_ratio,
                area_range=crop_scale,
                max_attempts=10,
                use_image_if_no_bounding_boxes=True,
            )
            image = tf.slice(image, begin, size)
        image = tf.image.resize(image, (height, width), method=interpolation, antialias=True)
        if augment and flip:
            image = tf.image.stateless_random_flip_left_right(image, flip_key)
        return normalise(tf.clip_by_value(image, 0.0, 255.0)), label

    stream = tf.data.Dataset.counter(first_pass).flat_map(one_pass).skip(offset)
    stream = stream.map(example, num_parallel_calls=AUTOTUNE, deterministic=True)
    stream = stream.batch(batch_size, drop_remainder=True)
    if mixup_alpha:
        mix = _mixup(mixup_alpha, source.num_classes, _fold(base_key, _MIXUP_STREAM))
        stream = stream.enumerate(start=int(start_epoch) * steps).map(mix, num_parallel_calls=AUTOTUNE)
    stream = stream.prefetch(AUTOTUNE)
    # Every worker computes the same global stream and keeps its share: DATA sharding.
    return _with_policy(stream, ShardPolicy.DATA)


def eval_pipeline(
    source: Source,
    spec: Preprocessing | None = None,
    *,
    batch_size: int,
    image_size: int | Sequence[int] | None = None,
    mean: Sequence[float] = UNSET,
    std: Sequence[float] = UNSET,
    crop_pct: float | None = UNSET,
    interpolation: str = UNSET,
    cache: bool = False,
) -> tf.data.Dataset:
    """Evaluation batches `(float32 (B, H, W, 3), int32 (B,))` in stored order, one pass.

    Each image is preprocessed as `spec` says (`keras_vit.preprocessing.Preprocessing`, e.g.
    `Preprocessing.for_model(model)`): shorter side resized to `image_size / crop_pct` and the
    centre crop kept, as timm's eval transform (`crop_pct=None`: plain resize to
    `image_size`), then normalised. It runs `keras_vit.tf_preprocessing.ImagePreprocessing`,
    the code the exported SavedModel runs, so the batches equal
    `preprocess_input(load_image(image, spec), spec)` exactly. Without a spec, `image_size`
    gives the package default spec at that size (crop 0.9, bicubic, mean = std = 0.5).
    `image_size`, `mean`, `std`, `crop_pct` and `interpolation`, when given, replace the
    spec's fields. The last batch keeps the remainder. `cache=True` keeps the resized uint8
    images in memory after the first pass (cached after decode + resize, before
    normalisation and batching: the costly steps run once, at a quarter of float32 memory).
    """
    if spec is None:
        if image_size is None:
            raise ValueError(
                "eval_pipeline needs a spec (keras_vit.preprocessing.Preprocessing) or an image_size."
            )
        spec = Preprocessing(image_size)
    elif image_size is not None:
        spec = spec.replace(image_size=image_size)
    preprocessing = ImagePreprocessing.from_spec(
        as_spec(spec, mean=mean, std=std, crop_pct=crop_pct, interpolation=interpolation)
    )

    def resize(image, label):
        return preprocessing.resize(image[None])[0], label

    dataset = source.dataset.map(resize, num_parallel_calls=AUTOTUNE)
    if cache:
        dataset = dataset.cache()
    dataset = dataset.map(
        lambda image, label: (preprocessing.normalize(image), label), num_parallel_calls=AUTOTUNE
    )
    dataset = dataset.batch(batch_size).prefetch(AUTOTUNE)
    return _with_policy(dataset, source.shard_policy)


def _with_policy(dataset: tf.data.Dataset, policy: ShardPolicy) -> tf.data.Dataset:
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def distribute(
    dataset: tf.data.Dataset,
    strategy: tf.distribute.Strategy | None = None,
    *,
    policy: ShardPolicy | None = None,
) -> tf.data.Dataset | tf.distribute.DistributedDataset:
    """Hand a batched pipeline to `strategy` (default: the current one) with its auto-shard policy.

    The pipelines above already carry theirs: DATA for `train_pipeline` and for array and
    folder sources (every worker reads everything and keeps its share), FILE for
    tensorflow-datasets evaluation (each worker reads its own files; it needs at least as
    many files as workers, else pass `policy=AutoShardPolicy.DATA`). `policy` overrides it.
    Returns `strategy.experimental_distribute_dataset(...)` (the global batch is split across
    replicas), which `model.fit` and custom loops take as is; under the default (no)
    strategy, the dataset itself.
    """
    if policy is not None:
        dataset = _with_policy(dataset, policy)
    if strategy is None:
        if not tf.distribute.has_strategy():
            return dataset
        strategy = tf.distribute.get_strategy()
    return strategy.experimental_distribute_dataset(dataset)

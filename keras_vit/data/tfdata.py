"""tf.data input pipelines: sources, a resumable training stream, evaluation, sharding.

Sources (`Source`) describe a labelled image set: `from_arrays`, `from_directory` (the
`keras.utils.image_dataset_from_directory` layout), `from_tfds` (prepared tensorflow-datasets
data) and `load_digits` (scikit-learn's 8x8 digits, the offline main job's data).
`source.dataset` gives its examples in stored order, unbatched: `(image, label)` with image
uint8 `(H, W, 3)` (grayscale repeated to RGB, as every ViT checkpoint takes RGB) and label a
SPARSE int32 class index (`keras_vit.training.optimization.loss` takes sparse labels).

`train_pipeline` is an endless stream of batches whose content is a pure function of
`(seed, epoch)`: the examples are read in passes, each pass a permutation drawn with
stateless random ops from `(seed, pass)`, the inception crop and flip of each example
are drawn from `(seed, pass, position in pass)`, and mixup's weight of each batch from
`(seed, batch index)`. Epoch `e` is the stretch of batches
`[e * steps, (e + 1) * steps)` of that stream, so a fresh process built with
`start_epoch=k` yields exactly what an uninterrupted run yields from epoch `k` on: the basis
of exact resume with epoch-granular backups. Nothing depends on TensorFlow's global seed.

`eval_pipeline` preprocesses with a checkpoint's `keras_vit.data.preprocessing.Preprocessing` spec
(resize, centre crop as timm's evaluation transform, normalisation), through the TensorFlow
implementation the exported SavedModel runs: its batches equal `load_image` +
`preprocess_input` with the same spec, exactly (which spec a model needs:
`keras_vit.registry.catalog.preprocessing_for`). `distribute` hands a
pipeline to a `tf.distribute` strategy with the auto-shard policy of its source.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from keras_vit.data.preprocessing import GOOGLE_MEAN, GOOGLE_STD, UNSET, Preprocessing, as_spec
from keras_vit.data.pyinput import (
    IMAGES,
    MIXUP_WEIGHT,
    PIXELS,
    BadImageError,
    BadImages,
    SourceInfo,
    checked_arrays,
    digits_sources,
    epoch_steps,
    is_folder_name,
    list_image_folder,
    training_augmentation,
)
from keras_vit.data.tf_preprocessing import ImagePreprocessing, decode_image
from keras_vit.registry.catalog import DEFAULT_INTERPOLATION, INTERPOLATIONS
from keras_vit.utils.defaults import BAD_IMAGE_ACTIONS, MAX_PIXELS
from keras_vit.utils.environment import import_tensorflow
from keras_vit.utils.validation import image_size as size_pair
from keras_vit.utils.validation import one_of, positive_number

tf = import_tensorflow("keras_vit.data.tfdata (the tf.data input)")


def _as_written(function: Callable) -> Callable:
    """`function` for tf.data to trace as written, without AutoGraph: the functions here branch on
    tensors with `tf.cond` and friends only, so converting them buys nothing and cost ~0.5 s of
    every process's start-up (`benchmarks/input.py`, the path to the first batch)."""
    return tf.autograph.experimental.do_not_convert(function)


__all__ = [
    "BAD_IMAGE_ACTIONS",
    "BadImageError",
    "DataNotPreparedError",
    "Preprocessing",
    "Source",
    "decode_crop",
    "distribute",
    "epoch_steps",
    "eval_pipeline",
    "from_arrays",
    "from_directory",
    "from_tfds",
    "images_only",
    "is_folder_name",
    "load_digits",
    "train_pipeline",
    "undecodable_files",
]

AUTOTUNE = tf.data.AUTOTUNE
ShardPolicy = tf.data.experimental.AutoShardPolicy
# Independent random streams derived from the user's seed.
_SHUFFLE_STREAM, _AUGMENT_STREAM, _MIXUP_STREAM = 0, 1, 2


class DataNotPreparedError(FileNotFoundError):
    """A tensorflow-datasets dataset is not prepared on disk (and is never downloaded here)."""


@dataclass(frozen=True, repr=False)
class Source(SourceInfo):
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
    # a folder's `index -> (encoded file, label)`: the training stream decodes only a JPEG's crop window
    read_file: Callable | None = None
    records: Callable[[], tf.data.Dataset] | None = None
    decode: Callable | None = None
    class_counts: tuple[int, ...] | None = None  # examples per class, where known
    files: tuple[str, ...] | None = None  # the image files of a folder source, in example order
    crop_scale: tuple[float, float] = (0.08, 1.0)
    flip: bool = True
    bad_images: BadImages | None = None  # a folder's policy for files that fail to decode when read

    @property
    def dataset(self) -> tf.data.Dataset:
        """The examples in stored order, unbatched: `(uint8 (H, W, 3), int32 label)` (a folder's
        files that fail to decode handled by `bad_images`: `skipping`)."""
        if self.lookup is not None:
            examples = tf.data.Dataset.range(self.num_examples).map(
                _as_written(lambda index: (*self.lookup(index), index)),
                num_parallel_calls=AUTOTUNE,
                deterministic=True,
            )
            return skipping(examples, 0, self.bad_images)
        return self.records().map(_as_written(self.decode), num_parallel_calls=AUTOTUNE)


def skipping(examples: tf.data.Dataset, first: int, bad_images: BadImages | None) -> tf.data.Dataset:
    """`(image, label, position)` examples (positions counting up from `first`) -> `(image, label)`.

    With `bad_images` skipping, an example whose file fails to decode when read is dropped and
    counted (a gap in the positions; tf.data cannot name the file: `undecodable_files` does,
    and TensorFlow logs each error); else an error stops the input (the run driver names the
    file, `keras_vit.training.runs.fit_checked`). A dropped example shifts the batches after it, so a
    run resumed past a skipped file is not bit-identical to an uninterrupted one (the JAX/PyTorch
    input fills the place instead and stays exact).
    """
    if bad_images is None or bad_images.action == "stop":
        return examples.map(_as_written(lambda image, label, position: (image, label)))
    skipped = tf.Variable(tf.constant(0, tf.int64), trainable=False)
    bad_images.add_counter(lambda: skipped.numpy())

    def gap(expected, example):
        image, label, position = example
        return position + 1, (image, label, position - expected)

    def count(image, label, missing):
        skipped.assign_add(missing)
        return image, label

    examples = examples.ignore_errors(log_warning=True)
    return examples.scan(tf.constant(first, tf.int64), _as_written(gap)).map(_as_written(count))


def _as_rgb(image: tf.Tensor) -> tf.Tensor:
    """uint8 `(H, W, 1 or 3)` -> `(H, W, 3)`."""
    if image.shape[-1] == 1:
        return tf.image.grayscale_to_rgb(image)
    return image


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
    images, labels, num_classes, class_names = checked_arrays(images, labels, num_classes, class_names)
    image_table = tf.constant(images)
    label_table = tf.constant(labels.astype("int32"))

    def lookup(index):
        return _as_rgb(tf.gather(image_table, index)), tf.gather(label_table, index)

    counts = tuple(int(count) for count in np.bincount(labels, minlength=num_classes))
    return Source(len(images), num_classes, class_names, ShardPolicy.DATA, lookup=lookup, class_counts=counts)


def _decode_file(path: tf.Tensor) -> tf.Tensor:
    """Decode a file as Pillow does (JPEG with the accurate IDCT): the pixels `load_image` reads."""
    return tf.ensure_shape(decode_image(tf.io.read_file(path), channels=3), (None, None, 3))


def from_directory(
    path: str | os.PathLike, *, on_bad_image: str = BAD_IMAGE_ACTIONS[0], max_pixels: int | None = MAX_PIXELS
) -> Source:
    """A source over an image folder with one sub-folder per class (`image_dataset_from_directory`).

    Classes are the sub-folders in alphanumeric order (label i = i-th folder); images are the
    files below each (searched recursively) with extension bmp, gif (first frame), jpeg, jpg
    or png, in sorted order. Files are decoded when read, so the folder can exceed memory, and
    as Pillow decodes them (`keras_vit.data.tf_preprocessing.decode_image`).

    Nothing is decoded first: each file's header and structure are checked by Pillow
    (`keras_vit.data.pyinput.list_image_folder`; class folders that resolve to another class
    or hold no image are refused there too). A file that is no image, is truncated, or has
    more than `max_pixels` pixels (`None`: no limit) is bad: `on_bad_image="stop"` (default)
    raises `BadImageError` naming the bad files; `"skip"` leaves them out with one warning that
    counts them. A file that passes the check but fails to decode when read (damaged mid-file)
    stops the run naming it, or with `"skip"` is dropped and counted (`skipping`).
    """
    root = os.fspath(path)
    paths, labels, class_names = list_image_folder(root, on_bad_image, max_pixels)
    path_table = tf.constant(paths)
    label_table = tf.constant(labels, dtype=tf.int32)

    def lookup(index):
        return _decode_file(tf.gather(path_table, index)), tf.gather(label_table, index)

    def read_file(index):
        return tf.io.read_file(tf.gather(path_table, index)), tf.gather(label_table, index)

    # The files are read by path inside a map, not by a file-reader dataset that FILE
    # sharding could split: shard by DATA.
    counts = tuple(labels.count(label) for label in range(len(class_names)))
    return Source(
        len(paths),
        len(class_names),
        tuple(class_names),
        ShardPolicy.DATA,
        lookup=lookup,
        read_file=read_file,
        class_counts=counts,
        files=tuple(paths),
        bad_images=BadImages(root, on_bad_image),
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
    return digits_sources(from_arrays, test_fraction, seed)


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
    return windows.map(_as_written(shuffle_window)).unbatch()


def _crop_box(shape: tf.Tensor, key: tf.Tensor, crop_scale, crop_ratio) -> tuple[tf.Tensor, tf.Tensor]:
    """An inception crop `(begin, size)` (3 entries each) of an image of `shape` `(H, W, ...)`, from `key`."""
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.stack([shape[0], shape[1], 3]),
        bounding_boxes=tf.zeros([1, 0, 4]),
        seed=key,
        min_object_covered=0.0,
        aspect_ratio_range=crop_ratio,
        area_range=crop_scale,
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    return begin, size


_JPEG_MARGIN = 16  # pixels decoded around a JPEG crop window: a 4:2:0 file's block (MCU) side


def decode_crop(contents: tf.Tensor, box: Callable[[tf.Tensor], tuple[tf.Tensor, tf.Tensor]]) -> tf.Tensor:
    """The `box(shape) -> (begin, size)` crop of an encoded image, uint8 RGB, as Pillow decodes it.

    Decode less: a JPEG's size is read from its header (`tf.io.extract_jpeg_shape`) and only the
    crop window decoded (`tf.io.decode_and_crop_jpeg`, libjpeg-turbo's accurate integer IDCT as
    `decode_image`), equal to decoding the whole file and cropping (`tests/data/test_tfdata.py`
    measures it); other formats are decoded whole, then cropped.
    """

    def jpeg():
        shape = tf.io.extract_jpeg_shape(contents)
        begin, size = box(shape)
        # libjpeg upsamples the chroma at a window's edge as at the image's: decode a margin around
        # the window (one 16-pixel block, within the image) and cut the window from it.
        start = tf.maximum(begin[:2] - _JPEG_MARGIN, 0)
        stop = tf.minimum(begin[:2] + size[:2] + _JPEG_MARGIN, shape[:2])
        window = tf.concat([start, stop - start], axis=0)
        padded = tf.io.decode_and_crop_jpeg(contents, window, channels=3, dct_method="INTEGER_ACCURATE")
        return tf.slice(padded, tf.concat([begin[:2] - start, [0]], axis=0), size)

    def other():
        image = decode_image(contents, channels=3)
        begin, size = box(tf.shape(image))
        return tf.slice(image, begin, size)

    return tf.ensure_shape(tf.cond(tf.io.is_jpeg(contents), jpeg, other), (None, None, 3))


def _mixup_weight(alpha: float, key: tf.Tensor, index: tf.Tensor) -> tf.Tensor:
    """Batch `index`'s mixup weight, `Beta(alpha, alpha)` drawn from `(key, index)` as two gammas."""
    first, second = (
        tf.random.stateless_gamma([], seed=seed, alpha=alpha)
        for seed in tf.unstack(tf.random.experimental.stateless_split(_fold(key, index), 2))
    )
    return tf.math.divide_no_nan(first, first + second)


def _mixup_weights(alpha: float, key: tf.Tensor) -> Callable:
    """`(batch index, (images, labels))` -> `({"images", "mixup_weight": (B,)}, labels)`: mixup's
    weight of the batch for each row, mixed on the device (`keras_vit.training.device_input`)."""
    alpha = positive_number("mixup_alpha", alpha)

    def weights(index, batch):
        images, labels = batch
        weight = _mixup_weight(alpha, key, index)
        return {IMAGES: images, MIXUP_WEIGHT: tf.fill(tf.shape(labels), weight)}, labels

    return weights


def _mixup(alpha: float, num_classes: int, key: tf.Tensor) -> Callable:
    """`(batch index, (images, labels))` -> the batch mixed with itself reversed, labels one-hot mixed."""
    alpha = positive_number("mixup_alpha", alpha)

    def mix(index, batch):
        images, labels = batch
        weight = _mixup_weight(alpha, key, index)

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
    interpolation: str = DEFAULT_INTERPOLATION,
    mixup_alpha: float = 0.0,
    pixels: str = PIXELS[0],
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

    `pixels="uint8"`: the resized pixels rounded to uint8 and left unnormalised, `(uint8 (B, H, W,
    3), int32 (B,))`, with mixup `({"images": uint8, "mixup_weight": float32 (B,)}, int32 (B,))` (the
    same weights): for a model that normalises and mixes on the device
    (`keras_vit.training.device_input.DeviceInput`, what the training driver fits). A folder's JPEGs
    are decoded only in their crop window (`decode_crop`).
    """
    _check_interpolation(interpolation)
    pixels = one_of("pixels", pixels, PIXELS)
    crop_scale, flip = training_augmentation(source, crop_scale, flip, start_epoch)
    height, width = size_pair("image_size", image_size)
    steps = epoch_steps(source, batch_size, steps_per_epoch)
    normalise = _normaliser(mean, std)
    base_key = tf.constant([int(seed), 0], dtype=tf.int64)
    first_pass, offset = divmod(int(start_epoch) * steps * batch_size, source.num_examples)

    def one_pass(pass_index):
        records = _pass_records(source, _fold(base_key, _SHUFFLE_STREAM, pass_index), shuffle_buffer)
        return records.enumerate().map(_as_written(lambda position, record: (pass_index, position, record)))

    def example(pass_index, position, record):
        stream_position = pass_index * source.num_examples + position
        return (*augmented(pass_index, position, record), stream_position)

    def augmented(pass_index, position, record):
        crop_key, flip_key = tf.unstack(
            tf.random.experimental.stateless_split(_fold(base_key, _AUGMENT_STREAM, pass_index, position), 2)
        )

        def box(shape):
            return _crop_box(shape, crop_key, crop_scale, crop_ratio)

        if augment and source.read_file is not None:  # a folder: decode the crop window only
            contents, label = source.read_file(record)
            image = decode_crop(contents, box)
        else:
            image, label = source.lookup(record) if source.lookup is not None else source.decode(*record)
            if augment:
                image = tf.slice(image, *box(tf.shape(image)))
        image = tf.image.resize(image, (height, width), method=interpolation, antialias=True)
        if augment and flip:
            image = tf.image.stateless_random_flip_left_right(image, flip_key)
        image = tf.ensure_shape(tf.clip_by_value(image, 0.0, 255.0), (height, width, 3))
        if pixels == "uint8":
            return tf.cast(tf.round(image), tf.uint8), label
        return normalise(image), label

    stream = tf.data.Dataset.counter(first_pass).flat_map(_as_written(one_pass)).skip(offset)
    stream = stream.map(_as_written(example), num_parallel_calls=AUTOTUNE, deterministic=True)
    stream = skipping(stream, first_pass * source.num_examples + offset, source.bad_images)
    stream = stream.batch(batch_size, drop_remainder=True)
    if mixup_alpha:
        mix_key = _fold(base_key, _MIXUP_STREAM)
        if pixels == "uint8":
            mix = _mixup_weights(mixup_alpha, mix_key)
        else:
            mix = _mixup(mixup_alpha, source.num_classes, mix_key)
        stream = stream.enumerate(start=int(start_epoch) * steps).map(
            _as_written(mix), num_parallel_calls=AUTOTUNE
        )
    stream = stream.prefetch(AUTOTUNE)
    # Every worker computes the same global stream and keeps its share: DATA sharding.
    return _with_policy(stream, ShardPolicy.DATA)


def images_only(batches: tf.data.Dataset) -> tf.data.Dataset:
    """`train_pipeline`'s batches without their labels (unlabeled pre-training)."""
    return batches.map(
        _as_written(lambda images, labels: images[IMAGES] if isinstance(images, dict) else images)
    )


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
    pixels: str = PIXELS[0],
) -> tf.data.Dataset:
    """Evaluation batches `(float32 (B, H, W, 3), int32 (B,))` in stored order, one pass.

    Each image is preprocessed as `spec` says (`keras_vit.data.preprocessing.Preprocessing`, e.g.
    `Preprocessing.for_model(model)`): shorter side resized to `image_size / crop_pct` and the
    centre crop kept, as timm's eval transform (`crop_pct=None`: plain resize to
    `image_size`), then normalised. It runs `keras_vit.data.tf_preprocessing.ImagePreprocessing`,
    the code the exported SavedModel runs, so the batches equal
    `preprocess_input(load_image(image, spec), spec)` exactly. Without a spec, `image_size`
    gives the package default spec at that size (crop 0.9, bicubic, mean = std = 0.5).
    `image_size`, `mean`, `std`, `crop_pct` and `interpolation`, when given, replace the
    spec's fields. The last batch keeps the remainder. `cache=True` keeps the resized uint8
    images in memory after the first pass (cached after decode + resize, before
    normalisation and batching: the costly steps run once, at a quarter of float32 memory).
    `pixels="uint8"`: the resized uint8 pixels, not normalised (for `DeviceInput` or an
    `image_dtype="uint8"` model, which normalise on the device to the same values).
    """
    pixels = one_of("pixels", pixels, PIXELS)
    if spec is None:
        if image_size is None:
            raise ValueError(
                "eval_pipeline needs a spec (keras_vit.data.preprocessing.Preprocessing) or an image_size."
            )
        spec = Preprocessing(image_size)
    elif image_size is not None:
        spec = spec.replace(image_size=image_size)
    preprocessing = ImagePreprocessing.from_spec(
        as_spec(spec, mean=mean, std=std, crop_pct=crop_pct, interpolation=interpolation)
    )

    def resize(image, label):
        return preprocessing.resize(image[None])[0], label

    dataset = source.dataset.map(_as_written(resize), num_parallel_calls=AUTOTUNE)
    if cache:
        dataset = dataset.cache()
    if pixels == "float32":
        dataset = dataset.map(
            _as_written(lambda image, label: (preprocessing.normalize(image), label)),
            num_parallel_calls=AUTOTUNE,
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

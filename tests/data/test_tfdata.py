"""Input pipelines: sources, exact resume of the training stream, eval crop, tfds offline, sharding."""

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image
from sklearn.datasets import load_sample_image

import keras_vit
from keras_vit.data import pyinput
from keras_vit.data import tfdata as data

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)


def _source(count=50, size=12, seed=0):
    """`count` random RGB images whose label is their index, so the order can be read off labels."""
    images = np.random.default_rng(seed).integers(0, 256, (count, size, size, 3), dtype="uint8")
    return data.from_arrays(images, np.arange(count)), images


def _batches(dataset, count):
    return [(images.numpy(), labels.numpy()) for images, labels in dataset.take(count)]


def _assert_same_batches(first, second):
    assert len(first) == len(second)
    for (images_a, labels_a), (images_b, labels_b) in zip(first, second, strict=True):
        np.testing.assert_array_equal(labels_a, labels_b)
        np.testing.assert_array_equal(images_a, images_b)


def test_load_digits_fixed_stratified_split():
    train, test = data.load_digits()
    assert (train.num_examples, test.num_examples) == (1438, 359)
    assert train.num_classes == test.num_classes == 10
    assert train.class_names == tuple("0123456789")
    images, labels = next(iter(test.dataset.batch(1000)))
    assert images.dtype == tf.uint8 and images.shape == (359, 8, 8, 3)
    np.testing.assert_array_equal(images[..., 0], images[..., 2])  # grayscale repeated to RGB
    assert int(tf.reduce_max(images)) == 255
    counts = np.bincount(labels.numpy(), minlength=10)
    train_counts = np.bincount(next(iter(train.dataset.batch(2000)))[1].numpy(), minlength=10)
    np.testing.assert_allclose(counts / (counts + train_counts), 0.2, atol=0.005)
    again = next(iter(data.load_digits()[1].dataset.batch(1000)))[0]
    np.testing.assert_array_equal(images, again)


@pytest.mark.parametrize("steps_per_epoch, mixup_alpha", [(4, 0.0), (None, 0.0), (4, 0.4)])
def test_train_stream_resumes_exactly_at_any_epoch(steps_per_epoch, mixup_alpha):
    source, _ = _source()
    options = dict(
        image_size=8, batch_size=8, mean=MEAN, std=STD, seed=7, steps_per_epoch=steps_per_epoch,
        mixup_alpha=mixup_alpha,
    )  # fmt: skip
    steps = data.epoch_steps(source, 8, steps_per_epoch)  # 4 or 50 // 8 = 6; 3 epochs cross passes
    uninterrupted = _batches(data.train_pipeline(source, **options), 3 * steps)
    resumed = _batches(data.train_pipeline(source, start_epoch=2, **options), steps)
    _assert_same_batches(uninterrupted[2 * steps :], resumed)
    # The global TF seed plays no part; the pipeline seed does.
    tf.random.set_seed(1234)
    _assert_same_batches(uninterrupted[:2], _batches(data.train_pipeline(source, **options), 2))
    other = _batches(data.train_pipeline(source, **{**options, "seed": 8}), 2)
    assert not np.array_equal(other[0][1], uninterrupted[0][1])


def test_train_stream_passes_are_permutations():
    source, _ = _source()
    stream = data.train_pipeline(source, image_size=8, batch_size=10, seed=0, augment=False)
    labels = np.concatenate([batch[1] for batch in _batches(stream, 10)])  # 2 passes of 50
    first, second = labels[:50], labels[50:]
    assert sorted(first) == sorted(second) == list(range(50))
    assert not np.array_equal(first, second) and not np.array_equal(first, np.arange(50))


def test_train_augmentation_is_crop_flip_resize_normalise():
    source, images = _source(count=16)
    plain = data.train_pipeline(
        source, image_size=12, batch_size=16, mean=MEAN, std=STD, seed=0, augment=False
    )
    plain_images, labels = _batches(plain, 1)[0]
    expected = (images[labels] / 255.0 - np.array(MEAN)) / np.array(STD)
    np.testing.assert_allclose(plain_images, expected, atol=1e-5)  # same-size resize is exact

    whole = dict(image_size=12, batch_size=16, mean=MEAN, std=STD, seed=0, crop_scale=(1.0, 1.0))
    unflipped = _batches(data.train_pipeline(source, flip=False, **whole), 1)[0][0]
    np.testing.assert_allclose(unflipped, plain_images, atol=1e-5)  # a full-area crop is the image
    flipped = _batches(data.train_pipeline(source, **whole), 1)[0][0]
    mirrored = [np.allclose(f, p[:, ::-1], atol=1e-5) for f, p in zip(flipped, plain_images, strict=True)]
    kept = [np.allclose(f, p, atol=1e-5) for f, p in zip(flipped, plain_images, strict=True)]
    assert all(m or k for m, k in zip(mirrored, kept, strict=True)) and 0 < sum(mirrored) < 16

    cropped = _batches(data.train_pipeline(source, image_size=12, batch_size=16, seed=0, flip=False), 1)[0][0]
    assert cropped.shape == (16, 12, 12, 3)
    assert sum(not np.allclose(c, p, atol=1e-3) for c, p in zip(cropped, plain_images, strict=True)) > 8


def test_mixup_blends_each_batch_with_itself_reversed():
    """Mixup: batch i is w_i * x + (1 - w_i) * x[::-1] over the same examples as without mixup, its
    labels the same blend of one-hot rows; w_i ~ Beta(alpha, alpha) differs from batch to batch."""
    source, _ = _source(count=40)
    options = dict(image_size=12, batch_size=8, mean=MEAN, std=STD, seed=3, augment=False)
    plain = _batches(data.train_pipeline(source, **options), 5)
    mixed = _batches(data.train_pipeline(source, mixup_alpha=0.4, **options), 5)
    weights = []
    for (images, labels), (mixed_images, targets) in zip(plain, mixed, strict=True):
        assert targets.shape == (8, 40) and targets.dtype == np.float32
        np.testing.assert_allclose(targets.sum(axis=1), 1.0, atol=1e-6)
        weight = targets[0, labels[0]]
        onehot = np.eye(40, dtype="float32")[labels]
        np.testing.assert_allclose(targets, weight * onehot + (1 - weight) * onehot[::-1], atol=1e-6)
        np.testing.assert_allclose(mixed_images, weight * images + (1 - weight) * images[::-1], atol=1e-5)
        weights.append(weight)
    assert len(set(np.round(weights, 6))) == 5 and all(0.0 <= w <= 1.0 for w in weights)
    with pytest.raises(ValueError, match="mixup_alpha must be > 0"):
        data.train_pipeline(source, mixup_alpha=-1.0, **options)


def test_eval_pipeline_centre_crops_like_load_image():
    image = np.random.default_rng(0).integers(0, 256, (20, 10, 3), dtype="uint8")
    source = data.from_arrays(np.stack([image] * 5), np.arange(5))
    batches = list(data.eval_pipeline(source, image_size=8, batch_size=2, mean=MEAN, std=STD, crop_pct=0.8))
    assert [len(labels) for _, labels in batches] == [2, 2, 1]  # the remainder is kept
    # Shorter side 10 -> 8 / 0.8 = 10 (no resampling), centre 8x8: rows 6..13, columns 1..8.
    expected = (image[6:14, 1:9] / 255.0 - np.array(MEAN)) / np.array(STD)
    np.testing.assert_allclose(batches[0][0][0], expected, atol=1e-5)

    # On a real photo, the TF resize is keras_vit.load_image's (Pillow's), exactly.
    photo = load_sample_image("china.jpg")
    photo_source = data.from_arrays(photo[None], [0])
    for crop_pct, interpolation in [(0.875, "bicubic"), (None, "bilinear")]:
        reference = keras_vit.load_image(photo, 64, crop_pct=crop_pct, interpolation=interpolation)
        pipeline = data.eval_pipeline(
            photo_source, image_size=64, batch_size=1, crop_pct=crop_pct, interpolation=interpolation
        )
        ours = next(iter(pipeline))[0][0].numpy()
        np.testing.assert_array_equal(ours, keras_vit.preprocess_input(reference))
    cached = list(
        data.eval_pipeline(source, image_size=8, batch_size=2, mean=MEAN, std=STD, crop_pct=0.8, cache=True)
    )
    for (a, _), (b, _) in zip(batches, cached, strict=True):
        np.testing.assert_array_equal(a, b)


def test_from_directory_reads_class_folders(tmp_path):
    rng = np.random.default_rng(0)
    cat = rng.integers(0, 256, (6, 5, 3), dtype="uint8")
    dog = rng.integers(0, 256, (4, 7), dtype="uint8")  # grayscale
    (tmp_path / "cat").mkdir()
    (tmp_path / "dog" / "nested").mkdir(parents=True)
    Image.fromarray(cat).save(tmp_path / "cat" / "a.png")
    Image.fromarray(dog).save(tmp_path / "dog" / "nested" / "b.png")
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    source = data.from_directory(tmp_path)
    assert (source.num_examples, source.num_classes, source.class_names) == (2, 2, ("cat", "dog"))
    examples = list(source.dataset)
    np.testing.assert_array_equal(examples[0][0], cat)
    np.testing.assert_array_equal(examples[1][0], np.repeat(dog[..., None], 3, axis=-1))
    assert [int(label) for _, label in examples] == [0, 1]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="No images found"):
        data.from_directory(tmp_path / "empty")


def test_from_arrays_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        data.from_arrays(np.full((2, 4, 4, 3), -1.0), [0, 1])
    with pytest.raises(ValueError, match="multiply by 255"):
        data.from_arrays(np.full((2, 4, 4, 3), 0.5), [0, 1])
    with pytest.raises(ValueError, match="argmax"):
        data.from_arrays(np.zeros((2, 4, 4, 3), "uint8"), np.eye(2))
    with pytest.raises(ValueError, match="num_classes"):
        data.from_arrays(np.zeros((2, 4, 4, 3), "uint8"), [0, 3], num_classes=2)


def test_from_tfds_stops_without_network_when_not_prepared(tmp_path, network_attempts):
    """No download attempt (tfds itself would retry the network for minutes): the error says what to do."""
    with pytest.raises(data.DataNotPreparedError, match="tfds build mnist"):
        data.from_tfds("mnist", "train", data_dir=tmp_path)
    assert network_attempts == []
    with pytest.raises(ValueError, match="no dataset"):
        data.from_tfds("no_such_dataset_xyz", data_dir=tmp_path)


def test_from_tfds_with_mock_data(tmp_path):
    import tensorflow_datasets as tfds

    # A prepared dataset's metadata; tfds' mock supplies the examples.
    builder = tfds.builder("mnist", data_dir=tmp_path)
    tf.io.gfile.makedirs(builder.data_dir)
    builder.info.write_to_directory(builder.data_dir)
    with tfds.testing.mock_data(num_examples=20, data_dir=str(tmp_path)):
        source = data.from_tfds("mnist", "train", data_dir=tmp_path)
        assert (source.num_examples, source.num_classes) == (20, 10)
        assert source.shard_policy == tf.data.experimental.AutoShardPolicy.FILE
        image, label = next(iter(source.dataset))
        assert image.shape == (28, 28, 3) and image.dtype == tf.uint8 and label.dtype == tf.int32
        options = dict(image_size=16, batch_size=4, seed=3, steps_per_epoch=3, shuffle_buffer=8)
        uninterrupted = _batches(data.train_pipeline(source, **options), 9)
        _assert_same_batches(
            uninterrupted[6:], _batches(data.train_pipeline(source, start_epoch=2, **options), 3)
        )
        assert len(list(data.eval_pipeline(source, image_size=16, batch_size=8))) == 3


def test_pipelines_take_the_catalogs_interpolations_only():
    """One interpolation list and default (the catalog's) for both readers and every spec."""
    source, _ = _source(count=8)
    assert data.INTERPOLATIONS is pyinput.INTERPOLATIONS is keras_vit.registry.catalog.INTERPOLATIONS
    for reader, arrays in (
        (data, source),
        (pyinput, pyinput.from_arrays(np.zeros((8, 8, 8)), np.arange(8) % 2)),
    ):
        with pytest.raises(
            ValueError, match=r"Unknown interpolation 'area': use one of \('bicubic', 'bilinear'\)"
        ):
            reader.train_pipeline(arrays, image_size=8, batch_size=4, seed=0, interpolation="area")


@pytest.mark.parametrize("reader", ["tfdata", "pyinput"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_from_arrays_refuses_non_finite_pixels(reader, value):
    images = np.full((4, 8, 8, 3), 100.0, "float32")
    images[2, 3, 3, 1] = value
    module = data if reader == "tfdata" else pyinput
    with pytest.raises(ValueError, match=r"images hold 1 NaN or infinite pixel value\(s\)"):
        module.from_arrays(images, np.arange(4) % 2)


def test_distribute_sets_the_shard_policy():
    source, _ = _source(count=8)
    policy = tf.data.experimental.AutoShardPolicy
    train = data.train_pipeline(source, image_size=8, batch_size=4, seed=0)
    assert train.options().experimental_distribute.auto_shard_policy == policy.DATA
    assert data.distribute(train) is train  # no strategy: the dataset as is
    overridden = data.distribute(train, policy=policy.OFF)
    assert overridden.options().experimental_distribute.auto_shard_policy == policy.OFF
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    distributed = data.distribute(data.eval_pipeline(source, image_size=8, batch_size=4), strategy)
    assert isinstance(distributed, tf.distribute.DistributedDataset)
    assert sum(int(labels.shape[0]) for _, labels in distributed) == 8


@pytest.mark.parametrize(
    "kind", ["4:2:0", "4:2:2", "4:4:4", "progressive 4:2:0", "grayscale", "png (decoded whole)"]
)
def test_decode_crop_equals_decode_then_crop(tmp_path, kind):
    """tf.data decodes only a JPEG's crop window (`decode_crop`: `tf.io.decode_and_crop_jpeg` with a
    16-pixel margin): equal to decoding the whole file and cropping, exactly, for 30 inception crops
    and the image's corners, at odd sizes and odd offsets. (Without the margin libjpeg upsamples
    the chroma at a window's edge as at the image's: up to 9 levels off in an edge column, measured
    on the benchmark's 4:2:0 photos; with it, 1,000 of 1,000 such files equal.)"""
    from keras_vit.data.tf_preprocessing import decode_image

    rng = np.random.default_rng(0)
    picture = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize(
        (333, 251), Image.BICUBIC
    )
    noisy = np.clip(np.asarray(picture, np.int16) + rng.integers(-12, 13, (251, 333, 3)), 0, 255)
    image = Image.fromarray(noisy.astype(np.uint8))
    path = str(tmp_path / ("photo.png" if kind.startswith("png") else "photo.jpg"))
    if kind == "grayscale":
        image.convert("L").save(path, quality=90)
    elif kind.startswith("png"):
        image.save(path)
    else:
        subsampling = {"4:4:4": 0, "4:2:2": 1}.get(kind.split()[-1], 2)
        image.save(path, quality=90, subsampling=subsampling, progressive=kind.startswith("progressive"))
    contents = tf.io.read_file(path)
    full = decode_image(contents)
    boxes = [
        lambda shape, seed=seed: data._crop_box(
            shape, tf.constant([seed, 1], tf.int64), (0.08, 1.0), (3 / 4, 4 / 3)
        )
        for seed in range(30)
    ]
    for begin, size in [
        ((0, 0), (37, 41)),
        ((214, 292), (37, 41)),
        ((0, 0), (251, 333)),
        ((1, 3), (249, 329)),
    ]:
        boxes.append(
            lambda shape, begin=begin, size=size: (tf.constant([*begin, 0]), tf.constant([*size, -1]))
        )
    for box in boxes:
        begin, size = box(tf.shape(full))
        np.testing.assert_array_equal(data.decode_crop(contents, box), tf.slice(full, begin, size))

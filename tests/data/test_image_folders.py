"""Image folders (`keras_vit.data.pyinput.list_image_folder`, both readers' `from_directory`): listing
decodes nothing, class folders that cannot be a class are refused or skipped by name, and a file
that fails to decode when read is handled by `on_bad_image` then (stop naming it, or skip it counted)."""

import os

import numpy as np
import pytest
from PIL import Image

from keras_vit.data import pyinput
from keras_vit.data import tfdata as data


def _folder(root, classes=("a", "b"), per_class=4, size=16):
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for index in range(per_class):
            pixels = rng.integers(0, 256, (size, size, 3)).astype("uint8")
            Image.fromarray(pixels).save(root / name / f"{index}.png")
    return root


def _damaged_when_read(root, monkeypatch):
    """`a/1.png` with its end cut off, past the header check (as a file changed after listing)."""
    bad = root / "a" / "1.png"
    bad.write_bytes(bad.read_bytes()[:-40])
    monkeypatch.setattr(pyinput, "image_problem", lambda path, max_pixels: None)
    return bad


@pytest.mark.parametrize("reader", [pyinput, data], ids=["pyinput", "tfdata"])
def test_listing_decodes_no_file(tmp_path, monkeypatch, reader):
    root = _folder(tmp_path / "train")

    def no_decode(*args, **kwargs):
        raise AssertionError("a file was decoded while listing")

    monkeypatch.setattr(pyinput, "_decode_file", no_decode)
    monkeypatch.setattr(data, "_decode_file", no_decode)
    source = reader.from_directory(root)
    assert source.num_examples == 8 and source.images_per_class() == {"a": 4, "b": 4}


@pytest.mark.parametrize("reader", [pyinput, data], ids=["pyinput", "tfdata"])
@pytest.mark.parametrize("problem", ["link", "empty"])
def test_class_folder_that_cannot_be_a_class_is_refused_or_skipped_by_name(tmp_path, reader, problem):
    root = _folder(tmp_path / "train")
    if problem == "link":
        os.symlink(root / "a", root / "c")
        why = rf"'c' resolves to {root / 'a'}, the folder of class 'a'"
    else:
        (root / "c").mkdir()
        why = r"'c' holds no image file"
    with pytest.raises(
        pyinput.BadImageError, match=rf"Class folders of {root} that cannot be a class: {why}"
    ):
        reader.from_directory(root)
    with pytest.warns(UserWarning, match=rf"Skipped class folders of {root}: {why}"):
        source = reader.from_directory(root, on_bad_image="skip")
    assert source.class_names == ("a", "b") and source.images_per_class() == {"a": 4, "b": 4}


def test_pyinput_file_bad_when_read_stops_naming_it(tmp_path, monkeypatch):
    bad = _damaged_when_read(_folder(tmp_path / "train"), monkeypatch)
    source = pyinput.from_directory(tmp_path / "train")
    batches = pyinput.train_pipeline(source, image_size=8, batch_size=8, seed=0)
    with pytest.raises(
        pyinput.BadImageError, match=rf"Image file {bad} cannot be read \(OSError: .*--on-bad-image skip"
    ):
        batches.batch(0, 0)


def test_pyinput_file_bad_when_read_is_skipped_counted_and_replaced_deterministically(tmp_path, monkeypatch):
    bad = _damaged_when_read(_folder(tmp_path / "train"), monkeypatch)
    source = pyinput.from_directory(tmp_path / "train", on_bad_image="skip")
    with pytest.warns(UserWarning, match=rf"Skipped image file {bad}, which cannot be read"):
        images, labels = pyinput.train_pipeline(source, image_size=8, batch_size=8, seed=0).batch(0, 0)
    assert images.shape == (8, 8, 8, 3) and np.isfinite(images).all()
    summary = source.bad_images.summary()
    assert summary == {"on_bad_image": "skip", "reads_skipped": 1, "files": [str(bad)]}
    # The next readable example of the pass takes its place: the batch is a function of (seed, epoch, index).
    again = pyinput.from_directory(tmp_path / "train", on_bad_image="skip")
    with pytest.warns(UserWarning):
        repeat = pyinput.train_pipeline(again, image_size=8, batch_size=8, seed=0).batch(0, 0)
    np.testing.assert_array_equal(images, repeat[0])
    np.testing.assert_array_equal(labels, repeat[1])


def test_tfdata_file_bad_when_read_is_skipped_and_counted(tmp_path, monkeypatch):
    _damaged_when_read(_folder(tmp_path / "train"), monkeypatch)
    source = data.from_directory(tmp_path / "train", on_bad_image="skip")
    batches = data.train_pipeline(source, image_size=8, batch_size=7, seed=0, steps_per_epoch=1)
    images, labels = next(iter(batches))
    assert images.shape == (7, 8, 8, 3)
    assert source.bad_images.count >= 1  # one pass read: its bad file was dropped and counted
    evaluated = sum(
        int(batch[1].shape[0]) for batch in data.eval_pipeline(source, image_size=8, batch_size=4)
    )
    assert evaluated == 7


def test_jpeg_crop_decoded_at_reduced_scale_equals_the_full_decode_within_tolerance(tmp_path):
    """Decode less: a JPEG box at least twice the output is decoded at 1/2-1/8 scale (Pillow's draft,
    libjpeg's DCT scaling), then resized; against resizing the full decode: mean |difference| <= 2
    levels, max <= 16 (measured 1.26 and 11 on such pictures), and equal where no reduction applies."""
    rng = np.random.default_rng(0)
    path = tmp_path / "photo.jpg"
    picture = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).resize(
        (500, 375), Image.BICUBIC
    )
    noisy = np.clip(np.asarray(picture, np.int16) + rng.integers(-12, 13, (375, 500, 3)), 0, 255)
    Image.fromarray(noisy.astype(np.uint8)).save(path, quality=90)
    full = pyinput._decode_file(str(path))
    for box, size in [
        ((0, 0, 375, 500), (64, 64)),
        ((50, 60, 200, 260), (64, 64)),
        ((20, 30, 300, 400), (224, 224)),
    ]:
        reduced = pyinput._read_box(
            str(path), lambda height, width, box=box: box, size, Image.BICUBIC
        ).astype(int)
        whole = pyinput._resize_pixels(full, box, size, Image.BICUBIC).astype(int)
        difference = np.abs(reduced - whole)
        if min(box[2] / size[0], box[3] / size[1]) < 2:
            assert difference.max() == 0
        else:
            assert 0 < difference.mean() <= 2 and difference.max() <= 16


def _jpeg_variants(root):
    """JPEGs as cameras and tools write them: subsamplings, progressive, grayscale, CMYK, EXIF and
    ICC segments, restart markers; each `(path, (height, width))`."""
    rng = np.random.default_rng(2)
    rgb = Image.fromarray(rng.integers(0, 256, (37, 53, 3)).astype("uint8"))
    exif = Image.Exif()
    exif[0x010F] = "camera" * 2000  # a large APP1 segment before the frame header
    variants = {
        "420": (rgb, {"subsampling": 2}),
        "444": (rgb, {"subsampling": 0}),
        "progressive": (rgb, {"progressive": True}),
        "gray": (rgb.convert("L"), {}),
        "cmyk": (rgb.convert("CMYK"), {}),
        "exif-icc": (rgb, {"exif": exif, "icc_profile": b"\0" * 5000}),
        "restarts": (rgb, {"restart_marker_blocks": 1}),
    }
    paths = []
    for name, (picture, options) in variants.items():
        path = root / f"{name}.jpg"
        picture.save(path, quality=90, **options)
        paths.append((path, (picture.height, picture.width)))
    return paths


def test_jpeg_header_size_agrees_with_pillow(tmp_path):
    for path, size in _jpeg_variants(tmp_path):
        with open(path, "rb") as file:
            assert pyinput._jpeg_size(file) == size, path.name
        assert pyinput.image_problem(str(path), None) is None
    png = tmp_path / "picture.jpg"  # a PNG named .jpg: not a JPEG header, so Pillow judges it
    Image.new("RGB", (5, 4)).save(png, format="PNG")
    with open(png, "rb") as file:
        assert pyinput._jpeg_size(file) is None
    assert pyinput.image_problem(str(png), None) is None


def test_jpeg_header_check_refuses_too_many_pixels_and_a_lost_end(tmp_path):
    path, (height, width) = _jpeg_variants(tmp_path)[0]
    assert pyinput.image_problem(str(path), height * width - 1).startswith(
        f"ImageTooLargeError: it is {width}x{height} = {height * width:,} pixels, more than the limit"
    )
    data = path.read_bytes()
    for cut in (data[:-2], data[: len(data) // 2]):  # without its end-of-image marker: decoded in full
        path.write_bytes(cut)
        assert pyinput.image_problem(str(path), None).startswith("OSError: image file is truncated")
    (tmp_path / "empty.jpg").write_bytes(b"")
    assert pyinput.image_problem(str(tmp_path / "empty.jpg"), None).startswith("UnidentifiedImageError")

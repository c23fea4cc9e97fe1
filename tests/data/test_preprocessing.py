"""One preprocessing spec, three implementations that agree exactly on real image files.

For the same files and the same `Preprocessing` spec: `load_image` + `preprocess_input` (Pillow,
NumPy), `data.eval_pipeline` over `data.from_directory` (tf.data), and the SavedModel written by
`export_serving` (its `serving_bytes` and `serving_default` signatures, loaded from disk) give
identical uint8 pixels after the resize and identical float32 inputs after normalising: the
tolerance is zero. The exported model outputs its own input (a flatten with an identity
activation), so the served graph's preprocessing is read off its `probabilities`.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from keras_vit.data import tfdata as data
from keras_vit.data.preprocessing import Preprocessing, load_image, preprocess_input
from keras_vit.data.tf_preprocessing import ImagePreprocessing, decode_image
from keras_vit.deploy.export import export_serving, image_preprocessing
from keras_vit.registry.catalog import get_entry

HF_TAG = "vit_b16.hf_orig_in21k_ft_in1k"  # crop_pct 1.0 (no crop), bilinear, 224 px
DEFAULT_SIZE = (32, 48)  # not square: the crop arithmetic differs per axis


@pytest.fixture(scope="module")
def image_files(tmp_path_factory) -> dict[str, str]:
    """Real photos written as JPEG and PNG, one class folder each (the folder name is the key)."""
    from skimage import data as skimage_data
    from sklearn import datasets

    china, flower = datasets.load_sample_images().images  # 427 x 640
    astronaut, cat = skimage_data.astronaut(), skimage_data.chelsea()  # 512 x 512, 300 x 451
    images = {
        "astronaut.jpg": astronaut,
        "astronaut.png": astronaut,
        "cat.jpg": cat,
        "cat.png": cat,
        "portrait.jpg": astronaut[13:400, 101:298],  # 387 x 197: odd sides, taller than wide
        "tiny.png": cat[::16, ::14],  # 19 x 33: upsampled
        "camera.jpg": skimage_data.camera(),  # 512 x 512 greyscale JPEG
        "china.jpg": china,
        "flower.png": flower,
    }
    root = tmp_path_factory.mktemp("photos")
    files = {}
    for filename, pixels in images.items():
        key = filename.replace(".", "_")
        (root / key).mkdir()
        files[key] = str(root / key / filename)
        Image.fromarray(np.ascontiguousarray(pixels)).save(files[key], quality=90)
    files["root"] = str(root)
    return files


def _default_spec() -> tuple[Preprocessing, str | None]:
    return Preprocessing(DEFAULT_SIZE), None


def _catalog_spec() -> tuple[Preprocessing, str | None]:
    return Preprocessing.from_entry(get_entry(HF_TAG)), HF_TAG


def _echo_model(spec: Preprocessing, name: str | None) -> keras.Model:
    """A "classifier" whose scores are its input pixels (an identity activation: not softmaxed)."""
    inputs = keras.Input((*spec.image_size, 3))
    outputs = keras.layers.Activation(tf.identity)(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, outputs, name=name or "echo")


SPECS = pytest.mark.parametrize("make_spec", [_default_spec, _catalog_spec], ids=["default", "hf_catalog"])


def _pillow_reference(image_files, spec):
    """Path 1, Pillow + NumPy: `{name: uint8 pixels}`, `{name: float32 inputs}`."""
    names = sorted(key for key in image_files if key != "root")
    pixels = {name: load_image(image_files[name], spec) for name in names}
    inputs = {name: preprocess_input(pixels[name][None], spec)[0] for name in names}
    assert all(p.dtype == np.uint8 and p.shape == (*spec.image_size, 3) for p in pixels.values())
    assert all(x.dtype == np.float32 for x in inputs.values())
    return names, pixels, inputs


@SPECS
def test_pillow_and_eval_pipeline_give_identical_tensors(image_files, make_spec):
    spec, tag = make_spec()
    # The model's spec is the one under test: the package default, or its catalog row by name.
    assert Preprocessing.for_model(_echo_model(spec, tag)) == spec
    if tag is not None:
        assert (spec.crop_pct, spec.interpolation, spec.image_size) == (None, "bilinear", (224, 224))
    else:
        assert (spec.crop_pct, spec.interpolation) == (0.9, "bicubic")
    names, pixels, inputs = _pillow_reference(image_files, spec)

    # Path 2, TensorFlow: the same uint8 pixels from the same files, then the tf.data batches.
    graph = ImagePreprocessing.from_spec(spec)
    for name in names:
        with open(image_files[name], "rb") as file:
            decoded = decode_image(file.read())
        np.testing.assert_array_equal(graph.resize(decoded[None])[0].numpy(), pixels[name], err_msg=name)
    source = data.from_directory(image_files["root"])
    assert source.class_names == tuple(names)
    (batch, labels), *rest = list(data.eval_pipeline(source, spec, batch_size=len(names)))
    assert not rest and batch.dtype == tf.float32
    for image, label in zip(batch.numpy(), labels.numpy(), strict=True):
        np.testing.assert_array_equal(image, inputs[names[label]], err_msg=names[label])


@pytest.mark.slow
@SPECS
def test_saved_model_gives_identical_tensors(image_files, make_spec, tmp_path):
    """Path 3, the exported SavedModel loaded from disk: encoded files and uint8 arrays."""
    spec, tag = make_spec()
    names, _, inputs = _pillow_reference(image_files, spec)
    model = _echo_model(spec, tag)
    assert image_preprocessing(model) == ImagePreprocessing.from_spec(spec)
    path = export_serving(model, tmp_path / "echo", warmup=False)  # the model's own spec
    signatures = tf.saved_model.load(path).signatures
    shape = (len(names), *spec.image_size, 3)
    encoded = []
    for name in names:
        with open(image_files[name], "rb") as file:
            encoded.append(file.read())
    served = signatures["serving_bytes"](image_bytes=tf.constant(encoded))["probabilities"].numpy()
    np.testing.assert_array_equal(served.reshape(shape), np.stack([inputs[name] for name in names]))
    for name in ("cat_png", "portrait_jpg"):
        arrays = np.asarray(Image.open(image_files[name]).convert("RGB"))[None]
        served = signatures["serving_default"](images=tf.constant(arrays))["probabilities"].numpy()
        np.testing.assert_array_equal(served.reshape(shape[1:]), inputs[name], err_msg=name)
    # An explicit spec goes in the graph too; it must fit the model's input.
    with pytest.raises(ValueError, match="resizes to"):
        export_serving(model, tmp_path / "other", spec=spec.replace(image_size=16), warmup=False)


def test_spec_checks_and_normalises_its_fields():
    spec = Preprocessing(224)
    assert spec == Preprocessing((224, 224), (0.5,) * 3, (0.5,) * 3, 0.9, "bicubic", "RGB", "pillow")
    assert Preprocessing(8, mean=0.5, std=[0.25], crop_pct=1.0).mean == (0.5, 0.5, 0.5)
    assert Preprocessing(8, crop_pct=1.0).crop_pct is None  # 1.0 is no crop
    assert spec.replace(crop_pct=None).crop_pct is None and spec.crop_pct == 0.9
    bad = {
        "image_size width must be an integer >= 1": dict(image_size=(224, 0)),
        "image_size must be": dict(image_size="224"),
        r"crop_pct must be in \(0, 1\]": dict(image_size=8, crop_pct=1.5),
        "interpolation must be one of": dict(image_size=8, interpolation="nearest"),
        "std must be positive": dict(image_size=8, std=(0.5, 0.0, 0.5)),
        "mean must be 3 finite numbers": dict(image_size=8, mean=(0.5, 0.5)),
        "channel_order must be one of": dict(image_size=8, channel_order="BGR"),
        "resampler must be one of": dict(image_size=8, resampler="cv2"),
    }
    for message, fields in bad.items():
        with pytest.raises(ValueError, match=message):
            Preprocessing(**fields)
    # The old keyword arguments still work, as overrides of the default spec.
    assert load_image(np.zeros((20, 30, 3), "uint8"), 8, crop_pct=None).shape == (8, 8, 3)
    with pytest.raises(ValueError, match="needs a spec"):
        data.eval_pipeline(data.from_arrays(np.zeros((1, 4, 4)), [0]), batch_size=1)


def test_tensorflow_resampler_is_one_antialiased_pass_everywhere():
    """The main job's evaluation resize (`resampler="tensorflow"`) is shared by all paths too."""
    image = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype="uint8")
    spec = Preprocessing(32, crop_pct=None, interpolation="bilinear", resampler="tensorflow")
    expected = tf.image.resize(image, (32, 32), method="bilinear", antialias=True)
    expected = tf.cast(tf.clip_by_value(tf.round(expected), 0, 255), tf.uint8).numpy()
    np.testing.assert_array_equal(load_image(image, spec), expected)
    (batch, _), *_ = list(data.eval_pipeline(data.from_arrays(image[None], [0]), spec, batch_size=1))
    np.testing.assert_array_equal(batch[0].numpy(), preprocess_input(expected, spec))
    # Pillow's two rounded passes give other pixels: the spec tells them apart.
    assert not np.array_equal(load_image(image, spec.replace(resampler="pillow")), expected)

"""TF Serving export: the SavedModel served by a process without keras, its listing, warm-up and CLI."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from PIL import Image

import keras_vit
from keras_vit import cli
from keras_vit.data.preprocessing import imagenet1k_labels, load_image, normalize, preprocess_input
from keras_vit.deploy.export import (
    BYTES_SIGNATURE,
    DEFAULT_SIGNATURE,
    PREPROCESSED_SIGNATURE,
    WARMUP_FILE,
    ImagePreprocessing,
    _outputs_probabilities,
    decode_image,
    image_preprocessing,
    latest_version,
)
from keras_vit.registry.catalog import class_names
from keras_vit.utils.environment import install_hint

CONFIG = keras_vit.ViTConfig("vit_tiny_test", patch_size=8, hidden_size=32, depth=2, num_heads=2, mlp_dim=64)
IMAGE_SIZE = (32, 48)  # not square: the crop arithmetic differs per axis
LABELS = [f"class_{index}" for index in range(10)]
TOP_K = 3
TIMEOUT = 300
SIGNATURES = (DEFAULT_SIGNATURE, BYTES_SIGNATURE, PREPROCESSED_SIGNATURE)

# The serving client: TensorFlow and the TF Serving protos only; `import keras` / `keras_vit` fail.
# It runs the requests in work/requests.json, then bad requests, then the warm-up records, then
# `saved_model_cli show --all` (its console script's entry point, in this process).
CLIENT = r"""
import contextlib, importlib.abc, importlib.machinery, io, json, sys


class _Blocked(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("keras", "keras_vit"):
            return importlib.machinery.ModuleSpec(name, self)  # no origin: TF skips its keras hook
        return None

    def create_module(self, spec):
        raise ImportError(f"{spec.name} is blocked in the serving client")

    def exec_module(self, module):
        raise ImportError(module.__name__)


sys.meta_path.insert(0, _Blocked())
import numpy as np
import tensorflow as tf
from tensorflow.python.tools import saved_model_cli
from tensorflow_serving.apis import prediction_log_pb2

saved_model, work = sys.argv[1], sys.argv[2]
with open(f"{work}/requests.json") as file:
    requests = json.load(file)
signatures = tf.saved_model.load(saved_model).signatures
results, report = {}, {"signatures": sorted(signatures), "errors": {}, "warmup": []}


def run(key, signature, name, source):
    if isinstance(source, list):
        value = tf.constant([open(path, "rb").read() for path in source])
    else:
        value = tf.constant(np.load(source))
    for output, tensor in signatures[signature](**{name: value}).items():
        array = tensor.numpy()
        results[f"{key}/{output}"] = np.char.decode(array.astype("S")) if array.dtype == object else array


for key, request in requests.items():
    run(key, *request)

bad = {
    "float_images": ("serving_default", "images", tf.zeros((1, 8, 8, 3), tf.float32)),
    "rank_3_images": ("serving_default", "images", tf.zeros((8, 8, 3), tf.uint8)),
    "grey_images": ("serving_default", "images", tf.zeros((1, 8, 8, 1), tf.uint8)),
    "empty_image": ("serving_default", "images", tf.zeros((1, 0, 8, 3), tf.uint8)),
    "not_an_image": ("serving_bytes", "image_bytes", tf.constant([b"this is not an image"])),
    "rank_2_bytes": ("serving_bytes", "image_bytes", tf.constant([[b"x"]])),
    "wrong_size_pixels": ("serving_preprocessed", "pixels", tf.zeros((1, 31, 48, 3))),
    "nan_pixels": ("serving_preprocessed", "pixels", tf.fill((1, 32, 48, 3), float("nan"))),
}
for key, (signature, name, value) in bad.items():
    try:
        signatures[signature](**{name: value})
        report["errors"][key] = None
    except Exception as error:
        report["errors"][key] = [type(error).__name__, getattr(error, "message", str(error))]
run("after_errors", *requests["batch"])

warmup = f"{saved_model}/assets.extra/tf_serving_warmup_requests"
for record in tf.data.TFRecordDataset(warmup).as_numpy_iterator():
    request = prediction_log_pb2.PredictionLog.FromString(record).predict_log.request
    inputs = {name: tf.constant(tf.make_ndarray(proto)) for name, proto in request.inputs.items()}
    outputs = signatures[request.model_spec.signature_name](**inputs)
    spec, shape = request.model_spec, list(outputs["probabilities"].shape)
    report["warmup"].append([spec.name, spec.signature_name, sorted(inputs), shape])

sys.argv = ["saved_model_cli", "show", "--dir", saved_model, "--all"]
listing = io.StringIO()
with contextlib.redirect_stdout(listing), contextlib.suppress(SystemExit):
    saved_model_cli.main()
report["saved_model_cli"] = listing.getvalue()

report["keras_modules"] = sorted(name for name in sys.modules if name.split(".")[0] in ("keras", "keras_vit"))
np.savez(f"{work}/results.npz", **results)
with open(f"{work}/report.json", "w") as file:
    json.dump(report, file)
"""


def _tiny_classifier(**kwargs) -> keras.Model:
    """A tiny ViT with a random head (the zero-initialised head would score every class equally).

    Logits by default (the export adds the softmax); `classifier_activation="softmax"` for probabilities.
    """
    arguments = {"image_size": IMAGE_SIZE, "num_classes": 10, "classifier_activation": None, **kwargs}
    model = keras_vit.build_vit(CONFIG, **arguments)
    head = model.get_layer("head")
    head.kernel.assign(np.random.default_rng(0).normal(0.0, 1.0, head.kernel.shape).astype("float32"))
    return model


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def photos() -> dict[str, np.ndarray]:
    from skimage import data
    from sklearn.datasets import load_sample_images

    china, flower = load_sample_images().images  # both 427 x 640
    return {
        "china": china,
        "flower": flower,
        "cat": data.chelsea(),  # 300 x 451
        "astronaut": data.astronaut(),  # 512 x 512
        "rocket": data.rocket(),  # 427 x 640
        "crop": np.ascontiguousarray(data.coffee()[100:120, 200:224]),  # 20 x 24: upsampled
    }


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """`keras-vit export` of a saved tiny model and a labels file: model, export dir, version dir, stdout."""
    work = tmp_path_factory.mktemp("export")
    model = _tiny_classifier()
    model.save(work / "tiny.keras")
    (work / "labels.txt").write_text("\n".join(LABELS) + "\n")
    export_dir = work / "tiny"
    argv = [
        "export",
        str(export_dir),
        "--model",
        str(work / "tiny.keras"),
        "--labels",
        str(work / "labels.txt"),
    ]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert cli.main([*argv, "--top-k", str(TOP_K)]) == 0
    return model, export_dir, export_dir / "1", printed.getvalue().splitlines()


@pytest.fixture(scope="module")
def served(exported, photos, tmp_path_factory):
    """Real photos through each signature in a separate process that cannot import keras."""
    _, _, path, _ = exported
    work = tmp_path_factory.mktemp("client")
    np.save(work / "batch.npy", np.stack([photos["china"], photos["flower"]]))
    np.save(work / "crop.npy", photos["crop"][None])
    files = []
    for name, suffix in (("cat", "jpg"), ("astronaut", "png"), ("rocket", "jpg")):
        files.append(str(work / f"{name}.{suffix}"))
        Image.fromarray(photos[name]).save(files[-1], quality=90)
    # The float signature gets the Pillow pipeline's pixels (load_image + preprocess_input).
    pixels = preprocess_input(np.stack([load_image(photos[name], IMAGE_SIZE) for name in ("cat", "rocket")]))
    np.save(work / "pixels.npy", pixels)
    requests = {
        "batch": [DEFAULT_SIGNATURE, "images", str(work / "batch.npy")],
        "crop": [DEFAULT_SIGNATURE, "images", str(work / "crop.npy")],
        "files": [BYTES_SIGNATURE, "image_bytes", files],
        "pixels": [PREPROCESSED_SIGNATURE, "pixels", str(work / "pixels.npy")],
    }
    (work / "requests.json").write_text(json.dumps(requests))
    (work / "client.py").write_text(CLIENT)
    done = subprocess.run(
        [sys.executable, "-I", str(work / "client.py"), str(path), str(work)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((work / "report.json").read_text())
    return report, dict(np.load(work / "results.npz")), files, pixels


def test_layout_and_latest_version(exported, tmp_path):
    model, export_dir, path, printed = exported
    assert printed == [f"wrote {path} ({model.name}, input (32, 48, 3), top {TOP_K})"]
    assert os.listdir(export_dir) == ["1"]  # the staging directory was renamed, nothing left over
    assert (path / "saved_model.pb").is_file() and (path / WARMUP_FILE).is_file()
    assert latest_version(export_dir) == str(path) and latest_version(path) == str(path)
    with pytest.raises(FileNotFoundError, match="numbered SavedModel versions"):
        latest_version(tmp_path)


@pytest.mark.slow
def test_signatures_match_model_predict(exported, served, photos):
    """Each signature's outputs = model.predict on the same preprocessing run eagerly here."""
    model, _, _, _ = exported
    report, results, files, pixels = served
    assert report["keras_modules"] == []
    assert report["signatures"] == sorted(SIGNATURES)
    preprocessing = image_preprocessing(model)
    decoded = [decode_image(Path(file).read_bytes()) for file in files]
    expected_pixels = {
        "batch": preprocessing(np.stack([photos["china"], photos["flower"]])).numpy(),
        "crop": preprocessing(photos["crop"][None]).numpy(),
        "files": np.concatenate([preprocessing(image[None]).numpy() for image in decoded]),
        "pixels": pixels,
    }
    for key, inputs in expected_pixels.items():
        probabilities = _softmax(model.predict(inputs, verbose=0))
        np.testing.assert_allclose(results[f"{key}/probabilities"], probabilities, rtol=0, atol=1e-5)
        best = np.argsort(-probabilities, axis=-1)[:, :TOP_K]
        np.testing.assert_array_equal(results[f"{key}/top_k_indices"], best)
        np.testing.assert_allclose(
            results[f"{key}/top_k_scores"], np.take_along_axis(probabilities, best, -1), rtol=0, atol=1e-5
        )
        np.testing.assert_array_equal(results[f"{key}/top_k_classes"], np.asarray(LABELS)[best])


@pytest.mark.slow
def test_bad_requests_fail_clearly(served):
    report, results, _, _ = served
    expected = {
        "float_images": "expected to be a uint8 tensor but is a float tensor",
        "rank_3_images": "Shape of tensor images [8,8,3] is not compatible with expected shape [?,?,?,3]",
        "grey_images": "Shape of tensor images [1,8,8,1] is not compatible with expected shape [?,?,?,3]",
        "empty_image": "images must have a positive height and width",
        "not_an_image": "Unknown image file format",
        "rank_2_bytes": "Shape of tensor image_bytes [1,1] is not compatible with expected shape [?]",
        "wrong_size_pixels": "tensor pixels [1,31,48,3] is not compatible with expected shape [?,32,48,3]",
        "nan_pixels": "serving_preprocessed got NaN or infinite values",
    }
    for key, fragment in expected.items():
        assert report["errors"][key] is not None, f"{key} was served"
        kind, message = report["errors"][key]
        assert kind == "InvalidArgumentError" and fragment in message, (key, kind, message)
    # The process kept serving: the same request after the errors gives the same answer.
    np.testing.assert_array_equal(results["after_errors/probabilities"], results["batch/probabilities"])


@pytest.mark.slow
def test_warmup_records_replay(served):
    report, _, _, _ = served
    assert report["warmup"] == [
        ["tiny", DEFAULT_SIGNATURE, ["images"], [1, 10]],
        ["tiny", BYTES_SIGNATURE, ["image_bytes"], [1, 10]],
        ["tiny", PREPROCESSED_SIGNATURE, ["pixels"], [1, 10]],
    ]


def _signature_listing(text: str) -> dict[str, dict[str, tuple[str, str]]]:
    """`saved_model_cli show --all` text -> {signature: {"inputs/name" or "outputs/name": (dtype, shape)}}."""
    listing, signature, tensor, dtype = {}, None, None, None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("signature_def['"):
            signature = line.split("'")[1]
            listing[signature] = {}
        elif line.startswith(("inputs['", "outputs['")) and signature is not None:
            tensor = line.split("[")[0] + "/" + line.split("'")[1]
        elif line.startswith("dtype:") and tensor is not None:
            dtype = line.split()[1]
        elif line.startswith("shape:") and tensor is not None:
            listing[signature][tensor] = (dtype, line.split(":", 1)[1].strip())
            tensor = None
    return listing


@pytest.mark.slow
def test_saved_model_cli_lists_the_signatures(served):
    report, _, _, _ = served
    listing = _signature_listing(report["saved_model_cli"])
    outputs = {
        "outputs/probabilities": ("DT_FLOAT", "(-1, 10)"),
        "outputs/top_k_indices": ("DT_INT32", f"(-1, {TOP_K})"),
        "outputs/top_k_scores": ("DT_FLOAT", f"(-1, {TOP_K})"),
        "outputs/top_k_classes": ("DT_STRING", f"(-1, {TOP_K})"),
    }
    assert listing[DEFAULT_SIGNATURE] == {"inputs/images": ("DT_UINT8", "(-1, -1, -1, 3)"), **outputs}
    assert listing[BYTES_SIGNATURE] == {"inputs/image_bytes": ("DT_STRING", "(-1)"), **outputs}
    assert listing[PREPROCESSED_SIGNATURE] == {"inputs/pixels": ("DT_FLOAT", "(-1, 32, 48, 3)"), **outputs}


def test_cli_predict_through_the_saved_model(exported, photos, tmp_path, capsys):
    model, export_dir, _, _ = exported
    photo = tmp_path / "cat.jpg"
    Image.fromarray(photos["cat"]).save(photo)
    assert cli.main(["predict", str(photo), "--saved-model", str(export_dir), "--top", "2"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    pixels = image_preprocessing(model)(decode_image(photo.read_bytes())[None])
    probabilities = _softmax(model.predict(pixels, verbose=0))[0]
    best = np.argsort(-probabilities)[:2]
    assert [(int(index), name) for _, index, name in lines] == [(index, LABELS[index]) for index in best]
    assert [float(score.rstrip("%")) for score, _, _ in lines] == pytest.approx(
        100 * probabilities[best], abs=0.006
    )

    assert cli.main(["predict", str(photo), "--saved-model", str(export_dir), "--top", str(TOP_K + 1)]) == 1
    assert f"export it again with --top-k {TOP_K + 1}" in capsys.readouterr().err
    assert cli.main(["predict", __file__, "--saved-model", str(export_dir)]) == 1
    assert "Unknown image file format" in capsys.readouterr().err


def test_cli_export_refuses_to_replace_a_version(exported, capsys):
    _, export_dir, _, _ = exported
    keras_file = str(export_dir.parent / "tiny.keras")
    assert cli.main(["export", str(export_dir), "--model", keras_file]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main(["export", str(export_dir), "--model", keras_file, "--weights", "true"]) == 1
    assert "a .keras file already holds its weights" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("image_size", "crop_pct", "interpolation"),
    [
        ((224, 224), 0.9, "bicubic"),
        (IMAGE_SIZE, 0.9, "bicubic"),
        ((384, 384), None, "bicubic"),
        ((224, 224), None, "bilinear"),
    ],
)
def test_resize_reproduces_load_image(photos, image_size, crop_pct, interpolation):
    """The in-graph resize + crop is Pillow's exactly (its fixed-point coefficients and pass order)."""
    preprocessing = ImagePreprocessing(image_size, (0.5,) * 3, (0.5,) * 3, crop_pct, interpolation)
    other_kernel = {"bicubic": "bilinear", "bilinear": "bicubic"}[interpolation]
    other = ImagePreprocessing(image_size, (0.5,) * 3, (0.5,) * 3, crop_pct, other_kernel)
    for name, photo in photos.items():
        reference = load_image(photo, image_size, crop_pct, interpolation).astype(int)
        difference = np.abs(preprocessing.resize(photo[None])[0].numpy().astype(int) - reference)
        assert difference.max() == 0, (name, difference.max(), difference.mean())
        # The other kernel is off by more: the comparison tells the kernels apart.
        assert np.abs(other.resize(photo[None])[0].numpy().astype(int) - reference).max() > 1, name


@pytest.mark.parametrize(
    ("suffix", "options"), [("jpg", {"quality": 75}), ("jpg", {"quality": 95}), ("png", {})]
)
def test_decode_image_matches_pillow(photos, tmp_path, suffix, options):
    for name in ("cat", "astronaut"):
        path = tmp_path / f"{name}.{suffix}"
        Image.fromarray(photos[name]).save(path, **options)
        expected = np.asarray(Image.open(path).convert("RGB"))
        np.testing.assert_array_equal(decode_image(path.read_bytes()).numpy(), expected)


def test_normalize_matches_numpy(photos):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    preprocessing = ImagePreprocessing((20, 24), mean, std, None, "bicubic")
    pixels = photos["crop"][None]
    np.testing.assert_allclose(preprocessing(pixels).numpy(), normalize(pixels, mean, std), rtol=0, atol=1e-6)


def test_settings_come_from_the_catalog():
    for tag in ("vit_ti16.augreg_in21k_ft_in1k", "vit_b16.hf_orig_in21k_ft_in1k"):
        entry = keras_vit.registry.catalog.get_entry(tag)
        model = keras_vit.build_vit(CONFIG, image_size=32, name=tag)
        crop_pct = None if entry.crop_pct is None or entry.crop_pct >= 1.0 else entry.crop_pct
        assert image_preprocessing(model) == ImagePreprocessing(
            (32, 32), entry.mean, entry.std, crop_pct, entry.interpolation
        )
        assert class_names(model, 1000) == list(imagenet1k_labels())
        assert class_names(model, 10) is None  # a new head: the ImageNet names do not apply
    plain = keras_vit.build_vit(CONFIG, image_size=32)
    assert image_preprocessing(plain, mean=(0.1, 0.2, 0.3)) == ImagePreprocessing(
        (32, 32), (0.1, 0.2, 0.3), (0.5, 0.5, 0.5), 0.9, "bicubic"
    )
    assert class_names(plain, 1000) is None
    assert _outputs_probabilities(plain)  # the factories' default head: softmax
    assert not _outputs_probabilities(keras_vit.build_vit(CONFIG, image_size=32, classifier_activation=None))


def test_bad_arguments_fail_before_writing(tmp_path, monkeypatch):
    model = _tiny_classifier()
    target = tmp_path / "export"
    with pytest.raises(ValueError, match="include_top=True"):
        keras_vit.export_serving(keras_vit.build_vit(CONFIG, image_size=32, include_top=False), target)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, 10\]"):
        keras_vit.export_serving(model, target, top_k=11)
    with pytest.raises(ValueError, match="labels has 3 names but the model's head has 10 classes"):
        keras_vit.export_serving(model, target, labels=["a", "b", "c"])
    with pytest.raises(ValueError, match="non-negative int"):
        keras_vit.export_serving(model, target, version=-1)
    with pytest.raises(ValueError, match="interpolation must be one of"):
        keras_vit.export_serving(model, target, interpolation="nearest")
    with pytest.raises(ValueError, match=r"crop_pct must be in \(0, 1\]"):
        keras_vit.export_serving(model, target, crop_pct=1.5)
    monkeypatch.setitem(sys.modules, "tensorflow_serving.apis", None)  # the `export` extra missing
    with pytest.raises(ModuleNotFoundError, match=re.escape(install_hint("export"))):
        keras_vit.export_serving(model, target)
    assert not target.exists()

"""TF Serving export: a versioned SavedModel that takes raw images and returns named classes.

`export_serving(model, "exports/vit")` writes `exports/vit/1/`, the layout TF Serving loads
(`tensorflow_model_server --model_base_path=/abs/path/exports/vit`), with three signatures
that share their outputs:

| signature | input | dtype and shape |
|---|---|---|
| `serving_default` | `images` | uint8 `(batch, height, width, channels)`, any height and width |
| `serving_bytes` | `image_bytes` | string `(batch,)`: encoded JPEG / PNG / GIF / BMP / WebP files |
| `serving_preprocessed` | `pixels` | float32 `(batch, H, W, channels)`: the model's own input, finite |

Outputs: `probabilities` float32 `(batch, classes)`; `top_k_indices` int32 `(batch, k)`;
`top_k_scores` float32 `(batch, k)`; and, when class names are known, `top_k_classes` string
`(batch, k)`. A head without an activation gives logits, turned into probabilities by a
softmax; a head with an activation (softmax, sigmoid) is taken as giving scores already.
`assets.extra/tf_serving_warmup_requests` holds one warm-up `PredictionLog` per signature,
so TF Serving traces each one when it loads the model, not on the first client request.

Preprocessing in the graph is the model's `keras_vit.data.preprocessing.Preprocessing` spec (its
catalog row's settings, or the package default: crop 0.9, bicubic, mean = std = 0.5), the one
`keras_vit.load_image` + `keras_vit.preprocess_input` and `keras_vit.data.tfdata.eval_pipeline` use,
run by `keras_vit.data.tf_preprocessing.ImagePreprocessing`: the shorter side resized to
`size / crop_pct`, the centre crop kept (`crop_pct` None: resized straight to the input size),
then `(x / 255 - mean) / std`. The resize is Pillow's, reproduced bit for bit (its fixed-point
coefficients and pass order), so `serving_default` on a uint8 image gives exactly the float32
input `preprocess_input(load_image(image, spec))` gives. Encoded files are decoded as Pillow
decodes them (`decode_image`), so `serving_bytes` on a file sees the pixels `load_image` sees.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from keras_vit.data.tf_preprocessing import ImagePreprocessing, decode_image
from keras_vit.registry.catalog import Preprocessing, class_names, preprocessing_for
from keras_vit.utils import tf2onnx_ops
from keras_vit.utils.defaults import MAX_PIXELS
from keras_vit.utils.environment import install_hint, require_tensorflow_backend
from keras_vit.utils.files import replace_file
from keras_vit.utils.validation import positive_int

__all__ = [
    "BYTES_SIGNATURE",
    "DEFAULT_SIGNATURE",
    "PREPROCESSED_SIGNATURE",
    "WARMUP_FILE",
    "ImagePreprocessing",
    "decode_image",
    "export_litert",
    "export_onnx",
    "export_serving",
    "image_preprocessing",
    "latest_version",
]

DEFAULT_SIGNATURE = "serving_default"
BYTES_SIGNATURE = "serving_bytes"
PREPROCESSED_SIGNATURE = "serving_preprocessed"
WARMUP_FILE = os.path.join("assets.extra", "tf_serving_warmup_requests")


def image_preprocessing(
    model: keras.Model,
    spec: Preprocessing | None = None,
    *,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    crop_pct: float | None = None,
    interpolation: str | None = None,
) -> ImagePreprocessing:
    """The preprocessing `export_serving` puts in the graph for `model`: its spec, in TensorFlow.

    `spec` defaults to `preprocessing_for(model)` (`keras_vit.registry.catalog`): the model's catalog
    row's, or else the package default at the model's input
    size (mean = std = 0.5, crop_pct 0.9, bicubic, as `keras-vit predict`). Each of `mean`,
    `std`, `crop_pct`, `interpolation` that is not `None` replaces the spec's; `crop_pct` 1.0
    resizes straight to the input size. The spec's `image_size` must be the model's.
    """
    shape = model.input_shape
    if not isinstance(shape, tuple) or len(shape) != 4 or None in shape[1:]:
        raise ValueError(
            f"export needs a model with one image input (batch, height, width, channels) of fixed "
            f"size, got input shape {shape}: build it with a fixed image_size."
        )
    if spec is None:
        spec = preprocessing_for(model)
    elif not isinstance(spec, Preprocessing):
        raise TypeError(
            f"spec must be a keras_vit.data.preprocessing.Preprocessing, got {type(spec).__name__}."
        )
    if spec.image_size != (int(shape[1]), int(shape[2])):
        raise ValueError(
            f"The preprocessing spec resizes to {spec.image_size} but the model takes {tuple(shape[1:3])}."
        )
    overrides = {"mean": mean, "std": std, "crop_pct": crop_pct, "interpolation": interpolation}
    spec = spec.replace(**{name: value for name, value in overrides.items() if value is not None})
    return ImagePreprocessing.from_spec(spec)


def _outputs_probabilities(model: keras.Model) -> bool:
    """Whether the model's last layer applies an activation (its outputs are then scores already)."""
    activation = getattr(model.layers[-1], "activation", None)
    return activation is not None and activation is not keras.activations.linear


def _check_version_dir(export_dir: str, version: int, overwrite: bool) -> str:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise ValueError(
            f"version must be a non-negative int (TF Serving's version directory), got {version!r}."
        )
    target = os.path.join(export_dir, str(int(version)))
    if os.path.exists(target) and not overwrite:
        raise FileExistsError(
            f"{target} already exists: TF Serving may be serving it. Export a new version, or pass "
            "overwrite=True (--overwrite) to replace it."
        )
    if os.path.exists(target) and not (os.path.isdir(target) and tf.saved_model.contains_saved_model(target)):
        raise FileExistsError(
            f"{target} exists and is not a SavedModel (overwrite replaces only an earlier export): move it "
            "away, or export another version."
        )
    return target


def _serving_module():
    """The `tensorflow_serving.apis` protos (the `export` extra)."""
    try:
        from tensorflow_serving.apis import model_pb2, predict_pb2, prediction_log_pb2
    except ImportError as error:
        raise ModuleNotFoundError(
            f"Writing TF Serving warm-up requests needs tensorflow-serving-api: {install_hint('export')}, "
            "or pass warmup=False (--no-warmup)."
        ) from error
    return model_pb2, predict_pb2, prediction_log_pb2


def _warmup_image(height: int, width: int, channels: int) -> np.ndarray:
    """A smooth deterministic uint8 test card (1, height, width, channels)."""
    rows = np.linspace(0, 255, height)[:, None, None]
    cols = np.linspace(0, 255, width)[None, :, None]
    phase = np.arange(channels)[None, None, :] * 85
    return ((rows + cols + phase) % 256).astype("uint8")[None]


def _write_warmup(path: str, model_name: str, requests: dict[str, tuple[str, np.ndarray]]) -> None:
    """One `PredictionLog` per signature (batch of 1) in TF Serving's warm-up file."""
    model_pb2, predict_pb2, prediction_log_pb2 = _serving_module()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tf.io.TFRecordWriter(path) as writer:
        for signature, (input_name, value) in requests.items():
            request = predict_pb2.PredictRequest(
                model_spec=model_pb2.ModelSpec(name=model_name, signature_name=signature)
            )
            request.inputs[input_name].CopyFrom(tf.make_tensor_proto(value))
            log = prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request))
            writer.write(log.SerializeToString())


def _header_hw(data: tf.Tensor) -> tf.Tensor:
    """`(height, width)` int64 from an encoded image's header (JPEG, PNG, GIF, BMP); `(0, 0)` if unknown.

    Read before decoding, so a small file that declares a huge image is refused unread.
    """

    def number(offset: int, size: int, big_endian: bool) -> tf.Tensor:
        digits = tf.cast(tf.io.decode_raw(tf.strings.substr(data, offset, size), tf.uint8), tf.int64)
        weights = 256 ** tf.range(size, dtype=tf.int64)
        return tf.reduce_sum(digits * (tf.reverse(weights, [0]) if big_endian else weights))

    def signed(value: tf.Tensor) -> tf.Tensor:  # an unsigned 32-bit field read as int32
        return tf.where(value >= 2**31, value - 2**32, value)

    def prefix(signature: bytes) -> tf.Tensor:
        return tf.strings.substr(data, 0, len(signature)) == signature

    long_enough = tf.strings.length(data) >= 26
    unknown = tf.zeros([2], tf.int64)
    return tf.case(
        [
            (tf.io.is_jpeg(data), lambda: tf.cast(tf.image.extract_jpeg_shape(data)[:2], tf.int64)),
            (
                long_enough & prefix(b"\x89PNG\r\n\x1a\n"),
                lambda: tf.stack([number(20, 4, True), number(16, 4, True)]),
            ),
            (long_enough & prefix(b"GIF8"), lambda: tf.stack([number(8, 2, False), number(6, 2, False)])),
            (
                long_enough & prefix(b"BM"),  # int32 fields; a negative height is a top-down bitmap
                lambda: tf.abs(signed(tf.stack([number(22, 4, False), number(18, 4, False)]))),
            ),
        ],
        default=lambda: unknown,
        exclusive=False,
    )


def _assert_pixels(hw: tf.Tensor, max_pixels: int) -> tf.Operation:
    """`tf.debugging.Assert` that `height * width <= max_pixels`, with a message saying what to do."""
    hw = tf.cast(hw, tf.int64)
    return tf.debugging.Assert(
        hw[0] * hw[1] <= max_pixels,
        [
            f"image_bytes: the image has more than {max_pixels} pixels (height, width follow), the "
            "limit of this export (export_serving's max_pixels): shrink it before sending it.",
            hw[0],
            hw[1],
        ],
    )


def latest_version(path: str | os.PathLike) -> str:
    """The SavedModel TF Serving would serve from `path`: `path` itself if it is one, else its
    highest-numbered version directory."""
    path = os.fspath(path)
    if tf.saved_model.contains_saved_model(path):
        return path
    versions = [
        int(name)
        for name in (os.listdir(path) if os.path.isdir(path) else ())
        if name.isdigit() and tf.saved_model.contains_saved_model(os.path.join(path, name))
    ]
    if not versions:
        raise FileNotFoundError(
            f"{path} is neither a SavedModel nor a directory of numbered SavedModel versions: "
            "pass the directory given to export_serving (keras-vit export) or one of its versions."
        )
    return os.path.join(path, str(max(versions)))


def export_serving(
    model: keras.Model,
    export_dir: str | os.PathLike,
    version: int = 1,
    *,
    top_k: int = 5,
    labels: Sequence[str] | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    crop_pct: float | None = None,
    interpolation: str | None = None,
    spec: Preprocessing | None = None,
    warmup: bool = True,
    model_name: str | None = None,
    overwrite: bool = False,
    max_pixels: int = MAX_PIXELS,
) -> str:
    """Write `model` as the TF Serving SavedModel `export_dir/<version>/` and return that path.

    Args:
        model: a classifier taking one fixed-size image batch and returning `(batch, classes)`.
        export_dir: TF Serving's model base path; versions are its numbered subdirectories.
        version: the version number (directory name).
        top_k: how many best classes the `top_k_*` outputs hold.
        labels: class names in head order, for any model (`keras_vit.data.preprocessing.read_labels`
            reads them from a file); default: the checkpoint's (ImageNet-1k names for a
            1000-class model from a catalog tag), else no `top_k_classes` output.
        mean, std, crop_pct, interpolation: preprocessing overrides (`image_preprocessing`).
        spec: the `keras_vit.data.preprocessing.Preprocessing` to run in the graph, default the
            model's (`Preprocessing.for_model(model)`); the overrides apply on top of it.
        warmup: write `assets.extra/tf_serving_warmup_requests` (needs tensorflow-serving-api).
        model_name: the model name in the warm-up requests, default the export directory's name.
        overwrite: replace an earlier export of this version (a SavedModel there); anything
            else in its place is refused, and `export_dir`'s other contents are never touched.
        max_pixels: the most pixels (height x width) an image sent to `serving_bytes` may have
            (default `defaults.MAX_PIXELS`, Pillow's limit): checked from the file's header
            before decoding (JPEG, PNG, GIF, BMP) and on the decoded image before resizing; a
            larger one fails the request with a message saying so.

    The signatures and outputs are described in `keras_vit.deploy.export`. The version directory
    is written next to its final place and renamed into it, so a TF Serving instance
    watching `export_dir` never loads a half-written version.
    """
    require_tensorflow_backend("SavedModel export (keras_vit.export_serving)")
    export_dir = os.fspath(export_dir)
    max_pixels = positive_int("max_pixels", max_pixels)
    target = _check_version_dir(export_dir, version, overwrite)
    num_classes = _checked_classes(model, top_k)
    preprocessing = image_preprocessing(
        model, spec, mean=mean, std=std, crop_pct=crop_pct, interpolation=interpolation
    )
    names = class_names(model, num_classes, labels)
    if warmup:
        _serving_module()  # fail before writing anything
    archive = _serving_archive(model, preprocessing, top_k, names, max_pixels)
    os.makedirs(export_dir, exist_ok=True)
    # Written under a non-numeric name (TF Serving skips those), then renamed in one step.
    staging = tempfile.mkdtemp(prefix=f".tmp-{int(version)}-", dir=export_dir)
    try:
        archive.write_out(staging, verbose=False)
        if warmup:
            name = model_name or os.path.basename(os.path.abspath(export_dir))
            _write_warmup(os.path.join(staging, WARMUP_FILE), name, _warmup_requests(model, preprocessing))
        if os.path.exists(target):  # the earlier export, renamed aside until the new one is in place
            replaced = tempfile.mkdtemp(prefix=f".old-{int(version)}-", dir=export_dir)
            os.replace(target, os.path.join(replaced, "version"))
            os.replace(staging, target)
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _checked_classes(model: keras.Model, top_k: int) -> int:
    """The classes of a `(batch, classes)` classifier; an error for a headless model or a bad `top_k`."""
    output_shape = model.output_shape
    layer_names = {layer.name for layer in model.layers}
    headless_vit = "encoder_norm" in layer_names and "head" not in layer_names  # include_top=False
    if (
        headless_vit
        or not isinstance(output_shape, tuple)
        or len(output_shape) != 2
        or None in output_shape[1:]
    ):
        raise ValueError(
            "export_serving needs a classifier with (batch, classes) outputs (a ViT with its head: "
            f"include_top=True); this model has no head and outputs {output_shape}."
        )
    num_classes = int(output_shape[1])
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= num_classes:
        raise ValueError(
            f"top_k must be an int in [1, {num_classes}] (the number of classes), got {top_k!r}."
        )
    return num_classes


def _serving_archive(
    model: keras.Model,
    preprocessing: ImagePreprocessing,
    top_k: int,
    names: Sequence[str] | None,
    max_pixels: int,
) -> keras.export.ExportArchive:
    """The model with its three serving signatures (`serving_default`, `serving_bytes`,
    `serving_preprocessed`), each checking its input first."""
    height, width = preprocessing.image_size
    channels = int(model.input_shape[-1])
    already_probabilities = _outputs_probabilities(model)
    names_tensor = None if names is None else tf.constant(names)

    # Traced once and called by each signature, instead of tracing the model in each of them.
    @tf.function(input_signature=[tf.TensorSpec((None, height, width, channels), tf.float32)])
    def infer(pixels):
        return tf.cast(model(pixels, training=False), tf.float32)

    def predict(pixels: tf.Tensor) -> dict[str, tf.Tensor]:
        scores = infer(pixels)
        probabilities = scores if already_probabilities else tf.nn.softmax(scores, axis=-1)
        best_scores, best_indices = tf.math.top_k(probabilities, k=int(top_k))
        outputs = {"probabilities": probabilities, "top_k_indices": best_indices, "top_k_scores": best_scores}
        if names_tensor is not None:
            outputs["top_k_classes"] = tf.gather(names_tensor, best_indices)
        return outputs

    def decode(data: tf.Tensor) -> tf.Tensor:
        # The pixel limit is checked from the header before decoding, and on the decoded shape
        # (formats without a parsed header, headers that lie) before the costly resize.
        with tf.control_dependencies([_assert_pixels(_header_hw(data), max_pixels)]):
            image = decode_image(data, channels)
        with tf.control_dependencies([_assert_pixels(tf.shape(image)[:2], max_pixels)]):
            return preprocessing.resize(image[None])[0]

    # Signatures do not check the shape of what they are fed (nor does TF Serving): each checks
    # its input first, so a wrong rank or size fails with a message naming the expected shape.
    @tf.function(input_signature=[tf.TensorSpec((None, None, None, channels), tf.uint8, name="images")])
    def serve_images(images):
        return predict(preprocessing(tf.ensure_shape(images, (None, None, None, channels), name="images")))

    @tf.function(input_signature=[tf.TensorSpec((None,), tf.string, name="image_bytes")])
    def serve_bytes(image_bytes):
        images = tf.map_fn(
            decode,
            tf.ensure_shape(image_bytes, (None,), name="image_bytes"),
            fn_output_signature=tf.TensorSpec((height, width, channels), tf.uint8),
        )
        return predict(preprocessing.normalize(images))

    @tf.function(input_signature=[tf.TensorSpec((None, height, width, channels), tf.float32, name="pixels")])
    def serve_pixels(pixels):
        pixels = tf.ensure_shape(pixels, (None, height, width, channels), name="pixels")
        return predict(
            tf.debugging.assert_all_finite(
                pixels,
                "pixels: serving_preprocessed got NaN or infinite values, which give meaningless scores: "
                "send finite normalised pixels (or uint8 images to serving_default).",
            )
        )

    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint(DEFAULT_SIGNATURE, serve_images)
    archive.add_endpoint(BYTES_SIGNATURE, serve_bytes)
    archive.add_endpoint(PREPROCESSED_SIGNATURE, serve_pixels)
    return archive


def _warmup_requests(
    model: keras.Model, preprocessing: ImagePreprocessing
) -> dict[str, tuple[str, np.ndarray]]:
    """One TF Serving warm-up request per signature: a test card through each input."""
    height, width = preprocessing.image_size
    card = _warmup_image(height, width, int(model.input_shape[-1]))
    return {
        DEFAULT_SIGNATURE: ("images", card),
        BYTES_SIGNATURE: ("image_bytes", np.array([tf.io.encode_png(card[0]).numpy()], dtype=object)),
        PREPROCESSED_SIGNATURE: ("pixels", preprocessing.normalize(card).numpy()),
    }


# ---- portable formats: ONNX and LiteRT --------------------------------------------------------

PORTABLE_FORMATS = ("onnx", "litert")


def _portable_model(model: keras.Model, preprocessing: bool) -> tuple[keras.Model, tf.TensorSpec]:
    """`model`, or with `preprocessing` a wrapper that takes uint8 images at the model's input size
    and normalises them in the graph (`(x / 255 - mean) / std`, the model's `Preprocessing`); and
    the input spec of the exported graph, named `images`."""
    shape = model.input_shape
    if not isinstance(shape, tuple) or len(shape) != 4 or None in shape[1:]:
        raise ValueError(
            f"ONNX / LiteRT export needs one image input (batch, height, width, channels) of fixed size, got "
            f"input shape {shape}: build the model with a fixed image_size."
        )
    height, width, channels = (int(side) for side in shape[1:])
    if not preprocessing:
        return model, tf.TensorSpec((None, height, width, channels), tf.float32, name="images")
    spec = preprocessing_for(model)
    std = np.asarray(spec.std[:channels], dtype=np.float32)
    scale = 1.0 / (255.0 * std)
    offset = -np.asarray(spec.mean[:channels], dtype=np.float32) / std
    images = keras.Input((height, width, channels), dtype="uint8", name="images")
    pixels = keras.ops.cast(images, "float32") * scale + offset
    wrapped = keras.Model(images, model(pixels), name=f"{model.name}_uint8")
    return wrapped, tf.TensorSpec((None, height, width, channels), tf.uint8, name="images")


def _portable_target(path: str | os.PathLike, suffix: str, overwrite: bool) -> str:
    path = os.fspath(path)
    if not path.endswith(suffix):
        raise ValueError(f"The output file should end in {suffix}, got {path!r}.")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a folder: give the path of the {suffix} file to write.")
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} already exists: pass overwrite=True (--overwrite) to replace it.")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def export_onnx(
    model: keras.Model, path: str | os.PathLike, *, preprocessing: bool = False, overwrite: bool = False
) -> str:
    """Write `model` as an ONNX file (Keras's `model.export(format="onnx")`, tf2onnx); returns the path.

    The graph takes `images`: float32 `(batch, H, W, C)` as the model does, or with
    `preprocessing` uint8 pixels at the model's input size, normalised in the graph (resize and
    crop stay outside: `keras_vit.load_image`). Its output is the model's (logits or
    probabilities). Run it with `onnxruntime.InferenceSession(path)`.
    """
    require_tensorflow_backend("ONNX export (keras_vit.export_onnx)")
    target = _portable_target(path, ".onnx", overwrite)
    portable, spec = _portable_model(model, preprocessing)
    if not tf2onnx_ops.register():
        raise ModuleNotFoundError(f"ONNX export needs tf2onnx and onnx: {install_hint('export')}.")
    return replace_file(
        target, lambda staging: portable.export(staging, format="onnx", input_signature=[spec], verbose=False)
    )


def export_litert(
    model: keras.Model,
    path: str | os.PathLike,
    *,
    preprocessing: bool = False,
    int8: bool = False,
    overwrite: bool = False,
) -> str:
    """Write `model` as a LiteRT (TFLite) file (Keras's `model.export(format="litert")`); returns the path.

    Inputs and outputs as `export_onnx`. `int8` quantizes the weights to int8 (TFLite's
    dynamic-range quantization, `tf.lite.Optimize.DEFAULT`: ~4x smaller, activations stay
    float). Run it with `ai_edge_litert.interpreter.Interpreter(model_path=path)`.
    """
    require_tensorflow_backend("LiteRT export (keras_vit.export_litert)")
    target = _portable_target(path, ".tflite", overwrite)
    portable, spec = _portable_model(model, preprocessing)
    options = {"optimizations": [tf.lite.Optimize.DEFAULT]} if int8 else {}
    return replace_file(
        target,
        lambda staging: portable.export(
            staging, format="litert", input_signature=[spec], verbose=False, **options
        ),
    )

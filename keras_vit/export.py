"""TF Serving export: a versioned SavedModel that takes raw images and returns named classes.

`export_serving(model, "exports/vit")` writes `exports/vit/1/`, the layout TF Serving loads
(`tensorflow_model_server --model_base_path=/abs/path/exports/vit`), with three signatures
that share their outputs:

| signature | input | dtype and shape |
|---|---|---|
| `serving_default` | `images` | uint8 `(batch, height, width, channels)`, any height and width |
| `serving_bytes` | `image_bytes` | string `(batch,)`: encoded JPEG / PNG / GIF / BMP / WebP files |
| `serving_preprocessed` | `pixels` | float32 `(batch, H, W, channels)`: the model's own input |

Outputs: `probabilities` float32 `(batch, classes)`; `top_k_indices` int32 `(batch, k)`;
`top_k_scores` float32 `(batch, k)`; and, when class names are known, `top_k_classes` string
`(batch, k)`. A head without an activation gives logits, turned into probabilities by a
softmax; a head with an activation (softmax, sigmoid) is taken as giving scores already.
`assets.extra/tf_serving_warmup_requests` holds one warm-up `PredictionLog` per signature,
so TF Serving traces each one when it loads the model, not on the first client request.

Preprocessing in the graph (`ImagePreprocessing`) is `keras_vit.load_image` +
`keras_vit.preprocess_input` with the checkpoint's settings (`keras_vit.pretrained.model_entry`;
a model without a catalog row gets crop_pct 0.9, bicubic and mean = std = 0.5, as
`keras-vit predict`): the shorter side resized to `size / crop_pct`, the centre crop kept
(`crop_pct` None: resized straight to the input size), then `(x / 255 - mean) / std`.
The resize reproduces Pillow's: TensorFlow's antialiased resize (`antialias=True`, Keys
cubic or triangle kernel, the kernels Pillow uses) done as Pillow does it, width first, then
height, each pass rounded to uint8. On the scikit-image / scikit-learn sample photos the
result differs from `load_image` by at most 1 grey level (mean at most 0.012 levels), the
residue of Pillow's fixed-point arithmetic; one antialiased pass differs by up to 8 levels,
a plain `tf.image.resize` (no antialiasing) by up to 178 when shrinking. Encoded files are
decoded as Pillow decodes them (`decode_image`), so `serving_bytes` on a file sees the
pixels `load_image` sees, to that 1 level.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from keras_vit.preprocessing import GOOGLE_MEAN, GOOGLE_STD, LABEL_SETS, imagenet1k_labels
from keras_vit.pretrained import model_entry

__all__ = [
    "BYTES_SIGNATURE",
    "DEFAULT_SIGNATURE",
    "PREPROCESSED_SIGNATURE",
    "WARMUP_FILE",
    "ImagePreprocessing",
    "decode_image",
    "export_serving",
    "image_preprocessing",
    "latest_version",
]

DEFAULT_SIGNATURE = "serving_default"
BYTES_SIGNATURE = "serving_bytes"
PREPROCESSED_SIGNATURE = "serving_preprocessed"
WARMUP_FILE = os.path.join("assets.extra", "tf_serving_warmup_requests")
INTERPOLATIONS = ("bicubic", "bilinear")
_DEFAULT_CROP_PCT = 0.9
_DEFAULT_INTERPOLATION = "bicubic"


@dataclass(frozen=True)
class ImagePreprocessing:
    """The in-graph twin of `load_image` + `preprocess_input` for one model input size.

    Calling it maps a uint8 batch `(batch, height, width, channels)` of any size to the
    model's float32 input `(batch, H, W, channels)`; it runs eagerly too, which is how the
    served graph is checked against `model.predict`.
    """

    image_size: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_pct: float | None
    interpolation: str

    def resize(self, images: tf.Tensor) -> tf.Tensor:
        """Resize (shorter side to `size / crop_pct`) and centre-crop a uint8 batch, as Pillow would."""
        height, width = self.image_size
        shape = tf.shape(images)
        in_height, in_width = shape[1], shape[2]
        tf.debugging.assert_positive(
            tf.minimum(in_height, in_width), message="images must have a positive height and width"
        )
        if self.crop_pct is None:
            new_height, new_width = tf.constant(height), tf.constant(width)
        else:
            # load_image's arithmetic in float64, in its order; tf.round is round-half-to-even like round().
            scale = tf.constant(max(height, width) / self.crop_pct, tf.float64) / tf.cast(
                tf.minimum(in_height, in_width), tf.float64
            )
            new_width = tf.maximum(width, tf.cast(tf.round(tf.cast(in_width, tf.float64) * scale), tf.int32))
            new_height = tf.maximum(
                height, tf.cast(tf.round(tf.cast(in_height, tf.float64) * scale), tf.int32)
            )
        pixels = tf.cast(images, tf.float32)
        # Pillow resamples width first, then height, rounding to uint8 in between.
        for size in ((in_height, new_width), (new_height, new_width)):
            pixels = tf.image.resize(pixels, size, method=self.interpolation, antialias=True)
            pixels = tf.clip_by_value(tf.round(pixels), 0.0, 255.0)
        top, left = (new_height - height) // 2, (new_width - width) // 2
        cropped = pixels[:, top : top + height, left : left + width, :]
        cropped = tf.ensure_shape(cropped, (None, height, width, images.shape[-1]))
        return tf.cast(cropped, tf.uint8)

    def normalize(self, images: tf.Tensor) -> tf.Tensor:
        """`(x / 255 - mean) / std` in float32, the same operations as `keras_vit.preprocessing.normalize`."""
        channels = images.shape[-1]
        mean = tf.constant(np.resize(np.asarray(self.mean, "float32"), channels))
        std = tf.constant(np.resize(np.asarray(self.std, "float32"), channels))
        return (tf.cast(images, tf.float32) / 255.0 - mean) / std

    def __call__(self, images: tf.Tensor) -> tf.Tensor:
        return self.normalize(self.resize(images))


def decode_image(data: tf.Tensor, channels: int = 3) -> tf.Tensor:
    """Decode one encoded image to uint8 `(height, width, channels)` as Pillow does.

    JPEG goes through libjpeg-turbo's accurate integer IDCT, Pillow's choice: the pixels are
    then identical to `PIL.Image.open(...).convert("RGB")` (TensorFlow's default fast IDCT is
    off by about 1 grey level on average, up to 18). PNG, GIF (first frame), BMP and WebP use
    `tf.io.decode_image`. A string that is no image raises `InvalidArgumentError`.
    """
    return tf.cond(
        tf.io.is_jpeg(data),
        lambda: tf.io.decode_jpeg(data, channels=channels, dct_method="INTEGER_ACCURATE"),
        lambda: tf.io.decode_image(data, channels=channels, expand_animations=False),
    )


def image_preprocessing(
    model: keras.Model,
    *,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    crop_pct: float | None = None,
    interpolation: str | None = None,
) -> ImagePreprocessing:
    """The preprocessing `export_serving` puts in the graph for `model`.

    Each argument left `None` comes from the model's catalog row (`model_entry`), or else
    the defaults of `keras-vit predict`: mean = std = 0.5, crop_pct 0.9, bicubic. `crop_pct`
    1.0 (or a catalog row without one, e.g. the Hugging Face rows) resizes straight to the
    input size.
    """
    shape = model.input_shape
    if not isinstance(shape, tuple) or len(shape) != 4 or None in shape[1:]:
        raise ValueError(
            f"export needs a model with one image input (batch, height, width, channels) of fixed "
            f"size, got input shape {shape}: build it with a fixed image_size."
        )
    entry = model_entry(model)
    if mean is None:
        mean = entry.mean if entry is not None else GOOGLE_MEAN
    if std is None:
        std = entry.std if entry is not None else GOOGLE_STD
    if crop_pct is None:
        crop_pct = entry.crop_pct if entry is not None else _DEFAULT_CROP_PCT
    if interpolation is None:
        interpolation = (entry.interpolation if entry is not None else None) or _DEFAULT_INTERPOLATION
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}.")
    if crop_pct is not None and not 0.0 < crop_pct <= 1.0:
        raise ValueError(f"crop_pct must be in (0, 1] (1.0: no crop), got {crop_pct!r}.")
    mean, std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
    if min(std) <= 0.0:
        raise ValueError(f"std must be positive, got {std}.")
    return ImagePreprocessing(
        image_size=(int(shape[1]), int(shape[2])),
        mean=mean,
        std=std,
        crop_pct=None if crop_pct is None or crop_pct >= 1.0 else float(crop_pct),
        interpolation=interpolation,
    )


def _class_names(model: keras.Model, labels: Sequence[str] | None, num_classes: int) -> list[str] | None:
    """`labels` checked against the head, else the checkpoint's shipped names, else None."""
    if labels is not None:
        labels = [str(label) for label in labels]
        if len(labels) != num_classes:
            raise ValueError(
                f"labels has {len(labels)} names but the model's head has {num_classes} classes."
            )
        return labels
    entry = model_entry(model)
    if entry is not None and entry.label_set == "imagenet1k" and num_classes == LABEL_SETS["imagenet1k"]:
        return list(imagenet1k_labels())
    return None


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
    return target


def _serving_module():
    """The `tensorflow_serving.apis` protos (the `export` extra)."""
    try:
        from tensorflow_serving.apis import model_pb2, predict_pb2, prediction_log_pb2
    except ImportError as error:
        raise ModuleNotFoundError(
            "Writing TF Serving warm-up requests needs tensorflow-serving-api: "
            "pip install 'keras-vit-zoo[export]', or pass warmup=False (--no-warmup)."
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
    warmup: bool = True,
    model_name: str | None = None,
    overwrite: bool = False,
) -> str:
    """Write `model` as the TF Serving SavedModel `export_dir/<version>/` and return that path.

    Args:
        model: a classifier taking one fixed-size image batch and returning `(batch, classes)`.
        export_dir: TF Serving's model base path; versions are its numbered subdirectories.
        version: the version number (directory name).
        top_k: how many best classes the `top_k_*` outputs hold.
        labels: class names in head order; default: the checkpoint's (ImageNet-1k names for a
            1000-class model from a catalog tag), else no `top_k_classes` output.
        mean, std, crop_pct, interpolation: preprocessing overrides (`image_preprocessing`).
        warmup: write `assets.extra/tf_serving_warmup_requests` (needs tensorflow-serving-api).
        model_name: the model name in the warm-up requests, default the export directory's name.
        overwrite: replace an existing version directory.

    The signatures and outputs are described in `keras_vit.export`. The version directory
    is written next to its final place and renamed into it, so a TF Serving instance
    watching `export_dir` never loads a half-written version.
    """
    export_dir = os.fspath(export_dir)
    target = _check_version_dir(export_dir, version, overwrite)
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
    preprocessing = image_preprocessing(
        model, mean=mean, std=std, crop_pct=crop_pct, interpolation=interpolation
    )
    names = _class_names(model, labels, num_classes)
    if warmup:
        _serving_module()  # fail before writing anything
    height, width = preprocessing.image_size
    channels = int(model.input_shape[-1])
    already_probabilities = _outputs_probabilities(model)
    class_names = None if names is None else tf.constant(names)

    # Traced once and called by each signature, instead of tracing the model in each of them.
    @tf.function(input_signature=[tf.TensorSpec((None, height, width, channels), tf.float32)])
    def infer(pixels):
        return tf.cast(model(pixels, training=False), tf.float32)

    def predict(pixels: tf.Tensor) -> dict[str, tf.Tensor]:
        scores = infer(pixels)
        probabilities = scores if already_probabilities else tf.nn.softmax(scores, axis=-1)
        best_scores, best_indices = tf.math.top_k(probabilities, k=int(top_k))
        outputs = {"probabilities": probabilities, "top_k_indices": best_indices, "top_k_scores": best_scores}
        if class_names is not None:
            outputs["top_k_classes"] = tf.gather(class_names, best_indices)
        return outputs

    def decode(data: tf.Tensor) -> tf.Tensor:
        return preprocessing.resize(decode_image(data, channels)[None])[0]

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
        return predict(tf.ensure_shape(pixels, (None, height, width, channels), name="pixels"))

    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint(DEFAULT_SIGNATURE, serve_images)
    archive.add_endpoint(BYTES_SIGNATURE, serve_bytes)
    archive.add_endpoint(PREPROCESSED_SIGNATURE, serve_pixels)

    os.makedirs(export_dir, exist_ok=True)
    # Written under a non-numeric name (TF Serving skips those), then renamed in one step.
    staging = tempfile.mkdtemp(prefix=f".tmp-{int(version)}-", dir=export_dir)
    try:
        archive.write_out(staging, verbose=False)
        if warmup:
            card = _warmup_image(height, width, channels)
            _write_warmup(
                os.path.join(staging, WARMUP_FILE),
                model_name or os.path.basename(os.path.abspath(export_dir)),
                {
                    DEFAULT_SIGNATURE: ("images", card),
                    BYTES_SIGNATURE: (
                        "image_bytes",
                        np.array([tf.io.encode_png(card[0]).numpy()], dtype=object),
                    ),
                    PREPROCESSED_SIGNATURE: ("pixels", preprocessing.normalize(card).numpy()),
                },
            )
        if os.path.exists(target):
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target

"""The preprocessing spec of a checkpoint, its NumPy/Pillow implementation, and label decoding.

A checkpoint is evaluated on images resized, centre-cropped and normalised one way; a
`Preprocessing` (a frozen dataclass: input size, crop fraction, interpolation, mean/std,
channel order) says which, and the three places that preprocess images all read it:

* `load_image` + `preprocess_input` (here: Pillow and NumPy, for images outside a graph);
* `keras_vit.data.tfdata.eval_pipeline` (tf.data evaluation batches);
* `keras_vit.deploy.export.export_serving` (the resize + crop + normalisation in the SavedModel).

The last two share one TensorFlow implementation (`keras_vit.data.tf_preprocessing.ImagePreprocessing`),
which reproduces Pillow's resize exactly (its fixed-point coefficients and pass order), so
the three give identical pixels: the same uint8 after resizing, the same float32 after
normalising. The spec itself, and which one a model uses (`preprocessing_for(model)`, also
`Preprocessing.for_model`: its catalog row's, else the package default), live in
`keras_vit.registry.catalog` and are re-exported here.

`decode_predictions` turns a head's output into `(class_index, class_name, score)` with the
checkpoint's label set (`keras_vit.registry.catalog`: the ImageNet-1k names are shipped, in the
standard index order; e.g. index 134 is "crane bird", 517 "crane"). ImageNet-21k names are
not shipped: for 21843-class heads `decode_predictions` returns indices with the name `None`.

This module imports neither TensorFlow nor Keras (Pillow only inside `load_image`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import numpy as np

from keras_vit.registry.catalog import (
    DEFAULT_CROP_PCT,
    DEFAULT_INTERPOLATION,
    GOOGLE_MEAN,
    GOOGLE_STD,
    INTERPOLATIONS,
    LABEL_SETS,
    RESAMPLERS,
    Preprocessing,
    imagenet1k_labels,
    model_entry,
    normalize,
    preprocessing_for,
)
from keras_vit.utils.defaults import MAX_PIXELS
from keras_vit.utils.validation import (
    ImageTooLargeError,
    as_uint8_pixels,
    check_pixel_count,
    optional,
    positive_int,
)

__all__ = [
    "DEFAULT_CROP_PCT",
    "DEFAULT_INTERPOLATION",
    "GOOGLE_MEAN",
    "GOOGLE_STD",
    "INTERPOLATIONS",
    "MAX_PIXELS",
    "RESAMPLERS",
    "ImageTooLargeError",
    "Preprocessing",
    "as_spec",
    "decode_predictions",
    "imagenet1k_labels",
    "load_image",
    "normalize",
    "preprocess_input",
    "preprocessing_for",
    "resized_size",
    "read_labels",
    "write_labels",
]


class _Unset:
    """The default of override arguments: "not given" (`None` is a value: `crop_pct=None` is no crop)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()


def as_spec(spec_or_size, **overrides) -> Preprocessing:
    """A `Preprocessing` from a spec, an image size (the package default at that size), a model or a tag.

    `overrides` (`mean`, `std`, `crop_pct`, `interpolation`, ...) that are not `UNSET` replace
    the spec's fields.
    """
    if isinstance(spec_or_size, Preprocessing):
        spec = spec_or_size
    elif isinstance(spec_or_size, (int, np.integer, tuple, list)):
        spec = Preprocessing(spec_or_size)
    else:
        spec = preprocessing_for(spec_or_size)
    changes = {name: value for name, value in overrides.items() if value is not UNSET}
    return spec.replace(**changes) if changes else spec


def _check_pixel_range(images: np.ndarray) -> None:
    """Refuse inputs that are not in [0, 255] or look already scaled, the usual silent bug."""
    if images.dtype == bool or not np.issubdtype(images.dtype, np.number) or np.iscomplexobj(images):
        raise TypeError(f"preprocess_input expects numeric pixel values, got dtype {images.dtype}.")
    if images.size == 0:
        return
    if np.issubdtype(images.dtype, np.floating) and not np.isfinite(images).all():
        raise ValueError("preprocess_input got NaN or infinite pixel values: they are no image.")
    low, high = float(images.min()), float(images.max())
    if low < 0:
        raise ValueError(
            f"preprocess_input expects pixel values in [0, 255], got [{low:g}, {high:g}]: negative "
            "values mean the images are already normalised (feed them to the model as they are)."
        )
    if high > 255:
        raise ValueError(
            f"preprocess_input expects pixel values in [0, 255], got [{low:g}, {high:g}]: 16-bit "
            "images need reducing to 8 bits first (load_image does it: uint16 values >> 8)."
        )
    if np.issubdtype(images.dtype, np.floating) and 0 < high <= 1:
        raise ValueError(
            f"These float images lie in [{low:g}, {high:g}], which looks like [0, 1] scaling; "
            "preprocess_input expects [0, 255]: multiply by 255 first (or, for images that really "
            "are that dark in [0, 255], cast them to uint8)."
        )


def _open(path, name: str):
    """`Image.open(path)` (which reads only the header), with Pillow's bomb check as our error."""
    from PIL import Image

    with warnings.catch_warnings():  # over Pillow's own limit: our check below says it better
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            return Image.open(path)
        except Image.DecompressionBombError as error:
            raise ImageTooLargeError(
                f"Image {name}: {error} Raise PIL.Image.MAX_IMAGE_PIXELS as well as max_pixels if you "
                "trust the file."
            ) from None


def _refuse_damaged_jpeg(file, name: str) -> None:
    """`OSError` naming the file for a JPEG that libjpeg decodes only by "recovering" from damaged
    data (`keras_vit.data.tf_preprocessing.jpeg_damage`), which Pillow decodes as a partly grey image
    without a word. The check decodes with TensorFlow, so it is skipped on the PyTorch backend,
    whose processes must not import TensorFlow (it crashes this torch build)."""
    import keras

    if keras.backend.backend() == "torch":
        return
    from keras_vit.data.tf_preprocessing import jpeg_damage

    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as opened:
            data = opened.read()
    elif file.seekable():
        start = file.tell()
        file.seek(0)
        data = file.read()
        file.seek(start)
    else:
        return
    damage = jpeg_damage(data)
    if damage:
        raise OSError(
            f"Image {name} could not be decoded: damaged JPEG data (libjpeg: {damage}); it would be read "
            "with grey or smeared blocks. Replace the file."
        )


def _as_picture(image, max_pixels: int | None = MAX_PIXELS):
    """A path, open file, PIL image or array as an RGB PIL image, its size checked before decoding.

    Arrays follow `keras_vit.utils.validation.as_uint8_pixels` (uint16 is 16-bit; floats in
    [0, 255]); 16-bit grayscale files (Pillow mode `I;16`) keep their high byte, as TensorFlow
    decodes them; other 32-bit modes (`I`, `F`) are refused rather than clipped.
    """
    from PIL import Image

    name = "image"
    if isinstance(image, Image.Image):
        picture = image
    elif isinstance(image, (str, os.PathLike)) or hasattr(image, "read"):  # a path or an open file
        name = repr(os.fspath(image)) if isinstance(image, (str, os.PathLike)) else "file"
        picture = _open(image, name)
        if picture.format == "JPEG":
            _refuse_damaged_jpeg(image, name)
    else:
        pixels = as_uint8_pixels("image", image)
        picture = Image.fromarray(pixels[..., 0] if pixels.ndim == 3 and pixels.shape[-1] == 1 else pixels)
    check_pixel_count(f"Image {name}", picture.height, picture.width, max_pixels)
    try:
        if picture.mode.startswith("I;16") or (picture.mode == "I" and picture.format == "PNG"):
            picture = Image.fromarray((np.asarray(picture).astype("int64") >> 8).clip(0, 255).astype("uint8"))
        elif picture.mode in ("I", "F"):
            raise ValueError(
                f"Image {name} has 32-bit {'float' if picture.mode == 'F' else 'integer'} pixels (Pillow "
                f"mode {picture.mode}), which have no single mapping to 8 bits: convert it to an 8-bit image."
            )
        return picture.convert("RGB")
    except OSError as error:  # a truncated or corrupt file, found while decoding
        raise OSError(f"Image {name} could not be decoded: {error}.") from None


def resized_size(height: int, width: int, spec: Preprocessing) -> tuple[int, int]:
    """The `(height, width)` an image is resized to before its centre crop (`spec.image_size` if no crop)."""
    out_height, out_width = spec.image_size
    if spec.crop_pct is None:
        return out_height, out_width
    scale = max(out_height, out_width) / spec.crop_pct / min(height, width)
    return max(out_height, round(height * scale)), max(out_width, round(width * scale))


def _pillow_resize(picture, width: int, height: int, resample):
    """`picture.resize((width, height), resample)` as Pillow 13 does it, whatever Pillow is installed.

    Pillow resizes in two passes, each rounded to uint8: width first, unless the height
    shrinks by more than twice as many pixels as the width (then height first; Pillow 13's
    rule, older Pillow always goes width first). The passes are made explicit here, so the
    result does not depend on the Pillow version and `keras_vit.data.tf_preprocessing` can follow
    the same order.
    """
    if picture.height - height > 0 and picture.height - height > 2 * (picture.width - width):
        return picture.resize((picture.width, height), resample).resize((width, height), resample)
    return picture.resize((width, picture.height), resample).resize((width, height), resample)


def load_image(
    image,
    image_size=224,
    crop_pct: float | None = UNSET,
    interpolation: str = UNSET,
    *,
    max_pixels: int | None = MAX_PIXELS,
) -> np.ndarray:
    """Read an image (path, PIL image or `(H, W[, C])` array), resized and cropped as a spec says.

    `image_size`: a `Preprocessing` spec, a model or a full catalog tag (its spec,
    `preprocessing_for`), or an int / `(height, width)`: the package default spec at that
    size (centre crop 0.9, bicubic). `crop_pct` and `interpolation`, when given, replace the
    spec's: the shorter side is resized to `max(image_size) / crop_pct` and the centre crop
    kept (`crop_pct=None` or 1.0: resize straight to `image_size`). Pillow does the resize
    (two rounded passes, `_pillow_resize`). Returns RGB uint8 `(h, w, 3)`, ready for
    `preprocess_input`; `keras_vit.data.tfdata.eval_pipeline` and the exported SavedModel give the
    same pixels for the same spec.

    Pixels: arrays are read by `keras_vit.utils.validation.as_uint8_pixels` (uint8 as is; uint16 as
    16-bit, high byte kept; other integers and floats must lie in [0, 255], floats all within
    [0, 1] are refused as scaled); 16-bit files keep their high byte, as TensorFlow decodes
    them. `max_pixels` (default `defaults.MAX_PIXELS`, Pillow's limit; `None`: none) bounds
    the image's height x width, checked from the file's header before decoding:
    `ImageTooLargeError` (a `ValueError`) above it.
    """
    from PIL import Image

    spec = as_spec(image_size, crop_pct=crop_pct, interpolation=interpolation)
    max_pixels = optional(positive_int, "max_pixels", max_pixels)
    picture = _as_picture(image, max_pixels)
    if spec.resampler == "tensorflow":
        from keras_vit.data.tf_preprocessing import ImagePreprocessing

        return ImagePreprocessing.from_spec(spec).resize(np.asarray(picture)[None])[0].numpy()
    height, width = spec.image_size
    new_height, new_width = resized_size(picture.height, picture.width, spec)
    resample = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR}[spec.interpolation]
    resized = _pillow_resize(picture, new_width, new_height, resample)
    left, top = (new_width - width) // 2, (new_height - height) // 2
    return np.asarray(resized.crop((left, top, left + width, top + height)))


def preprocess_input(images, tag_or_model=None) -> np.ndarray:
    """Scale images with pixel values in [0, 255] to the input a checkpoint expects.

    `images`: `(..., H, W, C)`, uint8 or float in [0, 255] (any resizing already done), as a
    NumPy array or eager tensor (it is NumPy code, for input pipelines outside the graph).
    `tag_or_model`: a `Preprocessing` spec, a full catalog tag or a model built with
    `pretrained=...` (found by its `pretrained_tag` or its name, which survives `.keras`
    saving); `None` or any other model gets the package default normalisation
    (mean = std = 0.5, output in [-1, 1]) that every catalog checkpoint uses. Negative values,
    values above 255, or floats within [0, 1] raise `ValueError`: they mean the images are
    already scaled, and so do NaN or infinite values. A 2-D array is one grayscale image
    `(H, W)`: its channel is repeated to the model's channels (3 unless `tag_or_model` is a
    model built with others). The last axis must be the channels: 1, 3 or the model's count.
    Returns a float32 NumPy array (`normalize`; its memory is the output's, no temporaries).
    """
    images = np.asarray(images)
    channels = getattr(tag_or_model, "channels", 3)
    if images.ndim < 2:
        raise ValueError(
            f"preprocess_input expects images (..., H, W, C) or one grayscale image (H, W), got shape "
            f"{images.shape}."
        )
    if images.ndim == 2:
        images = np.repeat(images[..., None], channels, axis=-1)
    elif images.shape[-1] not in {1, 3, channels}:
        raise ValueError(
            f"preprocess_input expects channels last (1 or {channels}), got shape {images.shape} whose "
            f"last axis is {images.shape[-1]}: for grayscale images (N, H, W) add a channel axis, "
            "images[..., None]; channels-first images need np.moveaxis(images, -3, -1)."
        )
    _check_pixel_range(images)
    if not isinstance(tag_or_model, Preprocessing):
        tag_or_model = preprocessing_for(tag_or_model, image_size=images.shape[-3:-1])
    return normalize(images, tag_or_model.mean, tag_or_model.std)


def read_labels(path) -> list[str]:
    """Class names from a text file, one per line in head order (blank lines at the end ignored)."""
    with open(path, encoding="utf-8") as file:
        names = file.read().splitlines()
    while names and not names[-1].strip():
        names.pop()
    if not names:
        raise ValueError(f"{path} holds no class names: write one per line, in the order of the head.")
    return names


def write_labels(path, names: Sequence[str]) -> None:
    """Write class names one per line (the format `read_labels` and `keras-vit export --labels` read)."""
    names = [str(name) for name in names]
    if any("\n" in name or "\r" in name for name in names):
        raise ValueError("Class names must not contain line breaks.")
    with open(path, "w", encoding="utf-8") as file:
        file.write("".join(f"{name}\n" for name in names))


def _as_probabilities(preds: np.ndarray, model=None) -> np.ndarray:
    """Probabilities: a model's softmax output kept, its logits softmaxed; without a model, rows
    that already are probability distributions are kept and anything else gets a softmax."""
    activation = getattr(model, "classifier_activation", "unknown")
    if activation in ("softmax", "sigmoid") or (
        activation == "unknown" and np.all(preds >= 0) and np.allclose(preds.sum(axis=-1), 1.0, atol=1e-3)
    ):
        return preds
    shifted = np.exp(preds - preds.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _shipped_names(entry, width: int) -> Sequence[str | None]:
    """The shipped class names for predictions `width` classes wide: the label set of the catalog
    row `entry`, or without one, the label set of that width."""
    if entry is not None:
        if entry.label_set is None:
            raise ValueError(f"Checkpoint {entry.tag!r} has no classification head, so no labels to decode.")
        label_set = entry.label_set
    else:
        label_set = next((name for name, size in LABEL_SETS.items() if size == width), None)
        if label_set is None:
            raise ValueError(
                f"Predictions have {width} classes, which is no shipped label set "
                f"({', '.join(f'{name}: {size}' for name, size in LABEL_SETS.items())}): "
                "pass the model's class names (class_names=)."
            )
    if width != LABEL_SETS[label_set]:
        raise ValueError(
            f"Predictions have {width} classes but the checkpoint's label set {label_set} has "
            f"{LABEL_SETS[label_set]}: a model with a new head needs its own class names (class_names=)."
        )
    if label_set == "imagenet1k":
        return imagenet1k_labels()
    warnings.warn(
        f"{label_set} class names are not shipped with keras_vit: class names are None.", stacklevel=3
    )
    return (None,) * width


def decode_predictions(
    preds, top: int = 5, tag_or_model=None, *, class_names: Sequence[str] | None = None
) -> list[list[tuple[int, str | None, float]]]:
    """The `top` classes of each prediction as `(class_index, class_name, probability)`, best first.

    `preds`: `(batch, classes)` probabilities (the factories' softmax head) or logits
    (`classifier_activation=None`), which get a softmax; with a keras_vit model as
    `tag_or_model` its head's activation says which, else the values do. The label set
    comes from the checkpoint (`tag_or_model` as in `preprocess_input`), or from the width of
    `preds` when that is `None`: 1000 = ImageNet-1k, 21843 = ImageNet-21k, whose names are not
    shipped (names are `None`, a warning says so). `class_names` (one per class, in head
    order, e.g. `read_labels` of the `labels.txt` that `keras-vit train` writes) name the
    classes of any model instead.
    """
    preds = np.asarray(preds, dtype="float64")
    if preds.ndim != 2:
        raise ValueError(f"decode_predictions expects (batch, classes) predictions, got shape {preds.shape}.")
    if not isinstance(top, (int, np.integer)) or top < 1:
        raise ValueError(f"top must be a positive int, got {top!r}.")
    if not np.isfinite(preds).all():
        raise ValueError(
            "decode_predictions got NaN or infinite predictions: the model's output is broken (NaN "
            "pixels, or a diverged model); there are no classes to name."
        )
    width = preds.shape[1]
    if class_names is not None:
        names = [str(name) for name in class_names]
        if len(names) != width:
            raise ValueError(f"class_names has {len(names)} names but the predictions have {width} classes.")
    else:
        names = _shipped_names(model_entry(tag_or_model), width)
    probabilities = _as_probabilities(preds, tag_or_model if hasattr(tag_or_model, "layers") else None)
    best = np.argsort(-probabilities, axis=-1, kind="stable")[:, :top]
    return [
        [(int(index), names[index], float(row[index])) for index in indices]
        for row, indices in zip(probabilities, best, strict=True)
    ]

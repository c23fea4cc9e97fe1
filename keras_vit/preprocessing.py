"""Input scaling and label decoding for the published checkpoints.

The models take images already normalised as their weights expect; `preprocess_input` maps
uint8-range pixels there with the checkpoint's mean/std from the catalog (mean = std = 0.5,
i.e. [-1, 1], for every Google-trained checkpoint). `decode_predictions` turns a head's
output into `(class_index, class_name, score)` with the checkpoint's label set.

ImageNet-1k class names: `weights/imagenet1k_labels.txt`, the 1000 names in the standard
index order (sorted WordNet ids), one per line, copied from torchvision 0.29.1
(`torchvision.models._meta._IMAGENET_CATEGORIES`, its weights' `categories` metadata; the
names are unique: e.g. index 134 is "crane bird", 517 "crane"). ImageNet-21k names are not
shipped: for 21843-class heads `decode_predictions` returns indices with the name `None`.
"""

from __future__ import annotations

import functools
import warnings
from importlib import resources

import numpy as np

from keras_vit.pretrained import model_entry

GOOGLE_MEAN = (0.5, 0.5, 0.5)
GOOGLE_STD = (0.5, 0.5, 0.5)
LABEL_SETS = {"imagenet1k": 1000, "imagenet21k": 21843}


def normalize(images, mean=GOOGLE_MEAN, std=GOOGLE_STD) -> np.ndarray:
    """Map pixel values in [0, 255] to `(x / 255 - mean) / std` (float32, channels last), unchecked."""
    images = np.asarray(images, dtype="float32") / 255.0
    channels = images.shape[-1]
    mean = np.resize(np.asarray(mean, dtype="float32"), channels)
    std = np.resize(np.asarray(std, dtype="float32"), channels)
    return (images - mean) / std


def _check_pixel_range(images: np.ndarray) -> None:
    """Refuse inputs that are not in [0, 255] or look already scaled, the usual silent bug."""
    if images.dtype == bool or not np.issubdtype(images.dtype, np.number):
        raise TypeError(f"preprocess_input expects numeric pixel values, got dtype {images.dtype}.")
    if images.size == 0:
        return
    low, high = float(images.min()), float(images.max())
    if low < 0 or high > 255:
        raise ValueError(
            f"preprocess_input expects pixel values in [0, 255], got [{low:g}, {high:g}]: negative "
            "values mean the images are already normalised (feed them to the model as they are)."
        )
    if np.issubdtype(images.dtype, np.floating) and 0 < high <= 1:
        raise ValueError(
            f"These float images lie in [{low:g}, {high:g}], which looks like [0, 1] scaling; "
            "preprocess_input expects [0, 255]: multiply by 255 first (or, for images that really "
            "are that dark in [0, 255], cast them to uint8)."
        )


def load_image(
    image,
    image_size: int | tuple[int, int] = 224,
    crop_pct: float | None = 0.9,
    interpolation: str = "bicubic",
) -> np.ndarray:
    """Read an image (path, PIL image or `(H, W, C)` array) and resize it as timm evaluates.

    The shorter side is resized to `size / crop_pct` and the centre `image_size` crop kept
    (`crop_pct=None` or 1.0: resize straight to `image_size`). Returns RGB uint8 `(h, w, 3)`,
    ready for `preprocess_input`.
    """
    from PIL import Image

    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    if isinstance(image, Image.Image):
        picture = image
    elif isinstance(image, np.ndarray):
        picture = Image.fromarray(np.asarray(image, dtype="uint8"))
    else:
        picture = Image.open(image)
    picture = picture.convert("RGB")
    resample = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR}[interpolation]
    if not crop_pct or crop_pct >= 1.0:
        return np.asarray(picture.resize((width, height), resample))
    scale = max(height, width) / crop_pct / min(picture.size)
    resized = picture.resize(
        (max(width, round(picture.width * scale)), max(height, round(picture.height * scale))), resample
    )
    left, top = (resized.width - width) // 2, (resized.height - height) // 2
    return np.asarray(resized.crop((left, top, left + width, top + height)))


def preprocess_input(images, tag_or_model=None) -> np.ndarray:
    """Scale images with pixel values in [0, 255] to the input a checkpoint expects.

    `images`: `(..., H, W, C)`, uint8 or float in [0, 255] (any resizing already done), as a
    NumPy array or eager tensor (it is NumPy code, for input pipelines outside the graph).
    `tag_or_model`: a full catalog tag or a model built with `pretrained=...` (found by its
    `pretrained_tag` or its name, which survives `.keras` saving); `None` or any other model
    gets the Google normalisation (mean = std = 0.5, output in [-1, 1]) that every catalog
    checkpoint uses. Negative values, values above 255, or floats within [0, 1] raise
    `ValueError`: they mean the images are already scaled.
    Returns a float32 NumPy array.
    """
    images = np.asarray(images)
    _check_pixel_range(images)
    entry = model_entry(tag_or_model)
    if entry is None:
        return normalize(images)
    return normalize(images, entry.mean, entry.std)


@functools.lru_cache(maxsize=1)
def imagenet1k_labels() -> tuple[str, ...]:
    """The 1000 ImageNet-1k class names in index order."""
    text = resources.files("keras_vit.weights").joinpath("imagenet1k_labels.txt").read_text(encoding="utf-8")
    return tuple(text.splitlines())


def _as_probabilities(preds: np.ndarray) -> np.ndarray:
    """Rows that already are probability distributions are kept; logits get a softmax."""
    if np.all(preds >= 0) and np.allclose(preds.sum(axis=-1), 1.0, atol=1e-3):
        return preds
    shifted = np.exp(preds - preds.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def decode_predictions(preds, top: int = 5, tag_or_model=None) -> list[list[tuple[int, str | None, float]]]:
    """The `top` classes of each prediction as `(class_index, class_name, probability)`, best first.

    `preds`: `(batch, classes)` logits or probabilities (logits get a softmax). The label set
    comes from the checkpoint (`tag_or_model` as in `preprocess_input`), or from the width of
    `preds` when that is `None`: 1000 = ImageNet-1k, 21843 = ImageNet-21k, whose names are not
    shipped (names are `None`, a warning says so).
    """
    preds = np.asarray(preds, dtype="float64")
    if preds.ndim != 2:
        raise ValueError(f"decode_predictions expects (batch, classes) predictions, got shape {preds.shape}.")
    if not isinstance(top, (int, np.integer)) or top < 1:
        raise ValueError(f"top must be a positive int, got {top!r}.")
    width = preds.shape[1]
    entry = model_entry(tag_or_model)
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
                "decode your own classes with np.argsort."
            )
    if width != LABEL_SETS[label_set]:
        raise ValueError(
            f"Predictions have {width} classes but the checkpoint's label set {label_set} has "
            f"{LABEL_SETS[label_set]}: a model with a new head needs its own class names."
        )
    if label_set == "imagenet1k":
        names = imagenet1k_labels()
    else:
        warnings.warn(
            f"{label_set} class names are not shipped with keras_vit: class names are None.", stacklevel=2
        )
        names = (None,) * width
    probabilities = _as_probabilities(preds)
    best = np.argsort(-probabilities, axis=-1, kind="stable")[:, :top]
    return [
        [(int(index), names[index], float(row[index])) for index in indices]
        for row, indices in zip(probabilities, best, strict=True)
    ]

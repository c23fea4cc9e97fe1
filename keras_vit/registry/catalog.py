"""The catalog of published checkpoints, and the one answer to "which preprocessing does this model use".

Pure Python over package data (NumPy only; no TensorFlow, Keras or huggingface_hub), so
everything that needs a checkpoint's mean/std, crop, interpolation or class names (training,
evaluation, export, sharing, `load_image`) reads it here, below the download code
(`keras_vit.checkpoints.pretrained`, which resolves and downloads the rows).

* `weights/catalog.json` (package data of `keras_vit.weights`) holds one row per published
  checkpoint (`CatalogEntry`) and one default tag per variant. Tags are
  `<variant>.<pre-training>`, e.g. `vit_b16.augreg2_in21k_ft_in1k`, with the suffix `_384`
  for checkpoints fine-tuned at 384 px. `format: "timm"` rows are the `timm/<model>.<tag>`
  repos; their hub id, resolution, class count, mean/std, crop_pct and interpolation were
  copied from timm 1.0.31's `pretrained_cfg` (named in each row's `metadata_source`).
  `format: "hf"` rows are the `google/vit-*` transformers repos, preprocessed as
  `ViTImageProcessor` does (bilinear, no crop, mean = std = 0.5). `numerics` is the
  `ViTConfig.numerics` of the row's source code. `sha256` is `null` in every row (the catalog
  was written offline and no hash is made up); a row with one is verified after download.
* `Preprocessing` is a checkpoint's preprocessing spec (input size, crop, interpolation,
  mean/std, channel order, resampler); `preprocessing_for(model_or_tag)` answers which one a
  model uses: its catalog row's (found by `model.pretrained_tag` or its name, which survive
  `.keras` saving), else the package default (the field defaults: crop 0.9, bicubic,
  mean = std = 0.5, i.e. inputs in [-1, 1], what every Google-trained checkpoint expects).
* `class_names(model_or_tag, num_classes)` gives a model's shipped class names: the 1000
  ImageNet-1k names (`weights/imagenet1k_labels.txt`, in the standard index order, copied
  from torchvision 0.29.1's `_IMAGENET_CATEGORIES`) for a 1000-class head built from an
  ImageNet-1k row; ImageNet-21k names are not shipped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import numpy as np

from keras_vit.registry.variants import get_config
from keras_vit.utils.validation import image_size as _image_size

__all__ = [
    "DEFAULT_CROP_PCT",
    "DEFAULT_INTERPOLATION",
    "GOOGLE_MEAN",
    "GOOGLE_STD",
    "INTERPOLATIONS",
    "LABEL_SETS",
    "RESAMPLERS",
    "CatalogEntry",
    "Preprocessing",
    "catalog_markdown",
    "class_names",
    "default_tag",
    "default_tags",
    "entry_for_repo",
    "get_entry",
    "imagenet1k_labels",
    "list_pretrained",
    "model_entry",
    "normalize",
    "preprocessing_for",
]

GOOGLE_MEAN = (0.5, 0.5, 0.5)
GOOGLE_STD = (0.5, 0.5, 0.5)
# The package default for a model without a catalog row (as timm evaluates most ViTs).
DEFAULT_CROP_PCT = 0.9
DEFAULT_INTERPOLATION = "bicubic"
INTERPOLATIONS = ("bicubic", "bilinear")
RESAMPLERS = ("pillow", "tensorflow")
CHANNEL_ORDERS = ("RGB",)
# label set -> classes of its head
LABEL_SETS = {"imagenet1k": 1000, "imagenet21k": 21843}


@dataclass(frozen=True)
class CatalogEntry:
    """One published checkpoint (a row of `weights/catalog.json`)."""

    tag: str
    variant: str
    hub_repo: str
    filename: str
    format: str
    numerics: str
    training_data: str
    resolution: int
    num_classes: int | None
    label_set: str | None
    representation_size: int | None
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    crop_pct: float | None
    interpolation: str | None
    sha256: str | None
    metadata_source: str

    @property
    def pretraining(self) -> str:
        """The tag without the variant, e.g. `augreg2_in21k_ft_in1k`."""
        return self.tag.split(".", 1)[1]


def _package_data(name: str) -> str:
    """A file of `keras_vit.weights` (setup.cfg installs the repository's `weights/` there); from a
    source checkout on `PYTHONPATH`, not installed (e.g. a GPU machine), `weights/` itself."""
    try:
        folder = resources.files("keras_vit.weights")
    except ModuleNotFoundError:
        folder = pathlib.Path(__file__).resolve().parents[2] / "weights"  # keras_vit/registry/ -> checkout
    return folder.joinpath(name).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def _catalog() -> tuple[dict[str, CatalogEntry], dict[str, str]]:
    """(tag -> entry, variant -> default pre-training tag), read once from the package data."""
    data = json.loads(_package_data("catalog.json"))
    entries = {}
    for row in data["checkpoints"]:
        entry = CatalogEntry(**{**row, "mean": tuple(row["mean"]), "std": tuple(row["std"])})
        entries[entry.tag] = entry
    return entries, dict(data["defaults"])


def list_pretrained(variant: str | None = None) -> list[str]:
    """Every catalog tag, or those of one variant, e.g. `list_pretrained("vit_b16")`."""
    if variant is not None:
        get_config(variant)
    return sorted(tag for tag, entry in _catalog()[0].items() if variant in (None, entry.variant))


def default_tag(variant: str) -> str:
    """The full tag `pretrained=True` loads for `variant`."""
    get_config(variant)
    defaults = _catalog()[1]
    if variant not in defaults:
        raise ValueError(f"{variant} has no published checkpoint: build it with pretrained=False.")
    return f"{variant}.{defaults[variant]}"


def default_tags() -> dict[str, str]:
    """`{variant: full tag}` of every variant's default checkpoint (what `pretrained=True` loads)."""
    return {variant: f"{variant}.{tag}" for variant, tag in _catalog()[1].items()}


def get_entry(tag: str, variant: str | None = None) -> CatalogEntry:
    """The catalog row of `tag`: a full tag, or a pre-training tag of `variant`.

    A tag of another variant is an error that names the factory that loads it.
    """
    entries = _catalog()[0]
    full_tag = tag if "." in tag or variant is None else f"{variant}.{tag}"
    entry = entries.get(full_tag)
    if entry is not None:
        if variant is not None and entry.variant != variant:
            raise ValueError(
                f"{tag!r} is a checkpoint of {entry.variant}, not {variant}: build it with "
                f"keras_vit.{entry.variant}(pretrained={entry.tag!r})."
            )
        return entry
    pretraining = full_tag.split(".", 1)[-1]
    elsewhere = sorted(e.variant for e in entries.values() if e.pretraining == pretraining)
    message = f"Unknown checkpoint tag {tag!r}"
    if variant is not None:
        message += f" for {variant}; its tags: {[t.split('.', 1)[1] for t in list_pretrained(variant)]}"
    else:
        message += "; use a full tag `<variant>.<pre-training>` from keras_vit.list_pretrained()"
    if elsewhere:
        message += f". {pretraining!r} exists for {', '.join(elsewhere)}: e.g. keras_vit.{elsewhere[0]}(...)"
    raise ValueError(message + ".")


def entry_for_repo(repo: str, variant: str | None = None) -> CatalogEntry | None:
    """The row of the hub repo `repo` (the one of `variant` if several), or `None`."""
    matches = [entry for entry in _catalog()[0].values() if entry.hub_repo == repo]
    preferred = [entry for entry in matches if entry.variant == variant]
    return (preferred or matches or [None])[0]


def lookup(source: str | bool, variant: str | None = None) -> CatalogEntry | None:
    """The catalog row a `pretrained=` value names, in one question: `True` (the variant's default
    tag), a tag (short with `variant`, or full) or a hub repo id (`"org/name"`; `None` when the
    catalog lists no checkpoint of that repo)."""
    if source is True:
        if variant is None:
            raise ValueError("pretrained=True needs a variant: pass a full tag, a file path or a repo id.")
        return get_entry(default_tag(variant))
    if "/" in source:
        return entry_for_repo(source, variant)
    return get_entry(source, variant)


def model_entry(tag_or_model) -> CatalogEntry | None:
    """The catalog row of a full tag, or of a model built from one (by `pretrained_tag` or name).

    `None`, and models not built from a catalog tag, give `None`.
    """
    if tag_or_model is None or isinstance(tag_or_model, CatalogEntry):
        return tag_or_model
    if isinstance(tag_or_model, str):
        if "." not in tag_or_model:
            raise ValueError(
                f"{tag_or_model!r} is not a full tag: use `<variant>.<pre-training>`, "
                f"e.g. 'vit_b16.{tag_or_model}' (keras_vit.list_pretrained())."
            )
        return get_entry(tag_or_model)
    if hasattr(tag_or_model, "layers") and isinstance(getattr(tag_or_model, "name", None), str):  # a model
        tag = getattr(tag_or_model, "pretrained_tag", None) or tag_or_model.name
        return _catalog()[0].get(tag)
    raise TypeError(f"Expected a catalog tag, a keras.Model or None, got {type(tag_or_model).__name__}.")


def catalog_markdown() -> str:
    """The catalog as a Markdown table (tag, resolution, classes, numerics, training data, hub repo)."""
    defaults = set(default_tags().values())
    lines = [
        "| Tag | Resolution | Classes | Numerics | Training data | Hub repo (file) |",
        "|---|---|---|---|---|---|",
    ]
    for entry in _catalog()[0].values():
        tag = f"`{entry.tag}`" + (" (default)" if entry.tag in defaults else "")
        classes = "none (features)" if entry.num_classes is None else str(entry.num_classes)
        lines.append(
            f"| {tag} | {entry.resolution} | {classes} | {entry.numerics} | {entry.training_data} | "
            f"[{entry.hub_repo}](https://huggingface.co/{entry.hub_repo}) (`{entry.filename}`) |"
        )
    return "\n".join(lines)


# ---- labels -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def imagenet1k_labels() -> tuple[str, ...]:
    """The 1000 ImageNet-1k class names in index order."""
    return tuple(_package_data("imagenet1k_labels.txt").splitlines())


def class_names(
    model_or_tag, num_classes: int | None, labels: Sequence[str] | None = None
) -> list[str] | None:
    """The class names of a model's head of `num_classes` classes (`None`: no head), or `None`.

    `labels`, if given, as strings, checked against the head. Else the shipped names: the
    ImageNet-1k names for a 1000-class head of a model (or tag) whose catalog row is an
    ImageNet-1k classifier; `None` for anything else (a new head, no catalog row, ImageNet-21k).
    """
    if labels is not None:
        labels = [str(label) for label in labels]
        if num_classes is None or len(labels) != num_classes:
            raise ValueError(
                f"labels has {len(labels)} names but the model's head has {num_classes or 'no'} classes."
            )
        return labels
    entry = model_entry(model_or_tag)
    if entry is not None and entry.label_set == "imagenet1k" and num_classes == LABEL_SETS["imagenet1k"]:
        return list(imagenet1k_labels())
    return None


# ---- preprocessing ----------------------------------------------------------------------------


def _channel_values(name: str, value) -> tuple[float, float, float]:
    try:
        values = tuple(float(v) for v in (value if isinstance(value, Sequence) else np.ravel(value)))
    except (TypeError, ValueError):
        values = ()
    if len(values) == 1:
        values = values * 3
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise ValueError(f"{name} must be 3 finite numbers (one per RGB channel) or 1, got {value!r}.")
    return values


@dataclass(frozen=True)
class Preprocessing:
    """How a checkpoint's images are resized, cropped and normalised: one spec for every path.

    Fields:
        image_size: the model input `(height, width)` (an int is a square side).
        mean, std: per-channel statistics of `(x / 255 - mean) / std`, x in [0, 255] (one
            number is repeated to the 3 channels).
        crop_pct: the centre-crop fraction: the shorter side is resized to
            `max(image_size) / crop_pct` (rounded as Python's `round`), keeping the aspect
            ratio, and the centre `image_size` kept, as timm's evaluation transform. `None`
            (or 1.0, stored as `None`): resize straight to `image_size`, aspect ratio not kept.
        interpolation: `"bicubic"` or `"bilinear"`, Pillow's filters (antialiased when shrinking).
        channel_order: `"RGB"`, the only order the checkpoints take.
        resampler: `"pillow"` (default): Pillow's resize, the width pass and the height pass
            each rounded to uint8, exactly (the TensorFlow implementation reproduces it bit for
            bit); `"tensorflow"`: one antialiased `tf.image.resize` pass rounded once, what
            `data.train_pipeline` uses and what `keras-vit train` evaluates with (kept so its
            measured accuracy stands); it has no Pillow implementation (`load_image` runs
            TensorFlow for it).

    The field defaults are the package default, used for a model without a catalog row:
    `Preprocessing(image_size)` is crop 0.9, bicubic, mean = std = 0.5. The fields are
    checked (and normalised: `image_size` to a pair, `mean`/`std` to 3 floats) on creation;
    a bad value raises `ValueError` naming it. `replace(**changes)` gives a modified copy.
    The implementations: `keras_vit.data.preprocessing` (Pillow/NumPy) and
    `keras_vit.data.tf_preprocessing` (TensorFlow).
    """

    image_size: tuple[int, int]
    mean: tuple[float, float, float] = GOOGLE_MEAN
    std: tuple[float, float, float] = GOOGLE_STD
    crop_pct: float | None = DEFAULT_CROP_PCT
    interpolation: str = DEFAULT_INTERPOLATION
    channel_order: str = "RGB"
    resampler: str = "pillow"

    def __post_init__(self):
        set_field = functools.partial(object.__setattr__, self)
        set_field("image_size", _image_size("image_size", self.image_size))
        set_field("mean", _channel_values("mean", self.mean))
        set_field("std", _channel_values("std", self.std))
        if min(self.std) <= 0.0:
            raise ValueError(f"std must be positive, got {self.std}.")
        crop_pct = self.crop_pct
        if crop_pct is not None:
            if isinstance(crop_pct, bool) or not isinstance(crop_pct, (int, float, np.number)):
                raise ValueError(f"crop_pct must be in (0, 1] (1.0: no crop) or None, got {crop_pct!r}.")
            if not 0.0 < float(crop_pct) <= 1.0:
                raise ValueError(f"crop_pct must be in (0, 1] (1.0: no crop) or None, got {crop_pct!r}.")
            set_field("crop_pct", None if float(crop_pct) >= 1.0 else float(crop_pct))
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {self.interpolation!r}.")
        if self.channel_order not in CHANNEL_ORDERS:
            raise ValueError(
                f"channel_order must be one of {CHANNEL_ORDERS} (every checkpoint takes RGB), "
                f"got {self.channel_order!r}."
            )
        if self.resampler not in RESAMPLERS:
            raise ValueError(f"resampler must be one of {RESAMPLERS}, got {self.resampler!r}.")

    @classmethod
    def from_entry(cls, entry: CatalogEntry, image_size: int | Sequence[int] | None = None) -> Preprocessing:
        """The spec of a catalog row, at its resolution by default.

        The row's mean, std, crop_pct and interpolation (a row without an interpolation gets
        the package default); `image_size` for a model built at another input size.
        """
        return cls(
            image_size=entry.resolution if image_size is None else image_size,
            mean=entry.mean,
            std=entry.std,
            crop_pct=entry.crop_pct,
            interpolation=entry.interpolation or DEFAULT_INTERPOLATION,
        )

    @classmethod
    def for_model(cls, model_or_tag, image_size: int | Sequence[int] | None = None) -> Preprocessing:
        """`preprocessing_for(model_or_tag, image_size)`."""
        return preprocessing_for(model_or_tag, image_size)

    def replace(self, **changes) -> Preprocessing:
        """A copy with some fields changed (checked again), e.g. `spec.replace(crop_pct=None)`."""
        return dataclasses.replace(self, **changes)


def _model_input_size(model) -> tuple[int, int]:
    shape = getattr(model, "input_shape", None)
    if not isinstance(shape, tuple) or len(shape) != 4 or None in shape[1:3]:
        raise ValueError(
            f"The preprocessing of a model needs one image input (batch, height, width, channels) of "
            f"fixed size, got input shape {shape}: build it with a fixed image_size, or pass image_size."
        )
    return int(shape[1]), int(shape[2])


def preprocessing_for(model_or_tag, image_size: int | Sequence[int] | None = None) -> Preprocessing:
    """The `Preprocessing` a model uses: its catalog row's if built from a tag, else the package default.

    `model_or_tag`: a model (its input size is the default `image_size`; the catalog row is
    found by `model_entry`: by `pretrained_tag` or name), a full catalog tag (at its
    resolution), or `None` (the package default; `image_size` required).
    """
    entry = model_entry(model_or_tag)
    if image_size is None and hasattr(model_or_tag, "input_shape"):
        image_size = _model_input_size(model_or_tag)
    if entry is not None:
        return Preprocessing.from_entry(entry, image_size)
    if image_size is None:
        raise ValueError("The package default preprocessing needs an image_size.")
    return Preprocessing(image_size)


def normalize(images, mean=GOOGLE_MEAN, std=GOOGLE_STD) -> np.ndarray:
    """Map pixel values in [0, 255] to `(x / 255 - mean) / std` (float32, channels last), unchecked.

    The normalisation of a `Preprocessing` (`normalize(x, spec.mean, spec.std)`). The
    TensorFlow implementation looks uint8 pixels up in a table this function computes, so the
    two agree exactly.
    """
    images = np.array(images, dtype="float32")  # a copy, normalised in place: no temporaries
    channels = images.shape[-1]
    images /= 255.0
    images -= np.resize(np.asarray(mean, dtype="float32"), channels)
    images /= np.resize(np.asarray(std, dtype="float32"), channels)
    return images

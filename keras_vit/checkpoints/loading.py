"""Recognise a checkpoint's format, describe its architecture, and load it into a keras_vit model.

`inspect_checkpoint` says what model a checkpoint fits (`CheckpointInfo`), `load_checkpoint` loads
one into a model; `Checkpoint`, what `checkpoints.pretrained.resolve_pretrained` returns, is a
checkpoint read into memory that answers the arguments of the model it fits (`model_kwargs`) and
loads into it (`load_into`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from keras_vit.checkpoints import common, format_timm
from keras_vit.checkpoints.common import CanonicalTensor, CheckpointFormat, Conversion
from keras_vit.checkpoints.errors import CheckpointError
from keras_vit.checkpoints.formats import FORMATS
from keras_vit.checkpoints.pos_embed import POS_EMBED_INTERPOLATIONS, resize_pos_embed
from keras_vit.checkpoints.reading import read_checkpoint, resolve_checkpoint_file
from keras_vit.registry.variants import NUMERICS, WIDTHS, ViTConfig, config_of, image_hw, variant_for

if TYPE_CHECKING:  # loading needs a model's variables, not Keras: resolving a checkpoint stays Keras-free
    import keras

    from keras_vit.registry.catalog import CatalogEntry

__all__ = [
    "Checkpoint",
    "CheckpointInfo",
    "detect_format",
    "inspect_checkpoint",
    "load_checkpoint",
    "read_hf_config",
    "source_numerics",
]

# transformers `hidden_act` -> whether it is the tanh approximation of GELU (False: exact erf)
_HF_GELU = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True}
_HEAD_DIM = 64  # ViT's head width, for checkpoints of a width keras_vit.registry.variants does not list


@dataclass(frozen=True)
class CheckpointInfo:
    """The architecture a checkpoint was trained with: what a model needs to fit it.

    `grid` is the patch grid of its position embedding, `num_classes` its head's classes
    (`None`: no head), `representation_size` its pre-logits width (`None`: none), `variant`
    the matching name in `keras_vit.registry.variants.VARIANTS` (`None` if no variant matches),
    `resnet_stages` the units per stage of a hybrid's ResNet stem (`None`: a plain ViT).
    `patch_size` is in pixels of the Transformer's input: the ResNet feature map for hybrids.
    `class_token`, `pooling` and `fc_norm` are its token layout, as `ViTConfig` has them:
    `pooling` is `"map"` for an attention-pooling head, `"gap"` without a [class] token
    (big_vision `pool_type="gap"`, timm `class_token=False`) or with timm's LayerNorm after the
    average pooling (`fc_norm`), else `"token"`. `numerics` is the computation
    of the checkpoint's source (`keras_vit.registry.variants.NUMERICS`: `"jax"` for Google `.npz`,
    `"timm"`, `"hf"` from transformers' `config.json`), `pos_embed_interpolation` its
    position-embedding resampling (its format's `pos_embed_interpolation`): what
    `create_model(..., pretrained=...)` builds and loads with unless told otherwise.
    """

    format: str
    hidden_size: int
    depth: int
    num_heads: int
    mlp_dim: int
    patch_size: int
    grid: tuple[int, int]
    channels: int
    num_classes: int | None
    representation_size: int | None
    variant: str | None
    resnet_stages: tuple[int, ...] | None = None
    class_token: bool = True
    pooling: str = "token"
    fc_norm: bool = False
    numerics: str = "timm"

    @property
    def pos_embed_interpolation(self) -> str:
        """How a model built for another resolution resamples the position embedding by default."""
        return FORMATS[self.format].pos_embed_interpolation

    @property
    def layout(self) -> dict[str, bool | str]:
        """`{"class_token", "pooling", "fc_norm"}`: the factory arguments of a model that fits."""
        return {"class_token": self.class_token, "pooling": self.pooling, "fc_norm": self.fc_norm}

    @property
    def layout_arguments(self) -> str:
        """The layout as factory arguments, e.g. `class_token=False, pooling="gap"`."""
        return _layout_arguments(self.layout)


@dataclass(frozen=True)
class _Checkpoint:
    """A checkpoint read, recognised and normalised, before its conversion for a given head count."""

    format: str
    flat: dict[str, np.ndarray]
    stored_heads: int | None  # from the weights' shapes or config.json; None if not recorded
    stored_grid: tuple[int, int] | None  # from config.json; None if not recorded
    label: str
    numerics: str  # the source's (`source_numerics`)

    @property
    def row(self) -> CheckpointFormat:
        return FORMATS[self.format]


def detect_format(state: Mapping[str, object]) -> str:
    """`"google_npz"`, `"timm"` or `"hf"`, recognised from the checkpoint's keys."""
    keys = set(state)
    found = [name for name, row in FORMATS.items() if row.matches(keys)]
    if len(found) == 1:
        return found[0]
    if found:
        raise CheckpointError(
            f"The checkpoint's keys match several formats {found}: pass format=one of them."
        )
    expected = "; ".join(row.description for row in FORMATS.values())
    raise CheckpointError(
        f"Unrecognised checkpoint layout: expected a ViT checkpoint in one of these formats: {expected}. "
        f"Found {len(keys)} keys, e.g. {sorted(keys)[:10]}."
    )


def read_hf_config(path: str | os.PathLike) -> dict:
    """The transformers `config.json` next to a checkpoint file (or in its directory), or `{}`."""
    path = Path(path)
    config_path = (path if path.is_dir() else path.parent) / "config.json"
    if not config_path.is_file():
        return {}
    try:
        return json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"Cannot read {config_path} ({error}): fix or delete it.") from None


def _config_grid(config: dict) -> tuple[int, int] | None:
    image, patch = config.get("image_size"), config.get("patch_size")
    if image is None or not isinstance(patch, int):
        return None
    height, width = image_hw(image)
    return height // patch, width // patch


def source_numerics(format: str, hf_config: Mapping | None = None) -> str:
    """The `ViTConfig.numerics` of a checkpoint format's own code: `"jax"` for Google `.npz`, `"timm"`,
    and for transformers the preset with its `config.json`'s `hidden_act` and `layer_norm_eps`.

    transformers files all have exact GELU and eps 1e-12 (`"hf"`); another eps takes the preset
    with the same GELU and the nearest eps, with a warning; a `hidden_act` other than GELU
    (exact or tanh) is a `CheckpointError`.
    """
    if format != "hf":
        return FORMATS[format].numerics
    hf_config = hf_config or {}
    activation = hf_config.get("hidden_act", "gelu")
    if activation not in _HF_GELU:
        raise CheckpointError(
            f"The transformers config has hidden_act={activation!r}: keras_vit ViTs compute GELU, exact or "
            f"tanh-approximated ({sorted(_HF_GELU)})."
        )
    epsilon = float(hf_config.get("layer_norm_eps", NUMERICS["hf"].layer_norm_epsilon))
    approximate = _HF_GELU[activation]
    candidates = [name for name in ("hf", "timm", "jax") if NUMERICS[name].approximate_gelu == approximate]
    name = min(candidates, key=lambda name: abs(math.log10(NUMERICS[name].layer_norm_epsilon / epsilon)))
    if NUMERICS[name].layer_norm_epsilon != epsilon:
        warnings.warn(
            f"The transformers config has layer_norm_eps={epsilon:g}, which no keras_vit numerics has: "
            f"using numerics={name!r} (LayerNorm eps {NUMERICS[name].layer_norm_epsilon:g}).",
            stacklevel=3,
        )
    return name


def _read(source, format: str | None, hf_config: Mapping | None = None) -> _Checkpoint:
    """A checkpoint path (read here) or a state dict, prepared for loading (`_prepare`)."""
    path = None if isinstance(source, Mapping) else resolve_checkpoint_file(source)
    if path is None:
        return _prepare(source, format, "state dict", hf_config=hf_config)
    return _prepare(read_checkpoint(path), format, str(path), path, hf_config)


def _prepare(
    state: Mapping, format: str | None, label: str, path: Path | None = None, hf_config: Mapping | None = None
) -> _Checkpoint:
    """A state dict in its format's flat names, with what it says of itself."""
    state = {str(key): np.asarray(value) for key, value in state.items()}
    if format is None:
        format = detect_format(state)
    elif format not in FORMATS:
        raise CheckpointError(f"Unknown checkpoint format {format!r}: use one of {sorted(FORMATS)}.")
    config = {}
    if format == "hf":
        config = read_hf_config(path) if hf_config is None and path is not None else dict(hf_config or {})
    row = FORMATS[format]
    flat = row.normalise(state)
    stored_heads = row.num_heads(flat) or config.get("num_attention_heads")
    numerics = source_numerics(format, config)
    return _Checkpoint(format, flat, stored_heads, _config_grid(config), label, numerics)


def _resnet_stages(checkpoint: _Checkpoint, conversion: Conversion) -> tuple[int, ...] | None:
    """The units per stage of the checkpoint's ResNet stem (`None`: a plain ViT); stem keys in a
    format that holds no hybrids are a `CheckpointError`."""
    stem, layout = conversion.stem, checkpoint.row.stem
    if not stem:
        return None
    if layout is None:
        hybrid_formats = sorted(name for name, other in FORMATS.items() if other.stem is not None)
        raise CheckpointError(
            f"The {checkpoint.format} checkpoint {checkpoint.label} has ResNet stem keys such as "
            f"{sorted(stem)[:3]}: hybrid ResNet+ViT checkpoints load from the {hybrid_formats} formats only."
        )
    return common.resnet_stages(stem, layout)


def _default_heads(hidden_size: int) -> int:
    """The head count of keras_vit's variant of this width, else hidden_size / 64."""
    for width, _depth, heads, _mlp in WIDTHS.values():
        if width == hidden_size:
            return heads
    if hidden_size % _HEAD_DIM:
        raise CheckpointError(
            f"Cannot tell the number of attention heads of a checkpoint of width {hidden_size}: no keras_vit "
            f"variant has that width and it is not a multiple of {_HEAD_DIM}."
        )
    return hidden_size // _HEAD_DIM


def _grid(tokens: int, stored: tuple[int, int] | None) -> tuple[int, int]:
    """The patch grid of `tokens` patch positions: as recorded, else the square one."""
    if stored is not None and stored[0] * stored[1] == tokens:
        return stored
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise CheckpointError(
            f"Cannot infer the patch grid of a position embedding with {tokens} patch positions (not a "
            "square): build the model for the checkpoint's own resolution so that no resizing is needed."
        )
    return side, side


def _layout(conversion: Conversion) -> dict[str, bool | str]:
    """The token layout of converted tensors: [class] token, pooling, LayerNorm after the pooling."""
    tensors = conversion.tensors
    class_token = common.CLASS_TOKEN in tensors
    norm = tensors.get(common.ENCODER_NORM_SCALE)
    fc_norm = norm is not None and norm.source in format_timm.FC_NORM_KEYS
    if f"{common.POOL}probe" in tensors:
        pooling = "map"
    else:  # timm's fc_norm follows average pooling, with or without a [class] token
        pooling = "token" if class_token and not fc_norm else "gap"
    return {"class_token": class_token, "pooling": pooling, "fc_norm": fc_norm}


def _layout_arguments(layout: Mapping[str, bool | str]) -> str:
    arguments = f'class_token={layout["class_token"]}, pooling="{layout["pooling"]}"'
    return arguments + (", fc_norm=True" if layout["fc_norm"] else "")


def _describe_layout(layout: Mapping[str, bool | str]) -> str:
    token = "a [class] token" if layout["class_token"] else "no [class] token"
    after = " followed by the final LayerNorm (timm fc_norm)" if layout["fc_norm"] else ""
    pooling = {
        "token": "the [class] token read out",
        "gap": f"global average pooling{after}",
        "map": "multihead attention pooling (MAP head)",
        None: "no pooling (the token sequence is the output)",
    }[layout["pooling"]]
    return f"{token}, {pooling}"


def _check_layout(model: keras.Model, checkpoint: _Checkpoint, conversion: Conversion) -> None:
    """A `CheckpointError` naming the layout found and the factory arguments that fit, if the model's differs.

    The [class] token, an attention-pooling head and the LayerNorm's place must agree; a
    [class]-token checkpoint may load into a model that pools by the patch mean (`"gap"`) or
    returns tokens (`None`), and a class-token-free one into a token-sequence model.
    """
    found, config = _layout(conversion), model.config
    fits = (
        found["class_token"] == config.class_token
        and (found["pooling"] == "map") == (config.pooling == "map")
        and found["fc_norm"] == config.fc_norm
    )
    if fits:
        return
    model_layout = {"class_token": config.class_token, "pooling": config.pooling, "fc_norm": config.fc_norm}
    arguments = _layout_arguments(found)
    raise CheckpointError(
        f"The {checkpoint.format} checkpoint {checkpoint.label} has {_describe_layout(found)}; model "
        f"{model.name!r} has {_describe_layout(model_layout)}. Build the model with {arguments} "
        f"(e.g. keras_vit.create_model(<variant>, {arguments})), or pass the file as pretrained= to a "
        "factory without them: it then takes the checkpoint's layout."
    )


def _info(checkpoint: _Checkpoint, conversion: Conversion) -> CheckpointInfo:
    resnet_stages = _resnet_stages(checkpoint, conversion)
    tensors = conversion.tensors
    needed = (common.PATCH_KERNEL, common.POS_EMBED, "block_0/fc1/kernel")
    missing = [name for name in needed if name not in tensors]
    if missing:
        raise CheckpointError(
            f"The {checkpoint.format} checkpoint {checkpoint.label} is incomplete: nothing fills {missing}."
        )
    kernel = tensors[common.PATCH_KERNEL].value
    pos_embed = tensors[common.POS_EMBED].value
    if kernel.ndim != 4 or pos_embed.ndim != 3:
        raise CheckpointError(
            f"Unexpected patch kernel {kernel.shape} / position embedding {pos_embed.shape} in "
            f"{checkpoint.label}: expected (P, P, C, D) and (1, tokens, D)."
        )
    hidden_size = int(kernel.shape[3])
    depth = common.block_count(tensors)
    num_heads = int(checkpoint.stored_heads or _default_heads(hidden_size))
    mlp_dim = int(tensors["block_0/fc1/kernel"].value.shape[-1])
    patch_size = int(kernel.shape[0])
    head = tensors.get(common.HEAD_KERNEL)
    pre_logits = tensors.get(common.PRE_LOGITS_KERNEL)
    layout = _layout(conversion)
    info = CheckpointInfo(
        format=checkpoint.format,
        hidden_size=hidden_size,
        depth=depth,
        num_heads=num_heads,
        mlp_dim=mlp_dim,
        patch_size=patch_size,
        grid=_grid(pos_embed.shape[1] - int(layout["class_token"]), checkpoint.stored_grid),
        channels=int(kernel.shape[2]),
        num_classes=None if head is None else int(head.value.shape[-1]),
        representation_size=None if pre_logits is None else int(pre_logits.value.shape[-1]),
        variant=None,
        resnet_stages=resnet_stages,
        **layout,
        numerics=checkpoint.numerics,
    )
    return dataclasses.replace(info, variant=variant_for(info))


def inspect_checkpoint(
    state_or_path: Mapping[str, np.ndarray] | str | os.PathLike,
    *,
    format: str | None = None,
    hf_config: Mapping | None = None,
) -> CheckpointInfo:
    """The architecture of a checkpoint (a path, or a state dict from `read_checkpoint`).

    Head counts come from the weights where the format stores them per head (Google .npz),
    from `config.json` next to a transformers file (or `hf_config`, its contents, for a state
    dict), and otherwise from the keras_vit variant of the same width (hidden_size / 64 for
    other widths).
    """
    checkpoint = _read(state_or_path, format, hf_config)
    heads = checkpoint.stored_heads
    if heads is None:
        patch = checkpoint.row.convert(checkpoint.flat, None).tensors.get(common.PATCH_KERNEL)
        heads = _default_heads(int(patch.value.shape[-1])) if patch is not None else None
    return _info(checkpoint, checkpoint.row.convert(checkpoint.flat, heads))


def _source_grid(pos_embed: np.ndarray, checkpoint: _Checkpoint, layer) -> tuple[int, int]:
    """The checkpoint's patch grid; an unrecorded non-square one is the model's if the counts agree."""
    tokens = pos_embed.shape[1] - layer.num_prefix_tokens
    try:
        return _grid(tokens, checkpoint.stored_grid)
    except CheckpointError:
        if tokens == layer.grid_size[0] * layer.grid_size[1]:
            return tuple(layer.grid_size)
        raise


def _stem_assignments(
    model: keras.Model, checkpoint: _Checkpoint, conversion: Conversion
) -> list[tuple[keras.Variable, np.ndarray]]:
    """The (variable, value) pairs of a hybrid's ResNet stem; an error if only one side is hybrid."""
    model_is_hybrid = model.config.is_hybrid
    stages = _resnet_stages(checkpoint, conversion)
    if stages is None and not model_is_hybrid:
        return []
    if stages is None:
        raise CheckpointError(
            f"Model {model.name!r} is a hybrid ResNet+ViT but the {checkpoint.format} checkpoint "
            f"{checkpoint.label} is a plain ViT (no ResNet stem weights): build the plain variant."
        )
    if not model_is_hybrid:
        raise CheckpointError(
            f"The {checkpoint.format} checkpoint {checkpoint.label} is a hybrid ResNet+ViT (ResNet stages "
            f"{stages}, keys such as {sorted(conversion.stem)[:2]}) but model "
            f"{model.name!r} is a plain ViT: build the hybrid (e.g. keras_vit.vit_r50_b16)."
        )
    return common.stem_weights(conversion.stem, checkpoint.row.stem, model)


def _model_summary(config: ViTConfig) -> str:
    return (
        f"hidden_size {config.hidden_size}, depth {config.depth}, num_heads {config.num_heads}, "
        f"mlp_dim {config.mlp_dim}, patch_size {config.patch_size}"
    )


def _checkpoint_summary(checkpoint: _Checkpoint, conversion: Conversion) -> str:
    try:
        info = _info(checkpoint, conversion)
    except CheckpointError:
        return "architecture not recognised"
    variant = f" = {info.variant}" if info.variant else ""
    return (
        f"hidden_size {info.hidden_size}, depth {info.depth}, num_heads {info.num_heads}, "
        f"mlp_dim {info.mlp_dim}, patch_size {info.patch_size}{variant}"
    )


def _skipped_parts(model: keras.Model, tensors: dict[str, CanonicalTensor]) -> tuple[bool, bool, list[str]]:
    """Whether the head and the pre-logits layer stay out of the load, and the warnings that say so."""
    notes = []
    head = model.head
    checkpoint_head = tensors.get(common.HEAD_KERNEL) or tensors.get(common.HEAD_BIAS)
    skip_head = head is None or checkpoint_head is None or checkpoint_head.value.shape[-1] != head.units
    if head is not None and checkpoint_head is None:
        notes.append("The checkpoint has no classification head: the model's head keeps its initial weights.")
    elif skip_head and head is not None:
        notes.append(
            f"The checkpoint's head has {checkpoint_head.value.shape[-1]} classes and the model's "
            f"{head.units}: the head is not loaded and keeps its zero initialisation (paper §3.2), "
            "to be fine-tuned."
        )
    skip_pre_logits = model.pre_logits is None
    if skip_pre_logits and common.PRE_LOGITS_KERNEL in tensors:
        width = tensors[common.PRE_LOGITS_KERNEL].value.shape[-1]
        notes.append(
            f"The checkpoint's pre-logits layer ({width} wide) is skipped: the model has none; build it "
            f"with representation_size={width} to use it."
        )
    return skip_head, skip_pre_logits, notes


def _describe(tensor: CanonicalTensor) -> str:
    return f"{tensor.source} {tensor.source_shape}"


def load_checkpoint(
    model: keras.Model,
    source: Mapping[str, np.ndarray] | str | os.PathLike,
    *,
    format: str | None = None,
    pos_embed_interpolation: str | None = None,
) -> None:
    """Copy a checkpoint's weights into a keras_vit `model`, every tensor by name, shapes checked.

    `source` is a checkpoint path (file, or a directory with `model.safetensors` /
    `pytorch_model.bin`) or a state dict; `format` (`"google_npz"`, `"timm"`, `"hf"`) is
    detected from the keys when not given. Rules, as timm applies them:

    - a position embedding for another patch grid is resampled to the model's with
      `pos_embed_interpolation` (`keras_vit.checkpoints.pos_embed.POS_EMBED_INTERPOLATIONS`), by default
      the source's own (its format's `pos_embed_interpolation`): for a Google `.npz` the original
      code's `scipy.ndimage.zoom(order=1)` (`"jax"`), else timm's antialiased bicubic
      (`"timm"`, its `checkpoint_filter_fn`);
    - a head with another class count, or none in the checkpoint, is not loaded: the model's
      head keeps its zero initialisation (paper §3.2), with a warning; a model without `head`
      (`include_top=False`) simply skips it;
    - a checkpoint's pre-logits layer (Google `pre_logits`, transformers `pooler`) loads into
      the model's `pre_logits` (`representation_size`), or is skipped with a warning;
    - for a model with other input `channels`, the patch kernel is adapted as timm's
      `adapt_input_conv` does (summed for 1 channel, else repeated and rescaled);
    - the token layout (`CheckpointInfo.layout`: a [class] token or none, an attention-pooling
      head, timm's `fc_norm`) must be the model's; a `CheckpointError` names the layout found
      and the factory arguments that fit (e.g. `class_token=False, pooling="gap"`). A
      [class]-token checkpoint also loads into a `pooling="gap"` or `None` model.

    Everything else must match exactly: checkpoint keys that fill no weight, model weights that
    get no value, and shape mismatches all raise one `CheckpointError` that lists them, as do
    tensors that are not floating point (integer, bool, string: refused, not cast) or hold
    NaN/Inf. Every value is read, checked and converted before any weight is changed: a failed
    load leaves the model as it was. The numerics (GELU form, epsilons: `ViTConfig.numerics`)
    are the model's: `create_model(..., pretrained=...)` builds the model with the checkpoint
    source's (`CheckpointInfo.numerics`).
    """
    _load(model, _read(source, format), pos_embed_interpolation)


def load_state(
    model: keras.Model,
    state: Mapping[str, np.ndarray],
    format: str,
    label: str,
    pos_embed_interpolation: str | None = None,
) -> None:
    """`load_checkpoint` of a state dict already read (`Checkpoint.load_into`), its errors
    naming the checkpoint as `label` (e.g. "checkpoint 'vit_b16.augreg_in21k'")."""
    checkpoint = _prepare(state, format, label)
    _load(model, checkpoint, pos_embed_interpolation)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint read into memory, with where it came from and what it holds.

    `entry` is its catalog row (`None` for a file or repo outside the catalog), `metadata` the
    `keras_vit.json` of a folder or Hub repo that keras_vit wrote (`None` otherwise).
    """

    state: dict[str, np.ndarray]
    info: CheckpointInfo
    entry: CatalogEntry | None
    label: str
    metadata: dict | None = None

    @property
    def tag(self) -> str | None:
        """The catalog tag whose preprocessing and labels the weights take (the row's, the saved model's)."""
        if self.entry is not None:
            return self.entry.tag
        return (self.metadata or {}).get("model", {}).get("pretrained_tag")

    @property
    def numerics(self) -> str:
        """The `ViTConfig.numerics` of the checkpoint's source: the catalog row's, else the file's."""
        return self.info.numerics if self.entry is None else self.entry.numerics

    def model_kwargs(self, config: ViTConfig, kwargs: Mapping | None = None) -> dict:
        """The keywords of `build_vit(config, **kwargs)` for a model that fits this checkpoint, asked once.

        `kwargs` are the caller's (`ViT` arguments and `ViTConfig` fields, as `create_model`
        takes them; `None` for `image_size`, `num_classes`, `include_top`,
        `representation_size` or `name` means unset). What the caller leaves unset the
        checkpoint gives: its token layout (`class_token`; `pooling` if the [class] token
        agrees; `fc_norm` for `"gap"` pooling), its `numerics`, its resolution as `image_size`
        (a user's size resizes the position embedding), its head (no head, e.g. `orig_in21k`,
        gives `include_top=False` unless `num_classes` is given; a user's `num_classes` gives a
        fresh zero head), its pre-logits width (`representation_size=0` drops it) and, for a
        catalog tag, the `name`.
        """
        kwargs = {
            key: value
            for key, value in (kwargs or {}).items()
            if value is not None or key in _NONE_IS_A_VALUE
        }
        layout = self.info.layout
        kwargs.setdefault("class_token", layout["class_token"])
        if kwargs["class_token"] == layout["class_token"]:
            kwargs.setdefault("pooling", layout["pooling"])
        if kwargs.get("pooling") == "gap":
            kwargs.setdefault("fc_norm", layout["fc_norm"])
        kwargs.setdefault("numerics", self.numerics)
        if self.entry is not None:
            kwargs.setdefault("image_size", self.entry.resolution)
        else:
            kwargs.setdefault("image_size", tuple(side * config.stride for side in self.info.grid))
        has_head = self.info.num_classes is not None
        include_top = kwargs.setdefault("include_top", has_head or "num_classes" in kwargs)
        if include_top and "num_classes" not in kwargs:
            if not has_head:
                raise ValueError(
                    f"{self.label} has no classification head: pass num_classes=<your classes> for a "
                    "new zero-initialised head, or leave include_top unset to get features."
                )
            kwargs["num_classes"] = self.info.num_classes
        stored = self.info.representation_size
        wanted = kwargs.get("representation_size", stored)
        if wanted and wanted != stored:
            has = "no pre-logits layer" if stored is None else f"a pre-logits layer of width {stored}"
            raise ValueError(
                f"{self.label} has {has}, not one of width {wanted}: leave representation_size unset "
                "to build the model as the checkpoint has it, or pass 0 to drop it."
            )
        kwargs["representation_size"] = wanted or None
        if self.entry is not None:
            kwargs.setdefault("name", self.entry.tag)
        return kwargs

    def model_arguments(
        self,
        config: ViTConfig,
        image_size,
        num_classes: int | None,
        include_top: bool | None,
        representation_size: int | None,
    ) -> tuple[int | tuple[int, int], int | None, bool, int | None]:
        """Deprecated: `model_kwargs`, which answers every argument at once."""
        warnings.warn(
            "Checkpoint.model_arguments is deprecated: use Checkpoint.model_kwargs.",
            DeprecationWarning,
            stacklevel=2,
        )
        given = dict(
            image_size=image_size,
            num_classes=num_classes,
            include_top=include_top,
            representation_size=representation_size,
        )
        kwargs = self.model_kwargs(config, given)
        return (
            kwargs["image_size"],
            kwargs.get("num_classes"),
            kwargs["include_top"],
            kwargs["representation_size"],
        )

    def load_into(self, model: keras.Model, pos_embed_interpolation: str | None = None) -> None:
        """Copy the weights into `model` (position embedding resized, other-sized head skipped).

        `pos_embed_interpolation`: as `load_checkpoint` (default: the source's own resampling).
        """
        load_state(model, self.state, self.info.format, self.label, pos_embed_interpolation)
        model.pretrained_tag = self.tag


# `Checkpoint.model_kwargs`: keywords whose `None` is a value (no pooling: the token sequence),
# not "unset"; every other `None` lets the checkpoint decide.
_NONE_IS_A_VALUE = ("pooling", "classifier_activation", "pretrained_tag", "quantization")


def _load(model: keras.Model, checkpoint: _Checkpoint, pos_embed_interpolation: str | None) -> None:
    """Plan every assignment, refuse a misfit, then assign: the load of `load_checkpoint`."""
    try:
        model_heads = config_of(model).num_heads
    except ValueError as error:
        raise CheckpointError(f"Checkpoints load into keras_vit models only. {error}") from None
    interpolation = pos_embed_interpolation or checkpoint.row.pos_embed_interpolation
    if interpolation not in POS_EMBED_INTERPOLATIONS:
        raise ValueError(
            f"Unknown pos_embed_interpolation {interpolation!r}: use one of "
            f"{sorted(POS_EMBED_INTERPOLATIONS)}."
        )
    conversion = checkpoint.row.convert(checkpoint.flat, model_heads)
    _check_layout(model, checkpoint, conversion)
    plan = _plan(model, checkpoint, conversion, model_heads)
    _refuse_misfit(model, checkpoint, conversion, plan)
    if plan.resized_pos_embed is not None:  # resampled before any weight changes, as every other value
        value, old_grid = plan.resized_pos_embed
        layer = model.pos_embed
        resized = resize_pos_embed(
            value,
            layer.grid_size,
            layer.num_prefix_tokens,
            old_grid=old_grid,
            **POS_EMBED_INTERPOLATIONS[interpolation],
        )
        plan.assignments.append((layer.embedding, resized.reshape(layer.embedding.shape)))
    for variable, value in plan.assignments:  # every value checked and converted: nothing fails half-way
        variable.assign(value)
    for note in plan.notes:
        warnings.warn(note, stacklevel=2)


@dataclass
class _Plan:
    """What a load would assign, and everything that stops it, found before any weight changes."""

    assignments: list[tuple[keras.Variable, np.ndarray]]
    notes: list[str]  # warnings for the parts not loaded (head, pre-logits)
    resized_pos_embed: tuple[np.ndarray, tuple[int, int]] | None = None  # (value, its grid)
    mismatched: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)  # tensors that cannot be weights: not float, NaN/Inf


def _plan(model: keras.Model, checkpoint: _Checkpoint, conversion: Conversion, model_heads: int) -> _Plan:
    """Every converted tensor matched to its weight, checked and converted (nothing assigned yet)."""
    tensors = conversion.tensors
    targets = common.model_targets(model)
    skip_head, skip_pre_logits, notes = _skipped_parts(model, tensors)
    plan = _Plan(_stem_assignments(model, checkpoint, conversion), notes)
    plan.unused = [_describe_key(key, checkpoint.flat) for key in conversion.unused]
    for name, tensor in tensors.items():
        if (name.startswith("head/") and skip_head) or (name.startswith("pre_logits/") and skip_pre_logits):
            continue
        variable = targets.get(name)
        if variable is None:
            plan.unused.append(_describe(tensor))
            continue
        expected = tuple(variable.shape)
        try:
            value = common.to_weight(
                tensor.source, tensor.value, expected, variable.dtype, name == common.PATCH_KERNEL
            )
        except CheckpointError as error:
            plan.bad.append(str(error))
            continue
        if (
            name == common.POS_EMBED
            and value.ndim == 3
            and value.shape[0] == 1
            and value.shape[2] == expected[2]
        ):
            try:
                source_grid = _source_grid(value, checkpoint, model.pos_embed)
            except CheckpointError as error:
                plan.problems.append(str(error))
                continue
            if source_grid != tuple(model.pos_embed.grid_size):
                plan.resized_pos_embed = value, source_grid
                continue
        if tuple(value.shape) != expected:
            plan.mismatched.append(f"{_describe(tensor)} -> {name} {expected}")
        else:
            plan.assignments.append((variable, value))
    plan.missing = [
        f"{name} {tuple(variable.shape)}"
        for name, variable in targets.items()
        if name not in tensors and not (name.startswith("head/") and skip_head)
    ]
    if checkpoint.stored_heads is not None and checkpoint.stored_heads != model_heads:
        plan.problems.append(
            f"The checkpoint has {checkpoint.stored_heads} attention heads, the model {model_heads}."
        )
    return plan


def _refuse_misfit(model: keras.Model, checkpoint: _Checkpoint, conversion: Conversion, plan: _Plan) -> None:
    """One `CheckpointError` listing every tensor that cannot load, or everything that does not fit."""
    if plan.bad:
        raise CheckpointError(
            f"The {checkpoint.format} checkpoint {checkpoint.label} has {len(plan.bad)} tensor(s) that "
            "cannot be loaded (no weight of the model was changed):\n"
            + "\n".join(f"  {line}" for line in plan.bad)
        )
    if not (plan.mismatched or plan.unused or plan.missing or plan.problems):
        return
    sections = [
        f"The {checkpoint.format} checkpoint {checkpoint.label} "
        f"({_checkpoint_summary(checkpoint, conversion)}) does not fit model {model.name!r} "
        f"({_model_summary(model.config)}):"
    ]
    for title, lines in (
        ("shapes differ (checkpoint key and shape -> model weight and shape)", plan.mismatched),
        ("checkpoint keys that fill no model weight", plan.unused),
        ("model weights the checkpoint does not fill", plan.missing),
        ("other problems", plan.problems),
    ):
        if lines:
            sections.append(f"  {len(lines)} {title}:\n" + "\n".join(f"    {line}" for line in lines))
    sections.append(
        "Build the model the checkpoint was trained for (keras_vit.inspect_checkpoint(...) describes it)."
    )
    raise CheckpointError("\n".join(sections))


def _describe_key(key: str, flat: Mapping[str, np.ndarray]) -> str:
    return f"{key} {tuple(np.shape(flat[key]))}"

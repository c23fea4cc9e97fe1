"""Checkpoint name maps for the hybrid models' BiT ResNet stem (`keras_vit.models.hybrid`).

Two source layouts, both mapped onto the Keras layers `resnet_conv_root`, `resnet_gn_root` and
`resnet_block{s}_unit{u}` (sublayers `conv1..3`, `gn1..3`, `conv_proj`, `gn_proj`):

- `"timm"` (PyTorch state dict, prefix `patch_embed.backbone.`): `stem.conv.weight` (O,I,H,W),
  `stem.norm.{weight,bias}` (`conv` / `norm` at the top of the backbone for the stem-only
  R+ViT-Ti/16), `stages.{s-1}.blocks.{u-1}.conv{1,2,3}.weight`, `.norm{1,2,3}.{weight,bias}`,
  `.downsample.conv.weight`, `.downsample.norm.{weight,bias}`.
- `"google_npz"` (Google/Flax checkpoints, after the loader strips `opt/target/` etc.):
  `conv_root/kernel` (H,W,I,O), `gn_root/{scale,bias}`, `block{s}/unit{u}/conv{1,2,3}/kernel`,
  `gn{1,2,3}/{scale,bias}`, `conv_proj/kernel`, `gn_proj/{scale,bias}`. GroupNorm parameters
  saved before Flax 0.3.6 have shape (1,1,1,C) and are flattened.

Format names are those of `keras_vit.checkpoints.FORMATS`. The loader calls `stem_weights` for
hybrid models and assigns the returned pairs; `stem_name_map` lists the source keys, e.g. to
report unused ones.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

import keras
import numpy as np

from keras_vit.checkpoints.common import adapt_input_conv
from keras_vit.checkpoints.errors import CheckpointError
from keras_vit.checkpoints.reading import as_weight

__all__ = ["FORMATS", "DEFAULT_PREFIXES", "is_stem_key", "resnet_stages", "stem_name_map", "stem_weights"]

FORMATS = ("timm", "google_npz")
DEFAULT_PREFIXES = {"timm": "patch_embed.backbone.", "google_npz": ""}
_NPZ_STEM = re.compile(r"(conv_root|gn_root|block\d+/unit\d+)/.+")
_SOURCE_UNIT = {
    "timm": re.compile(r"stages\.(\d+)\.blocks\.(\d+)\..+"),
    "google_npz": re.compile(r"block(\d+)/unit(\d+)/.+"),
}
_FIRST_STAGE = {"timm": 0, "google_npz": 1}


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"Unknown checkpoint format {fmt!r} for the ResNet stem: use one of {FORMATS}.")


def is_stem_key(key: str, fmt: str, prefix: str | None = None) -> bool:
    """Whether checkpoint key `key` (layout `fmt`, after `prefix`) belongs to a ResNet stem."""
    _check_format(fmt)
    prefix = DEFAULT_PREFIXES[fmt] if prefix is None else prefix
    if not key.startswith(prefix):
        return False
    return fmt == "timm" or _NPZ_STEM.fullmatch(key[len(prefix) :]) is not None


def resnet_stages(keys: Collection[str], fmt: str, prefix: str | None = None) -> tuple[int, ...]:
    """The units per stage of the ResNet stem whose weights are `keys` (`()`: root only).

    Stages and units must be numbered without gaps, as the references write them.
    """
    _check_format(fmt)
    prefix = DEFAULT_PREFIXES[fmt] if prefix is None else prefix
    units: dict[int, set[int]] = {}
    for key in keys:
        match = _SOURCE_UNIT[fmt].fullmatch(key[len(prefix) :]) if key.startswith(prefix) else None
        if match:
            stage = int(match.group(1)) - _FIRST_STAGE[fmt]
            units.setdefault(stage, set()).add(int(match.group(2)) - _FIRST_STAGE[fmt])
    stages = tuple(len(units[stage]) for stage in sorted(units))
    if sorted(units) != list(range(len(units))) or any(
        sorted(found) != list(range(len(found))) for found in units.values()
    ):
        raise CheckpointError(
            f"The ResNet stem keys of this {fmt} checkpoint number their stages/units with gaps "
            f"({ {stage: sorted(found) for stage, found in sorted(units.items())} }): the file is damaged."
        )
    return stages


def _stem(model: keras.Model) -> dict[str, keras.layers.Layer]:
    """The model's ResNet layers by original name (`ViT.stem`); an error for a plain ViT."""
    stem = getattr(model, "stem", None)
    if not stem:
        raise CheckpointError(
            f"Model {model.name!r} has no hybrid ResNet stem: stem weights only load into hybrid "
            "models such as vit_r50_b16."
        )
    return stem


def _conv_keys(fmt: str, base: str, conv: str) -> str:
    return f"{base}{conv}.weight" if fmt == "timm" else f"{base}{conv}/kernel"


def _norm_keys(fmt: str, base: str, norm: str) -> tuple[str, str]:
    if fmt == "timm":
        return f"{base}{norm}.weight", f"{base}{norm}.bias"
    return f"{base}{norm}/scale", f"{base}{norm}/bias"


def stem_name_map(model: keras.Model, fmt: str, prefix: str | None = None) -> dict[str, keras.Variable]:
    """Source checkpoint key -> Keras variable for every weight of `model`'s ResNet stem.

    `fmt` is `"timm"` or `"google_npz"`; `prefix` defaults to `DEFAULT_PREFIXES[fmt]`.
    """
    _check_format(fmt)
    prefix = DEFAULT_PREFIXES[fmt] if prefix is None else prefix
    stem = _stem(model)
    conv_root, gn_root = stem["conv_root"], stem["gn_root"]
    units = [(stage, unit, stem[f"block{stage}/unit{unit}"]) for stage, unit in model.config.stem_units]

    mapping: dict[str, keras.Variable] = {}

    def add_conv(base: str, conv: str, layer) -> None:
        mapping[_conv_keys(fmt, base, conv)] = layer.kernel

    def add_norm(base: str, norm: str, layer) -> None:
        scale, bias = _norm_keys(fmt, base, norm)
        mapping[scale], mapping[bias] = layer.gamma, layer.beta

    if fmt == "timm":
        root = f"{prefix}stem." if units else prefix
        add_conv(root, "conv", conv_root)
        add_norm(root, "norm", gn_root)
    else:
        add_conv(prefix, "conv_root", conv_root)
        add_norm(prefix, "gn_root", gn_root)
    for stage, unit, layer in units:
        if fmt == "timm":
            base = f"{prefix}stages.{stage - 1}.blocks.{unit - 1}."
            names = [(f"conv{i}", f"norm{i}", i) for i in (1, 2, 3)]
            projection = ("downsample.conv", "downsample.norm")
        else:
            base = f"{prefix}block{stage}/unit{unit}/"
            names = [(f"conv{i}", f"gn{i}", i) for i in (1, 2, 3)]
            projection = ("conv_proj", "gn_proj")
        for conv, norm, index in names:
            add_conv(base, conv, getattr(layer, f"conv{index}"))
            add_norm(base, norm, getattr(layer, f"gn{index}"))
        if layer.needs_projection:
            add_conv(base, projection[0], layer.conv_proj)
            add_norm(base, projection[1], layer.gn_proj)
    return mapping


def stem_weights(
    state: Mapping[str, np.ndarray], fmt: str, model: keras.Model, prefix: str | None = None
) -> list[tuple[keras.Variable, np.ndarray]]:
    """(variable, value) pairs that load the ResNet stem of `model` from checkpoint `state`.

    `state` maps source keys to arrays (numpy, or CPU tensors `np.asarray` accepts) in layout
    `fmt` (`"timm"` or `"google_npz"`, see the module docstring). Values come back float32 in Keras
    layout (HWIO kernels, flat GroupNorm parameters), checked against each variable's shape.
    Other keys of `state` are ignored unless they belong to a stem (`is_stem_key`): stem keys
    that fill no weight of `model` (a deeper ResNet's units) are an error, as are missing keys
    and mismatched shapes, and tensors that are not floating point or hold NaN/Inf; each raises
    `CheckpointError` naming them.
    """
    mapping = stem_name_map(model, fmt, prefix)
    missing = [key for key in mapping if key not in state]
    if missing:
        raise CheckpointError(
            f"The checkpoint lacks {len(missing)} of the {len(mapping)} ResNet stem weights of "
            f"{model.name!r} (first: {missing[:3]}): it is not a {fmt} checkpoint of this hybrid "
            "(check the variant, e.g. R50 vs R26, and the key prefix)."
        )
    extra = sorted(key for key in state if key not in mapping and is_stem_key(key, fmt, prefix))
    if extra:
        raise CheckpointError(
            f"The checkpoint has {len(extra)} ResNet stem weights that {model.name!r} lacks (first: "
            f"{extra[:3]}): it was trained with more ResNet units or stages; build that variant."
        )
    pairs, mismatched = [], []
    root_kernel = _stem(model)["conv_root"].kernel
    for key, variable in mapping.items():
        value = as_weight(key, state[key])  # float32; integer, string or NaN/Inf tensors refused
        if value.ndim == 4 and fmt == "timm":
            value = value.transpose(2, 3, 1, 0)  # OIHW -> HWIO
        elif len(variable.shape) == 1:
            value = value.reshape(-1)  # (1, 1, 1, C) GroupNorm parameters of older Flax files
        if variable is root_kernel and value.ndim == 4:
            value = adapt_input_conv(value, variable.shape[2])  # grayscale or extra channels, as timm
        if tuple(value.shape) != tuple(variable.shape):
            mismatched.append(f"{key}: checkpoint {tuple(value.shape)} vs model {tuple(variable.shape)}")
        pairs.append((variable, value))
    if mismatched:
        raise CheckpointError(
            f"ResNet stem weights do not fit {model.name!r} ({len(mismatched)} shapes differ, e.g. "
            f"{mismatched[0]}): build the hybrid variant (and channels) the checkpoint was trained with."
        )
    return pairs

"""Checkpoint name maps for the hybrid models' BiT ResNet stem (`keras_vit.models.hybrid`).

Each checkpoint format that holds hybrids declares how it names the stem as a `StemLayout` (its
`FORMAT.stem`); the functions here map any layout onto the Keras layers `resnet_conv_root`,
`resnet_gn_root` and `resnet_block{s}_unit{u}` (sublayers `conv1..3`, `gn1..3`, `conv_proj`,
`gn_proj`). The two layouts of today:

- `"timm"` (PyTorch state dict, prefix `patch_embed.backbone.`): `stem.conv.weight` (O,I,H,W),
  `stem.norm.{weight,bias}` (`conv` / `norm` at the top of the backbone for the stem-only
  R+ViT-Ti/16), `stages.{s-1}.blocks.{u-1}.conv{1,2,3}.weight`, `.norm{1,2,3}.{weight,bias}`,
  `.downsample.conv.weight`, `.downsample.norm.{weight,bias}`.
- `"google_npz"` (Google/Flax checkpoints, after the loader strips `opt/target/` etc.):
  `conv_root/kernel` (H,W,I,O), `gn_root/{scale,bias}`, `block{s}/unit{u}/conv{1,2,3}/kernel`,
  `gn{1,2,3}/{scale,bias}`, `conv_proj/kernel`, `gn_proj/{scale,bias}`. GroupNorm parameters
  saved before Flax 0.3.6 have shape (1,1,1,C) and are flattened.

The loader calls `stem_weights` for hybrid models and assigns the returned pairs; the writers
call `stem_name_map` and run it backwards.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

import numpy as np

from keras_vit.checkpoints.common import StemLayout, to_weight
from keras_vit.checkpoints.errors import CheckpointError

if TYPE_CHECKING:
    import keras

__all__ = ["is_stem_key", "resnet_stages", "stem_name_map", "stem_weights"]


def is_stem_key(key: str, layout: StemLayout, prefix: str | None = None) -> bool:
    """Whether checkpoint key `key` (after `prefix`, default the layout's) belongs to a ResNet stem."""
    prefix = layout.prefix if prefix is None else prefix
    if not key.startswith(prefix):
        return False
    return layout.stem_key is None or layout.stem_key.fullmatch(key[len(prefix) :]) is not None


def resnet_stages(keys: Collection[str], layout: StemLayout, prefix: str | None = None) -> tuple[int, ...]:
    """The units per stage of the ResNet stem whose weights are `keys` (`()`: root only).

    Stages and units must be numbered without gaps, as the references write them.
    """
    prefix = layout.prefix if prefix is None else prefix
    units: dict[int, set[int]] = {}
    for key in keys:
        match = layout.unit_key.fullmatch(key[len(prefix) :]) if key.startswith(prefix) else None
        if match:
            stage = int(match.group(1)) - layout.first
            units.setdefault(stage, set()).add(int(match.group(2)) - layout.first)
    stages = tuple(len(units[stage]) for stage in sorted(units))
    if sorted(units) != list(range(len(units))) or any(
        sorted(found) != list(range(len(found))) for found in units.values()
    ):
        raise CheckpointError(
            f"The ResNet stem keys of this {layout.format} checkpoint number their stages/units with gaps "
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


def stem_name_map(
    model: keras.Model, layout: StemLayout, prefix: str | None = None
) -> dict[str, keras.Variable]:
    """Source checkpoint key -> Keras variable for every weight of `model`'s ResNet stem, in `layout`
    (`prefix` defaults to the layout's)."""
    prefix = layout.prefix if prefix is None else prefix
    stem = _stem(model)
    units = [(stage, unit, stem[f"block{stage}/unit{unit}"]) for stage, unit in model.config.stem_units]
    scale, bias = layout.scale_bias
    mapping: dict[str, keras.Variable] = {}

    def add(base: str, conv: str, norm: str, conv_layer, norm_layer) -> None:
        mapping[f"{base}{conv}{layout.kernel}"] = conv_layer.kernel
        mapping[f"{base}{norm}{scale}"], mapping[f"{base}{norm}{bias}"] = norm_layer.gamma, norm_layer.beta

    add(prefix, *(layout.root if units else layout.root_only), stem["conv_root"], stem["gn_root"])
    for stage, unit, layer in units:
        base = prefix + layout.unit.format(stage=stage - 1 + layout.first, unit=unit - 1 + layout.first)
        for index, norm in enumerate(layout.norms, 1):
            add(base, f"conv{index}", norm, getattr(layer, f"conv{index}"), getattr(layer, f"gn{index}"))
        if layer.needs_projection:
            add(base, *layout.projection, layer.conv_proj, layer.gn_proj)
    return mapping


def stem_weights(
    state: Mapping[str, np.ndarray], layout: StemLayout, model: keras.Model, prefix: str | None = None
) -> list[tuple[keras.Variable, np.ndarray]]:
    """(variable, value) pairs that load the ResNet stem of `model` from checkpoint `state`.

    `state` maps source keys to arrays (numpy, or CPU tensors `np.asarray` accepts) named as
    `layout` says. Values come back float32 in Keras layout (HWIO kernels, flat GroupNorm
    parameters), checked against each variable's shape. Other keys of `state` are ignored unless
    they belong to a stem (`is_stem_key`): stem keys that fill no weight of `model` (a deeper
    ResNet's units) are an error, as are missing keys and mismatched shapes, and tensors that are
    not floating point or hold NaN/Inf; each raises `CheckpointError` naming them.
    """
    mapping = stem_name_map(model, layout, prefix)
    missing = [key for key in mapping if key not in state]
    if missing:
        raise CheckpointError(
            f"The checkpoint lacks {len(missing)} of the {len(mapping)} ResNet stem weights of "
            f"{model.name!r} (first: {missing[:3]}): it is not a {layout.format} checkpoint of this hybrid "
            "(check the variant, e.g. R50 vs R26, and the key prefix)."
        )
    extra = sorted(key for key in state if key not in mapping and is_stem_key(key, layout, prefix))
    if extra:
        raise CheckpointError(
            f"The checkpoint has {len(extra)} ResNet stem weights that {model.name!r} lacks (first: "
            f"{extra[:3]}): it was trained with more ResNet units or stages; build that variant."
        )
    pairs, mismatched = [], []
    root_kernel = _stem(model)["conv_root"].kernel
    for key, variable in mapping.items():
        value = np.asarray(state[key])
        if value.ndim == 4 and layout.oihw:
            value = value.transpose(2, 3, 1, 0)  # OIHW -> HWIO
        elif len(variable.shape) == 1:
            value = value.reshape(-1)  # (1, 1, 1, C) GroupNorm parameters of older Flax files
        # float32 (integer, string or NaN/Inf tensors refused); the root kernel adapted to the channels
        value = to_weight(key, value, variable.shape, input_conv=variable is root_kernel)
        if tuple(value.shape) != tuple(variable.shape):
            mismatched.append(f"{key}: checkpoint {tuple(value.shape)} vs model {tuple(variable.shape)}")
        pairs.append((variable, value))
    if mismatched:
        raise CheckpointError(
            f"ResNet stem weights do not fit {model.name!r} ({len(mismatched)} shapes differ, e.g. "
            f"{mismatched[0]}): build the hybrid variant (and channels) the checkpoint was trained with."
        )
    return pairs

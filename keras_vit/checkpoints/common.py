"""What the per-format converters share: target names, tensor transforms and the name-map driver.

Every format module turns a checkpoint into *canonical tensors*: arrays already in the Keras
layout, keyed by the path of the weight they fill, relative to the model
(`"block_3/attention/query/kernel"`, `"pos_embed/embedding"`, ...). A format is described by
two name maps -- top-level keys, and keys inside encoder block `i` -- from a checkpoint key to
`(target suffix, transform)` pairs; `apply_name_maps` runs them. Each format module also tells
which of its keys belong to a hybrid's ResNet stem (its `is_stem_key`): `apply_name_maps` sets
those apart, and the stem's own name map (`stem_name_map`, in the format's `StemLayout`) loads
(`stem_weights`) and writes them.
The writers run the same maps backwards (`invert_name_maps`): each transform has its inverse
(`_INVERSES`), and a key that fills several targets gets their parts concatenated.
Each format declares itself once as a `CheckpointFormat` (its module's `FORMAT`), listed in
`keras_vit.checkpoints.formats.FORMATS`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from keras_vit.checkpoints.errors import CheckpointError

if TYPE_CHECKING:
    import keras

# Canonical names: the weights' paths in a keras_vit model, relative to the model.
PATCH_KERNEL = "patch_embed/projection/kernel"
PATCH_BIAS = "patch_embed/projection/bias"
CLASS_TOKEN = "class_token/token"
POS_EMBED = "pos_embed/embedding"
ENCODER_NORM_SCALE = "encoder_norm/gamma"
ENCODER_NORM_BIAS = "encoder_norm/beta"
PRE_LOGITS_KERNEL = "pre_logits/kernel"
PRE_LOGITS_BIAS = "pre_logits/bias"
HEAD_KERNEL = "head/kernel"
HEAD_BIAS = "head/bias"
POOL = "pool/"  # prefix of the attention-pooling (MAP) head's weights
BLOCK = "block_{index}/{suffix}"
_BLOCK_NAME = re.compile(r"block_(\d+)/")  # the inverse of `BLOCK`


def block_count(names) -> int:
    """How many Transformer blocks canonical names (`block_{index}/...`) fill: 1 + the highest index."""
    return 1 + max((int(match.group(1)) for match in map(_BLOCK_NAME.match, names) if match), default=-1)


# (target, transform(array, num_heads) -> array); a key may fill several targets (fused qkv).
Transform = Callable[[np.ndarray, int | None], np.ndarray]
Rules = tuple[tuple[str, Transform], ...]


@dataclass(frozen=True)
class CanonicalTensor:
    """A tensor in Keras layout, with the checkpoint key and shape it came from (for messages)."""

    value: np.ndarray
    source: str
    source_shape: tuple[int, ...]


@dataclass
class Conversion:
    """A converted checkpoint: canonical tensors, a hybrid's ResNet stem (its arrays by checkpoint key,
    for `stem_weights`), and the checkpoint keys that map to nothing."""

    tensors: dict[str, CanonicalTensor] = field(default_factory=dict)
    stem: dict[str, np.ndarray] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StemLayout:
    """How one checkpoint format names the weights of a hybrid's BiT ResNet stem."""

    format: str  # the format's name, for messages
    prefix: str  # before every stem key (the default; a file may nest it elsewhere)
    root: tuple[str, str]  # the root convolution's and GroupNorm's base names, in a stem with units
    root_only: tuple[str, str]  # the same in a stem without units (R+ViT-Ti/16)
    unit: str  # a unit's base, from `{stage}` and `{unit}` numbered from `first`
    unit_key: re.Pattern  # a unit key (after the prefix) -> (stage, unit)
    first: int  # the number of the first stage and unit
    norms: tuple[str, str, str]  # the unit's three GroupNorms (convolutions are conv1..3 everywhere)
    projection: tuple[str, str]  # the unit's projection convolution and GroupNorm
    kernel: str  # a convolution kernel's suffix
    scale_bias: tuple[str, str]  # a GroupNorm's scale and bias suffixes
    oihw: bool  # kernels stored (out, in, height, width), PyTorch's order
    stem_key: re.Pattern | None = None  # which keys under the prefix are the stem's (None: all of them)


@dataclass(frozen=True)
class CheckpointFormat:
    """One checkpoint format, declared once in its module (`format_<name>.FORMAT`): the loader, the
    writers, `save_pretrained`, the model card and the CLI's choices all read this row."""

    name: str  # "timm", "hf", "google_npz": `format=` and `--to` / `--format`
    description: str  # its key layout, for the error that lists the formats a file may be in
    library: str  # the library that reads it (the model card's `library_name`)
    numerics: str  # `ViTConfig.numerics` of its own code (transformers files refine it from config.json)
    pos_embed_interpolation: str  # how its own code resamples position embeddings (`pos_embed`)
    files: tuple[str, ...]  # what `write` writes into a folder, the weights file first
    stem: StemLayout | None  # how it names a hybrid's ResNet stem; None: it holds no hybrids
    matches: Callable[[Collection[str]], bool]  # whether a checkpoint's keys are this format's
    normalise: Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]  # prefixes off, blocks apart
    num_heads: Callable[[Mapping[str, np.ndarray]], int | None]  # the head count, where the file has it
    convert: Callable[[Mapping[str, np.ndarray], int | None], Conversion]  # to canonical tensors
    check: Callable[[keras.Model], None]  # `NotExpressibleError` for what the format cannot express
    write: Callable[..., None]  # `write(model, folder, preprocessing, labels)`


def model_targets(model: keras.Model) -> dict[str, keras.Variable]:
    """Every Transformer weight of `model` by its canonical name (`block_0/fc1/kernel`).

    A hybrid's ResNet stem (`model.stem`) is left out: `common.stem_name_map` maps it.
    """
    stem = {id(layer) for layer in model.stem.values()}
    return {
        layer.name + variable.path[len(layer.path) :]: variable
        for layer in model.layers
        if id(layer) not in stem
        for variable in layer.weights
    }


# ---- per-tensor transforms --------------------------------------------------------------------


def keep(array: np.ndarray, num_heads: int | None = None) -> np.ndarray:
    """Already in Keras layout (Google checkpoints, tokens, norms, biases)."""
    return array


def linear_kernel(array: np.ndarray, num_heads: int | None = None) -> np.ndarray:
    """PyTorch `Linear.weight` (out, in) -> Keras `Dense.kernel` (in, out)."""
    return array.T


def conv_kernel(array: np.ndarray, num_heads: int | None = None) -> np.ndarray:
    """PyTorch `Conv2d.weight` OIHW -> Keras `Conv2D.kernel` HWIO."""
    return array.transpose(2, 3, 1, 0) if array.ndim == 4 else array


def conv_kernel_out(array: np.ndarray, num_heads: int | None = None) -> np.ndarray:
    """Keras `Conv2D.kernel` HWIO -> PyTorch `Conv2d.weight` OIHW (the inverse of `conv_kernel`)."""
    return array.transpose(3, 2, 0, 1) if array.ndim == 4 else array


def _divides(size: int, num_heads: int | None) -> bool:
    return num_heads is not None and num_heads > 0 and size % num_heads == 0


def heads_in(array: np.ndarray, num_heads: int | None) -> np.ndarray:
    """A query/key/value kernel (D, H*hd) -> (D, H, hd), or a bias (H*hd,) -> (H, hd).

    Left as it is when `num_heads` is unknown or does not divide the width: the shape check
    then reports the tensor.
    """
    if not _divides(array.shape[-1], num_heads):
        return array
    return array.reshape(*array.shape[:-1], num_heads, array.shape[-1] // num_heads)


def heads_out(array: np.ndarray, num_heads: int | None) -> np.ndarray:
    """The attention output kernel (H*hd, D) -> (H, hd, D), as `MultiHeadAttention` stores it."""
    if array.ndim != 2 or not _divides(array.shape[0], num_heads):
        return array
    return array.reshape(num_heads, array.shape[0] // num_heads, array.shape[1])


def heads_merged(array: np.ndarray, num_heads: int | None = None) -> np.ndarray:
    """(D, H, hd) -> (D, H*hd), (H, hd) -> (H*hd,): the inverse of `heads_in`."""
    return array.reshape(*array.shape[:-2], -1) if array.ndim >= 2 else array


def heads_out_merged(array: np.ndarray, num_heads: int | None = None) -> np.ndarray:
    """(H, hd, D) -> (H*hd, D): the inverse of `heads_out`."""
    return array.reshape(-1, array.shape[-1]) if array.ndim == 3 else array


# transform -> the transform that undoes it (Keras layout -> checkpoint layout), for the writers.
_INVERSES: dict[Transform, Transform] = {
    keep: keep,
    linear_kernel: linear_kernel,
    conv_kernel: conv_kernel_out,
    heads_in: heads_merged,
    heads_out: heads_out_merged,
}


def compose(*transforms: Transform) -> Transform:
    """Apply `transforms` left to right."""

    def composed(array: np.ndarray, num_heads: int | None) -> np.ndarray:
        for transform in transforms:
            array = transform(array, num_heads)
        return array

    inverses = [_INVERSES.get(transform) for transform in reversed(transforms)]
    if all(inverses):
        _INVERSES[composed] = compose(*inverses)
    return composed


def fused_part(index: int, parts: int = 3) -> Transform:
    """Part `index` of `parts` equal slices along axis 0 (timm's fused qkv weight and bias)."""

    def part(array: np.ndarray, num_heads: int | None) -> np.ndarray:
        size = array.shape[0] // parts
        return array[index * size : (index + 1) * size]

    _INVERSES[part] = keep  # `invert_name_maps` concatenates the parts of a fused key
    return part


# What `as_weight` calls the kinds of tensors that are never weights.
_KINDS = {"i": "integer", "u": "unsigned integer", "b": "bool", "U": "string", "S": "bytes", "O": "object",
          "c": "complex"}  # fmt: skip


def as_weight(name: str, value, dtype: str | np.dtype = "float32") -> np.ndarray:
    """`value` as a `dtype` array for the weight `name`, or a `CheckpointError` that names it.

    Weights are floating point: an integer, bool, string or object tensor is refused, not cast
    (an int32 kernel cast silently gives wrong outputs), as is a tensor with NaN or Inf values
    (counted after the cast, so float64 values beyond float32's range count too).
    """
    value = np.asarray(value)
    if value.dtype.kind != "f" and value.dtype != ml_dtypes.bfloat16:
        raise CheckpointError(
            f"{name} holds {_KINDS.get(value.dtype.kind, 'non-float')} values ({value.dtype}), not floating "
            "point: weights are never integer, bool or string tensors. The file is damaged or not a model "
            "checkpoint."
        )
    with np.errstate(over="ignore"):  # values beyond `dtype`'s range become Inf, counted below
        cast = np.asarray(value, dtype=dtype)
    bad = cast.size - int(np.count_nonzero(np.isfinite(cast)))
    if bad:
        raise CheckpointError(
            f"{name} holds {bad} NaN/Inf value(s) of {cast.size} (as {np.dtype(cast.dtype).name}): the "
            "checkpoint is damaged or comes from a diverged run."
        )
    return cast


def to_weight(
    name: str, value, shape, dtype: str | np.dtype = "float32", input_conv: bool = False
) -> np.ndarray:
    """A checkpoint tensor as the value of the weight `name` of `shape`, the one place a stored value
    becomes a weight: checked and cast (`as_weight`), and for an input convolution's kernel (the patch
    embedding, a hybrid's root conv) stored for other input channels, adapted (`adapt_input_conv`)."""
    value = as_weight(name, value, dtype)
    shape = tuple(shape)
    if (
        input_conv
        and value.ndim == 4
        and len(shape) == 4
        and value.shape[:2] + value.shape[3:] == shape[:2] + shape[3:]
    ):
        value = adapt_input_conv(value, shape[2]).astype(dtype, copy=False)
    return value


def adapt_input_conv(kernel: np.ndarray, channels: int) -> np.ndarray:
    """A patch kernel (P, P, C, D) for `channels` inputs, as timm's `adapt_input_conv`.

    One channel: the sum over the checkpoint's channels. Otherwise the channels are repeated
    cyclically up to `channels` and scaled by C / `channels`, which keeps the response to a
    grey image. Computed in float32.
    """
    kernel = np.asarray(kernel, dtype=np.float32)
    stored = kernel.shape[2]
    if channels == stored:
        return kernel
    if channels == 1:
        return kernel.sum(axis=2, keepdims=True)
    repeats = -(-channels // stored)
    return np.tile(kernel, (1, 1, repeats, 1))[:, :, :channels] * (stored / channels)


# ---- the name-map driver ----------------------------------------------------------------------


def rules(*pairs: tuple[str, Transform]) -> Rules:
    """The targets one checkpoint key fills: `(target suffix, transform)` pairs."""
    return tuple(pairs)


def apply_name_maps(
    state: Mapping[str, np.ndarray],
    *,
    top: Mapping[str, Rules],
    block_pattern: re.Pattern,
    block: Mapping[str, Rules],
    num_heads: int | None,
    ignore: Callable[[str], bool] = lambda key: False,
    stem: Callable[[str], bool] = lambda key: False,
) -> Conversion:
    """Convert every key of `state` with the top-level or per-block name map.

    `block_pattern` matches a block key with two groups: the block index and the key inside the
    block. Keys for which `ignore` is true are dropped; keys of a hybrid's ResNet stem (`stem`: the
    format's `is_stem_key`) are set apart in `Conversion.stem`; keys no map knows go to `unused`.
    Two keys filling the same target raise `CheckpointError`.
    """
    conversion = Conversion()
    for key, array in state.items():
        if ignore(key):
            continue
        if stem(key):
            conversion.stem[key] = np.asarray(array)
            continue
        match = block_pattern.fullmatch(key)
        if match:
            targets = block.get(match.group(2))
            prefix = BLOCK.format(index=int(match.group(1)), suffix="")
        else:
            targets = top.get(key)
            prefix = ""
        if targets is None:
            conversion.unused.append(key)
            continue
        array = np.asarray(array)
        for suffix, transform in targets:
            name = prefix + suffix
            if name in conversion.tensors:
                raise CheckpointError(
                    f"Checkpoint keys {conversion.tensors[name].source!r} and {key!r} both fill {name!r}: "
                    "the checkpoint mixes two layouts; keep one."
                )
            conversion.tensors[name] = CanonicalTensor(transform(array, num_heads), key, array.shape)
    return conversion


def invert_name_maps(
    tensors: Mapping[str, np.ndarray],
    *,
    top: Mapping[str, Rules],
    block_key: str,
    block: Mapping[str, Rules],
) -> tuple[dict[str, np.ndarray], set[str]]:
    """The name maps run backwards: checkpoint arrays from canonical tensors (Keras layout).

    `block_key` is the checkpoint name of a block key, e.g. `"blocks.{index}.{key}"`. Each
    target is written under the first key that fills it in map order, so a format's aliases
    (transformers-5 names, big_vision names) are not written. A key filling several targets
    (timm's fused qkv) gets its parts, undone, concatenated along axis 0. Keys whose targets
    are not all in `tensors` are left out. Returns the arrays and the canonical names they hold.
    """
    arrays: dict[str, np.ndarray] = {}
    used: set[str] = set()

    def add(key: str, targets: Rules, prefix: str) -> None:
        names = [prefix + suffix for suffix, _ in targets]
        inverses = [_INVERSES.get(transform) for _, transform in targets]
        if not all(inverses) or any(name in used or name not in tensors for name in names):
            return
        parts = [
            inverse(np.asarray(tensors[name]), None) for name, inverse in zip(names, inverses, strict=True)
        ]
        arrays[key] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        used.update(names)

    for key, targets in top.items():
        add(key, targets, "")
    for index in range(block_count(tensors)):
        for key, targets in block.items():
            add(block_key.format(index=index, key=key), targets, BLOCK.format(index=index, suffix=""))
    return arrays, used


# ---- the hybrid stem ----------------------------------------------------------------------------
# Each format that holds hybrids names the BiT ResNet stem in its `StemLayout` (`FORMAT.stem`); these
# map any layout onto the Keras layers `resnet_conv_root`, `resnet_gn_root` and
# `resnet_block{s}_unit{u}` (sublayers `conv1..3`, `gn1..3`, `conv_proj`, `gn_proj`): the converters
# set the stem's keys apart (`is_stem_key`), the loader assigns them (`stem_weights`), the writers
# run `stem_name_map` backwards.


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

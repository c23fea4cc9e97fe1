"""What the per-format converters share: target names, tensor transforms and the name-map driver.

Every format module turns a checkpoint into *canonical tensors*: arrays already in the Keras
layout, keyed by the path of the weight they fill, relative to the model
(`"block_3/attention/query/kernel"`, `"pos_embed/embedding"`, ...). A format is described by
two name maps -- top-level keys, and keys inside encoder block `i` -- from a checkpoint key to
`(target suffix, transform)` pairs; `apply_name_maps` runs them. Each format module also tells
which of its keys belong to a hybrid's ResNet stem (`is_stem_key`): the loader sets those apart.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from keras_vit.converters.errors import CheckpointError

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
BLOCK = "block_{index}/{suffix}"

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
    """A converted checkpoint: canonical tensors, and the checkpoint keys that map to nothing."""

    tensors: dict[str, CanonicalTensor] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)


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


def compose(*transforms: Transform) -> Transform:
    """Apply `transforms` left to right."""

    def composed(array: np.ndarray, num_heads: int | None) -> np.ndarray:
        for transform in transforms:
            array = transform(array, num_heads)
        return array

    return composed


def fused_part(index: int, parts: int = 3) -> Transform:
    """Part `index` of `parts` equal slices along axis 0 (timm's fused qkv weight and bias)."""

    def part(array: np.ndarray, num_heads: int | None) -> np.ndarray:
        size = array.shape[0] // parts
        return array[index * size : (index + 1) * size]

    return part


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
) -> Conversion:
    """Convert every key of `state` with the top-level or per-block name map.

    `block_pattern` matches a block key with two groups: the block index and the key inside the
    block. Keys for which `ignore` is true are dropped; keys no map knows go to `unused`. Two
    keys filling the same target raise `CheckpointError`.
    """
    conversion = Conversion()
    for key, array in state.items():
        if ignore(key):
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

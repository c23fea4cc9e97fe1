"""Google `.npz` checkpoints (flat `np.savez` of '/'-joined Flax parameter paths).

Accepted layouts: the original vision_transformer / AugReg names (`LayerNorm_0`,
`MultiHeadDotProductAttention_1`, `LayerNorm_2`, `MlpBlock_3`), optionally under `opt/target/`;
and big_vision names (`MultiHeadDotProductAttention_0`, `LayerNorm_1`, `MlpBlock_0`, top-level
`pos_embedding`), optionally under `params/` or `params/img/` and optionally scan-stacked
(`Transformer/encoderblock/...` with a leading depth axis). Keys outside the model's prefix
(optimizer state, another tower) are ignored. Flax kernels already have the Keras layout
(HWIO convolution, (D, H, hd) attention), so every tensor is copied as it is, except
big_vision's position embedding, which has no [class] token row: that tower adds the position
embedding before prepending the token, which equals a zero row for the token here.

big_vision's `pool_type="gap"` and `"map"` checkpoints have no `cls` parameter: their position
embedding is copied as it is, into a model built with `class_token=False`. The `"map"` head
(`MAPHead_0/probe`, `MAPHead_0/MultiHeadDotProductAttention_0/...`, `MAPHead_0/LayerNorm_0`,
`MAPHead_0/MlpBlock_0/...`) fills the model's `pool` (`MultiheadAttentionPooling`).

Writing: a keras_vit model as a Google `.npz` checkpoint (flat `np.savez` of '/'-joined Flax paths).

The reading maps run backwards, in the original vision_transformer layout that timm's
`_load_weights` and the JAX code read: `embedding`, `cls`,
`Transformer/posembed_input/pos_embedding`, `Transformer/encoderblock_{i}/LayerNorm_0`,
`MultiHeadDotProductAttention_1`, `LayerNorm_2`, `MlpBlock_3`, `Transformer/encoder_norm`,
`pre_logits`, `head`; a hybrid's ResNet as `conv_root`, `gn_root`, `block{s}/unit{u}/...`; an
attention-pooling head as big_vision's `MAPHead_0`. Flax kernels have the Keras layouts, so
every array is written as the model holds it; timm's LayerNorm after the pooling (`fc_norm`)
has no Google layout and is refused. The file stores no numerics or pooling:
`keras_vit.save_pretrained` records them next to it (`keras_vit.json`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

import numpy as np

from keras_vit.checkpoints import common
from keras_vit.checkpoints.common import Conversion, keep, rules
from keras_vit.checkpoints.errors import CheckpointError
from keras_vit.checkpoints.write_common import (
    check_writable,
    contiguous,
    refuse_inexpressible,
    stem_state,
    transformer_state,
)
from keras_vit.registry.catalog import Preprocessing

if TYPE_CHECKING:
    import keras

NAME = "google_npz"

# How the original code names a hybrid's stem (Flax paths; GroupNorm parameters of files saved before
# Flax 0.3.6 have shape (1, 1, 1, C)).
STEM = common.StemLayout(
    format=NAME,
    prefix="",
    root=("conv_root", "gn_root"),
    root_only=("conv_root", "gn_root"),
    unit="block{stage}/unit{unit}/",
    unit_key=re.compile(r"block(\d+)/unit(\d+)/.+"),
    first=1,
    norms=("gn1", "gn2", "gn3"),
    projection=("conv_proj", "gn_proj"),
    kernel="/kernel",
    scale_bias=("/scale", "/bias"),
    oihw=False,
    stem_key=re.compile(r"(conv_root|gn_root|block\d+/unit\d+)/.+"),
)
PREFIXES = ("opt/target/", "params/img/", "params/", "")
_STACKED = "Transformer/encoderblock/"
_BLOCK = re.compile(r"Transformer/encoderblock_(\d+)/(.+)")


def _prepend_class_position(array: np.ndarray, num_heads: int | None) -> np.ndarray:
    """big_vision's (1, N, D) patch-only position embedding -> (1, 1 + N, D), zero for the token."""
    if array.ndim != 3:
        return array
    return np.concatenate([np.zeros_like(array[:, :1]), array], axis=1)


_TOP = {
    "embedding/kernel": rules((common.PATCH_KERNEL, keep)),
    "embedding/bias": rules((common.PATCH_BIAS, keep)),
    "cls": rules((common.CLASS_TOKEN, keep)),
    "Transformer/posembed_input/pos_embedding": rules((common.POS_EMBED, keep)),
    "pos_embedding": rules((common.POS_EMBED, _prepend_class_position)),
    "Transformer/encoder_norm/scale": rules((common.ENCODER_NORM_SCALE, keep)),
    "Transformer/encoder_norm/bias": rules((common.ENCODER_NORM_BIAS, keep)),
    "pre_logits/kernel": rules((common.PRE_LOGITS_KERNEL, keep)),
    "pre_logits/bias": rules((common.PRE_LOGITS_BIAS, keep)),
    "head/kernel": rules((common.HEAD_KERNEL, keep)),
    "head/bias": rules((common.HEAD_BIAS, keep)),
}
_MAP_HEAD = "MAPHead_0/"


def _attention_and_mlp(
    attention: str, attention_target: str, mlp: str, mlp_target: str
) -> dict[str, common.Rules]:
    """Flax `MultiHeadDotProductAttention` keys under `attention` and `MlpBlock` keys under `mlp` -> the
    layer weights under `attention_target` / `mlp_target` (same layouts, copied as they are)."""
    mapping = {}
    for source, target in (
        ("query", "query"),
        ("key", "key"),
        ("value", "value"),
        ("out", "attention_output"),
    ):
        for weight in ("kernel", "bias"):
            mapping[f"{attention}/{source}/{weight}"] = rules((f"{attention_target}{target}/{weight}", keep))
    for dense, target in (("Dense_0", "fc1"), ("Dense_1", "fc2")):
        for weight in ("kernel", "bias"):
            mapping[f"{mlp}/{dense}/{weight}"] = rules((f"{mlp_target}{target}/{weight}", keep))
    return mapping


def _map_head_map() -> dict[str, common.Rules]:
    """big_vision's `MAPHead` keys -> the `pool` layer's weights (same layouts, copied as they are)."""
    mapping = {f"{_MAP_HEAD}probe": rules((f"{common.POOL}probe", keep))}
    mapping |= _attention_and_mlp(
        f"{_MAP_HEAD}MultiHeadDotProductAttention_0", common.POOL, f"{_MAP_HEAD}MlpBlock_0", common.POOL
    )
    for weight, target in (("scale", "gamma"), ("bias", "beta")):
        mapping[f"{_MAP_HEAD}LayerNorm_0/{weight}"] = rules((f"{common.POOL}norm/{target}", keep))
    return mapping


_TOP |= _map_head_map()
# Without a [class] token (pool_type "gap" / "map") the position embedding covers the patches only.
_TOP_WITHOUT_CLASS_TOKEN = _TOP | {"pos_embedding": rules((common.POS_EMBED, keep))}


def _block_map() -> dict[str, common.Rules]:
    """Both namings: (original, big_vision) module names for each sublayer."""
    names = {
        "norm1": ("LayerNorm_0", "LayerNorm_0"),
        "attention": ("MultiHeadDotProductAttention_1", "MultiHeadDotProductAttention_0"),
        "norm2": ("LayerNorm_2", "LayerNorm_1"),
        "mlp": ("MlpBlock_3", "MlpBlock_0"),
    }
    mapping = {}
    for naming in (0, 1):
        for norm in ("norm1", "norm2"):
            mapping[f"{names[norm][naming]}/scale"] = rules((f"{norm}/gamma", keep))
            mapping[f"{names[norm][naming]}/bias"] = rules((f"{norm}/beta", keep))
        mapping |= _attention_and_mlp(names["attention"][naming], "attention/", names["mlp"][naming], "")
    return mapping


_BLOCK_MAP = _block_map()


def _prefix(keys: Collection[str]) -> str | None:
    for prefix in PREFIXES:
        if f"{prefix}embedding/kernel" in keys:
            return prefix
    return None


def matches(keys: Collection[str]) -> bool:
    """Whether the keys look like a Google checkpoint (an `embedding/kernel` under a known prefix)."""
    return _prefix(keys) is not None


def normalise(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Drop the prefix (and keys outside it) and unstack scan-stacked blocks into `encoderblock_{i}`."""
    prefix = _prefix(state)
    if prefix is None:
        raise CheckpointError(
            f"Not a Google .npz checkpoint: no 'embedding/kernel' key under any of the prefixes {PREFIXES}."
        )
    flat = {}
    for key, value in state.items():
        if not key.startswith(prefix):
            continue
        key = key[len(prefix) :]
        if key.startswith(_STACKED):
            for index, layer in enumerate(np.asarray(value)):
                flat[f"Transformer/encoderblock_{index}/{key[len(_STACKED) :]}"] = layer
        else:
            flat[key] = value
    return flat


def is_stem_key(key: str) -> bool:
    """Whether a (normalised) key belongs to a hybrid's ResNet stem (`conv_root`, `block1/unit1/...`)."""
    return common.is_stem_key(key, STEM)


def num_heads(flat: Mapping[str, np.ndarray]) -> int | None:
    """The head count, read from the (D, heads, hd) query kernel of the first block."""
    for attention in ("MultiHeadDotProductAttention_1", "MultiHeadDotProductAttention_0"):
        kernel = flat.get(f"Transformer/encoderblock_0/{attention}/query/kernel")
        if kernel is not None and np.ndim(kernel) == 3:
            return int(np.shape(kernel)[1])
    return None


def convert(flat: Mapping[str, np.ndarray], num_heads: int | None) -> Conversion:
    """Canonical tensors of a normalised Google checkpoint (stem keys set apart); heads are in the file."""
    top = _TOP if "cls" in flat else _TOP_WITHOUT_CLASS_TOKEN
    return common.apply_name_maps(
        flat, top=top, block_pattern=_BLOCK, block=_BLOCK_MAP, num_heads=num_heads, stem=is_stem_key
    )


# ---- writing ----

WEIGHTS_FILE = "model.npz"
# What `write` writes: save_pretrained replaces only these (and its own keras_vit.json, README.md).
FILES = (WEIGHTS_FILE,)


def check(model: keras.Model) -> None:
    """A `NotExpressibleError` for timm's LayerNorm after the pooling (`fc_norm`): Google files have none."""
    config = check_writable(model, NAME)
    if config.fc_norm:
        refuse_inexpressible(
            model,
            NAME,
            [
                "its final LayerNorm follows the average pooling (fc_norm=True, timm's layout), the Google "
                "layout normalises the tokens before pooling (Transformer/encoder_norm); use the timm format"
            ],
        )


def state_dict(model: keras.Model) -> dict[str, np.ndarray]:
    """The Google `.npz` arrays of `model`, by key."""
    check(model)
    state = transformer_state(
        model,
        NAME,
        top=_TOP,
        block_key="Transformer/encoderblock_{index}/{key}",
        block=_BLOCK_MAP,
    )
    if model.config.is_hybrid:
        state.update(stem_state(model, STEM))
    return contiguous(state)


def write(
    model: keras.Model, directory: str | os.PathLike, preprocessing: Preprocessing, labels: list[str] | None
) -> str:
    """Write `model.npz` into `directory` (an uncompressed `np.savez`, like the published files)."""
    with open(os.path.join(directory, WEIGHTS_FILE), "wb") as file:
        np.savez(file, **state_dict(model))
    return WEIGHTS_FILE


FORMAT = common.CheckpointFormat(
    name=NAME,
    description="Google .npz ('embedding/kernel', 'Transformer/encoderblock_0/...', optionally under "
    "'opt/target/', 'params/' or 'params/img/')",
    library="keras",
    numerics="jax",
    pos_embed_interpolation="jax",
    files=FILES,
    stem=STEM,
    matches=matches,
    normalise=normalise,
    num_heads=num_heads,
    convert=convert,
    check=check,
    write=write,
)

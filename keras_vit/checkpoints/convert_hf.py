"""Hugging Face transformers ViT checkpoints (`ViTModel`, `ViTForImageClassification`).

Keys may carry the `vit.` prefix (`ViTForImageClassification`) or not (a `ViTModel` saved on
its own), and blocks may use the saved layout (`encoder.layer.{i}.attention.attention.query`,
what `save_pretrained` and every hub file have) or the transformers >= 5 in-memory one
(`layers.{i}.attention.q_proj`, `mlp.fc1`: what `torch.save(model.state_dict())` writes).
Linear weights are transposed, the patch convolution goes OIHW -> HWIO, and the separate
query/key/value weights are split per head. `pooler.dense` (+ tanh) is the paper's pre-logits
layer; `classifier` is the head; `embeddings.mask_token` (masked image modelling) has no
counterpart and is ignored. transformers stores no head count in the weights: `config.json`
next to the file gives it (`num_attention_heads`), else the model's is used.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

import numpy as np

from keras_vit.checkpoints import common
from keras_vit.checkpoints.common import (
    Conversion,
    compose,
    conv_kernel,
    heads_in,
    heads_out,
    keep,
    linear_kernel,
    rules,
)

NAME = "hf"
_PREFIX = "vit."
_PATCH_WEIGHT = "embeddings.patch_embeddings.projection.weight"
_STEM_PREFIX = "embeddings.patch_embeddings.backbone."
_IGNORED = ("embeddings.mask_token",)
# Blocks are `encoder.layer.{i}` in saved files (`save_pretrained` writes this original layout)
# and `layers.{i}` in transformers >= 5 in-memory state dicts (e.g. `torch.save(model.state_dict())`).
_BLOCK = re.compile(r"(?:encoder\.layer|layers)\.(\d+)\.(.+)")

_TOP = {
    _PATCH_WEIGHT: rules((common.PATCH_KERNEL, conv_kernel)),
    "embeddings.patch_embeddings.projection.bias": rules((common.PATCH_BIAS, keep)),
    "embeddings.cls_token": rules((common.CLASS_TOKEN, keep)),
    "embeddings.position_embeddings": rules((common.POS_EMBED, keep)),
    "layernorm.weight": rules((common.ENCODER_NORM_SCALE, keep)),
    "layernorm.bias": rules((common.ENCODER_NORM_BIAS, keep)),
    "pooler.dense.weight": rules((common.PRE_LOGITS_KERNEL, linear_kernel)),
    "pooler.dense.bias": rules((common.PRE_LOGITS_BIAS, keep)),
    "classifier.weight": rules((common.HEAD_KERNEL, linear_kernel)),
    "classifier.bias": rules((common.HEAD_BIAS, keep)),
}


def _block_map() -> dict[str, common.Rules]:
    """Per-block keys of both layouts: (saved name, transformers 5 name) -> Keras sublayer."""
    linear = compose(linear_kernel, heads_in)
    sublayers = (
        # saved name, transformers >= 5 name, keras sublayer, kernel transform, bias transform
        ("layernorm_before", "layernorm_before", "norm1", None, keep),
        ("attention.attention.query", "attention.q_proj", "attention/query", linear, heads_in),
        ("attention.attention.key", "attention.k_proj", "attention/key", linear, heads_in),
        ("attention.attention.value", "attention.v_proj", "attention/value", linear, heads_in),
        (
            "attention.output.dense",
            "attention.o_proj",
            "attention/attention_output",
            compose(linear_kernel, heads_out),
            keep,
        ),
        ("layernorm_after", "layernorm_after", "norm2", None, keep),
        ("intermediate.dense", "mlp.fc1", "fc1", linear_kernel, keep),
        ("output.dense", "mlp.fc2", "fc2", linear_kernel, keep),
    )
    mapping = {}
    for saved, current, target, kernel, bias in sublayers:
        for name in (saved, current):
            if kernel is None:  # LayerNorm
                mapping[f"{name}.weight"] = rules((f"{target}/gamma", keep))
                mapping[f"{name}.bias"] = rules((f"{target}/beta", keep))
            else:
                mapping[f"{name}.weight"] = rules((f"{target}/kernel", kernel))
                mapping[f"{name}.bias"] = rules((f"{target}/bias", bias))
    return mapping


_BLOCK_MAP = _block_map()


def matches(keys: Collection[str]) -> bool:
    """Whether the keys look like a transformers ViT (`[vit.]embeddings.patch_embeddings...`)."""
    return _PATCH_WEIGHT in keys or f"{_PREFIX}{_PATCH_WEIGHT}" in keys


def normalise(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Drop the `vit.` prefix of `ViTForImageClassification` keys."""
    return {key.removeprefix(_PREFIX): value for key, value in state.items()}


def is_stem_key(key: str) -> bool:
    """Whether a (normalised) key belongs to a `ViTHybrid` BiT backbone."""
    return key.startswith(_STEM_PREFIX)


def num_heads(flat: Mapping[str, np.ndarray]) -> int | None:
    """The weights do not record the head count (`config.json` does: see `inspect_checkpoint`)."""
    return None


def convert(flat: Mapping[str, np.ndarray], num_heads: int | None) -> Conversion:
    """Canonical tensors of a normalised transformers state dict, attention split into `num_heads` heads."""
    return common.apply_name_maps(
        flat,
        top=_TOP,
        block_pattern=_BLOCK,
        block=_BLOCK_MAP,
        num_heads=num_heads,
        ignore=lambda key: key in _IGNORED,
    )

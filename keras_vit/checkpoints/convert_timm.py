"""timm `VisionTransformer` state dicts (`model.safetensors` on the hub, or a torch.save'd state dict).

PyTorch layouts: Linear weights (out, in) are transposed, the patch convolution goes OIHW ->
HWIO, and the fused `attn.qkv` (3D, D) weight is cut into query, key and value, each split per
head as `(D, heads, D/heads)` (timm orders the fused output as (3, heads, head_dim)). timm
stores no head count: the model's is used. Old timm checkpoints' `pre_logits.fc` loads into
the model's `pre_logits` layer.

Class-token-free models (`class_token=False`) have no `cls_token`. `global_pool="avg"` models
normalise after pooling by default (`fc_norm.*` instead of `norm.*`): that LayerNorm fills
`encoder_norm` of a model built with `fc_norm=True`. `global_pool="map"` models'
`AttentionPoolLatent` (`attn_pool.latent`, `attn_pool.q`, the fused `attn_pool.kv` (2D, D) cut
into key and value, `attn_pool.proj`, `attn_pool.norm`, `attn_pool.mlp`) fills the `pool` layer.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

import numpy as np

from keras_vit.checkpoints import common, resnet_stem
from keras_vit.checkpoints.common import (
    Conversion,
    compose,
    conv_kernel,
    fused_part,
    heads_in,
    heads_out,
    keep,
    linear_kernel,
    rules,
)

NAME = "timm"
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")

_TOP = {
    "patch_embed.proj.weight": rules((common.PATCH_KERNEL, conv_kernel)),
    "patch_embed.proj.bias": rules((common.PATCH_BIAS, keep)),
    "cls_token": rules((common.CLASS_TOKEN, keep)),
    "pos_embed": rules((common.POS_EMBED, keep)),
    "norm.weight": rules((common.ENCODER_NORM_SCALE, keep)),
    "norm.bias": rules((common.ENCODER_NORM_BIAS, keep)),
    "pre_logits.fc.weight": rules((common.PRE_LOGITS_KERNEL, linear_kernel)),
    "pre_logits.fc.bias": rules((common.PRE_LOGITS_BIAS, keep)),
    "head.weight": rules((common.HEAD_KERNEL, linear_kernel)),
    "head.bias": rules((common.HEAD_BIAS, keep)),
    "fc_norm.weight": rules((common.ENCODER_NORM_SCALE, keep)),
    "fc_norm.bias": rules((common.ENCODER_NORM_BIAS, keep)),
    "attn_pool.latent": rules((f"{common.POOL}probe", keep)),
    "attn_pool.q.weight": rules((f"{common.POOL}query/kernel", compose(linear_kernel, heads_in))),
    "attn_pool.q.bias": rules((f"{common.POOL}query/bias", heads_in)),
    "attn_pool.kv.weight": rules(
        *(
            (f"{common.POOL}{name}/kernel", compose(fused_part(i, 2), linear_kernel, heads_in))
            for i, name in enumerate(("key", "value"))
        )
    ),
    "attn_pool.kv.bias": rules(
        *(
            (f"{common.POOL}{name}/bias", compose(fused_part(i, 2), heads_in))
            for i, name in enumerate(("key", "value"))
        )
    ),
    "attn_pool.proj.weight": rules(
        (f"{common.POOL}attention_output/kernel", compose(linear_kernel, heads_out))
    ),
    "attn_pool.proj.bias": rules((f"{common.POOL}attention_output/bias", keep)),
    "attn_pool.norm.weight": rules((f"{common.POOL}norm/gamma", keep)),
    "attn_pool.norm.bias": rules((f"{common.POOL}norm/beta", keep)),
    "attn_pool.mlp.fc1.weight": rules((f"{common.POOL}fc1/kernel", linear_kernel)),
    "attn_pool.mlp.fc1.bias": rules((f"{common.POOL}fc1/bias", keep)),
    "attn_pool.mlp.fc2.weight": rules((f"{common.POOL}fc2/kernel", linear_kernel)),
    "attn_pool.mlp.fc2.bias": rules((f"{common.POOL}fc2/bias", keep)),
}
# The LayerNorm after the pooling (`fc_norm`, timm's default for global_pool="avg").
FC_NORM_KEYS = ("fc_norm.weight", "fc_norm.bias")
_QKV = ("query", "key", "value")
_BLOCK_MAP = {
    "norm1.weight": rules(("norm1/gamma", keep)),
    "norm1.bias": rules(("norm1/beta", keep)),
    "attn.qkv.weight": rules(
        *(
            (f"attention/{name}/kernel", compose(fused_part(i), linear_kernel, heads_in))
            for i, name in enumerate(_QKV)
        )
    ),
    "attn.qkv.bias": rules(
        *((f"attention/{name}/bias", compose(fused_part(i), heads_in)) for i, name in enumerate(_QKV))
    ),
    "attn.proj.weight": rules(("attention/attention_output/kernel", compose(linear_kernel, heads_out))),
    "attn.proj.bias": rules(("attention/attention_output/bias", keep)),
    "norm2.weight": rules(("norm2/gamma", keep)),
    "norm2.bias": rules(("norm2/beta", keep)),
    "mlp.fc1.weight": rules(("fc1/kernel", linear_kernel)),
    "mlp.fc1.bias": rules(("fc1/bias", keep)),
    "mlp.fc2.weight": rules(("fc2/kernel", linear_kernel)),
    "mlp.fc2.bias": rules(("fc2/bias", keep)),
}


def matches(keys: Collection[str]) -> bool:
    """Whether the keys look like a timm ViT (`patch_embed.proj.weight`, `blocks.N.*`)."""
    return "patch_embed.proj.weight" in keys or ("cls_token" in keys and "pos_embed" in keys)


def normalise(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """timm keys need no normalising."""
    return dict(state)


def is_stem_key(key: str) -> bool:
    """Whether a key belongs to a hybrid's ResNet backbone (`patch_embed.backbone.*`)."""
    return resnet_stem.is_stem_key(key, NAME)


def num_heads(flat: Mapping[str, np.ndarray]) -> int | None:
    """timm checkpoints do not record the head count."""
    return None


def convert(flat: Mapping[str, np.ndarray], num_heads: int | None) -> Conversion:
    """Canonical tensors of a timm state dict (stem keys removed), attention split into `num_heads` heads."""
    return common.apply_name_maps(flat, top=_TOP, block_pattern=_BLOCK, block=_BLOCK_MAP, num_heads=num_heads)

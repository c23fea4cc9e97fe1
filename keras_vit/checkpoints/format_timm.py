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

Writing: a keras_vit model as a timm checkpoint: `model.safetensors` + timm's `config.json`.

The reading maps run backwards (its name maps run backwards; the hybrid stem by
`common.stem_name_map`). `config.json` is what timm's `push_to_hf_hub` writes:
`architecture` (a registered timm model), `num_classes`, `global_pool`, `model_args` (every
size, so any keras_vit architecture rebuilds: `timm.create_model("hf-hub:org/name")` or
`"local-dir:/path"`) and `pretrained_cfg` with the preprocessing (input size, mean/std,
crop_pct, interpolation) and `label_names`.

What timm's `VisionTransformer` cannot express is refused: a pre-logits layer, LayerNorm
epsilons other than 1e-6 (`numerics="hf"`), a hybrid's JAX stem epsilons, ResNet stages that
no timm hybrid has, an MLP width that is no exact multiple timm can rebuild.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

import numpy as np
from safetensors.numpy import save_file

from keras_vit.checkpoints import common
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
from keras_vit.checkpoints.write_common import (
    check_writable,
    contiguous,
    numerics,
    refuse_inexpressible,
    stem_state,
    transformer_state,
)
from keras_vit.registry.catalog import Preprocessing

if TYPE_CHECKING:
    import keras

NAME = "timm"

# How timm's `ResNetV2` backbone names a hybrid's stem (under `patch_embed.backbone.`).
STEM = common.StemLayout(
    format=NAME,
    prefix="patch_embed.backbone.",
    root=("stem.conv", "stem.norm"),
    root_only=("conv", "norm"),
    unit="stages.{stage}.blocks.{unit}.",
    unit_key=re.compile(r"stages\.(\d+)\.blocks\.(\d+)\..+"),
    first=0,
    norms=("norm1", "norm2", "norm3"),
    projection=("downsample.conv", "downsample.norm"),
    kernel=".weight",
    scale_bias=(".weight", ".bias"),
    oihw=True,
)
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
    return common.is_stem_key(key, STEM)


def num_heads(flat: Mapping[str, np.ndarray]) -> int | None:
    """timm checkpoints do not record the head count."""
    return None


def convert(flat: Mapping[str, np.ndarray], num_heads: int | None) -> Conversion:
    """Canonical tensors of a timm state dict (stem keys set apart), attention split into `num_heads`."""
    return common.apply_name_maps(
        flat, top=_TOP, block_pattern=_BLOCK, block=_BLOCK_MAP, num_heads=num_heads, stem=is_stem_key
    )


# ---- writing ----

WEIGHTS_FILE = "model.safetensors"
# What `write` writes: save_pretrained replaces only these (and its own keras_vit.json, README.md).
FILES = (WEIGHTS_FILE, "config.json")
# keras_vit variant -> timm's registered model of the same architecture at 224 px (model_args set every
# size anyway; the tests build their timm references from it).
TIMM_ARCHITECTURES = {
    "vit_ti16": "vit_tiny_patch16_224",
    "vit_s16": "vit_small_patch16_224",
    "vit_s32": "vit_small_patch32_224",
    "vit_s8": "vit_small_patch8_224",
    "vit_b8": "vit_base_patch8_224",
    "vit_b16": "vit_base_patch16_224",
    "vit_b32": "vit_base_patch32_224",
    "vit_l16": "vit_large_patch16_224",
    "vit_l32": "vit_large_patch32_224",
    "vit_h14": "vit_huge_patch14_224",
}
# ResNet units per stage -> the timm hybrid that builds that ResNetV2 (`vision_transformer_hybrid`).
_HYBRIDS = {
    (): "vit_tiny_r_s16_p8_224",
    (2, 2, 2, 2): "vit_small_r26_s32_224",
    (3, 4, 9): "vit_base_r50_s16_224",
    (3, 4, 6, 3): "vit_large_r50_s32_224",
}
_GLOBAL_POOL = {"token": "token", "gap": "avg", "map": "map", None: ""}


def check(model: keras.Model) -> None:
    """A `NotExpressibleError` naming what of `model` timm's `VisionTransformer` cannot rebuild."""
    config = check_writable(model, NAME)
    problems = []
    if model.pre_logits is not None:
        problems.append(
            f"a pre-logits layer (representation_size={model.representation_size}): timm's VisionTransformer "
            "has none; drop it with model.rebuild(representation_size=None) and fine-tune"
        )
    computation = numerics(config)
    if computation.layer_norm_epsilon != 1e-6:
        problems.append(
            f"LayerNorm epsilon {computation.layer_norm_epsilon:g} (numerics={config.numerics!r}): timm's "
            "ViT uses 1e-6; rebuild with numerics='timm' (model.rebuild(numerics='timm'))"
        )
    if config.is_hybrid:
        if config.resnet_stages not in _HYBRIDS:
            problems.append(
                f"a ResNet stem with stages {config.resnet_stages}: timm's hybrids have {sorted(_HYBRIDS)}"
            )
        if config.numerics != "timm":
            problems.append(
                f"hybrid stem numerics {config.numerics!r}: timm's ResNetV2 standardises with eps 1e-8 and "
                "GroupNorm eps 1e-5; rebuild with numerics='timm'"
            )
    if int(config.hidden_size * (config.mlp_dim / config.hidden_size)) != config.mlp_dim:
        problems.append(f"an MLP width {config.mlp_dim} that mlp_ratio cannot give from {config.hidden_size}")
    refuse_inexpressible(model, NAME, problems)


def state_dict(model: keras.Model) -> dict[str, np.ndarray]:
    """The timm `VisionTransformer` state dict of `model` (float32 numpy arrays)."""
    check(model)
    state = transformer_state(model, NAME, top=_TOP, block_key="blocks.{index}.{key}", block=_BLOCK_MAP)
    if model.config.fc_norm:  # the final LayerNorm follows the pooling: timm's `fc_norm`
        for part in ("weight", "bias"):
            state[f"fc_norm.{part}"] = state.pop(f"norm.{part}")
    if model.config.is_hybrid:
        state.update(stem_state(model, STEM))
    return contiguous(state)


def architecture(model: keras.Model) -> str:
    """The timm model name `config.json` names: the hybrid of the same ResNet, or the plain variant's."""
    config = model.config
    if config.is_hybrid:
        return _HYBRIDS[config.resnet_stages]
    return TIMM_ARCHITECTURES.get(config.name, "vit_base_patch16_224")


def model_args(model: keras.Model) -> dict:
    """The `timm.create_model` keyword arguments that rebuild `model`'s architecture."""
    config = model.config
    height, width = config.image_hw
    args = {
        "img_size": height if height == width else [height, width],
        "patch_size": config.patch_size,
        "embed_dim": config.hidden_size,
        "depth": config.depth,
        "num_heads": config.num_heads,
        "mlp_ratio": config.mlp_dim / config.hidden_size,
        "in_chans": model.channels,
        "num_classes": model.num_classes or 0,
        "global_pool": _GLOBAL_POOL[config.pooling],
        "class_token": config.class_token,
    }
    if config.pooling == "gap":
        args["fc_norm"] = config.fc_norm
    if numerics(config).approximate_gelu:
        args["act_layer"] = "gelu_tanh"
    return args


def _first_conv(config) -> str:
    """timm's name of the first convolution (`pretrained_cfg["first_conv"]`, for input-channel adaptation)."""
    if not config.is_hybrid:
        return "patch_embed.proj"
    return "patch_embed.backbone.stem.conv" if config.resnet_stages else "patch_embed.backbone.conv"


def config_json(model: keras.Model, preprocessing: Preprocessing, labels: list[str] | None) -> dict:
    """timm's hub `config.json` for `model` (the layout `timm.models._hub.save_config_for_hf` writes)."""
    config = model.config
    args = model_args(model)
    height, width = config.image_hw
    pretrained_cfg = {
        "tag": model.pretrained_tag or "keras_vit",
        "custom_load": False,
        "input_size": [model.channels, height, width],
        "fixed_input_size": True,
        "interpolation": preprocessing.interpolation,
        "crop_pct": preprocessing.crop_pct or 1.0,
        "crop_mode": "center",
        "mean": list(preprocessing.mean),
        "std": list(preprocessing.std),
        "num_classes": args["num_classes"],
        "pool_size": None,
        "first_conv": _first_conv(config),
        "classifier": "head",
    }
    result = {
        "architecture": architecture(model),
        "num_classes": args["num_classes"],
        "num_features": config.hidden_size,
        "global_pool": args["global_pool"],
        "model_args": args,
        "pretrained_cfg": pretrained_cfg,
    }
    if labels:
        result["label_names"] = labels
    return result


def write(
    model: keras.Model, directory: str | os.PathLike, preprocessing: Preprocessing, labels: list[str] | None
) -> str:
    """Write `model.safetensors` and `config.json` into `directory`; returns the weights file's name."""
    save_file(state_dict(model), os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as file:
        json.dump(config_json(model, preprocessing, labels), file, indent=2)
    return WEIGHTS_FILE


FORMAT = common.CheckpointFormat(
    name=NAME,
    description="timm ('patch_embed.proj.weight', 'cls_token', 'pos_embed', 'blocks.0.attn.qkv.weight', ...)",
    library="timm",
    numerics="timm",
    pos_embed_interpolation="timm",
    files=FILES,
    stem=STEM,
    matches=matches,
    normalise=normalise,
    num_heads=num_heads,
    convert=convert,
    check=check,
    write=write,
)

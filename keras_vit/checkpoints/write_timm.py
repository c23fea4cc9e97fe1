"""Write a keras_vit model as a timm checkpoint: `model.safetensors` + timm's `config.json`.

The inverse of `convert_timm` (its name maps run backwards; the hybrid stem by
`resnet_stem.stem_name_map`). `config.json` is what timm's `push_to_hf_hub` writes:
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

import keras
import numpy as np
from safetensors.numpy import save_file

from keras_vit.checkpoints import convert_timm
from keras_vit.checkpoints.write_common import (
    check_writable,
    contiguous,
    numerics,
    refuse_inexpressible,
    stem_state,
    transformer_state,
)
from keras_vit.registry.catalog import Preprocessing

NAME = "timm"
WEIGHTS_FILE = "model.safetensors"
# What `write` writes: save_pretrained replaces only these (and its own keras_vit.json, README.md).
FILES = (WEIGHTS_FILE, "config.json")
# keras_vit variant -> timm's registered model of the same architecture at 224 px (model_args set every
# size anyway; the tests build their timm references from it).
TIMM_ARCHITECTURES = {
    "vit_ti16": "vit_tiny_patch16_224",
    "vit_s16": "vit_small_patch16_224",
    "vit_s32": "vit_small_patch32_224",
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
    state = transformer_state(
        model, NAME, top=convert_timm._TOP, block_key="blocks.{index}.{key}", block=convert_timm._BLOCK_MAP
    )
    if model.config.fc_norm:  # the final LayerNorm follows the pooling: timm's `fc_norm`
        for part in ("weight", "bias"):
            state[f"fc_norm.{part}"] = state.pop(f"norm.{part}")
    if model.config.is_hybrid:
        state.update(stem_state(model, NAME))
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

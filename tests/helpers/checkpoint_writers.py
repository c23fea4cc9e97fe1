"""Reference checkpoints for tests: random-weight timm / transformers ViTs and the files they make.

Nothing is downloaded: models are built with random weights (`pretrained=False`), then every
tensor is perturbed so that no LayerNorm scale stays 1 and no bias stays 0 (a trivial value
would hide a swapped or transposed tensor). The writers produce each source format the
converters read:

- `save_timm_safetensors`: timm's hub format (`model.safetensors`, a timm state dict);
- `timm_to_google_npz` + `save_npz`: the original Google `.npz` layout, written from a timm
  state dict as the exact inverse of timm's own npz loader
  (`timm.models.vision_transformer._load_weights`), which the converter tests use to check it;
- `save_hf`: a transformers `save_pretrained` directory (`config.json`, `model.safetensors`)
  and optionally a `pytorch_model.bin` from `torch.save(model.state_dict())`.

Requires torch, timm and transformers (the `test` extra).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import timm
import torch
import transformers
from safetensors.torch import save_file

from helpers import TIMM_NAMES
from keras_vit.registry.variants import get_config


@torch.no_grad()
def perturb_(module: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> torch.nn.Module:
    """Add N(0, scale^2) noise to every parameter of `module` in place; returns it in eval mode."""
    rng = np.random.default_rng(seed)
    for parameter in module.parameters():
        noise = rng.standard_normal(tuple(parameter.shape), dtype=np.float32) * np.float32(scale)
        parameter.add_(torch.from_numpy(noise))
    return module.eval()


def random_timm_vit(variant: str, seed: int = 0, **kwargs) -> torch.nn.Module:
    """timm's model of keras_vit `variant` (e.g. "vit_b16"), random and perturbed, in eval mode.

    `kwargs` go to `timm.create_model` (e.g. `img_size=384`, `in_chans=1`, `num_classes=10`).
    timm's own (slow) initialisation is skipped: the layers' PyTorch default init, zeroed tokens
    and position embedding (`torch.empty` when skipped), then the perturbation give every
    tensor a random, non-trivial value.
    """
    torch.manual_seed(seed)
    model = timm.create_model(TIMM_NAMES[variant], pretrained=False, weight_init="skip", **kwargs)
    with torch.no_grad():
        for parameter in model.parameters(recurse=False):  # cls_token, pos_embed
            parameter.zero_()
    return perturb_(model, seed=seed)


def state_dict_numpy(model_or_state) -> dict[str, np.ndarray]:
    """A torch module's state dict (or a state dict) as float32 numpy arrays."""
    state = model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module) else model_or_state
    return {key: value.detach().cpu().numpy() for key, value in state.items()}


def save_timm_safetensors(
    model_or_state: torch.nn.Module | dict[str, np.ndarray], path: str | os.PathLike
) -> Path:
    """Write a timm model's state dict (or one as numpy arrays) as timm publishes it (`model.safetensors`)."""
    path = Path(path)
    if isinstance(model_or_state, torch.nn.Module):
        state = model_or_state.state_dict()
    else:
        state = {key: torch.from_numpy(np.asarray(value)) for key, value in model_or_state.items()}
    save_file({key: value.contiguous() for key, value in state.items()}, str(path))
    return path


_STEM_ROOT = {"conv.weight": "conv_root/kernel", "norm.weight": "gn_root/scale", "norm.bias": "gn_root/bias"}


def timm_stem_key_to_npz(key: str) -> str:
    """A timm hybrid's ResNet key (`patch_embed.backbone.*`) in the Google layout, as timm's
    `_load_weights` pairs them: `stem.conv` (or `conv` for the stem-only R+Ti) -> `conv_root`,
    `stages.S.blocks.U.convI/normI` -> `block{S+1}/unit{U+1}/convI/gnI`, `downsample` -> `*_proj`."""
    key = key.removeprefix("patch_embed.backbone.").removeprefix("stem.")
    if key in _STEM_ROOT:
        return _STEM_ROOT[key]
    _, stage, _, unit, *module, kind = key.split(".")
    module = ".".join(module)
    module = {"downsample.conv": "conv_proj", "downsample.norm": "gn_proj"}.get(module, module)
    module = module.replace("norm", "gn")
    kind = "kernel" if module.startswith("conv") else {"weight": "scale", "bias": "bias"}[kind]
    return f"block{int(stage) + 1}/unit{int(unit) + 1}/{module}/{kind}"


def timm_to_google_npz(
    state: dict[str, np.ndarray],
    num_heads: int,
    pre_logits: tuple[np.ndarray, np.ndarray] | None = None,
    groupnorm_4d: bool = False,
) -> dict[str, np.ndarray]:
    """The original Google `.npz` arrays (vision_transformer repo names) of a timm ViT state dict.

    The inverse of timm's `_load_weights`: HWIO patch kernel, (D, heads, hd) query/key/value
    kernels from the fused qkv, (heads, hd, D) output kernel, (in, out) dense kernels.
    `pre_logits` = `(kernel (D, R), bias (R,))` adds the ImageNet-21k representation layer,
    which timm models do not have. A hybrid's ResNet stem is written too, its GroupNorm
    parameters as (1, 1, 1, C) with `groupnorm_4d` (Flax before 0.3.6, as in the R50 files).
    """
    arrays = {}
    for key, value in state.items():
        if key.startswith("patch_embed.backbone."):
            if value.ndim == 4:
                value = value.transpose(2, 3, 1, 0)
            elif groupnorm_4d:
                value = value.reshape(1, 1, 1, -1)
            arrays[timm_stem_key_to_npz(key)] = value
    arrays |= {
        "embedding/kernel": state["patch_embed.proj.weight"].transpose(2, 3, 1, 0),
        "embedding/bias": state["patch_embed.proj.bias"],
        "cls": state["cls_token"],
        "Transformer/posembed_input/pos_embedding": state["pos_embed"],
        "Transformer/encoder_norm/scale": state["norm.weight"],
        "Transformer/encoder_norm/bias": state["norm.bias"],
    }
    if "head.weight" in state:
        arrays["head/kernel"] = state["head.weight"].T
        arrays["head/bias"] = state["head.bias"]
    if pre_logits is not None:
        arrays["pre_logits/kernel"], arrays["pre_logits/bias"] = pre_logits
    depth = 1 + max(int(key.split(".")[1]) for key in state if key.startswith("blocks."))
    for index in range(depth):
        source, target = f"blocks.{index}.", f"Transformer/encoderblock_{index}/"
        attention = f"{target}MultiHeadDotProductAttention_1/"
        width = state[f"{source}attn.qkv.weight"].shape[1]
        head_dim = width // num_heads
        qkv_weight = state[f"{source}attn.qkv.weight"].reshape(3, width, width)
        qkv_bias = state[f"{source}attn.qkv.bias"].reshape(3, num_heads, head_dim)
        for part, name in enumerate(("query", "key", "value")):
            arrays[f"{attention}{name}/kernel"] = qkv_weight[part].T.reshape(width, num_heads, head_dim)
            arrays[f"{attention}{name}/bias"] = qkv_bias[part]
        arrays[f"{attention}out/kernel"] = state[f"{source}attn.proj.weight"].T.reshape(
            num_heads, head_dim, width
        )
        arrays[f"{attention}out/bias"] = state[f"{source}attn.proj.bias"]
        for norm, flax in (("norm1", "LayerNorm_0"), ("norm2", "LayerNorm_2")):
            arrays[f"{target}{flax}/scale"] = state[f"{source}{norm}.weight"]
            arrays[f"{target}{flax}/bias"] = state[f"{source}{norm}.bias"]
        for fc, dense in (("fc1", "Dense_0"), ("fc2", "Dense_1")):
            arrays[f"{target}MlpBlock_3/{dense}/kernel"] = state[f"{source}mlp.{fc}.weight"].T
            arrays[f"{target}MlpBlock_3/{dense}/bias"] = state[f"{source}mlp.{fc}.bias"]
    return {key: np.ascontiguousarray(value, dtype=np.float32) for key, value in arrays.items()}


def save_npz(arrays: dict[str, np.ndarray], path: str | os.PathLike) -> Path:
    """Write arrays as a flat, uncompressed `np.savez` archive, like the published files."""
    path = Path(path)
    with open(path, "wb") as file:
        np.savez(file, **arrays)
    return path


def hf_config(variant: str, **kwargs) -> transformers.ViTConfig:
    """A transformers `ViTConfig` for keras_vit `variant`, with Google's LayerNorm eps 1e-6.

    `kwargs` override fields (`num_labels`, `image_size`, ...).
    """
    config = get_config(variant)
    fields = dict(
        hidden_size=config.hidden_size,
        num_hidden_layers=config.depth,
        num_attention_heads=config.num_heads,
        intermediate_size=config.mlp_dim,
        patch_size=config.patch_size,
        image_size=config.image_size,
        hidden_act="gelu",
        layer_norm_eps=1e-6,
        num_labels=1000,
    )
    fields.update(kwargs)
    return transformers.ViTConfig(**fields)


def random_hf_vit(
    variant: str,
    seed: int = 0,
    classifier: bool = True,
    pooler: bool = False,
    mask_token: bool = False,
    **config_kwargs,
) -> transformers.PreTrainedModel:
    """A perturbed random transformers ViT in eval mode: `ViTForImageClassification`, or with
    `classifier=False` a `ViTModel` (with a pooler if `pooler`, a mask token if `mask_token`).

    `config_kwargs` override `hf_config` fields."""
    torch.manual_seed(seed)
    config = hf_config(variant, **config_kwargs)
    if classifier:
        model = transformers.ViTForImageClassification(config)
    else:
        model = transformers.ViTModel(config, add_pooling_layer=pooler, use_mask_token=mask_token)
    return perturb_(model, seed=seed)


def save_hf(
    model: transformers.PreTrainedModel, directory: str | os.PathLike, pytorch_bin: bool = True
) -> Path:
    """`save_pretrained` into `directory` (config.json + model.safetensors), plus `pytorch_model.bin`."""
    directory = Path(directory)
    model.save_pretrained(directory)
    if pytorch_bin:
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
    return directory


def to_torch(images: np.ndarray) -> torch.Tensor:
    """NHWC float32 images (what keras_vit takes) as an NCHW torch tensor."""
    return torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2)))


def random_timm_vit_like(config, seed: int = 0, **kwargs) -> torch.nn.Module:
    """timm's `VisionTransformer` of a keras_vit `ViTConfig`'s shape (any size), random and perturbed.

    `kwargs` go to `VisionTransformer` (`global_pool`, `fc_norm`, `num_classes`, `act_layer`, ...);
    `class_token` and the image size follow `config`. Initialised as `random_timm_vit`.
    """
    torch.manual_seed(seed)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=config.image_hw,
        patch_size=config.patch_size,
        embed_dim=config.hidden_size,
        depth=config.depth,
        num_heads=config.num_heads,
        mlp_ratio=config.mlp_dim / config.hidden_size,
        class_token=config.class_token,
        weight_init="skip",
        **kwargs,
    )
    with torch.no_grad():
        for parameter in model.parameters(recurse=False):  # cls_token, pos_embed
            parameter.zero_()
    return perturb_(model, seed=seed)

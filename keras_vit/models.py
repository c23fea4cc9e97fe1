"""The ViT builder and the one-line factories for every variant."""

from __future__ import annotations

import os
from collections.abc import Sequence

import keras
import numpy as np

from keras_vit.layers import (
    ClassToken,
    PatchEncoder,
    PositionEmbedding,
    TokenPooling,
    TransformerBlock,
)
from keras_vit.pretrained import resolve_pretrained
from keras_vit.variants import VARIANTS, ViTConfig, get_config

POOLINGS = ("token", "gap", None)


def _image_hw(image_size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(image_size, (int, np.integer)):
        height = width = int(image_size)
    else:
        try:
            height, width = (int(side) for side in image_size)
        except (TypeError, ValueError):
            raise ValueError(
                f"image_size must be an int or a (height, width) pair, got {image_size!r}."
            ) from None
    if height < 1 or width < 1:
        raise ValueError(f"image_size must be positive, got {image_size!r}.")
    return height, width


def _token_grid(config: ViTConfig, height: int, width: int) -> tuple[int, int]:
    """Patch grid for an image, with an error that proposes valid sizes."""
    feature_hw = (height, width)
    if config.is_hybrid:
        from keras_vit.hybrid import feature_map_size

        feature_hw = feature_map_size(config, height, width)
    patch, stride = config.patch_size, config.stride
    for axis, image_side, size in zip(("height", "width"), (height, width), feature_hw, strict=True):
        if size % patch:
            lower = max(stride, image_side // stride * stride)
            feature_map = f" (ResNet feature map {size})" if config.is_hybrid else ""
            raise ValueError(
                f"{config.name}: image {axis} {image_side}{feature_map} is not divisible by the patch "
                f"size {patch}; use a multiple of {stride}, e.g. image_size={lower} or {lower + stride}."
            )
    return feature_hw[0] // patch, feature_hw[1] // patch


def classification_head(num_classes: int, classifier_activation: str | None = None) -> keras.layers.Dense:
    """The `head` layer: zero-initialised (paper §3.2), float32 so mixed precision gives float32 logits."""
    return keras.layers.Dense(
        num_classes,
        activation=classifier_activation,
        kernel_initializer="zeros",
        name="head",
        dtype="float32",
    )


def build_vit(
    config: ViTConfig,
    *,
    image_size: int | Sequence[int] = 224,
    num_classes: int = 1000,
    include_top: bool = True,
    pooling: str | None = "token",
    representation_size: int | None = None,
    dropout: float = 0.0,
    attention_dropout: float = 0.0,
    drop_path_rate: float = 0.0,
    classifier_activation: str | None = None,
    channels: int = 3,
    name: str | None = None,
) -> keras.Model:
    """Assemble a Vision Transformer as a functional `keras.Model` from a variant config."""
    if pooling not in POOLINGS:
        raise ValueError(
            f"Unknown pooling {pooling!r}: use 'token' (the [class] token), 'gap' (mean of the "
            "patch tokens), or None (the token sequence, with include_top=False)."
        )
    if include_top and pooling is None:
        raise ValueError("pooling=None returns the token sequence: it needs include_top=False.")
    if include_top and (not isinstance(num_classes, (int, np.integer)) or num_classes < 1):
        raise ValueError(f"num_classes must be a positive int with include_top=True, got {num_classes!r}.")
    if not isinstance(channels, (int, np.integer)) or channels < 1:
        raise ValueError(f"channels must be a positive int (3 for RGB, 1 for grayscale), got {channels!r}.")
    height, width = _image_hw(image_size)
    grid = _token_grid(config, height, width)

    images = keras.Input(shape=(height, width, channels), name="images")
    features = images
    if config.is_hybrid:
        from keras_vit.hybrid import resnet_stem

        features = resnet_stem(features, config)
    tokens = PatchEncoder(config.patch_size, config.hidden_size, name="patch_embed")(features)
    tokens = ClassToken(name="class_token")(tokens)
    tokens = PositionEmbedding(grid, name="pos_embed")(tokens)
    tokens = keras.layers.Dropout(dropout, name="pos_dropout")(tokens)
    drop_path_rates = np.linspace(0.0, drop_path_rate, config.depth)
    for index, rate in enumerate(drop_path_rates):
        tokens = TransformerBlock(
            config.num_heads,
            config.mlp_dim,
            dropout=dropout,
            attention_dropout=attention_dropout,
            drop_path=float(rate),
            name=f"block_{index}",
        )(tokens)
    outputs = keras.layers.LayerNormalization(epsilon=1e-6, name="encoder_norm")(tokens)
    if pooling is not None:
        outputs = TokenPooling(pooling, name="pool")(outputs)
        if representation_size:
            outputs = keras.layers.Dense(representation_size, activation="tanh", name="pre_logits")(outputs)
    if include_top:
        outputs = classification_head(num_classes, classifier_activation)(outputs)
    return keras.Model(images, outputs, name=name or config.name)


def create_model(
    variant: str,
    pretrained: bool | str | os.PathLike = False,
    *,
    image_size: int | Sequence[int] | None = None,
    num_classes: int | None = None,
    include_top: bool | None = None,
    pooling: str | None = "token",
    representation_size: int | None = None,
    dropout: float = 0.0,
    attention_dropout: float = 0.0,
    drop_path_rate: float = 0.0,
    classifier_activation: str | None = None,
    channels: int = 3,
    name: str | None = None,
) -> keras.Model:
    """Build the ViT variant `variant` (see `list_models()`), optionally with published weights.

    Args:
        variant: a name from `list_models()`, e.g. `"vit_b16"`.
        pretrained: `False` for random weights (training init of the paper); `True` for the
            variant's default checkpoint; a tag (`"augreg_in21k_ft_in1k"` or
            `"vit_b16.augreg_in21k_ft_in1k"`, see `keras_vit.list_pretrained()`); a local
            checkpoint file (Google `.npz`, timm or Hugging Face `.safetensors` / `.bin`); or
            a Hugging Face Hub repo id `"org/name"`. The model is built to fit the checkpoint:
            unset `image_size`, `num_classes` and `representation_size` take its values, and
            a model built from a tag is named after it (see `keras_vit.pretrained`).
        image_size: int or `(height, width)`; each side a multiple of the patch size.
            Defaults to the variant's 224, or the checkpoint's resolution; another size
            resizes the position embedding.
        num_classes: classes of the head, default 1000 or the checkpoint's; a count other
            than the checkpoint's gives a new zero-initialised head.
        include_top: with `False`, the model returns the pooled representation
            `(batch, D)` (or `representation_size`), or with `pooling=None` the token
            sequence `(batch, 1 + patches, D)` after the final LayerNorm. Default `True`,
            except for a checkpoint without a head (`orig_in21k`) and no `num_classes`.
        pooling: `"token"` (the [class] token, the paper's default), `"gap"` (mean of the
            patch tokens after the final LayerNorm) or `None`.
        representation_size: adds the pre-logits Dense+tanh layer of the original ImageNet-21k
            checkpoints with this width; loaded from a checkpoint that has one, `0` drops it.
        dropout, attention_dropout, drop_path_rate: regularisation; stochastic depth grows
            linearly from 0 to `drop_path_rate` over the blocks.
        classifier_activation: activation of the head, e.g. `"softmax"`; `None` gives logits.
        channels: input channels (3 for RGB).
        name: model name, defaults to `variant`.

    Inputs are images `(batch, height, width, channels)` already normalised as the weights
    expect: for all Google-trained checkpoints that is [-1, 1] (`keras_vit.preprocess_input`).
    """
    config = get_config(variant)
    checkpoint = None
    if pretrained is not False and pretrained is not None:
        checkpoint = resolve_pretrained(pretrained, variant)
        image_size, num_classes, include_top, representation_size = checkpoint.model_arguments(
            config, image_size, num_classes, include_top, representation_size
        )
        name = name or checkpoint.tag
    model = build_vit(
        config,
        image_size=config.image_size if image_size is None else image_size,
        num_classes=1000 if num_classes is None else num_classes,
        include_top=True if include_top is None else include_top,
        pooling=pooling,
        representation_size=representation_size,
        dropout=dropout,
        attention_dropout=attention_dropout,
        drop_path_rate=drop_path_rate,
        classifier_activation=classifier_activation,
        channels=channels,
        name=name,
    )
    if checkpoint is not None:
        checkpoint.load_into(model)
    return model


def list_models() -> list[str]:
    """Names of every variant with a factory, e.g. `['vit_b16', ...]`."""
    return sorted(VARIANTS)


def vit_ti16(pretrained: bool | str = False, **kwargs) -> keras.Model:
    """ViT-Ti/16: D=192, 12 layers, 3 heads, MLP 768. Arguments as `create_model`."""
    return create_model("vit_ti16", pretrained, **kwargs)


def vit_s16(pretrained: bool | str = False, **kwargs) -> keras.Model:
    """ViT-S/16: D=384, 12 layers, 6 heads, MLP 1536. Arguments as `create_model`."""
    return create_model("vit_s16", pretrained, **kwargs)


def vit_s32(pretrained: bool | str = False, **kwargs) -> keras.Model:
    """ViT-S/32: D=384, 12 layers, 6 heads, MLP 1536. Arguments as `create_model`."""
    return create_model("vit_s32", pretrained, **kwargs)


def vit_b8(pretrained: bool | str = False, **kwargs) -> keras.Model:
    """ViT-B/8: D=768, 12 layers, 12 heads, MLP 3072. Arguments as `create_model`."""
    return create_model("vit_b8", pretrained, **kwargs)


def vit_b16(pretrained: bool | str = False, **kwargs) -> keras.Model:
    """ViT-B/16: D=768, 12 layers, 12 heads, MLP 3072. Arguments as `create_model`."""
    return create_model("vit_b16", pretrained, **kwargs)


def vit_b32(pretrained: bool | str = False, **kwargs) -> keras.Model:
    """ViT-B/32: D=768, 12 layers, 12 heads, MLP 3072. Arguments as `create_model`."""
    return create_model("vit_b32", pretrained, **kwargs)


def vit_l16(pretrained: bool | str = False, **kwargs) -> keras.Model:
    """ViT-L/16: D=1024, 24 layers, 16 heads, MLP 4096. Arguments as `create_model`."""
    return create_model("vit_l16", pretrained, **kwargs)


def vit_l32(pretrained: bool | str = False, **kwargs) -> keras.Model:
    """ViT-L/32: D=1024, 24 layers, 16 heads, MLP 4096. Arguments as `create_model`."""
    return create_model("vit_l32", pretrained, **kwargs)


def vit_h14(pretrained: bool | str = False, **kwargs) -> keras.Model:
    """ViT-H/14: D=1280, 32 layers, 16 heads, MLP 5120. Arguments as `create_model`."""
    return create_model("vit_h14", pretrained, **kwargs)


def vit_r50_b16(pretrained: bool | str = False, **kwargs) -> keras.Model:
    """R50+ViT-B/16: BiT ResNet-50 stages (3, 4, 9) (stride 16), then ViT-B on 1x1 patches."""
    return create_model("vit_r50_b16", pretrained, **kwargs)


def vit_r50_l32(pretrained: bool | str = False, **kwargs) -> keras.Model:
    """R50+ViT-L/32: BiT ResNet-50 stages (3, 4, 6, 3) (stride 32), then ViT-L on 1x1 patches."""
    return create_model("vit_r50_l32", pretrained, **kwargs)


def vit_r26_b32(pretrained: bool | str = False, **kwargs) -> keras.Model:
    """R26+ViT-B/32: BiT ResNet-26 stages (2, 2, 2, 2) (stride 32), then ViT-B on 1x1 patches."""
    return create_model("vit_r26_b32", pretrained, **kwargs)


def vit_r26_s32(pretrained: bool | str = False, **kwargs) -> keras.Model:
    """R26+ViT-S/32: BiT ResNet-26 stages (2, 2, 2, 2) (stride 32), then ViT-S on 1x1 patches."""
    return create_model("vit_r26_s32", pretrained, **kwargs)


def vit_r_ti16(pretrained: bool | str = False, **kwargs) -> keras.Model:
    """R+ViT-Ti/16: BiT root block only (stride 4), then ViT-Ti on 8x8 patches (32 px per token)."""
    return create_model("vit_r_ti16", pretrained, **kwargs)

"""The ViT builder and the one-line factories for every variant."""

from __future__ import annotations

from typing import Sequence

import keras
import numpy as np

from keras_vit.layers import (
    ClassToken,
    PatchEncoder,
    PositionEmbedding,
    TokenPooling,
    TransformerBlock,
)
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
    if config.is_hybrid:
        from keras_vit.hybrid import feature_map_size

        height, width = feature_map_size(config, height, width)
    patch = config.patch_size
    for axis, size in (("height", height), ("width", width)):
        if size % patch:
            lower = max(patch, size // patch * patch)
            raise ValueError(
                f"{config.name}: image {axis} {size} is not divisible by the patch size {patch}; "
                f"use a multiple of {patch}, e.g. image_size={lower} or {lower + patch}."
            )
    return height // patch, width // patch


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
            outputs = keras.layers.Dense(representation_size, activation="tanh", name="pre_logits")(
                outputs
            )
    if include_top:
        # Zero-initialised (paper §3.2) and float32 so mixed-precision models give float32 logits.
        outputs = keras.layers.Dense(
            num_classes,
            activation=classifier_activation,
            kernel_initializer="zeros",
            name="head",
            dtype="float32",
        )(outputs)
    return keras.Model(images, outputs, name=name or config.name)


def create_model(
    variant: str,
    pretrained: bool | str = False,
    *,
    image_size: int | Sequence[int] | None = None,
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
    """Build the ViT variant `variant` (see `list_models()`), optionally with published weights.

    Args:
        variant: a name from `list_models()`, e.g. `"vit_b16"`.
        pretrained: `False` for random weights (training init of the paper).
        image_size: int or `(height, width)`; each side a multiple of the patch size.
            Defaults to the variant's 224.
        num_classes: classes of the zero-initialised head (used with `include_top=True`).
        include_top: with `False`, the model returns the pooled representation
            `(batch, D)` (or `representation_size`), or with `pooling=None` the token
            sequence `(batch, 1 + patches, D)` after the final LayerNorm.
        pooling: `"token"` (the [class] token, the paper's default), `"gap"` (mean of the
            patch tokens after the final LayerNorm) or `None`.
        representation_size: adds the pre-logits Dense+tanh layer of the original ImageNet-21k
            checkpoints with this width.
        dropout, attention_dropout, drop_path_rate: regularisation; stochastic depth grows
            linearly from 0 to `drop_path_rate` over the blocks.
        classifier_activation: activation of the head, e.g. `"softmax"`; `None` gives logits.
        channels: input channels (3 for RGB).
        name: model name, defaults to `variant`.

    Inputs are images `(batch, height, width, channels)` already normalised as the weights
    expect: for all Google-trained checkpoints that is [-1, 1] (`keras_vit.preprocess_input`).
    """
    config = get_config(variant)
    if pretrained is not False:
        raise ValueError(
            f"pretrained={pretrained!r} is not available yet: build with pretrained=False."
        )
    return build_vit(
        config,
        image_size=config.image_size if image_size is None else image_size,
        num_classes=num_classes,
        include_top=include_top,
        pooling=pooling,
        representation_size=representation_size,
        dropout=dropout,
        attention_dropout=attention_dropout,
        drop_path_rate=drop_path_rate,
        classifier_activation=classifier_activation,
        channels=channels,
        name=name,
    )


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

"""Building models: `build_vit`, `create_model` and one factory per registry row, as timm's `_builder.py`.

`create_model(variant, pretrained=...)` answers the checkpoint first (`checkpoints.pretrained`:
resolve, download, read, check, all without Keras), then builds the model it fits and loads it
(`build_with_checkpoint`): a missing network or a checkpoint that does not fit is reported before
Keras (and TensorFlow) is imported. This module imports the `ViT` class only when it builds one.

Outputs: as keras.applications, the factories and `build_vit` default to
`classifier_activation="softmax"` (probabilities, what `loss="sparse_categorical_crossentropy"`
expects); pass `classifier_activation=None` for logits (timm's and keras_hub's output), as the
training driver does for its from-logits loss. The low-level `ViT` constructor defaults to logits.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from keras_vit.checkpoints.pretrained import resolve_pretrained
from keras_vit.registry.variants import VARIANTS, ViTConfig, get_config, list_models
from keras_vit.utils.environment import tensorflow_loads_quietly

if TYPE_CHECKING:
    from keras_vit.checkpoints.loading import Checkpoint
    from keras_vit.models.vit import ViT

__all__ = ["build_vit", "build_with_checkpoint", "create_model", "list_models", *VARIANTS]

# The head's activation when the factories and `build_vit` are not told (keras.applications' default).
DEFAULT_CLASSIFIER_ACTIVATION = "softmax"
# The model's own keyword arguments; every other keyword of `build_vit` / `create_model` that
# names a `ViTConfig` field (image_size, pooling, class_token, numerics, ...) changes the config.
_MODEL_ARGUMENTS = (
    "num_classes",
    "include_top",
    "representation_size",
    "dropout",
    "attention_dropout",
    "drop_path_rate",
    "classifier_activation",
    "channels",
    "pretrained_tag",
    "quantization",
    "image_dtype",
    "image_mean",
    "image_std",
    "attention_implementation",
)


def _split_arguments(config: ViTConfig, kwargs: dict) -> tuple[ViTConfig, dict]:
    """`kwargs` naming `ViTConfig` fields change the config; the rest are `ViT` arguments.

    `None` for `image_size`, `num_classes`, `include_top` or `name` means unset (the default).
    """
    kwargs = {key: value for key, value in kwargs.items() if not (key in _UNSET_BY_NONE and value is None)}
    fields = set(ViTConfig.field_names()) - {"name"}
    changes = {key: kwargs.pop(key) for key in list(kwargs) if key in fields}
    unknown = sorted(set(kwargs) - set(_MODEL_ARGUMENTS) - {"name"})
    if unknown:
        raise TypeError(
            f"Unknown argument(s) {unknown}: model arguments are {list(_MODEL_ARGUMENTS)}, config fields "
            f"{sorted(fields)}."
        )
    return (config.replace(**changes) if changes else config), kwargs


# Keywords of `build_vit` / `create_model` whose `None` means "not given".
_UNSET_BY_NONE = ("image_size", "num_classes", "include_top", "name")


def build_vit(config: ViTConfig, **kwargs) -> ViT:
    """A `ViT` from a config; keywords are `ViT` arguments or `ViTConfig` fields to change.

    E.g. `build_vit(config, image_size=384, pooling="gap", num_classes=10)`. The head gives
    probabilities (`classifier_activation="softmax"`) unless `classifier_activation=None` (logits).
    """
    with tensorflow_loads_quietly():  # Keras, maybe TensorFlow, loads here first: as the package face does
        from keras_vit.models.vit import ViT

    config, arguments = _split_arguments(config, kwargs)
    arguments.setdefault("classifier_activation", DEFAULT_CLASSIFIER_ACTIVATION)
    return ViT(config, **arguments)


def build_with_checkpoint(
    config: ViTConfig,
    checkpoint: Checkpoint,
    kwargs: Mapping | None = None,
    pos_embed_interpolation: str | None = None,
) -> ViT:
    """The model a checkpoint fits, built and loaded: the one build-with-checkpoint step.

    The checkpoint answers the model's arguments once (`Checkpoint.model_kwargs`: the caller's
    `kwargs`, and for what they leave unset its layout, numerics, size, head, pre-logits and
    name), the model is built from `config` with them (`build_vit`), then the weights are
    loaded (`pos_embed_interpolation`: as `load_checkpoint`). `create_model(..., pretrained=)`
    and `keras_vit.load_pretrained` build through it.
    """
    model = build_vit(config, **checkpoint.model_kwargs(config, kwargs))
    checkpoint.load_into(model, pos_embed_interpolation=pos_embed_interpolation)
    return model


def create_model(
    variant: str | ViTConfig,
    pretrained: bool | str | os.PathLike = False,
    *,
    image_size: int | Sequence[int] | None = None,
    num_classes: int | None = None,
    include_top: bool | None = None,
    representation_size: int | None = None,
    name: str | None = None,
    pos_embed_interpolation: str | None = None,
    verify: bool = True,
    **kwargs,
) -> ViT:
    """Build the ViT variant `variant` (see `list_models()`), optionally with published weights.

    Args:
        variant: a name from `list_models()`, e.g. `"vit_b16"`, or a `ViTConfig`.
        pretrained: `False` for random weights (training init of the paper); `True` for the
            variant's default checkpoint; a tag (`"augreg_in21k_ft_in1k"` or
            `"vit_b16.augreg_in21k_ft_in1k"`, see `keras_vit.list_pretrained()`); a local
            checkpoint file (Google `.npz`, timm or Hugging Face `.safetensors` / `.bin`); or
            a Hugging Face Hub repo id `"org/name"`. The model is built to fit the checkpoint:
            unset `image_size`, `num_classes` and `representation_size` take its values, and
            a model built from a tag is named after it (see `keras_vit.checkpoints.pretrained`).
        image_size: int or `(height, width)`; each side a multiple of the patch size.
            Defaults to the variant's, or the checkpoint's resolution; another size
            resizes the position embedding.
        num_classes: classes of the head, default 1000 or the checkpoint's; a count other
            than the checkpoint's gives a new zero-initialised head.
        include_top: with `False`, the model returns the pooled representation
            `(batch, D)` (or `representation_size`), or with `pooling=None` the token
            sequence `(batch, 1 + patches, D)` after the final LayerNorm. Default `True`,
            except for a checkpoint without a head (`orig_in21k`) and no `num_classes`.
        representation_size: adds the pre-logits Dense+tanh layer of the original ImageNet-21k
            checkpoints with this width; loaded from a checkpoint that has one, `0` drops it.
        name: model name, defaults to the variant's (or the checkpoint's tag).
        pos_embed_interpolation: how a checkpoint's position embedding is resampled to another
            `image_size` (`keras_vit.checkpoints.pos_embed.POS_EMBED_INTERPOLATIONS`): `"jax"` (the original
            code's `scipy.ndimage.zoom(order=1)`), `"timm"` (antialiased bicubic) or `"hf"`
            (bicubic); default the checkpoint source's: `"jax"` for Google `.npz`, `"timm"` else.
        verify: for a `keras_vit.save_pretrained` folder or repo, check the SHA-256 checksums
            its `keras_vit.json` records before loading (a changed or damaged file is a
            `keras_vit.utils.files.ChecksumError` naming it); `False` loads files edited on purpose.
        **kwargs: `ViT` arguments (`dropout`, `attention_dropout`, `drop_path_rate`,
            `classifier_activation`, `channels`, `image_dtype` (`"uint8"`: pixels normalised in
            the model, with the checkpoint's mean and std), `attention_implementation`) and
            `ViTConfig` fields to change: `pooling`
            (`"token"`, the paper's default; `"gap"`; `"map"`, attention pooling; `None` for
            the token sequence), `class_token` (`False`: no [class] token; with pooling
            `"gap"`, `"map"` or `None`), `fc_norm`, `numerics` (`"timm"`, `"jax"`, `"hf"`: see
            `keras_vit.registry.variants.NUMERICS`; default the checkpoint source's: `"jax"` for a Google
            `.npz`, `"timm"` for timm, `"hf"` for transformers, else `"timm"`). A checkpoint's token layout
            (`class_token`, `pooling`, `fc_norm`: `keras_vit.inspect_checkpoint(...).layout`)
            is taken where these are not given. `classifier_activation` defaults to
            `"softmax"`, as in keras.applications: the model outputs probabilities; `None`
            gives logits.

    Inputs are images `(batch, height, width, channels)` already normalised as the weights
    expect: for all Google-trained checkpoints that is [-1, 1] (`keras_vit.preprocess_input`).
    """
    config = variant if isinstance(variant, ViTConfig) else get_config(variant)
    kwargs = dict(
        kwargs,
        image_size=image_size,
        num_classes=num_classes,
        include_top=include_top,
        representation_size=representation_size,
        name=name,
    )
    if pretrained is False or pretrained is None:
        if pos_embed_interpolation is not None:
            raise ValueError(
                "pos_embed_interpolation resamples a checkpoint's position embedding: it needs pretrained=."
            )
        return build_vit(config, **kwargs)
    _split_arguments(config, kwargs)  # argument errors before any download
    checkpoint = resolve_pretrained(
        pretrained, config.name if config.name in VARIANTS else None, verify=verify
    )
    return build_with_checkpoint(config, checkpoint, kwargs, pos_embed_interpolation)


def _factory(variant: str):
    def factory(pretrained: bool | str | os.PathLike = False, **kwargs) -> ViT:
        return create_model(variant, pretrained, **kwargs)

    factory.__name__ = factory.__qualname__ = variant
    factory.__doc__ = f"{variant}: {VARIANTS[variant].description}. Arguments as `create_model`."
    return factory


# One factory per registry row: keras_vit.vit_b16(pretrained=True), keras_vit.vit_digits(), ...
globals().update({variant: _factory(variant) for variant in VARIANTS})

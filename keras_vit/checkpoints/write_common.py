"""What the checkpoint writers (each `format_<name>.write`) share.

A writer is the inverse of a reader: the model's weights by canonical name
(`canonical_weights`, the names `load_checkpoint` fills), the reader's name maps run backwards
(`common.invert_name_maps`), and a hybrid's ResNet stem through `common.stem_name_map`
in the format's `StemLayout`.
`check_writable` refuses what no format holds (a quantized model, an object that is not a
keras_vit ViT); each writer's `check` then refuses what its own format cannot express, with a
`NotExpressibleError` that names the part, before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from keras_vit.checkpoints import common
from keras_vit.registry.variants import NUMERICS, Numerics, ViTConfig, config_of

if TYPE_CHECKING:
    import keras


class NotExpressibleError(ValueError):
    """The model has a part or a numerical choice that the target checkpoint format cannot express."""


def check_writable(model: keras.Model, format_name: str) -> ViTConfig:
    """The model's config; an error for a non-keras_vit model or a quantized one."""
    config = config_of(model)
    quantized = model.quantization() if hasattr(model, "quantization") else {}
    if quantized:
        raise NotExpressibleError(
            f"Model {model.name!r} is quantized ({len(quantized)} layers, e.g. {next(iter(quantized))!r}): "
            f"the {format_name} format holds float weights. Write the float model before quantizing it."
        )
    return config


def refuse_inexpressible(model: keras.Model, format_label: str, problems: list[str]) -> None:
    """One `NotExpressibleError` listing every part of `model` the format cannot express, if any."""
    if problems:
        raise NotExpressibleError(
            f"The {format_label} format cannot express model {model.name!r}: " + "; ".join(problems) + "."
        )


def numerics(config: ViTConfig) -> Numerics:
    """The GELU form and epsilons the model computes with (`keras_vit.registry.variants.NUMERICS`)."""
    return NUMERICS[config.numerics]


def canonical_weights(model: keras.Model) -> dict[str, np.ndarray]:
    """The model's Transformer weights (no ResNet stem) as float32 arrays, by canonical name."""
    return {name: _float32(variable) for name, variable in common.model_targets(model).items()}


def transformer_state(
    model: keras.Model,
    format_name: str,
    *,
    top: Mapping[str, common.Rules],
    block_key: str,
    block: Mapping[str, common.Rules],
) -> dict[str, np.ndarray]:
    """The checkpoint arrays of the model's Transformer, by the format's name maps run backwards.

    Every model weight must find a key: one that none does is a `NotExpressibleError`.
    """
    weights = canonical_weights(model)
    arrays, used = common.invert_name_maps(weights, top=top, block_key=block_key, block=block)
    left = sorted(set(weights) - used)
    if left:
        raise NotExpressibleError(
            f"The {format_name} format has no place for {len(left)} weights of {model.name!r} "
            f"(e.g. {left[:3]})."
        )
    return arrays


def stem_state(model: keras.Model, layout: common.StemLayout) -> dict[str, np.ndarray]:
    """A hybrid's ResNet stem arrays under the layout's keys (`common.stem_name_map`), kernels
    in the layout's order."""
    arrays = {}
    for key, variable in common.stem_name_map(model, layout).items():
        value = _float32(variable)
        arrays[key] = common.conv_kernel_out(value) if layout.oihw else value
    return arrays


def _float32(variable: keras.Variable) -> np.ndarray:
    import keras

    return np.asarray(keras.ops.convert_to_numpy(variable), dtype=np.float32)


def contiguous(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float32, C-contiguous copies (what safetensors and `np.savez` write)."""
    return {key: np.ascontiguousarray(value, dtype=np.float32) for key, value in arrays.items()}

"""Write a keras_vit model as a Hugging Face transformers ViT: `config.json` + `model.safetensors`.

The inverse of `convert_hf` (its saved-layout names, `encoder.layer.{i}...`): a model with a head
becomes `ViTForImageClassification` (keys under `vit.`, the head as `classifier`, `id2label`
from the labels), a model without one `ViTModel` (its pre-logits layer as the `pooler`). The
config carries the model's numerics: `layer_norm_eps` and `hidden_act` (`"gelu"`, or
`"gelu_pytorch_tanh"` for the JAX tanh form).

transformers' ViT reads the [class] token, without the pooler, into its classifier, and has no
hybrid: a hybrid, a model without a [class] token or with another pooling, and a classifier
with a pre-logits layer are refused (`NotExpressibleError`).
"""

from __future__ import annotations

import json
import os

import keras
import numpy as np
from safetensors.numpy import save_file

from keras_vit.checkpoints import convert_hf
from keras_vit.checkpoints.write_common import (
    check_writable,
    contiguous,
    numerics,
    refuse_inexpressible,
    transformer_state,
)
from keras_vit.registry.catalog import Preprocessing

NAME = "hf"
WEIGHTS_FILE = "model.safetensors"
# What `write` writes: save_pretrained replaces only these (and its own keras_vit.json, README.md).
FILES = (WEIGHTS_FILE, "config.json", "preprocessor_config.json")
_PREFIX = "vit."
_HEAD_KEYS = ("classifier.weight", "classifier.bias")


def check(model: keras.Model) -> None:
    """A `NotExpressibleError` naming what of `model` transformers' ViT classes lack."""
    config = check_writable(model, NAME)
    problems = []
    if config.is_hybrid:
        problems.append("a hybrid ResNet stem (transformers has no ViT hybrid; use the timm format)")
    if not config.class_token:
        problems.append("no [class] token (transformers' ViT always prepends one)")
    if config.pooling not in ("token", None):
        problems.append(
            f"pooling={config.pooling!r} (transformers' ViT classifies the [class] token; "
            "use the timm format)"
        )
    if model.head is not None and model.pre_logits is not None:
        problems.append(
            "a pre-logits layer before the head (ViTForImageClassification has no pooler in front of its "
            "classifier; write the model without its head to get a ViTModel with the pooler)"
        )
    refuse_inexpressible(model, "transformers", problems)


def state_dict(model: keras.Model) -> dict[str, np.ndarray]:
    """The transformers state dict: `ViTForImageClassification` keys with a head, else `ViTModel`'s."""
    check(model)
    state = transformer_state(
        model, NAME, top=convert_hf._TOP, block_key="encoder.layer.{index}.{key}", block=convert_hf._BLOCK_MAP
    )
    if model.head is not None:
        state = {key if key in _HEAD_KEYS else _PREFIX + key: value for key, value in state.items()}
    return contiguous(state)


def config_json(model: keras.Model, preprocessing: Preprocessing, labels: list[str] | None) -> dict:
    """transformers' `config.json` (`model_type: vit`) for `model`."""
    config = model.config
    computation = numerics(config)
    height, width = config.image_hw
    result = {
        "architectures": ["ViTForImageClassification" if model.head is not None else "ViTModel"],
        "model_type": "vit",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.depth,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.mlp_dim,
        "hidden_act": "gelu_pytorch_tanh" if computation.approximate_gelu else "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02,
        "layer_norm_eps": computation.layer_norm_epsilon,
        "image_size": height if height == width else [height, width],
        "patch_size": config.patch_size,
        "num_channels": model.channels,
        "qkv_bias": True,
        "encoder_stride": config.patch_size,
        "pooler_output_size": model.representation_size or config.hidden_size,
        "pooler_act": "tanh",
        "dtype": "float32",
    }
    if model.head is not None:
        names = labels or [f"LABEL_{index}" for index in range(model.num_classes)]
        result["id2label"] = {str(index): name for index, name in enumerate(names)}
        result["label2id"] = {name: index for index, name in enumerate(names)}
    return result


def preprocessor_json(preprocessing: Preprocessing) -> dict:
    """`preprocessor_config.json` for transformers' `ViTImageProcessor` (resize to the input, no crop)."""
    height, width = preprocessing.image_size
    return {
        "image_processor_type": "ViTImageProcessor",
        "do_resize": True,
        "size": {"height": height, "width": width},
        "resample": {"bicubic": 3, "bilinear": 2}[preprocessing.interpolation],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(preprocessing.mean),
        "image_std": list(preprocessing.std),
    }


def write(
    model: keras.Model, directory: str | os.PathLike, preprocessing: Preprocessing, labels: list[str] | None
) -> str:
    """Write `model.safetensors`, `config.json` and `preprocessor_config.json` into `directory`."""
    save_file(state_dict(model), os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
    for name, content in (
        ("config.json", config_json(model, preprocessing, labels)),
        ("preprocessor_config.json", preprocessor_json(preprocessing)),
    ):
        with open(os.path.join(directory, name), "w", encoding="utf-8") as file:
            json.dump(content, file, indent=2)
    return WEIGHTS_FILE

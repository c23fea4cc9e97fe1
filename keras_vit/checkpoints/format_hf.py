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

Writing: a keras_vit model as a Hugging Face transformers ViT: `config.json` + `model.safetensors`.

The reading maps run backwards (its saved-layout names, `encoder.layer.{i}...`): a model with a head
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
    transformer_state,
)
from keras_vit.registry.catalog import Preprocessing

if TYPE_CHECKING:
    import keras

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
        stem=is_stem_key,
    )


# ---- writing ----

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
        model, NAME, top=_TOP, block_key="encoder.layer.{index}.{key}", block=_BLOCK_MAP
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


FORMAT = common.CheckpointFormat(
    name=NAME,
    description="Hugging Face transformers ('[vit.]embeddings.patch_embeddings.projection.weight', "
    "'[vit.]encoder.layer.0...')",
    library="transformers",
    numerics="hf",
    pos_embed_interpolation="timm",
    files=FILES,
    stem=None,
    matches=matches,
    normalise=normalise,
    num_heads=num_heads,
    convert=convert,
    check=check,
    write=write,
)

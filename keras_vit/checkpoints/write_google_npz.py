"""Write a keras_vit model as a Google `.npz` checkpoint (flat `np.savez` of '/'-joined Flax paths).

The inverse of `convert_google_npz`, in the original vision_transformer layout that timm's
`_load_weights` and the JAX code read: `embedding`, `cls`,
`Transformer/posembed_input/pos_embedding`, `Transformer/encoderblock_{i}/LayerNorm_0`,
`MultiHeadDotProductAttention_1`, `LayerNorm_2`, `MlpBlock_3`, `Transformer/encoder_norm`,
`pre_logits`, `head`; a hybrid's ResNet as `conv_root`, `gn_root`, `block{s}/unit{u}/...`; an
attention-pooling head as big_vision's `MAPHead_0`. Flax kernels have the Keras layouts, so
every array is written as the model holds it; timm's LayerNorm after the pooling (`fc_norm`)
has no Google layout and is refused. The file stores no numerics or pooling:
`keras_vit.save_pretrained` records them next to it (`keras_vit.json`).
"""

from __future__ import annotations

import os

import keras
import numpy as np

from keras_vit.checkpoints import convert_google_npz
from keras_vit.checkpoints.write_common import (
    check_writable,
    contiguous,
    refuse_inexpressible,
    stem_state,
    transformer_state,
)
from keras_vit.registry.catalog import Preprocessing

NAME = "google_npz"
WEIGHTS_FILE = "model.npz"
# What `write` writes: save_pretrained replaces only these (and its own keras_vit.json, README.md).
FILES = (WEIGHTS_FILE,)


def check(model: keras.Model) -> None:
    """A `NotExpressibleError` for timm's LayerNorm after the pooling (`fc_norm`): Google files have none."""
    config = check_writable(model, NAME)
    if config.fc_norm:
        refuse_inexpressible(
            model,
            NAME,
            [
                "its final LayerNorm follows the average pooling (fc_norm=True, timm's layout), the Google "
                "layout normalises the tokens before pooling (Transformer/encoder_norm); use the timm format"
            ],
        )


def state_dict(model: keras.Model) -> dict[str, np.ndarray]:
    """The Google `.npz` arrays of `model`, by key."""
    check(model)
    state = transformer_state(
        model,
        NAME,
        top=convert_google_npz._TOP,
        block_key="Transformer/encoderblock_{index}/{key}",
        block=convert_google_npz._BLOCK_MAP,
    )
    if model.config.is_hybrid:
        state.update(stem_state(model, NAME))
    return contiguous(state)


def write(
    model: keras.Model, directory: str | os.PathLike, preprocessing: Preprocessing, labels: list[str] | None
) -> str:
    """Write `model.npz` into `directory` (an uncompressed `np.savez`, like the published files)."""
    with open(os.path.join(directory, WEIGHTS_FILE), "wb") as file:
        np.savez(file, **state_dict(model))
    return WEIGHTS_FILE

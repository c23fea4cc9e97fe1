"""keras_vit: the Vision Transformer (Dosovitskiy et al. 2020) for Keras 3.

Importing the package registers its layers, so saved `.keras` models load without
`custom_objects`.
"""

from keras_vit import data as data
from keras_vit import evaluate as evaluate

# `keras_vit.inspect` (attention maps, ...) is deliberately left out of __all__: a star import
# must not hide the standard library's `inspect`.
from keras_vit import inspect as inspect
from keras_vit import pretrain as pretrain
from keras_vit import recipes as recipes
from keras_vit.converters import CheckpointError, inspect_checkpoint, load_checkpoint
from keras_vit.export import export_serving
from keras_vit.hybrid import BottleneckUnit, StdConv2D
from keras_vit.layers import (
    ClassToken,
    DropPath,
    MultiHeadSelfAttention,
    PatchEncoder,
    PositionEmbedding,
    TokenPooling,
    TransformerBlock,
)
from keras_vit.models import (
    build_vit,
    create_model,
    list_models,
    vit_b8,
    vit_b16,
    vit_b32,
    vit_h14,
    vit_l16,
    vit_l32,
    vit_r26_b32,
    vit_r26_s32,
    vit_r50_b16,
    vit_r50_l32,
    vit_r_ti16,
    vit_s16,
    vit_s32,
    vit_ti16,
)
from keras_vit.pos_embed import resize_pos_embed
from keras_vit.preprocessing import decode_predictions, load_image, preprocess_input
from keras_vit.pretrained import (
    WeightsIntegrityError,
    WeightsUnavailableError,
    list_pretrained,
    load_weights,
)
from keras_vit.variants import VARIANTS, ViTConfig

__version__ = "0.1.0"

__all__ = [
    "BottleneckUnit",
    "CheckpointError",
    "ClassToken",
    "DropPath",
    "MultiHeadSelfAttention",
    "PatchEncoder",
    "PositionEmbedding",
    "StdConv2D",
    "TokenPooling",
    "TransformerBlock",
    "VARIANTS",
    "ViTConfig",
    "WeightsIntegrityError",
    "WeightsUnavailableError",
    "build_vit",
    "create_model",
    "decode_predictions",
    "export_serving",
    "inspect_checkpoint",
    "list_models",
    "list_pretrained",
    "load_checkpoint",
    "load_image",
    "load_weights",
    "preprocess_input",
    "resize_pos_embed",
    "vit_b8",
    "vit_b16",
    "vit_b32",
    "vit_h14",
    "vit_l16",
    "vit_l32",
    "vit_r26_b32",
    "vit_r26_s32",
    "vit_r50_b16",
    "vit_r50_l32",
    "vit_r_ti16",
    "vit_s16",
    "vit_s32",
    "vit_ti16",
]

"""keras_vit: the Vision Transformer (Dosovitskiy et al. 2020) for Keras 3.

Importing the package registers its layers, so saved `.keras` models load without
`custom_objects`.
"""

from keras_vit.layers import (
    ClassToken,
    DropPath,
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
    vit_s16,
    vit_s32,
    vit_ti16,
)
from keras_vit.pos_embed import resize_pos_embed
from keras_vit.preprocessing import preprocess_input
from keras_vit.variants import VARIANTS, ViTConfig

__version__ = "0.1.0"

__all__ = [
    "ClassToken",
    "DropPath",
    "PatchEncoder",
    "PositionEmbedding",
    "TokenPooling",
    "TransformerBlock",
    "VARIANTS",
    "ViTConfig",
    "build_vit",
    "create_model",
    "list_models",
    "preprocess_input",
    "resize_pos_embed",
    "vit_b8",
    "vit_b16",
    "vit_b32",
    "vit_h14",
    "vit_l16",
    "vit_l32",
    "vit_s16",
    "vit_s32",
    "vit_ti16",
]

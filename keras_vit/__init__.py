"""keras_vit: the Vision Transformer (Dosovitskiy et al. 2020) for Keras 3.

`import keras_vit` is instant: it imports neither TensorFlow nor Keras. Each public name is
loaded from its module on first use (PEP 562), e.g. `keras_vit.vit_b16` imports the models.

Saved `.keras` models: `keras_vit.load_model(path)` registers keras_vit's Keras classes and
loads; `keras.saving.load_model` works too once keras_vit has registered them, which
`import keras_vit` does at once when Keras is already imported (else on first use of a model,
layer or loader).
"""

from __future__ import annotations

import importlib
import sys
import warnings

from keras_vit.variants import VARIANTS as VARIANTS
from keras_vit.variants import ViTConfig as ViTConfig
from keras_vit.variants import list_models as list_models
from keras_vit.version import __version__ as __version__

# public name -> the module that defines it
_EXPORTS = {
    "BottleneckUnit": "hybrid",
    "StdConv2D": "hybrid",
    "CheckpointError": "converters",
    "inspect_checkpoint": "converters",
    "load_checkpoint": "converters",
    "export_serving": "export",
    "export_litert": "export",
    "export_onnx": "export",
    "NotExpressibleError": "sharing",
    "load_pretrained": "sharing",
    "push_to_hub": "sharing",
    "save_pretrained": "sharing",
    "enable_lora": "lora",
    "enable_onednn": "environment",
    "get_layout_map": "parallel",
    "ClassToken": "layers",
    "DropPath": "layers",
    "MultiHeadSelfAttention": "layers",
    "MultiheadAttentionPooling": "layers",
    "PatchEncoder": "layers",
    "PositionEmbedding": "layers",
    "TokenPooling": "layers",
    "TransformerBlock": "layers",
    "ViT": "models",
    "build_vit": "models",
    "create_model": "models",
    "load_model": "saving",
    "resize_pos_embed": "pos_embed",
    "decode_predictions": "preprocessing",
    "load_image": "preprocessing",
    "Preprocessing": "preprocessing",
    "preprocess_input": "preprocessing",
    "ImageTooLargeError": "validation",
    "WeightsIntegrityError": "pretrained",
    "WeightsUnavailableError": "pretrained",
    "list_pretrained": "catalog",
    "preprocessing_for": "catalog",
    "load_weights": "pretrained",
    **{variant: "models" for variant in VARIANTS},
}
# Submodules reachable as attributes (`keras_vit.data`, ...).
_SUBMODULES = (
    "catalog",
    "data",
    "defaults",
    "evaluate",
    "inspection",
    "optimization",
    "options",
    "parallel",
    "pretrain",
    "pretrained",
    "recipes",
    "sharing",
    "training",
    "validation",
)

__all__ = sorted(["VARIANTS", "ViTConfig", "list_models", *_EXPORTS])


def __getattr__(name: str):
    if name == "inspect":  # renamed: a module `keras_vit/inspect.py` hid the standard library's `inspect`
        warnings.warn("keras_vit.inspect is now keras_vit.inspection.", DeprecationWarning, stacklevel=2)
        name = "inspection"
    if name in _SUBMODULES:
        return importlib.import_module(f"keras_vit.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_vit' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"keras_vit.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))


if "tensorflow" in sys.modules:  # imported before us: say so if its fast CPU kernels are off
    importlib.import_module("keras_vit.environment").note_onednn_off()
if "keras" in sys.modules:  # Keras is loaded anyway: register our classes for keras.saving now
    importlib.import_module("keras_vit.saving").register()

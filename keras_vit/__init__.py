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

from keras_vit.registry.variants import VARIANTS as VARIANTS
from keras_vit.registry.variants import ViTConfig as ViTConfig
from keras_vit.registry.variants import list_models as list_models
from keras_vit.utils.lazy import lazy_exports
from keras_vit.version import __version__ as __version__

# public name -> the module that defines it
_EXPORTS = {
    "BottleneckUnit": "models.hybrid",
    "StdConv2D": "models.hybrid",
    "CheckpointError": "checkpoints.errors",
    "inspect_checkpoint": "checkpoints.loading",
    "load_checkpoint": "checkpoints.loading",
    "export_serving": "deploy.export",
    "export_litert": "deploy.export",
    "export_onnx": "deploy.export",
    "NotExpressibleError": "deploy.sharing",
    "load_pretrained": "deploy.sharing",
    "push_to_hub": "deploy.sharing",
    "save_pretrained": "deploy.sharing",
    "enable_lora": "deploy.lora",
    "enable_onednn": "utils.environment",
    "get_layout_map": "models.parallel",
    "ClassToken": "models.layers",
    "DropPath": "models.layers",
    "MultiHeadSelfAttention": "models.layers",
    "MultiheadAttentionPooling": "models.layers",
    "PatchEncoder": "models.layers",
    "PositionEmbedding": "models.layers",
    "TokenPooling": "models.layers",
    "TransformerBlock": "models.layers",
    "ViT": "models.vit",
    "build_vit": "models.build",
    "create_model": "models.build",
    "load_model": "saving",
    "resize_pos_embed": "checkpoints.pos_embed",
    "decode_predictions": "data.preprocessing",
    "load_image": "data.preprocessing",
    "Preprocessing": "data.preprocessing",
    "preprocess_input": "data.preprocessing",
    "ImageTooLargeError": "utils.validation",
    "WeightsIntegrityError": "utils.hub",
    "WeightsUnavailableError": "utils.hub",
    "list_pretrained": "registry.catalog",
    "preprocessing_for": "registry.catalog",
    "load_weights": "checkpoints.pretrained",
    **{variant: "models.build" for variant in VARIANTS},
}
# The parts, reachable as attributes (`keras_vit.training.train`, `keras_vit.data.tfdata`, ...).
_SUBMODULES = (
    "checkpoints",
    "data",
    "deploy",
    "inspection",
    "models",
    "registry",
    "saving",
    "training",
    "utils",
)

__all__ = sorted(["VARIANTS", "ViTConfig", "list_models", *_EXPORTS])
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, _SUBMODULES)


if "tensorflow" in sys.modules:  # imported before us: say so if its fast CPU kernels are off
    importlib.import_module("keras_vit.utils.environment").note_onednn_off()
if "keras" in sys.modules:  # Keras is loaded anyway: register our classes for keras.saving now
    importlib.import_module("keras_vit.saving").register()

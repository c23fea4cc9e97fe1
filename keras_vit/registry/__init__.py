"""What exists, as data (pure Python, no Keras): every architecture (`variants`: one `ViTConfig` row
per model, `list_models`) and every published checkpoint with its file, format, preprocessing and
class names (`catalog`: `list_pretrained`, `preprocessing_for`). Everything above reads these tables."""

from keras_vit.utils.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {}, submodules=("catalog", "variants"))

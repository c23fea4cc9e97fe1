"""Deployment: SavedModel for TF Serving, ONNX and LiteRT exports (`export`), sharing in the published
formats and on the Hub (`sharing`), and LoRA adapters (`lora`; quantization is `ViT.quantize`).
Names load on first use."""

from keras_vit.utils.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "export_litert": "export",
        "export_onnx": "export",
        "export_serving": "export",
        "load_pretrained": "sharing",
        "push_to_hub": "sharing",
        "save_pretrained": "sharing",
        "enable_lora": "lora",
    },
    submodules=("export", "lora", "sharing"),
)

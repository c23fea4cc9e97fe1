"""Checkpoints: exact converters of Google `.npz`, timm and Hugging Face ViT weights into keras_vit
models, their writers, and the published-checkpoint downloads.

```python
model = keras_vit.create_model("vit_b16", image_size=384)
keras_vit.load_checkpoint(model, "model.safetensors")   # format detected from the keys
```

One module per format (`format_google_npz`, `format_timm`, `format_hf`) declares the format once
(`FORMAT`: its facts, a name map from checkpoint keys to keras_vit weights plus a small transform
per tensor, and the writer that runs the map backwards); `formats.FORMATS` lists them for the
loader, the writers, sharing and the CLI. `loading` applies the rules common to all
(position-embedding resizing with `pos_embed`, head and pre-logits skipping, input-channel
adaptation, strict shape checks); `common` also holds the hybrids' stem name map. `reading` opens `.npz`,
`.safetensors` and PyTorch `.bin` files without importing torch and without unpickling arbitrary
objects. `pretrained` resolves a `pretrained=` value (catalog tag, file, hub id) to a checked local
file and loads it (`load_weights`). Names load on first use.
"""

from keras_vit.utils.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "CheckpointError": "errors",
        "FORMATS": "formats",
        "CheckpointInfo": "loading",
        "detect_format": "loading",
        "inspect_checkpoint": "loading",
        "load_checkpoint": "loading",
        "read_checkpoint": "reading",
        "load_weights": "pretrained",
        "resolve_pretrained": "pretrained",
    },
    submodules=("formats", "loading", "pos_embed", "pretrained", "reading"),
)

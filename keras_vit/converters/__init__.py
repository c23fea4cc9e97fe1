"""Exact checkpoint converters: Google `.npz`, timm and Hugging Face ViT weights into keras_vit models.

```python
model = keras_vit.create_model("vit_b16", image_size=384)
keras_vit.load_checkpoint(model, "model.safetensors")   # format detected from the keys
```

One module per source format (`convert_google_npz`, `convert_timm`, `convert_hf`) holds a name
map from checkpoint keys to keras_vit weights plus a small transform per tensor; `loading`
applies the rules common to all (position-embedding resizing, head and pre-logits skipping,
input-channel adaptation, strict shape checks). `reading` opens `.npz`, `.safetensors` and
PyTorch `.bin` files without importing torch and without unpickling arbitrary objects.
"""

from keras_vit.converters.errors import CheckpointError
from keras_vit.converters.loading import (
    FORMATS,
    CheckpointInfo,
    detect_format,
    inspect_checkpoint,
    load_checkpoint,
)
from keras_vit.converters.reading import read_checkpoint

__all__ = [
    "FORMATS",
    "CheckpointError",
    "CheckpointInfo",
    "detect_format",
    "inspect_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
]

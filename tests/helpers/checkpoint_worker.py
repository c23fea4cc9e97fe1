"""Run by tests/test_backends.py under another Keras backend (`KERAS_BACKEND=jax|torch`) with
TensorFlow blocked (importing it raises `ImportError`, as where it is not installed):

    python tests/helpers/checkpoint_worker.py CONFIG.json IMAGES.npy OUT.json CHECKPOINT...

For every checkpoint (a timm safetensors file, a Google `.npz`, a transformers folder):
`inspect_checkpoint`, then `create_model(config, pretrained=CHECKPOINT)` and its logits. Writes
`OUT.json`: per checkpoint the format found and the logits, and whether TensorFlow was imported.
"""

import json
import sys
from pathlib import Path

from no_tensorflow import block_tensorflow

block_tensorflow("loading a checkpoint must not need TensorFlow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_vit  # noqa: E402
from keras_vit import ViTConfig  # noqa: E402

config_path, images_path, out_path, *checkpoints = sys.argv[1:]
config = ViTConfig.from_dict(json.loads(Path(config_path).read_text()))
images = np.load(images_path)
result = {"backend": keras.backend.backend(), "checkpoints": {}}
for checkpoint in checkpoints:
    info = keras_vit.inspect_checkpoint(checkpoint)
    model = keras_vit.create_model(config, pretrained=checkpoint, classifier_activation=None)
    logits = keras.ops.convert_to_numpy(model(images, training=False))
    result["checkpoints"][checkpoint] = {"format": info.format, "logits": logits.tolist()}
result["tensorflow_imported"] = sorted(name for name in sys.modules if name.partition(".")[0] == "tensorflow")
Path(out_path).write_text(json.dumps(result))

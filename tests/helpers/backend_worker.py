"""Run by tests/test_backends.py under another Keras backend (`KERAS_BACKEND=jax|torch`).

    python tests/helpers/backend_worker.py MODELS_DIR OUT_DIR

For every `MODELS_DIR/<case>.keras` (saved on another backend, with its inputs in
`MODELS_DIR/<case>.npy`): load it, predict, run the attention rollout, `fit` a copy on NumPy
arrays and on a `keras.utils.PyDataset`, save it as `OUT_DIR/<case>.keras` under this backend.
Writes `OUT_DIR/result.json`: per case the logits and config, and whether TensorFlow had been
imported before the first save (it must not have been: Keras's own `.keras` serialiser
imports it when it is installed, so saving itself is not checked).
"""

import json
import os
import sys
from pathlib import Path

import numpy as np

import keras_vit  # imports neither TensorFlow nor Keras

models_dir, out_dir = (Path(arg) for arg in sys.argv[1:3])
import keras  # noqa: E402

from keras_vit.inspection import analysis as vit_inspect  # noqa: E402


class Batches(keras.utils.PyDataset):
    def __init__(self, images, labels):
        super().__init__()
        self.images, self.labels = images, labels

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return self.images, self.labels


loaded = {}
for path in sorted(models_dir.glob("*.keras")):
    images = np.load(path.with_suffix(".npy"))
    model = keras_vit.load_model(path)
    labels = np.arange(len(images)) % model.output_shape[-1]
    trained = model.rebuild()
    trained.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    trained.fit(images, labels, epochs=1, verbose=0)
    trained.fit(Batches(images, labels), epochs=1, verbose=0)
    loaded[path.stem] = {
        "class": type(model).__name__,
        "config": model.config.to_dict(),
        "logits": keras.ops.convert_to_numpy(model(images, training=False)).tolist(),
        "rollout_shape": list(vit_inspect.attention_rollout(model, images).shape),
        "model": model,
    }
result = {"backend": keras.backend.backend(), "tensorflow_before_saving": "tensorflow" in sys.modules}
for case, entry in loaded.items():
    entry.pop("model").save(out_dir / f"{case}.keras")
result["cases"] = loaded
(out_dir / "result.json").write_text(json.dumps(result))
os._exit(0)  # skip interpreter teardown (torch + TensorFlow threads)

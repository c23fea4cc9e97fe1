"""Run by tests/training/test_backend_training.py under `KERAS_BACKEND=jax|torch` with TensorFlow blocked
(importing it raises `ImportError`, as where it is not installed):

    python tests/helpers/backend_training_worker.py ARGUMENTS.json OUT.json [slow]

Calls `keras_vit.training.train(**ARGUMENTS)`, or with `"task": "finetune"` or `"pretrain"` in
ARGUMENTS `keras_vit.training.finetune` or `keras_vit.training.pretrain.pretrain` (a `model` given as a
dict is a `ViTConfig`; `slow`: every training step slowed by 0.3 s, so a test can kill the run
mid-way) and writes `OUT.json`: the report's metrics (accuracy and loss, or pre-training's loss
and patch accuracy), backend, distribution, steps, history and start epoch, the SHA-256 of the
final weights' bytes (in `model.weights` order) and which TensorFlow modules it tried to import
and imported (none, if it holds).
"""

import hashlib
import json
import sys
import time
from pathlib import Path

from no_tensorflow import block_tensorflow

ATTEMPTS = block_tensorflow("training on JAX or PyTorch must not need TensorFlow")

import keras  # noqa: E402

from keras_vit import ViTConfig  # noqa: E402
from keras_vit.training import classification as training  # noqa: E402
from keras_vit.training import pretrain  # noqa: E402

TASKS = {"train": training.train, "finetune": training.finetune, "pretrain": pretrain.pretrain}


class _Slow(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.3)


arguments_path, out_path, *mode = sys.argv[1:]
arguments = json.loads(Path(arguments_path).read_text())
if isinstance(arguments.get("model"), dict):
    arguments["model"] = ViTConfig.from_dict(arguments["model"])
run = TASKS[arguments.pop("task", "train")]
result = run(**arguments, callbacks=[_Slow()] if mode == ["slow"] else [])
digest = hashlib.sha256()
for weight in result.model.weights:
    digest.update(keras.ops.convert_to_numpy(weight).tobytes())
report = result.report
summary = {
    key: report.get(key)
    for key in (
        "accuracy",
        "loss",
        "patch_accuracy",
        "backend",
        "strategy",
        "replicas",
        "devices",
        "mesh",
        "steps",
        "history",
    )
}
summary["resumed_from_epoch"] = report["resumed_from_epoch"]
summary.update(
    backend_in_process=keras.backend.backend(),
    weights_sha256=digest.hexdigest(),
    tensorflow_import_attempts=sorted(set(ATTEMPTS)),
    tensorflow_imported=sorted(name for name in sys.modules if name.partition(".")[0] == "tensorflow"),
)
Path(out_path).write_text(json.dumps(summary))

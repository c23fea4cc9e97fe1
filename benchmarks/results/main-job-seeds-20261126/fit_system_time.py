"""Where the JAX main job's system time goes: a JAX fit of `vit_digits` on the main job's batches,
from its PyDataset and from the same batches in memory (user and system CPU seconds of 5 epochs).

Run from the repository root: `python benchmarks/results/main-job-seeds-20261126/fit_system_time.py`.
"""

import os
import resource
import time

os.environ["KERAS_BACKEND"] = "jax"

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras_vit.variants import model_config  # noqa: E402

from keras_vit import pyinput  # noqa: E402
from keras_vit.models import build_vit  # noqa: E402

STEPS = 22  # one pass of the digits at batch 64


def usage() -> tuple[float, float, float]:
    """Wall, user and system seconds of this process so far."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), used.ru_utime, used.ru_stime


def main() -> None:
    train, _ = pyinput.load_digits()
    batches = pyinput.train_pipeline(
        train,
        image_size=(32, 32),
        batch_size=64,
        mean=(0.5,) * 3,
        std=(0.5,) * 3,
        seed=0,
        start_epoch=0,
        steps_per_epoch=STEPS,
        **train.augmentation(None, None),
        mixup_alpha=0.2,
    )
    images = np.concatenate([batches[i][0] for i in range(STEPS)])
    labels = np.concatenate([batches[i][1] for i in range(STEPS)])
    inputs = {
        "arrays": dict(x=images, y=labels, batch_size=64, shuffle=False),
        "pydataset": dict(x=batches, steps_per_epoch=STEPS),
    }
    for name, data in inputs.items():
        model = build_vit(model_config("vit_digits"), num_classes=10, classifier_activation=None)
        loss = keras.losses.CategoricalCrossentropy(from_logits=True)
        model.compile("adam", loss, jit_compile=True, steps_per_execution=STEPS)
        model.fit(epochs=1, verbose=0, **data)  # compiles
        before = usage()
        model.fit(epochs=5, verbose=0, **data)
        wall, user, system = (after - start for start, after in zip(before, usage(), strict=True))
        print(f"{name}: wall {wall:.1f} s, user {user:.1f} s, system {system:.1f} s")


if __name__ == "__main__":
    main()

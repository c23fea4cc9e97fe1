"""Issue 35's GPU target: `fit` from a JPEG folder against the same step on a device-resident batch.

    python benchmarks/gpu_input_fit.py --output DIR [--folder DIR --files 2000] [--workers N]
        [--steps 150 --warmup 30] [--tiny]

One process, Keras on JAX, the model the training driver fits: `DeviceInput` (uint8 pixels normalised on
the device) around a random-weight ViT-B/16 classifier of 10 classes built as the GPU mode builds it
(`worker.KerasWorker.build`: `mixed_bfloat16`), `compile(worker.adamw(), sparse cross-entropy,
jit_compile=True)` (AdamW 1e-3, weight decay 0.05). Three measurements, in this order:

1. `device`: `fit` of one device-resident uint8 batch of 64 (the step's rate, as `gpu.py` measures it);
2. `folder`: `fit` of `keras_vit.data.pyinput.train_pipeline(pixels="uint8", workers=N)` on the folder,
   what the driver reads on JAX and PyTorch (inception crop + flip at 224 px, batches of 64; N: the
   pipeline's default, the CPUs this process may use, unless `--workers`);
3. `input`: the same pipeline read alone, as `fit` reads it (`PyDatasetAdapter`), no model: what the
   input can give.

Rates are images/s over the steps after the first `--warmup` (the compile, the worker pool's start and
what it made ahead), the last loss fetched to the host at the end. `folder ÷ device` is the target
(>= 0.8); `input` says whether the input or the overlap is short. The folder is `benchmarks/input.py`'s
generated ImageNet-like one (500x375 JPEGs, 10 classes). Results: OUTPUT/input_fit.jsonl (one line per
measurement, then a summary line with the ratios and lscpu's model and CPU count).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("KERAS_BACKEND", "jax")

from cases import lookup_case  # noqa: E402
from input import make_folder  # noqa: E402
from machine import lscpu  # noqa: E402
from worker import KerasWorker  # noqa: E402

from keras_vit.utils.files import open_for_writing  # noqa: E402


def timed_fit(model, data, steps: int, warmup: int) -> float:
    """Seconds of `fit` from the start of step `warmup` to the end (the last loss fetched)."""
    import keras

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == warmup:
                self.started = time.perf_counter()

    clock = Clock()
    history = model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False, callbacks=[clock])
    float(history.history["loss"][-1])
    return time.perf_counter() - clock.started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--folder", default="/tmp/keras_vit_input_bench_2000")
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=None, help="default: the pipeline's (the CPUs)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--tiny", action="store_true", help="test-size model and batch: a CPU rehearsal")
    args = parser.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    results = os.path.join(args.output, "input_fit.jsonl")

    def record(**line) -> None:
        print(json.dumps(line), flush=True)
        with open_for_writing(results, "a") as file:
            file.write(json.dumps(line) + "\n")

    make_folder(args.folder, args.files)
    cpus = len(os.sched_getaffinity(0))
    worker = KerasWorker("keras_vit", cpus, 1, "jax")
    import jax
    import keras
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    from keras_vit.data import pyinput
    from keras_vit.data.preprocessing import GOOGLE_MEAN, GOOGLE_STD
    from keras_vit.training.device_input import DeviceInput

    case = lookup_case("train_b16_bf16_bs64", args.tiny)
    batch = 8 if args.tiny else case.batch
    model = DeviceInput(worker.build(case), GOOGLE_MEAN, GOOGLE_STD, num_classes=10)
    model.compile(
        optimizer=worker.adamw(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    pipeline = pyinput.train_pipeline(
        pyinput.from_directory(args.folder),
        image_size=case.image_size,
        batch_size=batch,
        seed=0,
        steps_per_epoch=10_000,
        workers=args.workers,
        pixels="uint8",
    )
    images, labels = pipeline.make_item(0)  # the pipeline's shapes and dtypes: the device-resident batch
    common = {"case": case.name, "batch": batch, "image_size": case.image_size, "workers": pipeline.processes}
    common.update(steps=args.steps, warmup=args.warmup, devices=[str(device) for device in jax.devices()])
    on_device = jax.device_put(images), jax.device_put(labels)

    def resident():
        while True:
            yield on_device

    rates = {}
    for name, data in (("device", resident()), ("folder", pipeline)):
        seconds = timed_fit(model, data, args.steps, args.warmup)
        rates[name] = (args.steps - args.warmup) * batch / seconds
        record(measurement=name, images_per_s=round(rates[name], 1), seconds=round(seconds, 3), **common)
    stream = PyDatasetAdapter(pipeline, shuffle=False).get_numpy_iterator()
    for _ in range(args.warmup):
        next(stream)
    started = time.perf_counter()
    for _ in range(args.steps - args.warmup):
        next(stream)
    rates["input"] = (args.steps - args.warmup) * batch / (time.perf_counter() - started)
    record(measurement="input", images_per_s=round(rates["input"], 1), **common)
    record(
        summary="input_fit",
        folder_vs_device=round(rates["folder"] / rates["device"], 3),
        input_vs_device=round(rates["input"] / rates["device"], 3),
        cpu=lscpu("Model name").get("Model name"),
        cpus=cpus,
        keras=keras.__version__,
        jax=jax.__version__,
        **common,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

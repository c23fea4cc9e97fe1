"""Training input speed: images/s of the training input on an ImageNet-like JPEG folder at 224 px.

Readers: keras_vit's JAX/PyTorch input (`keras_vit.data.pyinput.train_pipeline` read through Keras's
PyDataset adapter, as `fit` reads it), keras_vit's tf.data input (`keras_vit.data.tfdata.train_pipeline`,
its thread pool capped at the worker count) and timm's (`ImageFolder` + `create_transform(224,
is_training=True)` + `torch.utils.data.DataLoader(num_workers=N)`); the same folder, inception crop +
flip, batches of 64. Each (reader, workers) runs in a fresh process (TensorFlow and torch are never
imported together). Start-up: seconds from the folder's path to the first batch, per 1,000 files
(imports excluded).

    python benchmarks/input.py --files 2000 --workers 1 2 --out benchmarks/results/input.json

keras_vit's pyinput is measured as `fit` reads it now (`keras-vit-pyinput`: worker processes,
`keras_vit.data.workers`; the pool's start is outside the timed batches, `workers_ready_s` says how long
it took), with the same batches made by Keras's threads (`-threads`: the input before the worker
processes), and on request by Keras's own processes (`-keras-mp`, fork) and by grain (`-grain`, its
`mp_prefetch` over the same batch function: `pip install grain`).

The folder is generated once if missing: `--files` JPEGs of 500x375 (quality 90) in 10 class folders,
smooth random pictures (JPEG sizes like photos'), seed 0.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import subprocess
import sys
import time

from machine import lscpu

from keras_vit.utils.files import open_for_writing, refuse_link

BATCH, SIZE, CLASSES = 64, 224, 10
# keras_vit's batches: `--pixels uint8` (default) as the training driver reads them (uint8, normalised
# and mixed on the device), `float32` as `train_pipeline`'s default (normalised and mixed on the host).
PIXELS = os.environ.get("KERAS_VIT_BENCH_PIXELS", "uint8")
MIXUP = float(os.environ.get("KERAS_VIT_BENCH_MIXUP", "0"))


def make_folder(root: str, files: int) -> None:
    """`files` JPEGs of 500x375 in `CLASSES` class folders (skipped if the folder holds them already)."""
    import numpy as np
    from PIL import Image

    if os.path.isdir(root) and sum(len(names) for _, _, names in os.walk(root)) >= files:
        return
    rng = np.random.default_rng(0)
    for index in range(files):
        folder = os.path.join(root, f"class{index % CLASSES}")
        os.makedirs(folder, exist_ok=True)
        coarse = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
        picture = Image.fromarray(coarse).resize((500, 375), Image.Resampling.BICUBIC)
        noise = rng.integers(-12, 13, (375, 500, 3))
        pixels = np.clip(np.asarray(picture, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(os.path.join(folder, f"{index:05d}.jpg"), quality=90)


def _pyinput_batches(root: str, workers: int):
    from keras_vit.data import pyinput

    source = pyinput.from_directory(root)
    return pyinput.train_pipeline(
        source,
        image_size=SIZE,
        batch_size=BATCH,
        seed=0,
        steps_per_epoch=10_000,
        workers=workers,
        mixup_alpha=MIXUP,
        pixels=PIXELS,
    )


def _keras_vit_pyinput(root: str, workers: int):
    """The driver's input: worker processes (`keras_vit.data.workers`), read as `fit` reads them."""
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    from keras_vit.data import pyinput  # noqa: F401

    yield  # imported: the start-up clock starts here
    batches = _pyinput_batches(root, workers)
    stream = PyDatasetAdapter(batches, shuffle=False).get_numpy_iterator()
    yield next(stream)  # made in this process while the workers start
    started = time.perf_counter()
    batches.pool.wait_ready()
    yield {"workers_ready_s": round(time.perf_counter() - started, 2)}
    yield from stream


def _keras_vit_pyinput_threads(root: str, workers: int):
    """The same batches made by Keras's PyDataset threads (the input before the worker processes)."""
    import keras
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    from keras_vit.data import pyinput  # noqa: F401

    yield
    batches = _pyinput_batches(root, 0)
    keras.utils.PyDataset.__init__(batches, workers=workers, use_multiprocessing=False)
    yield from PyDatasetAdapter(batches, shuffle=False).get_numpy_iterator()


def _keras_vit_pyinput_keras_mp(root: str, workers: int):
    """The same batches made by Keras's own PyDataset processes (`use_multiprocessing=True`: fork)."""
    import keras
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    from keras_vit.data import pyinput  # noqa: F401

    yield
    batches = _pyinput_batches(root, 0)
    keras.utils.PyDataset.__init__(batches, workers=workers, use_multiprocessing=True)
    yield from PyDatasetAdapter(batches, shuffle=False).get_numpy_iterator()


def _keras_vit_pyinput_grain(root: str, workers: int):
    """The same batches made by grain's processes (`MapDataset` of batch indices, `mp_prefetch`)."""
    import grain
    from absl import flags

    from keras_vit.data import pyinput  # noqa: F401

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv[:1])
    yield
    batches = _pyinput_batches(root, 0)
    dataset = grain.MapDataset.range(10_000).map(batches.make_item)
    dataset = dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))  # 1 thread
    stream = iter(dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)))
    yield next(stream)
    yield from stream


def _keras_vit_tfdata(root: str, workers: int):
    import tensorflow as tf

    from keras_vit.data import tfdata

    yield  # imported: the start-up clock starts here
    source = tfdata.from_directory(root)
    pixels = {"pixels": PIXELS} if "pixels" in inspect.signature(tfdata.train_pipeline).parameters else {}
    batches = tfdata.train_pipeline(
        source, image_size=SIZE, batch_size=BATCH, seed=0, steps_per_epoch=10_000, mixup_alpha=MIXUP, **pixels
    )
    options = tf.data.Options()
    options.threading.private_threadpool_size = workers
    yield from batches.with_options(options).as_numpy_iterator()


def _timm(root: str, workers: int):
    import torch
    from timm.data import ImageDataset, create_transform

    yield  # imported: the start-up clock starts here
    dataset = ImageDataset(root, transform=create_transform(SIZE, is_training=True))
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=BATCH, shuffle=True, num_workers=workers, drop_last=True, persistent_workers=True
    )

    while True:
        yield from loader


READERS = {
    "keras_vit-pyinput": _keras_vit_pyinput,
    "keras_vit-pyinput-threads": _keras_vit_pyinput_threads,
    "keras_vit-pyinput-keras-mp": _keras_vit_pyinput_keras_mp,
    "keras_vit-pyinput-grain": _keras_vit_pyinput_grain,
    "keras_vit-tfdata": _keras_vit_tfdata,
    "timm": _timm,
}
DEFAULT_READERS = ["keras_vit-pyinput", "keras_vit-pyinput-threads", "keras_vit-tfdata", "timm"]


def measure(reader: str, root: str, workers: int, batches: int) -> dict:
    """One reader's start-up (path to first batch) and images/s over `batches` batches, after 3 + 2 x
    workers (what the readers with worker processes made ahead while starting)."""
    files = sum(len(names) for _, _, names in os.walk(root))
    stream = READERS[reader](root, workers)
    next(stream)  # the reader's imports, outside the clock
    started = time.perf_counter()
    next(stream)
    startup = time.perf_counter() - started
    extra = next(stream)
    extra = extra if isinstance(extra, dict) else {}  # the pool's readiness, where it has one
    for _ in range(2 + 2 * workers):  # what the reader made ahead while it started: not its rate
        next(stream)
    timed = time.perf_counter()
    for _ in range(batches):
        next(stream)
    seconds = time.perf_counter() - timed
    return {
        "reader": reader,
        "workers": workers,
        "images_per_s": round(batches * BATCH / seconds, 1),
        "startup_s_per_1000_files": round(startup * 1000 / files, 3),
        "files": files,
        "batches_timed": batches,
        "pixels": PIXELS if reader != "timm" else "float32",
        **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="/tmp/keras_vit_input_bench")
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--readers", nargs="+", default=DEFAULT_READERS, choices=list(READERS))
    parser.add_argument("--deadline", type=float, default=3600, help="seconds for all cases")
    parser.add_argument("--pixels", choices=["uint8", "float32"], default=PIXELS)
    parser.add_argument("--mixup", type=float, default=MIXUP, help="keras_vit's mixup alpha (timm: none)")
    parser.add_argument("--out")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one reader here and print its JSON
    args = parser.parse_args()
    if args.out:
        refuse_link(args.out)  # before the run, not after it
    if args.one:
        print(json.dumps(measure(args.one, args.folder, args.workers[0], args.batches)))
        return
    start = time.monotonic()
    make_folder(args.folder, args.files)
    results = []
    for workers in args.workers:
        for reader in args.readers:
            command = [sys.executable, __file__, "--one", reader, "--folder", args.folder]
            command += ["--workers", str(workers), "--batches", str(args.batches)]
            left = args.deadline - (time.monotonic() - start)
            row = {"reader": reader, "workers": workers}
            env = {
                **os.environ,
                "KERAS_VIT_BENCH_PIXELS": args.pixels,
                "KERAS_VIT_BENCH_MIXUP": str(args.mixup),
            }
            if left < 10:
                row["skipped"] = "deadline"
            else:
                try:
                    done = subprocess.run(command, capture_output=True, text=True, timeout=left, env=env)
                    if done.returncode == 0:
                        row = json.loads(done.stdout.strip().splitlines()[-1])
                    else:
                        row["error"] = done.stderr.strip().splitlines()[-1:]
                except subprocess.TimeoutExpired:
                    row["skipped"] = "deadline (cut short)"
            results.append(row)
            print(json.dumps(results[-1]), flush=True)
    for row in results:
        timm = [
            other for other in results if other["workers"] == row["workers"] and other["reader"] == "timm"
        ]
        if "images_per_s" in row and timm and "images_per_s" in timm[0]:
            row["vs_timm"] = round(row["images_per_s"] / timm[0]["images_per_s"], 2)
        one = [other for other in results if other["workers"] == 1 and other["reader"] == row["reader"]]
        if "images_per_s" in row and one and "images_per_s" in one[0]:
            row["vs_1_worker"] = round(row["images_per_s"] / one[0]["images_per_s"], 2)
    record = {
        "results": results,
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
            "lscpu": lscpu("Model name", "CPU(s)", "Flags"),
            "python": platform.python_version(),
        },
        "command": " ".join(sys.argv),
        "pixels": args.pixels,
        "mixup": args.mixup,
    }
    if args.out:
        with open_for_writing(args.out, "w", encoding="utf-8") as file:
            json.dump(record, file, indent=1)


if __name__ == "__main__":
    main()

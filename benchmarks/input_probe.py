"""How an input pipeline scales with CPU workers (issue 35's question): JPEG files to uint8 batches.

    python benchmarks/input_probe.py --output DIR [--images 2000] [--workers 1 2 8 16] [--batch 64]
        [--seconds 3] [--deadline 90] [--pipelines grain_draft timm grain pool grain_threads]

A folder of `--images` generated JPEGs (500x375, quality 90, 10 class folders; smooth random colour
fields with fine noise, written by a process pool at the start, not timed) is read as training
batches of `--batch` 224x224 images, each pipeline at each worker count:

* `grain_draft`, `grain`: `grain.MapDataset` (source of file paths, shuffle, `random_map` of the
  decode below, repeat, batch of stacked uint8 arrays), `to_iter_dataset` with one read thread, then
  `mp_prefetch(MultiprocessingOptions(num_workers=N))`. The decode: Pillow opens the file, a random
  resized crop box is drawn (torchvision's: scale 0.08-1, ratio 3/4-4/3, 10 tries, else the centre),
  `grain_draft` asks Pillow's JPEG decoder for a reduced image first (`Image.draft`: DCT scaling by
  1/2, 1/4 or 1/8, as far as the crop still has at least 224 pixels a side), then the crop is resized
  to 224x224 (bilinear) and flipped with probability 1/2, as uint8 HWC.
* `grain_threads`: the same as `grain_draft` in the main process, `ReadOptions(num_threads=N)`
  (threads, no worker processes).
* `timm`: `timm.data.ImageDataset(folder)` with `timm.data.create_transform(224, is_training=True)`
  (random resized crop, flip, colour jitter 0.4, to a normalised float32 CHW tensor: more work than
  the uint8 pipelines) and a `torch.utils.data.DataLoader(batch_size, num_workers=N)`.
* `pool`: the `grain_draft` decode in a `multiprocessing` pool of N processes (fork), `imap` in
  order, batches stacked in the main process.

Each (pipeline, workers): the first batch is untimed (workers start), then batches for `--seconds`;
images/s of those. One JSON line per measurement in DIR/input_probe.jsonl as it finishes; the whole
probe stops at `--deadline` s (the rest recorded as skipped).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

from keras_vit.utils.files import open_for_writing

SIZE = 224
PIPELINES = ("grain_draft", "timm", "grain", "pool", "grain_threads")


def write_image(args) -> None:
    """One JPEG: a smooth random colour field (a 20x15 noise image upscaled) plus fine noise."""
    import numpy as np
    from PIL import Image

    path, seed = args
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (15, 20, 3), dtype=np.uint8)).resize(
        (500, 375), Image.BICUBIC
    )
    pixels = np.asarray(coarse, dtype=np.int16) + rng.integers(-12, 13, (375, 500, 3), dtype=np.int16)
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=90)


def make_folder(count: int, classes: int = 10) -> tuple[str, list[str]]:
    import multiprocessing

    folder = tempfile.mkdtemp(prefix="input_probe_jpegs_")
    paths = []
    for index in range(count):
        class_folder = os.path.join(folder, f"class_{index % classes}")
        os.makedirs(class_folder, exist_ok=True)
        paths.append(os.path.join(class_folder, f"{index:05d}.jpg"))
    with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
        pool.map(write_image, [(path, index) for index, path in enumerate(paths)], chunksize=16)
    return folder, paths


def crop_box(rng, width: int, height: int) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box (left, top, width, height): scale 0.08-1, ratio 3/4-4/3."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    side = min(width, height)
    return (width - side) // 2, (height - side) // 2, side, side


class Decode:
    """path -> uint8 (224, 224, 3): random resized crop and flip, optionally from a reduced decode."""

    def __init__(self, draft: bool):
        self.draft = draft

    def __call__(self, path: str, rng):
        import numpy as np
        from PIL import Image

        with Image.open(path) as image:
            width, height = image.size
            left, top, w, h = crop_box(rng, width, height)
            if self.draft:
                shrink = min(w, h) / SIZE  # the crop may shrink this much and keep 224 px a side
                if shrink > 1:
                    image.draft("RGB", (math.ceil(width / shrink), math.ceil(height / shrink)))
                factor = width / image.size[0]
                left, top, w, h = left / factor, top / factor, w / factor, h / factor
            image = image.convert("RGB")
            out = image.resize((SIZE, SIZE), Image.BILINEAR, box=(left, top, left + w, top + h))
        if rng.random() < 0.5:
            out = out.transpose(Image.FLIP_LEFT_RIGHT)
        return np.asarray(out)


def _pool_decode(args):
    import numpy as np

    path, seed = args
    return Decode(True)(path, np.random.default_rng(seed))


def timed_batches(iterator, batch: int, seconds: float) -> dict:
    next(iterator)  # workers start
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(iterator)
        count += 1
    elapsed = time.perf_counter() - start
    return {"images_per_s": count * batch / elapsed, "batches": count, "seconds": elapsed}


def grain_iterator(paths: list[str], batch: int, workers: int, draft: bool, threads: bool):
    import grain

    dataset = (
        grain.MapDataset.source(paths)
        .shuffle(seed=0)
        .random_map(Decode(draft), seed=0)
        .repeat()
        .batch(batch, drop_remainder=True)
    )
    if threads:
        return iter(
            dataset.to_iter_dataset(grain.ReadOptions(num_threads=workers, prefetch_buffer_size=4 * batch))
        )
    iterable = dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
    return iter(
        iterable.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=2))
    )


def timm_iterator(folder: str, batch: int, workers: int):
    import timm.data
    import torch

    transform = timm.data.create_transform(SIZE, is_training=True)
    dataset = timm.data.ImageDataset(folder, transform=transform)
    sampler = torch.utils.data.RandomSampler(dataset, replacement=True, num_samples=10**8)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch,
        sampler=sampler,
        num_workers=workers,
        drop_last=True,
        persistent_workers=True,
    )
    return iter(loader), repr(transform)


def pool_batches(pool, paths: list[str], batch: int):
    import itertools

    import numpy as np

    jobs = ((paths[index % len(paths)], index) for index in itertools.count())
    results = pool.imap(_pool_decode, jobs, chunksize=4)
    while True:
        yield np.stack([next(results) for _ in range(batch)])


def probe(args) -> None:
    import multiprocessing

    start = time.monotonic()
    try:  # grain reads absl flags, which a plain script has not parsed
        from absl import flags

        if not flags.FLAGS.is_parsed():
            flags.FLAGS(sys.argv[:1])
    except ImportError:
        pass
    folder, paths = make_folder(args.images)
    lines = open_for_writing(os.path.join(args.output, "input_probe.jsonl"), "a")

    def write(entry):
        lines.write(json.dumps(entry) + "\n")
        lines.flush()
        state = entry.get("error") or entry.get("skipped") or f"{entry['images_per_s']:.0f} images/s"
        print(f"  {entry.get('pipeline', '')} x{entry.get('workers', '')}: {state}", flush=True)

    versions = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
    for name in ("PIL", "numpy", "grain", "torch", "timm"):
        try:
            module = __import__(name)
            versions[name] = getattr(module, "__version__", "?")
        except ImportError as error:
            versions[name] = f"missing: {error}"
    sizes = [os.path.getsize(path) for path in paths]
    write_time = time.monotonic() - start
    lines.write(
        json.dumps(
            {
                "event": "start",
                "versions": versions,
                "images": len(paths),
                "mean_jpeg_bytes": sum(sizes) / len(sizes),
                "folder_written_s": write_time,
            }
        )
        + "\n"
    )
    print(
        f"{len(paths)} JPEGs written in {write_time:.1f} s, mean {sum(sizes) / len(sizes) / 1e3:.0f} kB",
        flush=True,
    )
    for pipeline in args.pipelines:
        for workers in args.workers:
            entry = {"pipeline": pipeline, "workers": workers, "batch": args.batch}
            if time.monotonic() - start > args.deadline - args.seconds - 2:
                write({**entry, "skipped": "deadline"})
                continue
            iterator, pool = None, None
            try:
                if pipeline in ("grain", "grain_draft", "grain_threads"):
                    draft = pipeline != "grain"
                    iterator = grain_iterator(paths, args.batch, workers, draft, pipeline == "grain_threads")
                elif pipeline == "timm":
                    iterator, transform = timm_iterator(folder, args.batch, workers)
                    entry["transform"] = transform
                else:
                    pool = multiprocessing.get_context("fork").Pool(workers)
                    iterator = pool_batches(pool, paths, args.batch)
                write({**entry, **timed_batches(iterator, args.batch, args.seconds)})
            except Exception as error:  # recorded; the next one goes on
                write({**entry, "error": f"{type(error).__name__}: {str(error)[:300]}"})
            finally:
                close = getattr(iterator, "close", None)
                if callable(close):
                    close()
                del iterator
                if pool is not None:
                    pool.terminate()
    lines.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 8, 16])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per measurement")
    parser.add_argument("--deadline", type=float, default=90.0, help="seconds for the whole probe")
    parser.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=PIPELINES)
    args = parser.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    probe(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

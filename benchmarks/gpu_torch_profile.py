"""Where keras_vit's PyTorch-backend training step spends its time: eager against `jit_compile=True`.

    python benchmarks/gpu_torch_profile.py --output DIR [--case train_b16_bf16_bs64] [--steps 5] [--tiny]

On an H200 (2026-11-28) the compiled forward pass (`compile(jit_compile=True)`: `ViT.compile` runs the
forward through `torch.compile`, Keras's step eager) inferred at timm compiled's rate but trained slower
than eager (909 against 1,294 images/s, ViT-B/16 bf16, batch 64). This profiles both training steps as
the GPU mode builds and times them (`worker.KerasWorker`: `mixed_bfloat16`, AdamW 1e-3 / 0.05, the
device-resident batch fed to `fit` by a generator): per mode, `fit` of `--warmup` steps (the compile),
then `torch.profiler` over `fit` of `--steps` steps, then (on a GPU) `fit` of `--steps` steps counting
the host-device synchronisations. Recorded per mode: wall ms per step, the device's kernel time per
step (CPU operator time off a GPU), the host's, the top kernels by self time and the synchronisations.
Writes DIR/torch_profile.jsonl (one line per mode); prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["KERAS_BACKEND"] = "torch"
import torch  # noqa: E402, F401  - before TensorFlow could ever be imported (keras_vit never does on torch)
from cases import lookup_case  # noqa: E402
from worker import KerasWorker, random_batch  # noqa: E402

TOP = 15


def profile_mode(worker: KerasWorker, case, jit: bool, warmup: int, steps: int) -> dict:
    """`fit` of `warmup` steps, then `steps` steps under torch.profiler: times per step and top kernels."""
    import keras
    from torch.profiler import ProfilerActivity, profile

    model = worker.compiled_for_training(case, jit)
    images, labels = (
        keras.ops.convert_to_tensor(value) for value in random_batch(case.batch, case.image_size)
    )

    def batches():
        while True:
            yield images, labels

    def fit(count: int) -> float:
        started = time.perf_counter()
        history = model.fit(batches(), epochs=1, steps_per_epoch=count, verbose=0, shuffle=False)
        float(history.history["loss"][-1])
        return time.perf_counter() - started

    compile_s = fit(warmup)
    plain_s = fit(steps)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as trace:
        fit(steps)
    syncs = _synchronisations(lambda: fit(steps)) if torch.cuda.is_available() else None
    events = trace.key_averages()
    if cuda:
        kernels = [
            (event.key, event.self_device_time_total) for event in events if event.self_device_time_total
        ]
    else:
        kernels = [(event.key, event.self_cpu_time_total) for event in events if event.self_cpu_time_total]
    kernels.sort(key=lambda item: -item[1])
    return {
        "case": case.name,
        "mode": "jit_compile" if jit else "eager",
        "compiled_forward": bool(getattr(model, "compiled_forward", False)),
        "device": "cuda" if cuda else "cpu",
        "first_steps_s": round(compile_s, 2),
        "wall_ms_per_step": round(plain_s / steps * 1e3, 3),
        "images_per_s": round(steps * case.batch / plain_s, 1),
        "kernel_ms_per_step": round(sum(spent for _, spent in kernels) / steps / 1e3, 3),
        "host_ms_per_step": round(sum(event.self_cpu_time_total for event in events) / steps / 1e3, 3),
        "kernels": len(kernels),
        # host-device synchronisations in `fit` of `steps` steps (PyTorch's sync debug mode), by caller;
        # `fit` itself makes a few per call (metrics reset, the epoch's logs)
        "synchronisations": syncs,
        "top": [(name, round(spent / steps / 1e3, 3)) for name, spent in kernels[:TOP]],
    }


def _synchronisations(run) -> dict:
    """`run()` under `torch.cuda.set_sync_debug_mode("warn")`: the number of synchronising CUDA calls,
    by the Python line that made each."""
    import collections
    import warnings

    import torch

    callers = collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchronizing" in str(warning.message):
            callers[f"{warning.filename.split('site-packages/')[-1]}:{warning.lineno}"] += 1
    return {"total": sum(callers.values()), "callers": dict(callers.most_common(12))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--case", default="train_b16_bf16_bs64")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="test-size model and batch: a CPU rehearsal")
    args = parser.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    worker = KerasWorker("keras_vit", len(os.sched_getaffinity(0)), 1, "torch")
    case = lookup_case(args.case, args.tiny)
    for jit in (False, True):
        line = profile_mode(worker, case, jit, args.warmup, args.steps)
        with open(os.path.join(args.output, "torch_profile.jsonl"), "a") as file:
            file.write(json.dumps(line) + "\n")
        print(json.dumps({key: value for key, value in line.items() if key != "top"}), flush=True)
        for name, milliseconds in line["top"]:
            print(f"  {milliseconds:8.3f} ms/step  {name[:100]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where keras_vit's PyTorch-backend steps spend their time, beside timm eager's: kernels, host, waits.

    python benchmarks/gpu_torch_profile.py --output DIR [--cases train_b16_bf16_bs64 infer_b16_bf16_bs256]
        [--competitors keras_vit keras_vit_compiled timm] [--steps 5] [--tiny]

On an H200 (2026-11-28) the eager PyTorch path trained ViT-B/16 bf16 at 0.56x timm eager (batch 64) and
inferred at 0.74x (batch 256); the compiled forward pass (`compile(jit_compile=True)`: `ViT.compile`
runs the forward through `torch.compile`, Keras's step eager) inferred at timm compiled's rate but
trained slower than eager (909 against 1,294 images/s). This profiles each competitor's timed step as
the benchmark builds it (`worker.KerasWorker` / `worker.TimmWorker` `.runner`: `fit` of the
device-resident batch with AdamW 1e-3 / 0.05 for training, the forward pass under
`torch.inference_mode()` with the logits fetched for inference; mixed bfloat16 / autocast): `--warmup`
steps (the compile), `--steps` steps timed, `--steps` under `torch.profiler`, then (on a GPU) `--steps`
counting the host-device synchronisations. Recorded per (case, competitor): wall ms per step, the
device's kernel time per step (CPU operator time off a GPU), the host's, the number of distinct kernels,
the top kernels by self time and the synchronisations. Writes DIR/torch_profile.jsonl (one line per
(case, competitor)); prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["KERAS_BACKEND"] = "torch"
import torch  # noqa: E402, F401  - before TensorFlow could ever be imported (keras_vit never does on torch)
from cases import lookup_case  # noqa: E402
from worker import KerasWorker, TimmWorker  # noqa: E402

from keras_vit.utils.files import open_for_writing  # noqa: E402

TOP = 15
COMPETITORS = {  # name: (worker class, framework, jit)
    "keras_vit": (KerasWorker, "keras_vit", False),
    "keras_vit_compiled": (KerasWorker, "keras_vit", True),
    "timm": (TimmWorker, "timm", False),
}


def profile_runner(runner, batch: int, warmup: int, steps: int) -> dict:
    """`runner(warmup)`, `runner(steps)` timed, then `runner(steps)` under torch.profiler (and on a GPU
    once more counting synchronisations): times per step and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    first_s = runner(warmup)
    plain_s = runner(steps)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as trace:
        runner(steps)
    syncs = _synchronisations(lambda: runner(steps)) if cuda else None
    events = trace.key_averages()
    if cuda:
        kernels = [
            (event.key, event.self_device_time_total) for event in events if event.self_device_time_total
        ]
    else:
        kernels = [(event.key, event.self_cpu_time_total) for event in events if event.self_cpu_time_total]
    kernels.sort(key=lambda item: -item[1])
    return {
        "device": "cuda" if cuda else "cpu",
        "first_steps_s": round(first_s, 2),
        "wall_ms_per_step": round(plain_s / steps * 1e3, 3),
        "images_per_s": round(steps * batch / plain_s, 1),
        "kernel_ms_per_step": round(sum(spent for _, spent in kernels) / steps / 1e3, 3),
        "host_ms_per_step": round(sum(event.self_cpu_time_total for event in events) / steps / 1e3, 3),
        "kernels": len(kernels),
        # host-device synchronisations in `steps` steps (PyTorch's sync debug mode), by caller; Keras's
        # `fit` itself makes a few per call (metrics reset, the epoch's logs), inference one (the fetch)
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
    parser.add_argument("--cases", nargs="+", default=["train_b16_bf16_bs64", "infer_b16_bf16_bs256"])
    parser.add_argument("--competitors", nargs="+", choices=sorted(COMPETITORS), default=list(COMPETITORS))
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="test-size model and batch: a CPU rehearsal")
    args = parser.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    threads = len(os.sched_getaffinity(0))
    workers = {}
    for case_name in args.cases:
        case = lookup_case(case_name, args.tiny)
        for competitor in args.competitors:
            kind, framework, jit = COMPETITORS[competitor]
            if framework not in workers:
                workers[framework] = kind(framework, threads, 1, "torch")
            runner, _ = workers[framework].runner(case, jit)
            line = {"case": case.name, "competitor": competitor}
            line |= profile_runner(runner, case.batch, args.warmup, args.steps)
            with open_for_writing(os.path.join(args.output, "torch_profile.jsonl"), "a") as file:
                file.write(json.dumps(line) + "\n")
            print(json.dumps({key: value for key, value in line.items() if key != "top"}), flush=True)
            for name, milliseconds in line["top"]:
                print(f"  {milliseconds:8.3f} ms/step  {name[:100]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

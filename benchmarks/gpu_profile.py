"""Where a keras_vit training step's time goes on a GPU (JAX): a breakdown and the kernels' times.

    python benchmarks/gpu_profile.py --output DIR [--case train_b16_bf16_bs64] [--tiny]

Two views of the same step (the GPU mode's case: keras_vit on JAX, `mixed_bfloat16`, AdamW
1e-3 / 0.05, random inputs already on the device):

* The breakdown, each part `jax.jit`-compiled on its own and timed as the median of 3 rounds
  of at least 1 s: the forward pass with the loss (`training=True`); forward and backward
  (`jax.value_and_grad`); one step of optax's AdamW with donated state (forward, backward,
  update); Keras's `fit` per step (a generator of the same device batch); and Keras's
  `train_on_batch`, which copies the state back into the variables and fetches the logs every
  call. backward = grad − forward, the optimizer = optax step − grad, what Keras adds = fit −
  optax step.
* The kernels: `jax.profiler.trace` of a 5-step `fit`, read back with `jax.profiler.ProfileData`;
  the device's kernel times summed by name and by kind (matmul, attention, the rest). The
  kernels' sum against the wall time per step says whether the device waits for the host.

Writes DIR/gpu_profile.json and prints a summary. Runs on a CPU too (`--tiny`: a rehearsal).
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("KERAS_BACKEND", "jax")

from cases import lookup_case  # noqa: E402
from worker import LEARNING_RATE, WEIGHT_DECAY, KerasWorker, Runner, fit_runner, random_batch, timed  # noqa: E402

from keras_vit.utils.files import open_for_writing, refuse_link  # noqa: E402

KINDS = (
    ("attention", re.compile(r"fmha|flash|attention|cudnn|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|cublas|cutlass|nvjet|matmul|dot|xmma|sm90", re.I)),
)
TRACED_STEPS = 5


def seconds_per_step(run: Runner, min_time: float = 1.0, rounds: int = 3) -> float:
    """The median over `rounds` of the seconds per call of `run` (a `worker.Runner`), each round one
    run of about `min_time` s (so a `fit` round pays its per-call set-up once, as a training epoch does)."""
    run(1)
    calls, elapsed = 1, run(1)
    while elapsed < min_time / 4:
        calls *= 2
        elapsed = run(calls)
    calls = math.ceil(calls * min_time / elapsed)
    return statistics.median(run(calls) / calls for _ in range(rounds))


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def kernel_times(trace_dir: str, steps: int) -> dict:
    """The device kernels' summed times per step, by name and by kind, from the trace's xplane."""
    import jax

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        return {"error": f"no .xplane.pb under {trace_dir}"}
    data = jax.profiler.ProfileData.from_file(paths[0])
    per_line: dict[str, collections.Counter] = {}
    planes = []
    for plane in data.planes:
        planes.append(plane.name)
        for line in plane.lines:
            counter = per_line.setdefault(f"{plane.name} | {line.name}", collections.Counter())
            for event in line.events:
                counter[event.name] += event.duration_ns
    # A GPU: its streams' kernels; else XLA's ops; on a CPU rehearsal, XLA's host threads.
    for chosen in (r"^/device:GPU.*stream", r"^/device:GPU.*XLA Ops", r"^/host:CPU \| tf_XLA"):
        used = [name for name in per_line if re.search(chosen, name, re.I) and per_line[name]]
        if used:
            break
    by_name: collections.Counter = sum((per_line[name] for name in used), collections.Counter())
    total = sum(by_name.values())
    by_kind: collections.Counter = collections.Counter()
    for name, ns in by_name.items():
        by_kind[kind_of(name)] += ns
    per_step = lambda ns: ns / steps / 1e6  # noqa: E731  milliseconds
    return {
        "total_ms_per_step": per_step(total),
        "by_kind_ms_per_step": {kind: per_step(ns) for kind, ns in by_kind.most_common()},
        "top_kernels": [
            {"name": name[:160], "ms_per_step": per_step(ns), "share": ns / total if total else 0.0}
            for name, ns in by_name.most_common(30)
        ],
        "lines_used": used,
        "lines": {name: sum(counter.values()) / steps / 1e6 for name, counter in per_line.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--case", default="train_b16_bf16_bs64")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    refuse_link(os.path.join(args.output, "gpu_profile.json"))  # before the run, not after it
    worker = KerasWorker("keras_vit", os.cpu_count(), 1, "jax")
    jax, keras = worker.jax, worker.keras
    import optax

    case = lookup_case(args.case, args.tiny)
    images, labels = random_batch(case.batch, case.image_size)
    x, y = jax.device_put(images), jax.device_put(labels)
    record: dict = {"case": args.case, "tiny": args.tiny, "attention": args.attention, "batch": case.batch}
    record["devices"] = [str(device) for device in jax.devices()]
    record["versions"] = worker.versions()
    ready = lambda result: jax.block_until_ready(result)  # noqa: E731

    model = worker.compiled_for_training(case, jit=True, attention=args.attention)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainable = [variable.value for variable in model.trainable_variables]
    non_trainable = [variable.value for variable in model.non_trainable_variables]

    def loss(trainable, non_trainable, x, y):
        logits, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_fn(y, logits), non_trainable

    forward = jax.jit(loss)
    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    optimizer = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def optax_step(trainable, opt_state, non_trainable, x, y):
        (value, non_trainable), grads = jax.value_and_grad(loss, has_aux=True)(trainable, non_trainable, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, non_trainable, value

    state = {"params": [jax.numpy.array(v) for v in trainable], "opt": None}
    state["opt"] = optimizer.init(state["params"])

    def run_optax():
        params, opt_state, _, value = optax_step(state["params"], state["opt"], non_trainable, x, y)
        state.update(params=params, opt=opt_state)
        return value

    run_fit = fit_runner(model.fit, x, y)
    timings = {}
    for part, run in (
        ("forward", timed(lambda: forward(trainable, non_trainable, x, y)[0], ready)),
        ("forward_backward", timed(lambda: grad(trainable, non_trainable, x, y)[0][0], ready)),
        ("optax_adamw_step", timed(run_optax, ready)),
        ("keras_fit", run_fit),
        ("keras_train_on_batch", timed(lambda: model.train_on_batch(x, y), ready)),
    ):
        start = time.perf_counter()
        timings[part] = seconds_per_step(run)
        print(f"{part}: {timings[part] * 1e3:.2f} ms/step ({time.perf_counter() - start:.0f} s)", flush=True)
    ms = {part: value * 1e3 for part, value in timings.items()}
    record["ms_per_step"] = ms
    record["images_per_s"] = {part: case.batch / value for part, value in timings.items()}
    record["breakdown_ms"] = {
        "forward": ms["forward"],
        "backward": ms["forward_backward"] - ms["forward"],
        "optimizer_update": ms["optax_adamw_step"] - ms["forward_backward"],
        "keras_fit_over_optax_step": ms["keras_fit"] - ms["optax_adamw_step"],
        "train_on_batch_over_fit": ms["keras_train_on_batch"] - ms["keras_fit"],
    }
    trace_dir = tempfile.mkdtemp(prefix="keras_vit_trace_")  # deep folders: not brought back from $OUT
    with jax.profiler.trace(trace_dir):
        run_fit(TRACED_STEPS)
    record["kernels"] = kernel_times(trace_dir, TRACED_STEPS)
    with open_for_writing(os.path.join(args.output, "gpu_profile.json"), "w") as file:
        json.dump(record, file, indent=1)
    print(json.dumps({key: record[key] for key in ("ms_per_step", "breakdown_ms")}, indent=1))
    kernels = record["kernels"]
    summary = {key: kernels.get(key) for key in ("total_ms_per_step", "by_kind_ms_per_step")}
    print(json.dumps(summary, indent=1))
    for row in kernels.get("top_kernels", [])[:15]:
        print(f"{row['ms_per_step']:8.3f} ms {row['share']:6.1%}  {row['name'][:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Inference speed and weight memory of keras_vit models: float32 against Keras post-training quantization.

    python benchmarks/quantization.py          # ViT-Ti/16 and ViT-B/16, batch 16, the 3 modes below
    python benchmarks/quantization.py --modes float32 int8 int4 --variants vit_b16 --rounds 7
    python benchmarks/quantization.py --quick  # smoke test: ViT-Ti/16, 2 short rounds

Modes: `int8` is `model.quantize("int8")` (int8 kernels and dynamically quantized int8
activations: integer matrix products); `int8_weight_only` the same kernels with float
activations (`Int8QuantizationConfig(activation_quantizer=None)`: float matrix products with the
int8 kernel converted on the fly); `int4` and `float8` are Keras's modes of those names.

For each variant one float32 model (random weights, a random head so the logits are not zero)
and one copy per quantized mode (`model.quantize(mode)`) are built in this process and traced
(`predict_on_batch` twice). Each round then measures every mode one after another, in an order
rotated from round to round, so slow drifts of the machine hit all alike: one measurement is as
many `predict_on_batch` calls on the same batch as take at least `--min-time` seconds.
Reported per mode: images/s (median, min, max over rounds), the speed-up against float32 (median of
the per-round ratios), the bytes of `model.weights` (int8 kernels hold 1 byte per value plus a
float32 scale per output), the relative logit difference against float32 on the batch, and the
share of the machine's CPU time that other processes took during the measurements (from
/proc/stat: this machine may be shared). The CPU model is `lscpu`'s "Model name".

Results go to `benchmarks/results/quantization-<machine>.json` (every measurement, the machine,
versions, date and command line) and the table is printed as Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time

from machine import busy_seconds, cpu_model

from keras_vit.utils.files import open_for_writing, refuse_link

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("float32", "int8", "int8_weight_only", "int4", "float8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", default=["vit_ti16", "vit_b16"], help="keras_vit variants")
    parser.add_argument("--modes", nargs="+", default=["float32", "int8", "int8_weight_only"], choices=MODES)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-time", type=float, default=2.0, help="seconds per measurement, at least")
    parser.add_argument("--output", default=None, help="default: results/quantization-<machine>.json")
    parser.add_argument("--quick", action="store_true", help="ViT-Ti/16 only, 2 rounds of 0.3 s")
    args = parser.parse_args(argv)
    if args.quick:
        args.variants, args.rounds, args.min_time = ["vit_ti16"], 2, 0.3
    if "float32" not in args.modes:
        args.modes = ["float32", *args.modes]
    if args.rounds < 1 or args.batch_size < 1 or args.min_time <= 0:
        parser.error("--rounds and --batch-size must be >= 1, --min-time > 0")
    return args


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def weight_bytes(model) -> int:
    import keras
    import numpy as np

    return int(
        sum(
            int(np.prod(weight.shape)) * np.dtype(keras.backend.standardize_dtype(weight.dtype)).itemsize
            for weight in model.weights
        )
    )


def build(variant: str, modes: list[str], images):
    """{mode: model}: a float32 model with random weights and a random head, and quantized copies."""
    import keras
    import numpy as np

    import keras_vit

    keras.utils.set_random_seed(0)
    model = keras_vit.create_model(variant, classifier_activation=None)  # logits
    rng = np.random.default_rng(0)
    model.head.kernel.assign(rng.normal(0.0, 0.02, model.head.kernel.shape).astype("float32"))
    models, quantize_seconds = {"float32": model}, {}
    for mode in modes:
        if mode == "float32":
            continue
        copy = model.rebuild()
        start = time.perf_counter()
        gc.freeze()  # Keras runs gc.collect() per replaced kernel: frozen objects make it cheap
        try:
            if mode == "int8_weight_only":
                copy.quantize(config=keras.quantizers.Int8QuantizationConfig(activation_quantizer=None))
            else:
                copy.quantize(mode)
        finally:
            gc.unfreeze()
        quantize_seconds[mode] = time.perf_counter() - start
        models[mode] = copy
    for copy in models.values():
        copy.predict_on_batch(images)  # trace
        copy.predict_on_batch(images)
    return models, quantize_seconds


def measure(model, images, min_time: float) -> dict:
    """Calls on `images` for at least `min_time` s: images/s and the other processes' CPU share."""
    calls, start = 0, time.perf_counter()
    busy, own = busy_seconds(), own_cpu_seconds()
    while True:
        model.predict_on_batch(images)
        calls += 1
        wall = time.perf_counter() - start
        if wall >= min_time:
            break
    other = (busy_seconds() - busy) - (own_cpu_seconds() - own)
    return {
        "calls": calls,
        "seconds": wall,
        "images_per_s": calls * len(images) / wall,
        "other_cpu_share": max(0.0, other) / (wall * os.cpu_count()),
    }


def relative_logit_error(reference, actual) -> float:
    import numpy as np

    reference = reference - reference.mean(axis=1, keepdims=True)
    actual = actual - actual.mean(axis=1, keepdims=True)
    return float(np.linalg.norm(actual - reference) / np.linalg.norm(reference))


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    import keras
    import numpy as np

    import keras_vit

    size = keras_vit.VARIANTS[variant].image_hw
    images = np.random.default_rng(1).uniform(-1, 1, (args.batch_size, *size, 3)).astype("float32")
    models, quantize_seconds = build(variant, args.modes, images)
    reference = keras.ops.convert_to_numpy(models["float32"].predict_on_batch(images))
    rounds = []
    for index in range(args.rounds):
        order = args.modes[index % len(args.modes) :] + args.modes[: index % len(args.modes)]
        rounds.append({mode: measure(models[mode], images, args.min_time) for mode in order})
        print(
            f"  {variant} round {index + 1}: "
            + ", ".join(f"{m} {r['images_per_s']:.1f}" for m, r in rounds[-1].items())
        )
    result = {}
    for mode in args.modes:
        speeds = [round_[mode]["images_per_s"] for round_ in rounds]
        logits = keras.ops.convert_to_numpy(models[mode].predict_on_batch(images))
        result[mode] = {
            "images_per_s": {"median": statistics.median(speeds), "min": min(speeds), "max": max(speeds)},
            "speedup_vs_float32": statistics.median(
                round_[mode]["images_per_s"] / round_["float32"]["images_per_s"] for round_ in rounds
            ),
            "weight_bytes": weight_bytes(models[mode]),
            "parameters": int(models[mode].count_params()),
            "quantize_seconds": quantize_seconds.get(mode),
            "relative_logit_error": relative_logit_error(reference, logits),
            "top1_agreement": float(np.mean(reference.argmax(axis=1) == logits.argmax(axis=1))),
            "other_cpu_share_max": max(round_[mode]["other_cpu_share"] for round_ in rounds),
            "rounds": [round_[mode] for round_ in rounds],
        }
    return result


def table(results: dict, batch_size: int) -> str:
    lines = [
        f"| model | weights | batch-{batch_size} images/s (median, min-max) | speed-up | weight memory "
        "| relative logit error |",
        "|---|---|---|---|---|---|",
    ]
    for variant, modes in results.items():
        float_bytes = modes["float32"]["weight_bytes"]
        for mode, result in modes.items():
            speed = result["images_per_s"]
            memory = result["weight_bytes"]
            lines.append(
                f"| {variant} | {mode} | {speed['median']:.1f} ({speed['min']:.1f}-{speed['max']:.1f}) "
                f"| {result['speedup_vs_float32']:.2f}x "
                f"| {memory / 2**20:.1f} MiB ({memory / float_bytes:.2f}x) "
                f"| {result['relative_logit_error']:.4f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import warnings

    warnings.filterwarnings("ignore", message="Layer .* does not have a `quantize` method")
    import keras

    cpu = cpu_model()
    print(f"CPU: {cpu} ({os.cpu_count()} CPUs), Keras {keras.__version__} on {keras.backend.backend()}")
    machine = f"{re.sub(r'[^a-z0-9]+', '-', cpu.lower()).strip('-')}-{os.cpu_count()}cpu"
    output = args.output or os.path.join(
        HERE, "results", f"quantization-{machine}{'-quick' if args.quick else ''}.json"
    )
    refuse_link(output)  # before the run, not after it
    results = {variant: run_variant(variant, args) for variant in args.variants}
    backend_versions = {"keras": keras.__version__, "backend": keras.backend.backend()}
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        backend_versions["tensorflow"] = tf.__version__
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(part) for part in [sys.executable, *sys.argv]),
        "machine": {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": backend_versions,
        "settings": {k: getattr(args, k) for k in ("batch_size", "rounds", "min_time", "modes", "variants")},
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open_for_writing(output, "w") as file:
        json.dump(report, file, indent=1)
    print()
    print(table(results, args.batch_size))
    print(
        f"\nCPU: {cpu}; other processes took at most "
        f"{max(r['other_cpu_share_max'] for m in results.values() for r in m.values()):.0%} of the CPUs "
        f"during a measurement. Results: {output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

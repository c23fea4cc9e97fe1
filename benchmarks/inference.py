"""Forward-pass throughput of keras_vit against timm, measured interleaved in one process.

Both models get random weights and the same float32 input. Contestants:

* `keras_vit`: `model(x, training=False)` wrapped in `tf.function(jit_compile=False)` (the graph
  that `model.predict` also runs, without its per-call data-adapter overhead);
* `keras_vit_xla`: the same wrapped with `jit_compile=True` (skipped with `--no-xla`, or reported
  as failed if XLA cannot compile it);
* `timm`: the equivalent timm model (`vit_base_patch16_224` for `vit_b16`) under
  `torch.inference_mode()`.

TensorFlow (intra- and inter-op pools) and PyTorch (intra- and inter-op) get the same thread
count. After warm-up, every round times each contestant once, rotating the order from round to
round so no contestant always runs first; the reported figure is the median images/s over rounds.
The last line printed is one JSON object with every number. Usage:

    python benchmarks/inference.py --batch-sizes 1 16 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# torchvision (pulled in by timm) crashes when imported after TensorFlow on this stack, so PyTorch
# and timm are imported here and TensorFlow / Keras / keras_vit only inside the functions below.
import numpy as np  # noqa: E402
import timm  # noqa: E402
import torch  # noqa: E402

TIMM_WIDTHS = {"ti": "tiny", "s": "small", "b": "base", "l": "large", "h": "huge"}

Runner = Callable[[], object]
BUSY_LOAD = 1.0  # 1-minute load average above which another process is competing for the CPUs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="vit_b16", help="keras_vit variant (plain ViTs only)")
    parser.add_argument("--image-size", type=int, default=224, help="square input side in pixels")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per contestant and batch size")
    parser.add_argument(
        "--images-per-round",
        type=int,
        default=16,
        help="each timed measurement runs ceil(this / batch) forward calls",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both frameworks")
    parser.add_argument("--no-xla", action="store_true", help="skip the jit_compile=True contestant")
    args = parser.parse_args(argv)
    for name in ("image_size", "rounds", "images_per_round", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or min(args.batch_sizes) < 1:
        parser.error("--warmup must be >= 0 and every --batch-sizes value >= 1")
    return args


def configure_threads(threads: int) -> None:
    """Give TensorFlow and PyTorch the same pools; must run before either executes an op."""
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(threads)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)


def timm_model_name(variant: str) -> str:
    """The timm architecture equal to a plain keras_vit variant, e.g. vit_b16 -> vit_base_patch16_224.

    Built with `img_size=` for other resolutions, as the keras model is.
    """
    from keras_vit.variants import WIDTHS, get_config

    config = get_config(variant)
    if config.is_hybrid:
        raise ValueError(f"{variant} is a hybrid: this benchmark compares plain ViTs only (e.g. vit_b16).")
    width = next(key for key, dims in WIDTHS.items() if dims[0] == config.hidden_size)
    return f"vit_{TIMM_WIDTHS[width]}_patch{config.patch_size}_224"


def build_contestants(variant: str, image_size: int, xla: bool) -> tuple[dict, dict]:
    """A factory `make(images) -> runner` per contestant, and both models' parameter counts."""
    import tensorflow as tf

    import keras_vit

    model = keras_vit.create_model(variant, image_size=image_size)
    reference = timm.create_model(timm_model_name(variant), pretrained=False, img_size=image_size).eval()
    params = {
        "keras_vit": int(model.count_params()),
        "timm": int(sum(p.numel() for p in reference.parameters())),
    }

    def forward(images):
        return model(images, training=False)

    keras_functions = {"keras_vit": tf.function(forward, jit_compile=False)}
    if xla:
        keras_functions["keras_vit_xla"] = tf.function(forward, jit_compile=True)

    def keras_runner(function) -> Callable[[np.ndarray], Runner]:
        def make(images: np.ndarray) -> Runner:
            tensor = tf.constant(images)
            return lambda: function(tensor).numpy()

        return make

    def timm_runner(images: np.ndarray) -> Runner:
        tensor = torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2)))

        def run() -> object:
            with torch.inference_mode():
                return reference(tensor)

        return run

    makers = {name: keras_runner(function) for name, function in keras_functions.items()}
    makers["timm"] = timm_runner
    return makers, params


def measure(runner: Runner, calls: int) -> float:
    """Seconds for `calls` consecutive forward passes."""
    start = time.perf_counter()
    for _ in range(calls):
        runner()
    return time.perf_counter() - start


def benchmark_batch(makers: dict, batch: int, args: argparse.Namespace) -> dict:
    """Warm up, then time all contestants interleaved; returns images/s (median) and failures."""
    images = np.random.default_rng(0).uniform(-1, 1, (batch, args.image_size, args.image_size, 3))
    images = images.astype("float32")
    runners, failures = {}, {}
    for name, make in makers.items():
        runner = make(images)
        try:
            for _ in range(max(args.warmup, 1)):  # the first call traces / compiles
                runner()
        except Exception as error:  # an XLA compile failure is a result to report, not a crash
            first_line = (str(error).strip().splitlines() or [""])[0]
            failures[name] = f"{type(error).__name__}: {first_line[:200]}"
            continue
        runners[name] = runner
    calls = -(-args.images_per_round // batch)
    timings = {name: [] for name in runners}
    order = list(runners)
    for round_index in range(args.rounds):
        shift = round_index % len(order)
        for name in order[shift:] + order[:shift]:
            timings[name].append(measure(runners[name], calls))
    throughput = {
        name: statistics.median(batch * calls / seconds for seconds in values)
        for name, values in timings.items()
    }
    return {
        "batch_size": batch,
        "calls_per_measurement": calls,
        "images_per_s": throughput,
        "failed": failures,
    }


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table and a final JSON line, and return the JSON record."""
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    configure_threads(args.threads)
    makers, params = build_contestants(args.variant, args.image_size, xla=not args.no_xla)
    reference_name = timm_model_name(args.variant)
    print(
        f"{args.variant} vs timm {reference_name}(img_size={args.image_size}) | {args.image_size}px, "
        "float32, random weights | "
        f"threads {args.threads} (TF intra/inter, torch intra/inter) | {args.rounds} rounds, "
        f"{args.warmup} warm-up calls\nparameters: keras_vit {params['keras_vit']:,}, "
        f"timm {params['timm']:,}\nkeras_vit call path: tf.function(model(x, training=False)), "
        "jit_compile=False; keras_vit_xla: jit_compile=True"
    )
    if load_before >= BUSY_LOAD:
        print(
            f"WARNING: 1-minute load average {load_before:.1f} on {os.cpu_count()} CPUs: other processes "
            "compete for the cores, so these timings are unreliable (PyTorch's OpenMP pool slows down "
            "far more under contention than TensorFlow's). Rerun on an idle machine."
        )
    results = []
    for batch in args.batch_sizes:
        result = benchmark_batch(makers, batch, args)
        timm_rate = result["images_per_s"].get("timm")
        result["ratio_vs_timm"] = {
            name: rate / timm_rate
            for name, rate in result["images_per_s"].items()
            if name != "timm" and timm_rate
        }
        results.append(result)
        print(f"\nbatch {batch} ({result['calls_per_measurement']} calls per measurement)")
        for name, rate in result["images_per_s"].items():
            ratio = result["ratio_vs_timm"].get(name)
            suffix = f"   {name}/timm = {ratio:.2f}" if ratio is not None else ""
            print(f"  {name:<14} {rate:8.2f} images/s  {1000 * batch / rate:9.1f} ms/batch{suffix}")
        for name, reason in result["failed"].items():
            print(f"  {name:<14} failed: {reason}")
    import keras
    import tensorflow as tf

    record = {
        "benchmark": "inference",
        "variant": args.variant,
        "timm_model": reference_name,
        "image_size": args.image_size,
        "dtype": "float32",
        "threads": args.threads,
        "rounds": args.rounds,
        "parameters": params,
        "results": results,
        "versions": {
            "python": platform.python_version(),
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "torch": torch.__version__,
            "timm": timm.__version__,
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        },
    }
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main(sys.argv[1:])

"""Where a keras_vit step spends its time: TensorFlow's profiler, op time summed by class.

    python benchmarks/op_profile.py                      # ViT-B/16 inference bs16 + ViT-S/16 training bs32
    python benchmarks/op_profile.py --model vit_ti16 --steps 3

Runs the TensorFlow graph path (`tf.function` forward for inference, Keras's compiled
`train_on_batch` for training, XLA off: an XLA cluster hides its ops from the profiler) with
random weights, traces `--steps` steps after a warm-up, reads the trace (`.xplane.pb`) and sums
each TensorFlow op's time by class: matmuls (oneDNN fuses bias and GELU into them), layer
norm, GELU, softmax, bias/residual adds, reshapes/transposes/copies, the optimizer update, the
rest. Op times are summed over the threads that ran them, so shares are of total op time; the
table also gives the wall time per step measured outside the profiler.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time

from machine import isa_flags

from keras_vit.utils.files import open_for_writing, refuse_link

CLASSES = (
    "matmul",
    "layer norm",
    "GELU",
    "softmax",
    "bias / residual adds",
    "reshape / transpose / copy",
    "optimizer update",
    "loss and metrics",
    "other",
)
_MATMUL_WORDS = ("MatMul", "Conv2D", "Einsum")  # oneDNN's variants: _MklNativeFusedMatMul, ...
_MOVES = {"Reshape", "Transpose", "ConcatV2", "StridedSlice", "StridedSliceGrad", "Pack", "Unpack",
          "Split", "SplitV", "Slice", "Identity", "Tile", "BroadcastTo", "Cast", "GatherV2",
          "ZerosLike", "Fill"}  # fmt: skip


def _base_type(op_type: str) -> str:
    """`_MklNativeTranspose` -> `Transpose`: the op type without oneDNN's prefixes."""
    for prefix in ("_MklNative", "_Mkl", "_"):
        if op_type.startswith(prefix):
            return op_type[len(prefix) :]
    return op_type


def classify(name: str, op_type: str) -> str:
    """The class of one TensorFlow op, from its type and its Keras name scope."""
    # Grappler's rewrites ("ArithmeticOptimizer/...") are not the training optimizer.
    lowered = name.lower().replace("arithmeticoptimizer", "").replace("layoutoptimizer", "")
    op_type = _base_type(op_type)
    if any(word in op_type for word in _MATMUL_WORDS):  # Grappler's "ArithmeticOptimizer/..." too
        return "matmul"
    if "optimizer" in lowered or "adam" in lowered or op_type.startswith("ResourceApply"):
        return "optimizer update"
    if "norm" in lowered and "clip" not in lowered:
        return "layer norm"
    if "gelu" in lowered or "erf" in op_type.lower() or op_type in ("Tanh", "TanhGrad"):
        return "GELU"
    if "softmax" in lowered or op_type in ("Softmax", "SoftmaxGrad"):
        return "softmax" if "loss" not in lowered and "entropy" not in lowered else "loss and metrics"
    if "loss" in lowered or "entropy" in lowered or "metric" in lowered or "accuracy" in lowered:
        return "loss and metrics"
    if op_type in _MOVES:
        return "reshape / transpose / copy"
    if op_type in ("AddV2", "BiasAdd", "BiasAddGrad", "Add", "AddN"):
        return "bias / residual adds"
    return "other"


def read_trace(logdir: str) -> dict[str, float]:
    """Seconds of TensorFlow op time per class in the profiler trace under `logdir`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    (path,) = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    space = xplane_pb2.XSpace()
    with open(path, "rb") as file:
        space.ParseFromString(file.read())
    totals: dict[str, float] = collections.defaultdict(float)
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):  # the executor's threads run the ops
                continue
            for event in line.events:
                label = plane.event_metadata[event.metadata_id].name
                # TensorFlow op events are named "<op name>:<op type>"; "Class::method" are not ops.
                if ":" not in label or "::" in label:
                    continue
                name, _, op_type = label.rpartition(":")
                totals[classify(name, op_type)] += event.duration_ps * 1e-12
    return dict(totals)


def _step(case: str, model_name: str, batch: int):
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_vit

    model = keras_vit.create_model(model_name, classifier_activation=None)
    rng = np.random.default_rng(0)
    height, width = model.input_shape[1:3]
    images = tf.constant(rng.standard_normal((batch, height, width, 3), dtype=np.float32))
    if case == "inference":
        forward = tf.function(lambda x: model(x, training=False))
        return lambda: forward(images).numpy()
    labels = tf.constant(rng.integers(0, 1000, batch), dtype=tf.int32)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return lambda: model.train_on_batch(images, labels)


def profile(case: str, model_name: str, batch: int, steps: int) -> dict:
    import tensorflow as tf

    step = _step(case, model_name, batch)
    for _ in range(2):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - started) / steps
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        for _ in range(steps):
            step()
        tf.profiler.experimental.stop()
        totals = read_trace(logdir)
    op_seconds = sum(totals.values())
    return {
        "case": case,
        "model": model_name,
        "batch": batch,
        "wall_seconds_per_step": round(seconds, 4),
        "op_seconds_per_step": round(op_seconds / steps, 4),
        "share": {name: round(totals.get(name, 0.0) / op_seconds, 4) for name in CLASSES},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["inference:vit_b16:16", "training:vit_s16:32"],
                        help="CASE:MODEL:BATCH with CASE inference or training")  # fmt: skip
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--output", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.output:
        refuse_link(args.output)  # before the run, not after it
    from keras_vit.utils.environment import enable_onednn, machine, versions

    enable_onednn()
    import tensorflow as tf

    from keras_vit.utils.environment import onednn_enabled

    tf.config.threading.set_intra_op_parallelism_threads(os.cpu_count())
    results = [profile(c, m, int(b), args.steps) for c, m, b in (spec.split(":") for spec in args.cases)]
    flags = " ".join(isa_flags())
    record = {"machine": {**machine(), "flags": flags}, "versions": versions(), "onednn": onednn_enabled(),
              "results": results}  # fmt: skip
    print(f"{record['machine']['cpu']} ({flags}); oneDNN {'on' if record['onednn'] else 'off'}")
    print("| class | " + " | ".join(f"{r['model']} {r['case']} bs{r['batch']}" for r in results) + " |")
    print("|---|" + "---:|" * len(results))
    for name in CLASSES:
        print(f"| {name} | " + " | ".join(f"{100 * r['share'][name]:.1f}%" for r in results) + " |")
    timings = (f"{r['wall_seconds_per_step']:.3f} ({r['op_seconds_per_step']:.3f})" for r in results)
    print("| wall s/step (op s/step) | " + " | ".join(timings) + " |")
    if args.output:
        with open_for_writing(args.output, "w", encoding="utf-8") as file:
            json.dump(record, file, indent=2)


if __name__ == "__main__":
    sys.exit(main())

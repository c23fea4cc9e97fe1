"""File size, batch-1 latency and logit deviation of ViT-S/16 exported as SavedModel, ONNX and LiteRT.

Random weights (LayerNorm scales around 1), 224 px, 1000 classes, float32 logits. Each format
is written by keras_vit (`model.export` for the SavedModel, `keras_vit.export_onnx`,
`keras_vit.export_litert` with and without `int8`), loaded in its own runtime
(`tf.saved_model.load`, onnxruntime, the LiteRT interpreter) and timed on one image: median of
`--runs` calls after `--warmup`. Writes `benchmarks/results/export_formats.json`.

    python benchmarks/export_formats.py [--model vit_s16] [--runs 30]

CPU heavy (a few minutes on 2 cores); the numbers depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from machine import cpu_model

from keras_vit.utils.files import open_for_writing, refuse_link

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names
    )


def _latency(run, warmup: int, runs: int) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="vit_s16")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--output",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "export_formats.json"),
    )
    args = parser.parse_args(argv)
    refuse_link(args.output)  # before the run, not after it

    import keras
    import onnxruntime
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    import keras_vit

    model = keras_vit.create_model(args.model, classifier_activation=None)
    rng = np.random.default_rng(0)
    for variable in model.weights:
        noise = rng.normal(0, 0.02, variable.shape) + (1.0 if variable.path.endswith("gamma") else 0.0)
        variable.assign(noise.astype("float32"))
    image = rng.uniform(-1, 1, (1, *model.input_shape[1:])).astype("float32")
    expected = keras.ops.convert_to_numpy(model(image))
    results = {}
    with tempfile.TemporaryDirectory() as workspace:
        saved_model = os.path.join(workspace, "saved_model")
        started = time.perf_counter()
        model.export(saved_model, verbose=False)
        export_seconds = time.perf_counter() - started
        serve = tf.saved_model.load(saved_model).signatures["serving_default"]
        tensor = tf.constant(image)
        output = next(iter(serve(tensor).values())).numpy()
        results["saved_model"] = (saved_model, export_seconds, output, lambda: serve(tensor))

        onnx_path = os.path.join(workspace, "model.onnx")
        started = time.perf_counter()
        keras_vit.export_onnx(model, onnx_path)
        export_seconds = time.perf_counter() - started
        session = onnxruntime.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
        feed = {"images": image}
        results["onnx"] = (
            onnx_path,
            export_seconds,
            session.run(None, feed)[0],
            lambda: session.run(None, feed),
        )

        for name, int8 in (("litert", False), ("litert_int8", True)):
            path = os.path.join(workspace, f"{name}.tflite")
            started = time.perf_counter()
            keras_vit.export_litert(model, path, int8=int8)
            export_seconds = time.perf_counter() - started
            interpreter = Interpreter(model_path=path)
            interpreter.allocate_tensors()
            feed_index = interpreter.get_input_details()[0]["index"]
            output_index = interpreter.get_output_details()[0]["index"]

            def invoke(interpreter=interpreter, feed_index=feed_index):
                interpreter.set_tensor(feed_index, image)
                interpreter.invoke()

            invoke()
            results[name] = (path, export_seconds, interpreter.get_tensor(output_index).copy(), invoke)

        keras_ms = _latency(lambda: model(image, training=False), args.warmup, args.runs)
        rows = {
            name: {
                "bytes": _size(path),
                "mib": round(_size(path) / 2**20, 2),
                "export_seconds": round(seconds, 1),
                "latency_ms_batch1": round(_latency(run, args.warmup, args.runs), 2),
                "max_abs_logit_deviation_vs_keras": float(np.abs(output - expected).max()),
            }
            for name, (path, seconds, output, run) in results.items()
        }
    report = {
        "model": args.model,
        "parameters": int(model.count_params()),
        "image_size": list(model.input_shape[1:3]),
        "weights": "random (normal 0.02, LayerNorm scales ~1)",
        "keras_eager_latency_ms_batch1": round(keras_ms, 2),
        "max_abs_keras_logit": float(np.abs(expected).max()),
        "formats": rows,
        "runs": args.runs,
        "warmup": args.warmup,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "note": "shared 2-core machine: other jobs ran at the same time, so latencies are indicative only",
        "versions": {
            "python": sys.version.split()[0],
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "onnxruntime": onnxruntime.__version__,
        },
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open_for_writing(args.output, "w", encoding="utf-8") as file:
        json.dump(report, file, indent=2)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The host's work per step on Keras's PyTorch backend against timm eager, where compute is near zero.

On a GPU, eager PyTorch launches kernels asynchronously: a step takes the longer of the kernels'
time and the host's Python work that launches them. Keras's PyTorch backend ran ViT-B/16 training
on an H200 at 0.36x timm eager (issue 36), a host-bound step. This measures that host work on the
CPU: ViT-B/16's structure (12 blocks, patch 16, the [class] token) narrowed to width 32 (2 heads,
MLP 64) on 32 px images (4 patches), batch 2, so the arithmetic is negligible and the time per
step is the dispatch: Keras's layer calls, ops, casts and optimizer against timm's modules.
`keras_vit_compiled` is keras_vit after `model.compile(jit_compile=True)`: on PyTorch its forward pass
runs through `torch.compile` (`ViT.compile`); the warm-up steps compile it and are not timed.
`keras_vit_adamw` (training only) is keras_vit compiled with `keras_vit.training.optimization.AdamW`
(Keras's AdamW, bit for bit, with a leaner PyTorch update) instead of `keras.optimizers.AdamW`.
`keras_vit_keras_step` (training only) is `keras_vit_adamw` stepping with Keras's own `train_step`
instead of keras_vit's (`keras_vit.models.torch_step.TorchTrainStep`, the same operations without a
host-device synchronisation): what the step's changes cost or save on the host.

Cases: `infer` (the forward pass, `training=False`, no gradient) and `train` (one step of `fit`
for Keras: forward, cross-entropy, backward, AdamW; for timm: zero_grad, forward, cross-entropy,
backward, `torch.optim.AdamW(foreach=True)`). Each (competitor, case) runs in a fresh process with
one torch thread, `--rounds` times, competitors alternating; the figure is CPU seconds of the
process per step (`time.process_time`, less sensitive to a shared machine than wall time), the
median over rounds, and the ratio timm / keras_vit (timm's speed relative: 1.0 = as fast).

    python benchmarks/torch_overhead.py --rounds 3 --out benchmarks/results/torch-overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types

from machine import isa_flags, lscpu

from keras_vit.utils.files import open_for_writing, refuse_link

WIDTH, DEPTH, HEADS, MLP, PATCH, IMAGE, BATCH, CLASSES = 32, 12, 2, 64, 16, 32, 2, 10
COMPETITORS = ("keras_vit", "keras_vit_adamw", "keras_vit_keras_step", "keras_vit_compiled", "timm")
TRAINING_ONLY = ("keras_vit_adamw", "keras_vit_keras_step")
CASES = ("infer", "train")


def _keras_vit(
    case: str, steps: int, jit_compile: bool = False, lean_adamw: bool = False, keras_step: bool = False
) -> float:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    import keras

    import keras_vit

    model = keras_vit.create_model(
        "vit_b16", image_size=IMAGE, hidden_size=WIDTH, num_heads=HEADS, mlp_dim=MLP,
        num_classes=CLASSES, classifier_activation=None,
    )  # fmt: skip
    images = np.random.default_rng(0).uniform(0, 255, (BATCH, IMAGE, IMAGE, 3)).astype("float32")
    labels = np.arange(BATCH) % CLASSES
    if case == "infer":
        tensor = torch.from_numpy(images)
        if jit_compile:  # the forward pass through torch.compile (`ViT.compile`)
            model.compile(jit_compile=True)

        def run(count: int) -> None:
            with torch.inference_mode():
                for _ in range(count):
                    model(tensor, training=False)

    else:
        from keras_vit.training import optimization

        adamw = optimization.AdamW if lean_adamw else keras.optimizers.AdamW
        model.compile(
            optimizer=adamw(1e-3, weight_decay=0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
        if keras_step:
            model.train_step = types.MethodType(keras.Model.train_step, model)

        def batches():
            while True:
                yield images, labels

        def run(count: int) -> None:
            model.fit(batches(), steps_per_epoch=count, epochs=1, verbose=0, shuffle=False)

    return _per_step(run, steps)


def _timm(case: str, steps: int) -> float:
    import torch

    torch.set_num_threads(1)
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(
        img_size=IMAGE, patch_size=PATCH, embed_dim=WIDTH, depth=DEPTH, num_heads=HEADS,
        mlp_ratio=MLP / WIDTH, num_classes=CLASSES,
    )  # fmt: skip
    images = torch.rand(BATCH, 3, IMAGE, IMAGE) * 255
    labels = torch.arange(BATCH) % CLASSES
    if case == "infer":
        model.eval()

        def run(count: int) -> None:
            with torch.inference_mode():
                for _ in range(count):
                    model(images)

    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, foreach=True)

        def run(count: int) -> None:
            for _ in range(count):
                optimizer.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(images), labels)
                loss.backward()
                optimizer.step()
            loss.item()

    return _per_step(run, steps)


def _per_step(run, steps: int) -> float:
    """CPU seconds per step, after a warm-up of 5 steps."""
    run(5)
    started = time.process_time()
    run(steps)
    return (time.process_time() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--out")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # COMPETITOR CASE, here; prints seconds
    args = parser.parse_args()
    if args.out:
        refuse_link(args.out)  # before the run, not after it
    if args.one:
        competitor, case = args.one
        if competitor == "timm":
            print(_timm(case, args.steps))
        else:
            jit_compile = competitor == "keras_vit_compiled"
            keras_step = competitor == "keras_vit_keras_step"
            lean_adamw = competitor == "keras_vit_adamw" or keras_step
            print(_keras_vit(case, args.steps, jit_compile, lean_adamw, keras_step))
        return
    environment = {**os.environ, "KERAS_BACKEND": "torch"}
    runs = {
        case: [name for name in COMPETITORS if case == "train" or name not in TRAINING_ONLY]
        for case in args.cases
    }
    seconds = {(competitor, case): [] for case in args.cases for competitor in runs[case]}
    for _ in range(args.rounds):
        for case in args.cases:
            for competitor in runs[case]:
                command = [sys.executable, __file__, "--one", competitor, case, "--steps", str(args.steps)]
                done = subprocess.run(command, capture_output=True, text=True, env=environment, check=True)
                seconds[competitor, case].append(float(done.stdout.strip().splitlines()[-1]))
    rows = []
    for case in args.cases:  # per step, in milliseconds
        by_name = {name: seconds[name, case] for name in runs[case]}
        ms = {name: round(statistics.median(times) * 1000, 2) for name, times in by_name.items()}
        rows.append(
            {
                "case": case,
                "ms_per_step": ms,
                "vs_timm": {name: round(ms["timm"] / ms[name], 2) for name in runs[case] if name != "timm"},
                "rounds_ms": {name: [round(1000 * x, 2) for x in seconds[name, case]] for name in runs[case]},
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    record = {
        "rows": rows,
        "command": " ".join(sys.argv),
        "structure": dict(width=WIDTH, depth=DEPTH, heads=HEADS, mlp=MLP, image=IMAGE, batch=BATCH),
        "machine": {**lscpu("Model name", "CPU(s)"), "isa_flags": isa_flags()},
        "load_average_at_end": os.getloadavg(),
        "python": platform.python_version(),
    }
    if args.out:
        with open_for_writing(args.out, "w", encoding="utf-8") as file:
            json.dump(record, file, indent=1)


if __name__ == "__main__":
    main()

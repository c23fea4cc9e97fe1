"""Host time of one optimizer update on Keras's PyTorch backend: Keras's AdamW and SGD against keras_vit's.

    python benchmarks/optimizer_apply.py [--rounds 30 --applies 30] [--out FILE]

`optimizer.apply(grads, variables)` for the 200 trainable weights of ViT-B/16's structure narrowed to
width 32 (`torch_overhead.py`'s model: the arithmetic is small, the time is the per-variable work), one
torch thread, CPU seconds per apply (`time.process_time`). Competitors: `keras.optimizers.AdamW`,
`keras_vit.training.optimization.AdamW` (the same foreach operations, bit for bit, on tensors read once),
`KernelDecayAdamW` (keras_vit's, kernels decayed only), and `keras.optimizers.SGD` against
`optimization.SGD` (momentum 0.9, the fine-tuning recipe's), each built and warmed up, then measured in
turns, `--rounds` rounds of `--applies` applies each; the median and the fastest round are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ["KERAS_BACKEND"] = "torch"
import torch  # noqa: E402 - PyTorch before Keras (never TensorFlow in this process)
from machine import isa_flags, lscpu  # noqa: E402
from torch_overhead import HEADS, IMAGE, MLP, WIDTH  # noqa: E402 - its model

from keras_vit.utils.files import open_for_writing, refuse_link  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--applies", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.out:
        refuse_link(args.out)  # before the run, not after it
    torch.set_num_threads(1)
    import keras

    import keras_vit
    from keras_vit.training import optimization

    model = keras_vit.create_model(
        "vit_b16", image_size=IMAGE, hidden_size=WIDTH, num_heads=HEADS, mlp_dim=MLP, num_classes=10
    )
    variables = model.trainable_variables
    grads = [torch.randn_like(variable.value) * 1e-3 for variable in variables]
    optimizers = {
        "keras AdamW": keras.optimizers.AdamW(1e-3, weight_decay=0.05),
        "keras_vit AdamW": optimization.AdamW(1e-3, weight_decay=0.05),
        "keras_vit KernelDecayAdamW": optimization.KernelDecayAdamW(1e-3, weight_decay=0.05),
        "keras SGD": keras.optimizers.SGD(1e-2, momentum=0.9),
        "keras_vit SGD": optimization.SGD(1e-2, momentum=0.9),
    }
    ms = {name: [] for name in optimizers}
    for optimizer in optimizers.values():
        optimizer.build(variables)
        for _ in range(10):
            optimizer.apply(grads, variables)
    for _ in range(args.rounds):
        for name, optimizer in optimizers.items():
            started = time.process_time()
            for _ in range(args.applies):
                optimizer.apply(grads, variables)
            ms[name].append((time.process_time() - started) / args.applies * 1e3)
    record = {
        "ms_per_apply": {name: round(statistics.median(values), 3) for name, values in ms.items()},
        "fastest_round_ms": {name: round(min(values), 3) for name, values in ms.items()},
        "variables": len(variables),
        "command": "python benchmarks/optimizer_apply.py "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v),
        "machine": {**lscpu("Model name", "CPU(s)"), "isa_flags": isa_flags()},
        "versions": {"keras": keras.__version__, "torch": torch.__version__},
    }
    print(json.dumps(record, indent=1))
    if args.out:
        with open_for_writing(args.out, "w", encoding="utf-8") as file:
            json.dump(record, file, indent=1)


if __name__ == "__main__":
    main()

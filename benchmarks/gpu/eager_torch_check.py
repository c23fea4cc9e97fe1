"""Keras's PyTorch backend on the GPU: `eager_torch.model_call` against the functional graph.

On a CPU the tests (`tests/models/test_layers.py::test_eager_torch_*`) prove the whole-model path as
accurate as the graph (`tests/helpers/rounding.py`: the biases added inside the matrix products round
once, not twice); a CUDA device adds cuBLAS's epilogue and the branch a CPU never takes: flash
attention, chosen as `keras.ops.dot_product_attention` chooses it. This runs a ViT-B/16-shaped model
(2 blocks, head dimension 64) in float32 and mixed bfloat16, training and not, both ways on Keras's
device and the graph in float64, and prints one JSON line per case: the largest difference of the
output and of every gradient between the paths, each path's mean error against float64 (relative),
what breaks `rounding.accuracy_failures`' criterion (nothing expected), and whether PyTorch would
take flash attention there.

    KERAS_BACKEND=torch python benchmarks/gpu/eager_torch_check.py [--tiny] [--output DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import keras  # noqa: E402
import torch  # before TensorFlow could be imported (none is, on the GPU machine)
from helpers.rounding import accuracy_failures, mean_errors, relative_errors  # noqa: E402

from keras_vit.models import eager_torch  # noqa: E402
from keras_vit.models.vit import ViT  # noqa: E402
from keras_vit.registry.variants import model_config  # noqa: E402
from keras_vit.utils.files import open_for_writing, refuse_link  # noqa: E402


def _results(model: ViT, images: torch.Tensor, training: bool, fast: bool) -> dict:
    """The output and the gradients of every trainable weight by name (float64 NumPy arrays), through
    `model_call` or the graph."""
    applies = eager_torch.model_applies
    if not fast:
        eager_torch.model_applies = lambda *arguments: None
    try:
        output = model(images, training=training)
        loss = (output.float() * torch.sin(output.float())).sum()
        grads = torch.autograd.grad(loss, [weight.value for weight in model.trainable_weights])
    finally:
        eager_torch.model_applies = applies
    names = ["output", *(weight.path for weight in model.trainable_weights)]
    arrays = [output.detach(), *grads]
    return {name: array.double().cpu().numpy() for name, array in zip(names, arrays, strict=True)}


def _flash(model: ViT, images: torch.Tensor) -> bool:
    """Whether PyTorch would run flash attention on the blocks' query, key and value."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    attention, config = model.blocks[0].attention, model.config
    tokens = config.num_prefix_tokens + math.prod(config.token_grid())
    shape = (images.shape[0], attention.num_heads, tokens, attention.head_dim)
    query = torch.zeros(shape, dtype=getattr(torch, model.compute_dtype), device=images.device)
    return bool(can_use_flash_attention(SDPAParams(query, query, query, None, 0.0, False, False), False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a test-size model (a CPU rehearsal)")
    parser.add_argument("--output", help="a folder for eager_torch_check.jsonl")
    args = parser.parse_args(argv)
    if args.output:
        refuse_link(os.path.join(args.output, "eager_torch_check.jsonl"))  # before the run, not after it
    sizes = dict(hidden_size=64, num_heads=2, mlp_dim=128, image_size=32) if args.tiny else {}
    lines = []
    for policy in ("float32", "mixed_bfloat16"):
        models = {}
        for dtype_policy in (policy, "float64"):
            keras.config.set_dtype_policy(dtype_policy)
            models[dtype_policy] = ViT(model_config("vit_b16", depth=2, **sizes), num_classes=10)
        model = models[policy]
        generator = torch.Generator().manual_seed(0)
        for weight in model.weights:  # random, not the zero head
            weight.assign(torch.randn(weight.shape, generator=generator) * 0.05)
        models["float64"].set_weights(model.get_weights())
        size = model.config.image_hw
        images = keras.ops.convert_to_tensor(torch.randn((4, *size, 3), generator=generator))
        for training in (False, True):
            fast = _results(model, images, training, fast=True)
            graph = _results(model, images, training, fast=False)
            exact = _results(models["float64"], images.double(), training, fast=False)
            differences = {name: float(abs(fast[name] - graph[name]).max()) for name in fast}
            errors = relative_errors(fast, graph, exact)
            lines.append({
                "policy": policy, "training": training, "device": str(images.device),
                "flash_attention": _flash(model, images),
                "applies": eager_torch.model_applies(model, images, training),
                "output_max_difference": differences.pop("output"),
                "gradient_max_difference": max(differences.values()),
                "mean_relative_error": dict(zip(("eager", "graph"), mean_errors(errors), strict=True)),
                "failures": accuracy_failures(fast, graph, exact),
            })  # fmt: skip
            print(json.dumps(lines[-1]), flush=True)
    if args.output:
        with open_for_writing(os.path.join(args.output, "eager_torch_check.jsonl"), "w") as file:
            file.writelines(json.dumps(line) + "\n" for line in lines)
    return 1 if any(line["failures"] for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())

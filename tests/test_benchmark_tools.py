"""The benchmark tools refuse bad arguments before any work, with what to do, and write over nothing;
the kernel counter counts what a GPU would launch.

`benchmarks/gpu_hlo.py` compiles for a GPU only where JAX's CUDA plugin is installed; its refusals come
first, so they are tested here without it.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import subprocess_env

REPO = Path(__file__).resolve().parents[1]
GPU_HLO = REPO / "benchmarks" / "gpu_hlo.py"
TORCH_KERNELS = REPO / "benchmarks" / "torch_kernels.py"


@pytest.mark.backend_free
@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--variants", "pos_matmull"], "argument --variants: invalid choice: 'pos_matmull'"),
        (["--cases", "matmul_bf16_8192"], "argument --cases: invalid choice: 'matmul_bf16_8192'"),
        (["--target", "missing.txtpb"], "--target missing.txtpb: no such file"),
        (
            ["--keep-hlo", "--variants", "stock"],
            "train_b16_bf16_bs64-stock.hlo.gz, infer_b16_bf16_bs256-stock.hlo.gz already in",
        ),
    ],
)
def test_gpu_hlo_refuses_bad_arguments_and_writes_over_nothing(tmp_path, arguments, message):
    """A misspelt variant (which would compile as the stock model under its name), a case it cannot
    compile, a missing target, or kept modules that would replace a user's file or a link: one line
    naming the fix, exit 2, and the folder as it was."""
    own, outside = tmp_path / "train_b16_bf16_bs64-stock.hlo.gz", tmp_path / "outside.txt"
    own.write_text("the user's")
    outside.write_text("elsewhere")
    (tmp_path / "infer_b16_bf16_bs256-stock.hlo.gz").symlink_to(outside)
    before = sorted(path.name for path in tmp_path.iterdir())
    result = subprocess.run(
        [sys.executable, str(GPU_HLO), "--output", str(tmp_path), *arguments],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == before  # no gpu_hlo.jsonl either
    assert own.read_text() == "the user's" and outside.read_text() == "elsewhere"


@pytest.mark.backend_free
def test_torch_kernels_refuses_a_case_it_cannot_count(tmp_path):
    """A case that is no model's training or inference (the chip's matmul) is refused by name before
    any step runs: exit 2, the valid cases listed, nothing written."""
    output = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(TORCH_KERNELS), "--output", str(output), "--cases", "matmul_bf16_8192"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "argument --cases: invalid choice: 'matmul_bf16_8192' (choose from" in result.stderr
    assert "train_b16_bf16_bs64" in result.stderr
    assert not output.exists()


@pytest.mark.backend_free
def test_torch_kernels_counts_the_same_products_for_keras_vit_and_timm(tmp_path):
    """`torch_kernels.py` on the test-size ViT (2 blocks): keras_vit's PyTorch step and timm's launch the
    same matrix products (one per product, views not counted) and flash attention once per block and
    pass (a composite operation followed to its kernel), 5 LayerNorms per pass, and both trainings
    update with multi-tensor kernels (timm's AdamW on CUDA's foreach path)."""
    result = subprocess.run(
        [sys.executable, str(TORCH_KERNELS), "--output", str(tmp_path), "--tiny"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "torch_kernels.jsonl").read_text().splitlines()]
    steps = {(line["case"].split("_")[0], line["competitor"]): line["by_kind"] for line in lines}
    assert sorted(steps) == [(kind, who) for kind in ("infer", "train") for who in ("keras_vit", "timm")]
    # forward: the patch embedding, 4 per block, the head; backward: the input's and the weight's
    # gradients of each, but no gradient for the images
    products = {"infer": 10, "train": 10 + 2 * 10 - 1}
    for kind, passes in (("infer", 1), ("train", 2)):
        keras_vit, timm = steps[kind, "keras_vit"], steps[kind, "timm"]
        for name in ("matmul", "attention"):
            assert keras_vit[name]["flops"] == timm[name]["flops"] > 0, (kind, name)
        assert keras_vit["matmul"]["kernels"] == timm["matmul"]["kernels"] == products[kind]
        assert keras_vit["attention"]["kernels"] == timm["attention"]["kernels"] == 2 * passes
        assert keras_vit["layer norm"]["kernels"] == timm["layer norm"]["kernels"] == 5 * passes
        updates = "optimizer (multi-tensor)"
        assert (updates in keras_vit) == (updates in timm) == (kind == "train"), kind

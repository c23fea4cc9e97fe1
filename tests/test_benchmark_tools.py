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


@pytest.mark.backend_free
def test_benchmarks_write_files_only_through_open_for_writing():
    """Every file a benchmark script writes (results, logs, READMEs) is opened by
    `keras_vit.utils.files.open_for_writing`, never by `open` in a writing mode: a link planted at a
    result's name (e.g. a shared results folder's `gpu_results.jsonl`) is refused instead of written
    through."""
    import ast

    writers = []
    for script in sorted((REPO / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(script.read_text(), str(script))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
                modes = [*node.args[1:2], *(k.value for k in node.keywords if k.arg == "mode")]
                mode = modes[0].value if modes and isinstance(modes[0], ast.Constant) else "r"
                if set(mode) & set("wax+"):
                    writers.append(f"{script.relative_to(REPO)}:{node.lineno} open(..., {mode!r})")
    assert not writers, writers


@pytest.mark.backend_free
@pytest.mark.parametrize(
    "script, option",
    [("run.py", "--output"), ("torch_overhead.py", "--out"), ("quantization.py", "--output"),
     ("export_formats.py", "--output"), ("optimizer_apply.py", "--out")],
)  # fmt: skip
def test_benchmarks_refuse_a_link_at_their_output_before_running(tmp_path, script, option):
    """A link planted at a results file's name is refused before the measurements start (not after an
    hour of them), and what it points to is left as it was."""
    precious = tmp_path / "precious.json"
    precious.write_text("the user's")
    (tmp_path / "results.json").symlink_to(precious)
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), option, str(tmp_path / "results.json")],
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "results.json is a symbolic link" in done.stderr.splitlines()[-1], done.stderr[-2000:]
    assert "Remove it" in done.stderr.splitlines()[-1]
    assert precious.read_text() == "the user's"

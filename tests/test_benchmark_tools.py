"""The benchmark tools refuse bad arguments before any work, with what to do, and write over nothing.

`benchmarks/gpu_hlo.py` compiles for a GPU only where JAX's CUDA plugin is installed; its refusals come
first, so they are tested here without it.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import subprocess_env

REPO = Path(__file__).resolve().parents[1]
GPU_HLO = REPO / "benchmarks" / "gpu_hlo.py"


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

"""The NVIDIA H200's rates measured on 2026-11-28 (`results/gpu-20261128-h200-issue36/`), which the
estimates of a step's kernels without a GPU share (`gpu_hlo.py` for JAX, `torch_kernels.py` for PyTorch):
4.0 TB/s (the q|k|v slices, 5.6 GB in 1.36 ms), 760 TFLOP/s for cuBLAS's bfloat16 products (356 for
float32 ones, as TF32), 200 TFLOP/s for flash attention (its backward 2.5x the forward's FLOPs)."""

BANDWIDTH = 4.0e12  # bytes/s
MATMUL_RATE = {"bf16": 7.6e14, "f32": 3.56e14}  # FLOP/s by the product's output type (f32: TF32)
ATTENTION_RATE = 2.0e14  # FLOP/s
ATTENTION_BACKWARD_FLOPS = 2.5  # the backward's FLOPs over the forward's

"""Which attention a `MultiHeadSelfAttention` runs, and the fused kernels' call.

`choose_attention` resolves `attention_implementation="auto"` through `ATTENTION_POLICY` (backend,
device, compute precision, mode -> implementation; each row's measurement is in
docs/performance.md); `fused_attention` calls the backend's attention op, on tokens padded to
`ATTENTION_PADDING_MULTIPLE` for `"fused_padded"`. The layers (`keras_vit.models.layers`) hold the
weights and the plain products; this module holds the policy.
"""

from __future__ import annotations

import functools

import keras
from keras import ops

__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "ATTENTION_PADDING_MULTIPLE",
    "ATTENTION_POLICY",
    "checked_implementation",
    "choose_attention",
    "compute_device",
    "fused_attention",
    "refuse_unsupported_kernel",
]

ATTENTION_IMPLEMENTATIONS = ("auto", "plain", "fused", "fused_padded")
# Tokens are padded to a multiple of this for "fused_padded" (197 -> 256, 577 -> 640, 50 -> 128):
# flash-attention kernels work in 64- or 128-token tiles.
ATTENTION_PADDING_MULTIPLE = 128
# What "auto" runs: (backend, device, precision, mode) -> implementation; "*" matches anything,
# the first matching row wins; "half" is bfloat16 or float16 compute. Each row's measurement, with
# its command, is in docs/performance.md ("Attention on a GPU").
ATTENTION_POLICY = (
    ("tensorflow", "*", "*", "*", "plain"),  # no fused kernel: Keras's op is the same products, plus a pass
    ("torch", "*", "*", "*", "fused"),  # scaled_dot_product_attention
    ("jax", "cpu", "*", "*", "plain"),  # XLA's CPU attention is slower than the products it fuses
    ("jax", "gpu", "half", "inference", "fused"),  # cuDNN takes 197 tokens at inference
    ("jax", "gpu", "half", "training", "fused_padded"),  # cuDNN refuses 197 tokens when training
    ("jax", "gpu", "float32", "*", "fused"),  # cuDNN's flash attention has no float32: XLA's kernel
    ("*", "*", "*", "*", "plain"),
)


def checked_implementation(implementation: str) -> str:
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"Unknown attention_implementation {implementation!r}: use one of {ATTENTION_IMPLEMENTATIONS} "
            '("auto" picks per backend, device, dtype and mode).'
        )
    return implementation


@functools.cache
def compute_device() -> str:
    """`"gpu"`, `"tpu"` or `"cpu"`: where this backend computes (JAX: its default backend; torch: CUDA)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.default_backend()
    if backend == "torch":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    if backend == "tensorflow":
        import tensorflow as tf

        return "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    return "cpu"


def _precision(dtype) -> str:
    dtype = keras.backend.standardize_dtype(dtype)
    return "half" if dtype in ("bfloat16", "float16") else dtype


def choose_attention(
    implementation: str,
    dtype="float32",
    training: bool = False,
    head_dim: int = 64,
    *,
    backend: str | None = None,
    device: str | None = None,
) -> str:
    """The attention a `MultiHeadSelfAttention` runs: `implementation`, or for `"auto"` the first
    row of `ATTENTION_POLICY` that matches the backend, device, compute dtype and mode.

    `backend` and `device` default to Keras's backend and where it computes. On JAX a head width
    that cuDNN does not take (a multiple of 8, at most 128) runs XLA's kernel for "fused" and
    unpadded for "auto", as padding only helps cuDNN.
    """
    implementation = checked_implementation(implementation)
    if implementation != "auto":
        return implementation
    backend = backend or keras.backend.backend()
    device = device or compute_device()
    key = (backend, device, _precision(dtype), "training" if training else "inference")
    for *pattern, choice in ATTENTION_POLICY:
        if all(want in ("*", got) for want, got in zip(pattern, key, strict=True)):
            if choice == "fused_padded" and not _cudnn_takes(device, dtype, head_dim):
                return "fused"
            return choice
    raise AssertionError("ATTENTION_POLICY ends with a catch-all row.")


def _cudnn_takes(device: str, dtype, head_dim: int) -> bool:
    """Whether cuDNN's flash attention takes these heads (JAX's checks: half precision, a head width
    that is a multiple of 8 and at most 128; any Hopper takes up to 256, left out as untested)."""
    return device == "gpu" and _precision(dtype) == "half" and head_dim % 8 == 0 and head_dim <= 128


def refuse_unsupported_kernel(kernel: str, tokens: int, training: bool) -> None:
    """Refuse, with what to use instead, a forced "fused" attention the kernel cannot run: cuDNN's flash
    attention does not train on an odd token count (jax's check; 197 tokens for B/16 at 224 px, measured
    on an H200), which otherwise fails deep inside the training step's compilation."""
    if kernel == "cudnn" and training and tokens % 2:
        raise ValueError(
            f'attention_implementation="fused" cannot train on {tokens} tokens here: cuDNN\'s flash '
            'attention takes an odd token count at inference only. Use "fused_padded" (tokens padded to '
            f"a multiple of {ATTENTION_PADDING_MULTIPLE} and masked, the fastest measured for training) or "
            '"auto".'
        )


def fused_attention(query, key, value, padded: bool, training: bool = False):
    """softmax(q k^T) v through the backend's attention op, `(batch, tokens, heads, head_dim)`
    inputs with q scaled; with `padded`, on tokens padded to `ATTENTION_PADDING_MULTIPLE` and masked.
    A kernel that cannot run the call is refused first (`refuse_unsupported_kernel`)."""
    length = query.shape[1]
    if length is None:
        raise ValueError("Fused attention needs a known token count: build the model for its image size.")
    padding = (-length) % ATTENTION_PADDING_MULTIPLE if padded else 0
    if padding:
        query, key, value = (ops.pad(t, ((0, 0), (0, padding), (0, 0), (0, 0))) for t in (query, key, value))
    if keras.backend.backend() == "jax":
        import jax
        import jax.numpy as jnp

        kernel = "cudnn" if _cudnn_takes(compute_device(), query.dtype, query.shape[-1]) else "xla"
        refuse_unsupported_kernel(kernel, length + padding, training)
        lengths = jnp.full((query.shape[0],), length, "int32") if padding else None
        context = jax.nn.dot_product_attention(
            query,
            key,
            value,
            scale=1.0,
            query_seq_lengths=lengths,
            key_value_seq_lengths=lengths,
            implementation=kernel,
        )
    else:
        # (1, 1, 1, padded tokens): every query sees the real keys only.
        mask = (ops.arange(length + padding) < length)[None, None, None, :] if padding else None
        context = ops.dot_product_attention(query, key, value, mask=mask, scale=1.0)
    return context[:, :length] if padding else context

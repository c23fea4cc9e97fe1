"""The encoder block in plain PyTorch calls on Keras's PyTorch backend: the same operations, less host work.

Keras's PyTorch backend runs eagerly: every sublayer call and every `keras.ops` call does
Python work (call contexts, dtype checks, tree walks) before its kernel starts, and a Python
number turned into a device tensor is a host-to-device copy that waits for the GPU. A
`TransformerBlock` is ten sublayer calls and ~40 ops, so its host work exceeded the GPU's
kernels (ViT-B/16 training on an H200 ran at 0.36x timm eager, issue 36). `block_call` runs the
block's arithmetic with `torch` directly, operation for operation as the `keras.ops` path
(`TransformerBlock.call`), bit for bit the same values and gradients (`tests/models/test_layers.py`),
and `benchmarks/torch_overhead.py` measures the host work it saves.

It runs where the block is plain: not quantized (the sublayers' own calls compute quantized
kernels), no dropout or stochastic depth to draw while training, no attention scores asked
for, and attention "plain" or "fused" (`choose_attention`). LoRA kernels are read through
`Dense.kernel` / `EinsumDense.kernel`, which add the LoRA product, as the sublayers do.
"""

from __future__ import annotations

import functools

import keras
import numpy as np

from keras_vit.models.attention import choose_attention, compute_device

__all__ = ["applies", "block_call"]


def applies(block, training, return_attention_scores: bool) -> str | None:
    """The attention `block_call` runs for this call of `block` (a `TransformerBlock`): `"plain"` or
    `"fused"`, or None where the block's own call computes it."""
    if keras.backend.backend() != "torch" or return_attention_scores:
        return None
    attention = block.attention
    if training and (block.dropout or block.drop_path or attention.dropout):
        return None
    if block.compute_dtype == "float16" and compute_device() == "cpu":
        return None  # Keras multiplies float16 in float32 on a CPU
    dense = (attention.query_dense, attention.key_dense, attention.value_dense, attention.output_dense)
    if any(layer.quantization_mode is not None for layer in (*dense, block.fc1, block.fc2)):
        return None
    implementation = choose_attention(
        attention.attention_implementation, attention.compute_dtype, bool(training), attention.head_dim
    )
    return None if implementation == "fused_padded" else implementation


def _tensor(value):
    """A variable's tensor (read inside the block's call: cast to its compute dtype by Keras's autocast)."""
    return value.value if isinstance(value, keras.Variable) else value


@functools.cache
def _scalar(value: float, dtype, device):
    """`value` as a 0-d tensor, made once per dtype and device: no host-to-device copy per call."""
    import torch

    return torch.tensor(value, dtype=dtype, device=device)


def _layer_norm(tokens, layer):
    """Keras's LayerNormalization on torch: `F.layer_norm` in at least float32, back to the input's dtype."""
    import torch
    import torch.nn.functional as F

    statistics = tokens.to(torch.promote_types(tokens.dtype, torch.float32))
    width = tokens.shape[-1]
    normed = F.layer_norm(statistics, (width,), _tensor(layer.gamma), _tensor(layer.beta), layer.epsilon)
    return normed.to(tokens.dtype)


def _dense(hidden, layer):
    import torch

    return torch.matmul(hidden, _tensor(layer.kernel)) + _tensor(layer.bias)


def _attention(tokens, attention, implementation: str):
    """`MultiHeadSelfAttention.call`'s fused-projection path for `(batch, tokens, width)` tokens."""
    import torch

    batch, length, width = tokens.shape
    heads, head_dim = attention.num_heads, attention.head_dim
    scale = _scalar(float(1.0 / np.sqrt(head_dim)), tokens.dtype, tokens.device)
    query, key, value = attention.query_dense, attention.key_dense, attention.value_dense
    kernel = torch.cat(
        [_tensor(query.kernel).reshape(width, width) * scale]
        + [_tensor(dense.kernel).reshape(width, width) for dense in (key, value)],
        dim=1,
    )
    bias = torch.cat(
        [_tensor(query.bias).reshape(width) * scale]
        + [_tensor(dense.bias).reshape(width) for dense in (key, value)]
    )
    qkv = (torch.matmul(tokens.reshape(-1, width), kernel) + bias).reshape(batch, length, 3, heads, head_dim)
    if implementation == "plain":
        query, key, value = torch.unbind(qkv.permute(2, 0, 3, 1, 4), 0)
        logits = torch.matmul(query, key.transpose(2, 3))
        statistics = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        scores = torch.softmax(logits.to(statistics), dim=-1).to(logits.dtype)
        context = torch.matmul(scores, value).permute(0, 2, 1, 3)
    else:  # Keras's op: its choice of PyTorch kernel (flash attention where it applies), as the ops path
        query, key, value = torch.unbind(qkv, 2)
        context = keras.ops.dot_product_attention(query, key, value, scale=1.0)
    output = attention.output_dense
    projected = torch.matmul(context.reshape(-1, width), _tensor(output.kernel).reshape(width, width))
    return (projected + _tensor(output.bias)).reshape(batch, length, width)


def block_call(block, tokens, implementation: str):
    """`TransformerBlock.call(tokens, training)` where `applies` (which chose the attention
    `implementation`): x + MSA(LN(x)), then x + MLP(LN(x))."""
    import torch.nn.functional as F

    tokens = tokens + _attention(_layer_norm(tokens, block.norm1), block.attention, implementation)
    hidden = _dense(_layer_norm(tokens, block.norm2).reshape(-1, tokens.shape[-1]), block.fc1)
    hidden = _dense(F.gelu(hidden, approximate="tanh" if block.approximate_gelu else "none"), block.fc2)
    return tokens + hidden.reshape(tokens.shape)

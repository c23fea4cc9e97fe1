"""A ViT's arithmetic in plain PyTorch calls on Keras's PyTorch backend: the same operations, less host work.

Keras's PyTorch backend runs eagerly: every layer call and every `keras.ops` call does Python work
(call contexts, dtype checks, tree walks) before its kernel starts, and a Python number turned into
a device tensor is a host-to-device copy that waits for the GPU. A `TransformerBlock` is ten
sublayer calls and ~40 ops, so its host work exceeded the GPU's kernels (ViT-B/16 training on an
H200 ran at 0.36x timm eager, issue 36). `block_call` runs the block's arithmetic with `torch`
directly, operation for operation as the `keras.ops` path (`TransformerBlock.call`) except that each
bias is added inside its matrix product (`_affine`: one `addmm`, as `F.linear`); `model_call`
runs a whole `ViT` (`ViT.call`) so: its layers in the functional graph's order, the patch
embedding, class token, position embedding, final LayerNorm and Dense layers as torch calls and the
rest by their own `call`, without a `Layer.__call__` per layer (20 per forward pass before). Values
and gradients are the `keras.ops` path's and the graph's within float rounding, as accurate within
rounding noise (`tests/models/test_layers.py::test_eager_torch_*`); `benchmarks/torch_overhead.py`
measures the host work saved.

A block runs here where it is plain: not quantized (the sublayers' own calls compute quantized
kernels), no dropout or stochastic depth to draw while training, no attention scores asked for,
and attention "plain" or "fused" (`choose_attention`); a model where every block is, and the input
is one array of images of its shape (hybrids and models built under a `keras.RematScope` run the
graph). A layer whose dtype policy is not the model's (the float32 head under mixed precision) is
still called through `__call__`, for Keras's autocast. LoRA kernels are read through
`Dense.kernel` / `EinsumDense.kernel`, which add the LoRA product, as the layers do.
"""

from __future__ import annotations

import dataclasses
import weakref

import keras
import numpy as np

from keras_vit.models.attention import choose_attention, compute_device
from keras_vit.models.torch_step import device_constant

__all__ = [
    "VariableReader",
    "applies",
    "block_call",
    "compiled_model_call",
    "compiles_forward",
    "model_applies",
    "model_call",
]


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


class VariableReader:
    """A variable's tensor as `Variable.value` gives it (inside a layer's call: cast to the compute
    dtype by Keras's autocast), with `value`'s scope checks made once per call instead of per read
    (~200 reads per forward pass of ViT-B/16's structure; ~800 per step of `optimization.AdamW`)."""

    def __init__(self):
        from keras.src.backend.common.stateless_scope import in_stateless_scope
        from keras.src.backend.common.variables import get_autocast_scope
        from keras.src.backend.torch.core import get_device

        # In a stateless scope `Variable.value` gives the scope's values; in a symbolic call (PyTorch's
        # meta device), meta stand-ins: both are left to it.
        self.direct = not in_stateless_scope() and str(get_device()) != "meta"
        self.autocast = get_autocast_scope()

    def __call__(self, value):
        if not isinstance(value, keras.Variable):
            return value  # a kernel with its LoRA product: already a tensor
        if not self.direct:
            return value.value
        if value._autocast and self.autocast is not None:
            return self.autocast.maybe_cast(value._value)
        return value._value

    def kernel(self, layer):
        """`Dense.kernel` / `EinsumDense.kernel` of a layer that is not quantized."""
        return self(layer.kernel if layer.lora_enabled else layer._kernel)


def _layer_norm(tokens, layer, read: VariableReader):
    """Keras's LayerNormalization on torch (`ops.layer_normalization`): `F.layer_norm` in at least
    float32, tokens, gamma and beta in one dtype, back to the tokens' dtype.

    One dtype is also what PyTorch's CUDA kernel takes: it refuses bfloat16 tokens with float32 gamma
    ("expected scalar type BFloat16 but found Float"). Its CPU kernel takes that mix, but its backward
    is inexact for gamma and beta there (torch 2.14: 8% off for 4,000 rows)."""
    import torch
    import torch.nn.functional as F

    width = layer.gamma.shape[-1]  # a Python int, also where a tracer (ONNX export) follows `tokens.shape`
    statistics = tokens.to(torch.promote_types(tokens.dtype, torch.float32))
    gamma, beta = (read(weight).to(statistics.dtype) for weight in (layer.gamma, layer.beta))
    return F.layer_norm(statistics, (width,), gamma, beta, layer.epsilon).to(tokens.dtype)


def _affine(hidden, kernel, bias):
    """`hidden @ kernel + bias` over the last axis as one `addmm`: the bias added in the matrix
    product's epilogue (cuBLAS, oneDNN), as `F.linear` (timm) does, instead of a second pass over the
    output. It rounds once, not twice: within float rounding of `keras.ops.matmul` + `add`."""
    import torch

    product = torch.addmm(bias, hidden.reshape(-1, kernel.shape[0]), kernel)
    return product.reshape(*hidden.shape[:-1], kernel.shape[1])


def _dense(hidden, layer, read: VariableReader):
    return _affine(hidden, read.kernel(layer), read(layer.bias))


def _attention(tokens, attention, implementation: str, read: VariableReader):
    """`MultiHeadSelfAttention.call`'s fused-projection path for `(batch, tokens, width)` tokens."""
    import torch

    batch, length, width = tokens.shape
    heads, head_dim = attention.num_heads, attention.head_dim
    scale = device_constant(float(1.0 / np.sqrt(head_dim)), tokens.dtype, tokens.device)  # made once
    query, key, value = attention.query_dense, attention.key_dense, attention.value_dense
    kernel = torch.cat(
        [read.kernel(query).reshape(width, width) * scale]
        + [read.kernel(dense).reshape(width, width) for dense in (key, value)],
        dim=1,
    )
    bias = torch.cat(
        [read(query.bias).reshape(width) * scale]
        + [read(dense.bias).reshape(width) for dense in (key, value)]
    )
    qkv = _affine(tokens, kernel, bias).reshape(batch, length, 3, heads, head_dim)
    if implementation == "plain":
        query, key, value = torch.unbind(qkv.permute(2, 0, 3, 1, 4), 0)
        logits = torch.matmul(query, key.transpose(2, 3))
        statistics = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        scores = torch.softmax(logits.to(statistics), dim=-1).to(logits.dtype)
        context = torch.matmul(scores, value).permute(0, 2, 1, 3)
    else:
        context = _fused_attention(*torch.unbind(qkv.permute(2, 0, 3, 1, 4), 0)).transpose(1, 2)
    output = attention.output_dense
    kernel = read.kernel(output).reshape(width, width)
    return _affine(context.reshape(batch, length, width), kernel, read(output.bias))


def _fused_attention(query, key, value):
    """`keras.ops.dot_product_attention(..., scale=1.0)` for `(batch, heads, tokens, head_dim)` inputs
    of one dtype, without its conversions and checks: Keras's choice of kernel (flash attention where
    PyTorch says it can run, else PyTorch's own choice). The strided q, k and v cut from the one
    projection go in as they are, where Keras's op copies them contiguous first: PyTorch's kernels take
    any strides with a contiguous last axis (as timm gives them), and its CPU kernel returns the context
    in the layout the next product reads without a copy."""
    import torch.nn.functional as F
    from torch.backends.cuda import SDPAParams, can_use_flash_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if can_use_flash_attention(SDPAParams(query, key, value, None, 0.0, False, False), False):
        with sdpa_kernel(backends=[SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(query, key, value, scale=1.0)
    return F.scaled_dot_product_attention(query, key, value, scale=1.0)


def block_call(block, tokens, implementation: str, read: VariableReader | None = None):
    """`TransformerBlock.call(tokens, training)` where `applies` (which chose the attention
    `implementation`): x + MSA(LN(x)), then x + MLP(LN(x)). `read`: the caller's `VariableReader`."""
    import torch.nn.functional as F

    read = read or VariableReader()
    normed = _layer_norm(tokens, block.norm1, read)
    tokens = tokens + _attention(normed, block.attention, implementation, read)
    hidden = _dense(_layer_norm(tokens, block.norm2, read), block.fc1, read)
    gelu = F.gelu(hidden, approximate="tanh" if block.approximate_gelu else "none")
    return tokens + _dense(gelu, block.fc2, read)


@dataclasses.dataclass(frozen=True)
class _Parts:
    """A `ViT`'s layers in call order, read once (its functional graph never changes)."""

    pixel_normalization: keras.layers.Layer | None
    patch_embed: keras.layers.Layer
    class_token: keras.layers.Layer | None
    pos_embed: keras.layers.Layer
    pos_dropout: keras.layers.Layer
    blocks: tuple
    encoder_norm: keras.layers.Layer
    pool: keras.layers.Layer | None
    pre_logits: keras.layers.Layer | None
    head: keras.layers.Layer | None
    remat: bool  # built under a `keras.RematScope`: its layer calls recompute activations


_PARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _parts(model) -> _Parts:
    parts = _PARTS.get(model)
    if parts is None:
        layers = {layer.name: layer for layer in model.layers}
        parts = _PARTS[model] = _Parts(
            layers.get("pixel_normalization"),
            layers["patch_embed"],
            layers.get("class_token"),
            layers["pos_embed"],
            layers["pos_dropout"],
            tuple(layers[f"block_{index}"] for index in range(model.config.depth)),
            layers["encoder_norm"],
            layers.get("pool"),
            layers.get("pre_logits"),
            layers.get("head"),
            any(getattr(layer, "_remat_mode", None) is not None for layer in (model, *layers.values())),
        )
    return parts


def model_applies(model, inputs, training) -> tuple[str, ...] | None:
    """The attention of each block for `model_call` of `model` (a `ViT`) on `inputs`, or None where
    the functional graph computes the call: another backend, a hybrid, rematerialisation, an input
    that is not one array of images of the model's shape, dropout to draw, or a block that `applies`
    leaves to its sublayers."""
    if keras.backend.backend() != "torch" or model.config.is_hybrid:
        return None
    shape = () if isinstance(inputs, (dict, list, tuple)) else tuple(getattr(inputs, "shape", ()))
    if shape[1:] != model.image_shape:
        return None
    parts = _parts(model)
    if parts.remat or (training and parts.pos_dropout.rate):
        return None
    implementations = tuple(applies(block, training, False) for block in parts.blocks)
    return None if None in implementations else implementations


def _patch_embed(images, layer, read: VariableReader):
    """`PatchEncoder.call`: the patches cut by a reshape and a transpose, one matrix product."""
    kernel = read.kernel(layer.projection)  # (P, P, C, D)
    size, channels, width = layer.patch_size, kernel.shape[2], layer.hidden_size
    rows, columns = images.shape[1] // size, images.shape[2] // size
    patches = images.reshape(-1, rows, size, columns, size, channels).permute(0, 1, 3, 2, 4, 5)
    patches = patches.reshape(-1, rows * columns, size * size * channels)
    return _affine(patches, kernel.reshape(-1, width), read(layer.projection.bias))


def _class_token(tokens, layer, read: VariableReader):
    """`ClassToken.call`: the [class] token first."""
    import torch

    token = read(layer.token).to(tokens.dtype)
    return torch.cat([torch.broadcast_to(token, (tokens.shape[0], 1, tokens.shape[-1])), tokens], dim=1)


def _pos_embed(tokens, layer, read: VariableReader):
    """`PositionEmbedding.call`."""
    return tokens + read(layer.embedding).to(tokens.dtype)


def _dense_layer(hidden, layer, read: VariableReader):
    """`Dense.call` (its activation too) for a `keras.layers.Dense` with a bias."""
    return layer.activation(_dense(hidden, layer, read))


def _layer_call(model, layer, inputs, read: VariableReader, arithmetic=None):
    """`layer(inputs)` as the model's graph calls it. Where the layer has the model's dtype policy
    (the model's autocast scope is the one its `__call__` would run in; a layer with `autocast=False`,
    as Keras's LayerNormalization, enters none and its variables are not cast either way), is not
    quantized and has no activity regularizer: without Keras's call machinery, as
    `arithmetic(inputs, layer, read)` (torch calls, the same operations as its `call`) or its `call`;
    else its `__call__` (the float32 head under mixed precision)."""
    direct = (
        layer.compute_dtype == model.compute_dtype
        and layer.variable_dtype == model.variable_dtype
        and layer.quantization_mode is None
        and layer.activity_regularizer is None
    )
    if not direct:
        return layer(inputs)
    inputs = layer.dtype_policy.convert_input(inputs, layer.autocast, layer.input_dtype)
    return layer.call(inputs) if arithmetic is None else arithmetic(inputs, layer, read)


def model_call(model, inputs, implementations: tuple[str, ...]):
    """`ViT.call(inputs, training)` where `model_applies` (which chose each block's attention):
    the graph's layers in its order, each computing as its own call, without a `Layer.__call__`
    per layer (~0.1 ms of host work each)."""
    parts, read = _parts(model), VariableReader()
    tokens = keras.ops.convert_to_tensor(inputs, dtype=model.image_dtype)  # as the graph's input
    if parts.pixel_normalization is not None:
        tokens = _layer_call(model, parts.pixel_normalization, tokens, read)
    tokens = _layer_call(model, parts.patch_embed, tokens, read, _patch_embed)
    if parts.class_token is not None:
        tokens = _layer_call(model, parts.class_token, tokens, read, _class_token)
    tokens = _layer_call(model, parts.pos_embed, tokens, read, _pos_embed)
    for block, implementation in zip(parts.blocks, implementations, strict=True):
        tokens = block_call(block, tokens, implementation, read)
    if not model.config.fc_norm:
        tokens = _layer_call(model, parts.encoder_norm, tokens, read, _layer_norm)
    if parts.pool is None:
        return tokens
    tokens = _layer_call(model, parts.pool, tokens, read)
    if model.config.fc_norm:
        tokens = _layer_call(model, parts.encoder_norm, tokens, read, _layer_norm)
    for layer in (parts.pre_logits, parts.head):
        if layer is not None:
            tokens = _layer_call(model, layer, tokens, read, _dense_layer)
    return tokens


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiles_forward(jit_compile) -> bool:
    """Whether `compile(jit_compile=...)` of a ViT (or of a model that trains one) compiles the ViT's
    forward pass (`compiled_model_call`) and leaves Keras's step eager: `True` on PyTorch."""
    return keras.backend.backend() == "torch" and jit_compile is True


def compiled_model_call(model, inputs, implementations: tuple[str, ...]):
    """`model_call` through `torch.compile`, one compiled function per model (its own cache of graphs:
    training and not, new input shapes): what `ViT.compile(jit_compile=True)` runs on PyTorch. The
    first call of each kind compiles (seconds to a minute); values match `model_call` within float
    rounding, not bit for bit (the compiler fuses and reorders the arithmetic)."""
    import torch

    inputs = keras.ops.convert_to_tensor(inputs, dtype=model.image_dtype)  # arrays too: a tensor to trace
    if inputs.device.type == "meta":  # Keras's symbolic build: shapes only, nothing worth compiling
        return model_call(model, inputs, implementations)
    compiled = _COMPILED.get(model)
    if compiled is None:
        compiled = _COMPILED[model] = torch.compile(model_call)
    return compiled(model, inputs, implementations)

"""Numerics of every layer in `keras_vit.models.layers` against independent references on the same weights.

References: plain numpy (patchify + matmul, softmax attention, pooling) and timm's PyTorch modules
(`PatchEmbed`, `Block`, `resample_abs_pos_embed`) built with random weights and copied over.
"""

from __future__ import annotations

import math
from functools import partial

import keras
import numpy as np
import pytest
import torch
from helpers.rounding import accuracy_failures
from timm.layers import PatchEmbed, resample_abs_pos_embed
from timm.models.vision_transformer import Block

from keras_vit import (
    ClassToken,
    DropPath,
    MultiHeadSelfAttention,
    PatchEncoder,
    PositionEmbedding,
    TokenPooling,
    TransformerBlock,
    resize_pos_embed,
)
from keras_vit.models.build import build_vit
from keras_vit.models.layers import _gelu
from keras_vit.models.vit import ViT
from keras_vit.registry.variants import ViTConfig

TOLERANCE = 1e-5


def _randomize(layer: keras.layers.Layer, rng: np.random.Generator, scale: float = 1.0) -> None:
    """Give every weight non-trivial random values (zero biases would hide layout mistakes)."""
    layer.set_weights([rng.normal(0.0, scale, w.shape).astype("float32") for w in layer.get_weights()])


def _timm_resample(
    pos_embed: np.ndarray, new_grid, old_grid=None, prefix=1, method="bicubic", antialias=True
) -> np.ndarray:
    return resample_abs_pos_embed(
        torch.from_numpy(pos_embed),
        new_size=list(new_grid),
        old_size=None if old_grid is None else list(old_grid),
        num_prefix_tokens=prefix,
        interpolation=method,
        antialias=antialias,
    ).numpy()


# --------------------------------------------------------------------------------------- PatchEncoder


def _numpy_patchify(images: np.ndarray, kernel: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Cut (B,H,W,C) into row-major P x P patches, flatten each as (ph, pw, c), project."""
    batch, height, width, channels = images.shape
    patch = kernel.shape[0]
    grid_h, grid_w = height // patch, width // patch
    patches = images.reshape(batch, grid_h, patch, grid_w, patch, channels)
    patches = patches.transpose(0, 1, 3, 2, 4, 5).reshape(batch, grid_h * grid_w, -1).astype("float64")
    return patches @ kernel.reshape(-1, kernel.shape[-1]) + bias


PATCH_CASES = [  # (patch, height, width, channels)
    (16, 32, 32, 3),
    (16, 48, 32, 1),
    (14, 28, 42, 4),
    (14, 14, 14, 3),
]


@pytest.mark.parametrize("patch,height,width,channels", PATCH_CASES)
def test_patch_encoder_matches_numpy_and_timm(patch, height, width, channels, rng):
    hidden = 8
    images = rng.normal(size=(2, height, width, channels)).astype("float32")
    layer = PatchEncoder(patch, hidden)
    layer.build(images.shape)
    _randomize(layer, rng, scale=(patch * patch * channels) ** -0.5)  # outputs of order 1
    kernel, bias = (w.numpy() for w in layer.projection.weights)
    assert kernel.shape == (patch, patch, channels, hidden)

    output = keras.ops.convert_to_numpy(layer(images))
    tokens = (height // patch) * (width // patch)
    assert output.shape == (2, tokens, hidden)
    assert layer.compute_output_shape(images.shape) == output.shape
    np.testing.assert_allclose(output, _numpy_patchify(images, kernel, bias), atol=TOLERANCE, rtol=0)

    reference = PatchEmbed(img_size=(height, width), patch_size=patch, in_chans=channels, embed_dim=hidden)
    with torch.no_grad():
        reference.proj.weight.copy_(torch.from_numpy(kernel.transpose(3, 2, 0, 1)))
        reference.proj.bias.copy_(torch.from_numpy(bias))
        expected = reference(torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
    np.testing.assert_allclose(output, expected, atol=TOLERANCE, rtol=0)


def test_patch_encoder_token_order_is_row_major():
    """Patch (i, j) of an (h, w) grid must become token i * w + j."""
    patch, grid_h, grid_w = 4, 3, 5
    index = np.arange(grid_h * grid_w, dtype="float32").reshape(grid_h, grid_w)
    images = np.kron(index, np.ones((patch, patch), dtype="float32"))[None, :, :, None]
    layer = PatchEncoder(patch, 1)
    layer.build(images.shape)
    layer.set_weights([np.full((patch, patch, 1, 1), 1.0 / patch**2, "float32"), np.zeros(1, "float32")])
    tokens = keras.ops.convert_to_numpy(layer(images))[0, :, 0]
    np.testing.assert_allclose(tokens, np.arange(grid_h * grid_w), atol=1e-5)


def test_patch_encoder_dynamic_image_size(rng):
    """Built on (None, None, C), the encoder patches whatever valid size it is fed."""
    layer = PatchEncoder(8, 6)
    model = keras.Sequential([keras.Input((None, None, 2)), layer])
    assert model.output_shape == (None, None, 6)
    images = rng.normal(size=(1, 16, 40, 2)).astype("float32")
    output = model.predict_on_batch(images)
    assert output.shape == (1, 10, 6)
    kernel, bias = (w.numpy() for w in layer.projection.weights)
    np.testing.assert_allclose(output, _numpy_patchify(images, kernel, bias), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize(
    "shape,match",
    [
        ((1, 30, 32, 3), r"height 30 .*patch size 16.*multiple of 16 \(e\.g\. 16 or 32\)"),
        ((1, 32, 40, 3), r"width 40 .*patch size 16.*multiple of 16 \(e\.g\. 32 or 48\)"),
        ((1, 32, 3), r"\(batch, height, width, channels\)"),
    ],
)
def test_patch_encoder_rejects_bad_shapes(shape, match):
    with pytest.raises(ValueError, match=match):
        PatchEncoder(16, 8)(np.zeros(shape, "float32"))


def test_patch_encoder_rejects_other_channel_count():
    layer = PatchEncoder(4, 8)
    layer.build((None, 8, 8, 3))
    with pytest.raises(ValueError, match=r"built for images with 3 channels but received 1.*channels=1"):
        layer(np.zeros((1, 8, 8, 1), "float32"))


# ---------------------------------------------------------------- ClassToken, PositionEmbedding, pooling


def test_class_token_prepends_the_same_token_to_every_sample(rng):
    tokens = rng.normal(size=(3, 5, 4)).astype("float32")
    layer = ClassToken()
    layer.build(tokens.shape)
    _randomize(layer, rng)
    cls = layer.token.numpy()
    assert cls.shape == (1, 1, 4)
    expected = np.concatenate([np.repeat(cls, 3, axis=0), tokens], axis=1)
    output = keras.ops.convert_to_numpy(layer(tokens))
    np.testing.assert_array_equal(output, expected)
    assert layer.compute_output_shape(tokens.shape) == output.shape


@pytest.mark.parametrize("grid,prefix", [((3, 3), 1), ((2, 5), 0)])
def test_position_embedding_adds_its_weight(grid, prefix, rng):
    tokens = rng.normal(size=(2, prefix + grid[0] * grid[1], 4)).astype("float32")
    layer = PositionEmbedding(grid, num_prefix_tokens=prefix)
    layer.build(tokens.shape)
    _randomize(layer, rng)
    assert layer.embedding.shape == (1, tokens.shape[1], 4)
    output = keras.ops.convert_to_numpy(layer(tokens))
    np.testing.assert_allclose(output, tokens + layer.embedding.numpy(), atol=1e-6, rtol=0)


def test_position_embedding_rejects_wrong_token_count():
    with pytest.raises(ValueError, match=r"made for 10 tokens .*received 17"):
        PositionEmbedding(3)(np.zeros((1, 17, 4), "float32"))


@pytest.mark.parametrize(
    "new_grid,old_grid,old_tokens",
    [
        ((4, 4), None, 49),  # square -> square, old grid inferred
        ((4, 6), None, 49),  # square -> non-square
        ((6, 4), (3, 5), 15),  # non-square -> non-square
    ],
)
def test_position_embedding_assign_resized_matches_timm(new_grid, old_grid, old_tokens, rng):
    source = rng.normal(size=(1, 1 + old_tokens, 8)).astype("float32")
    layer = PositionEmbedding(new_grid)
    layer.build((None, layer.num_tokens, 8))
    layer.assign_resized(source, old_grid=old_grid)
    expected = _timm_resample(source, new_grid, old_grid)
    np.testing.assert_allclose(layer.embedding.numpy(), expected, atol=TOLERANCE, rtol=0)
    np.testing.assert_array_equal(layer.embedding.numpy()[:, :1], source[:, :1])


def test_position_embedding_assign_resized_same_grid_is_a_copy(rng):
    source = rng.normal(size=(1, 1 + 12, 4)).astype("float32")
    layer = PositionEmbedding((3, 4))
    layer.build((None, 13, 4))
    layer.assign_resized(source, old_grid=(3, 4))
    np.testing.assert_array_equal(layer.embedding.numpy(), source)


@pytest.mark.parametrize("prefix", [0, 1, 2])
def test_token_pooling_matches_numpy(prefix, rng):
    tokens = rng.normal(size=(3, prefix + 6, 4)).astype("float32")
    token = keras.ops.convert_to_numpy(TokenPooling("token", num_prefix_tokens=prefix)(tokens))
    gap = TokenPooling("gap", num_prefix_tokens=prefix)
    pooled = keras.ops.convert_to_numpy(gap(tokens))
    np.testing.assert_array_equal(token, tokens[:, 0])
    np.testing.assert_allclose(pooled, tokens[:, prefix:].mean(axis=1), atol=1e-6, rtol=0)
    assert gap.compute_output_shape(tokens.shape) == pooled.shape


def test_token_pooling_rejects_unknown_mode():
    with pytest.raises(ValueError, match=r"Unknown pooling 'max'.*'token', 'gap'"):
        TokenPooling("max")


# ------------------------------------------------------------------------------------- TransformerBlock


def _copy_timm_block(reference: Block, block: TransformerBlock, num_heads: int) -> None:
    """timm's fused qkv Linear -> per-head (D, H, hd) query/key/value kernels; Linear weights transposed."""
    state = {name: value.detach().numpy() for name, value in reference.state_dict().items()}
    dim = state["norm1.weight"].shape[0]
    head_dim = dim // num_heads
    qkv_w = state["attn.qkv.weight"].reshape(3, dim, dim)  # (q|k|v, out, in)
    qkv_b = state["attn.qkv.bias"].reshape(3, num_heads, head_dim)
    attention = block.attention
    for index, dense in enumerate((attention.query_dense, attention.key_dense, attention.value_dense)):
        dense.kernel.assign(qkv_w[index].T.reshape(dim, num_heads, head_dim))
        dense.bias.assign(qkv_b[index])
    attention.output_dense.kernel.assign(state["attn.proj.weight"].T.reshape(num_heads, head_dim, dim))
    attention.output_dense.bias.assign(state["attn.proj.bias"])
    for norm in ("norm1", "norm2"):
        getattr(block, norm).gamma.assign(state[f"{norm}.weight"])
        getattr(block, norm).beta.assign(state[f"{norm}.bias"])
    for fc in ("fc1", "fc2"):
        getattr(block, fc).kernel.assign(state[f"mlp.{fc}.weight"].T)
        getattr(block, fc).bias.assign(state[f"mlp.{fc}.bias"])


def _timm_block(dim: int, num_heads: int, mlp_ratio: float) -> Block:
    torch.manual_seed(0)
    norm_layer = partial(torch.nn.LayerNorm, eps=1e-6)
    reference = Block(dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer)
    with torch.no_grad():
        for parameter in reference.parameters():  # timm's init leaves biases/LN trivial: randomise all
            parameter.normal_(0.0, 0.3 if parameter.ndim > 1 else 0.5)
    return reference.eval()


def _layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


@pytest.mark.parametrize("dim,num_heads,mlp_ratio", [(32, 4, 4.0), (24, 3, 2.5)])
def test_transformer_block_matches_timm(dim, num_heads, mlp_ratio, rng):
    tokens = rng.normal(size=(2, 10, dim)).astype("float32")
    reference = _timm_block(dim, num_heads, mlp_ratio)
    block = TransformerBlock(num_heads, int(dim * mlp_ratio))
    block.build(tokens.shape)
    _copy_timm_block(reference, block, num_heads)
    with torch.no_grad():
        expected = reference(torch.from_numpy(tokens)).numpy()
    output = keras.ops.convert_to_numpy(block(tokens, training=False))
    np.testing.assert_allclose(output, expected, atol=TOLERANCE, rtol=0)
    assert block.compute_output_shape(tokens.shape) == output.shape


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="TensorFlow backend only: the training-time GELU is TensorFlow's",
)
def test_training_block_has_the_inference_values_and_gradients(rng):
    """While training on TensorFlow the MLP's GELU has a hand-written derivative
    (`layers._erf_gelu_lean_gradient`): outputs and the gradients of every weight and of the input
    are those of `ops.gelu`'s automatic derivative (the inference path, also on a gradient tape)."""
    import tensorflow as tf

    tokens = tf.constant(rng.normal(0, 2, size=(2, 9, 24)).astype("float32"))
    block = TransformerBlock(3, 48)
    block.build(tokens.shape)
    _randomize(block, rng, scale=0.5)
    results = []
    for training in (True, False):
        with tf.GradientTape() as tape:
            tape.watch(tokens)
            output = block(tokens, training=training)
            loss = tf.reduce_sum(output * tf.sin(output))
        results.append((output, tape.gradient(loss, [tokens, *block.trainable_weights])))
    (trained, trained_grads), (plain, plain_grads) = results
    np.testing.assert_allclose(trained.numpy(), plain.numpy(), atol=1e-5, rtol=0)
    scale = max(np.abs(grad.numpy()).max() for grad in plain_grads)  # gradients reach the hundreds
    names = ["input", *(weight.path for weight in block.trainable_weights)]
    for name, got, expected in zip(names, trained_grads, plain_grads, strict=True):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=1e-5 * scale, rtol=0, err_msg=name)


def _exact_gelu_and_derivative(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x·Φ(x) and Φ(x) + x·φ(x) in float64."""
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    return x * cdf, cdf + x * np.exp(-0.5 * x**2) / math.sqrt(2.0 * math.pi)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlp_gelu_is_the_exact_gelu_in_the_input_dtype(dtype, training, rng):
    """The MLP's exact GELU, in whichever form the backend computes it (`layers._gelu`: erf in float32 on
    JAX, the lean-gradient form while training on TensorFlow, `ops.gelu` elsewhere), is x·Φ(x) to the
    dtype's rounding, in the input's dtype."""
    x = rng.normal(0.0, 3.0, 4096).astype("float32")
    given = keras.ops.cast(x, dtype)
    output = _gelu(given, approximate=False, training=training)
    assert keras.backend.standardize_dtype(output.dtype) == dtype
    expected, _ = _exact_gelu_and_derivative(keras.ops.convert_to_numpy(keras.ops.cast(given, "float32")))
    got = keras.ops.convert_to_numpy(keras.ops.cast(output, "float32"))
    tolerance = 1e-6 if dtype == "float32" else 2.0**-8  # float32 rounding / one bfloat16 rounding
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX backend only: the erf form is JAX's")
def test_jax_mlp_gelu_gradient_is_the_exact_derivative(rng):
    """On JAX the MLP's GELU is x·(1 + erf(x/√2))/2 (`layers._erf_gelu`): its automatic derivative is
    Φ(x) + x·φ(x) to float32 rounding."""
    import jax

    x = rng.normal(0.0, 3.0, 4096).astype("float32")
    gradient = jax.grad(lambda v: jax.numpy.sum(_gelu(v, approximate=False, training=True)))(x)
    _, expected = _exact_gelu_and_derivative(x.astype("float64"))
    np.testing.assert_allclose(np.asarray(gradient), expected, rtol=1e-6, atol=1e-6)


_TORCH_ONLY = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="PyTorch backend only: the eager fast path is PyTorch's"
)


def _block_results(block, tokens, monkeypatch, fast: bool) -> tuple[dict, int]:
    """Outputs and the gradients of the input and every weight, training and not, by name, through the
    eager PyTorch path (`fast`) or the `keras.ops` path, and how often the eager path ran."""
    from keras_vit.models import eager_torch

    ran, original = [], eager_torch.block_call
    if fast:
        monkeypatch.setattr(eager_torch, "block_call", lambda *a: ran.append(1) or original(*a))
    else:
        monkeypatch.setattr(eager_torch, "applies", lambda *a: False)
    results = {}
    for training in (True, False):
        inputs = keras.ops.convert_to_tensor(tokens).clone().requires_grad_(True)  # on Keras's device
        output = block(inputs, training=training)
        loss = (output.float() * torch.sin(output.float())).sum()
        grads = torch.autograd.grad(loss, [inputs, *(weight.value for weight in block.trainable_weights)])
        names = ["output", "inputs", *(weight.path.split("/", 1)[1] for weight in block.trainable_weights)]
        arrays = [output.detach(), *grads]
        for name, array in zip(names, arrays, strict=True):
            results[f"{name} training={training}"] = array.float().cpu().numpy()
    monkeypatch.undo()
    return results, len(ran)


def _lora_block(policy: str, attention: str, lora: bool) -> TransformerBlock:
    """A built block under dtype `policy`; with `lora`, LoRA on fc1 and the query projection."""
    keras.config.set_dtype_policy(policy)
    block = TransformerBlock(3, 48, attention_implementation=attention)
    block.build((2, 9, 24))
    for layer in (block.fc1, block.attention.query_dense) if lora else ():
        layer.enable_lora(2)
    return block


@_TORCH_ONLY
def test_eager_torch_block_equals_the_keras_ops_path(rng, monkeypatch):
    """On PyTorch a plain block runs `eager_torch.block_call` (less host work per call): its outputs and
    gradients are the `keras.ops` path's within rounding (`helpers.rounding`), float32 and mixed
    bfloat16, both attentions, LoRA."""
    for policy, attention, lora in [
        ("float32", "auto", False),
        ("float32", "plain", False),
        ("mixed_bfloat16", "auto", False),
        ("mixed_bfloat16", "plain", False),
        ("float32", "auto", True),
    ]:
        exact_block = _lora_block("float64", attention, lora)
        block = _lora_block(policy, attention, lora)
        _randomize(block, rng, scale=0.5)
        exact_block.set_weights(block.get_weights())
        tokens = torch.tensor(rng.normal(0, 2, size=(2, 9, 24)).astype("float32")).to(
            {"float32": torch.float32, "bfloat16": torch.bfloat16}[block.compute_dtype]
        )
        fast, calls = _block_results(block, tokens, monkeypatch, fast=True)
        plain, _ = _block_results(block, tokens, monkeypatch, fast=False)
        exact, _ = _block_results(exact_block, tokens.double(), monkeypatch, fast=False)
        assert calls == 2, (policy, attention, lora)
        assert not accuracy_failures(fast, plain, exact), (policy, attention, lora)


@_TORCH_ONLY
def test_eager_torch_fused_attention_takes_q_k_v_strided(rng, monkeypatch):
    """The direct path gives PyTorch's attention q, k and v as cut from the one projection (strided,
    the last axis contiguous), as timm does, with and without gradients: a contiguous copy of each
    (Keras's op makes them) is three passes over memory per block that no kernel needs."""
    import torch.nn.functional as F

    block = _lora_block("float32", "fused", False)
    _randomize(block, rng, scale=0.5)
    seen, attention = [], F.scaled_dot_product_attention

    def recording(query, key, value, *rest, **options):
        seen.append([(t.is_contiguous(), t.stride(-1)) for t in (query, key, value)])
        return attention(query, key, value, *rest, **options)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    tokens = torch.tensor(rng.normal(0, 2, size=(2, 9, 24)).astype("float32"))
    with torch.inference_mode():
        block(tokens)
    block(tokens.requires_grad_(), training=True).sum().backward()
    assert seen == [[(False, 1)] * 3] * 2


@_TORCH_ONLY
def test_eager_torch_block_leaves_what_it_does_not_compute_to_the_sublayers():
    """Dropout or stochastic depth while training, attention scores, quantized kernels and padded
    attention run the `keras.ops` path (the sublayers' own calls)."""
    from keras_vit.models import eager_torch

    def block(**options):
        layer = TransformerBlock(3, 48, **options)
        layer.build((2, 9, 24))
        return layer

    assert eager_torch.applies(block(), True, False) and eager_torch.applies(block(dropout=0.1), False, False)
    assert not eager_torch.applies(block(), False, True)
    for option in ("dropout", "attention_dropout", "drop_path"):
        assert not eager_torch.applies(block(**{option: 0.1}), True, False), option
    assert not eager_torch.applies(block(attention_implementation="fused_padded"), False, False)
    quantized = block()
    quantized.fc1.quantize("int8")
    assert not eager_torch.applies(quantized, False, False)


def _model_results(model, images, monkeypatch, fast: bool, training: bool) -> tuple[dict, int]:
    """A `ViT`'s output and the gradients of every trainable weight (and of float images) by name,
    through `eager_torch.model_call` (`fast`) or the functional graph, and how often `model_call` ran."""
    from keras_vit.models import eager_torch

    ran, original = [], eager_torch.model_call
    if fast:
        monkeypatch.setattr(eager_torch, "model_call", lambda *a: ran.append(1) or original(*a))
    else:
        monkeypatch.setattr(eager_torch, "model_applies", lambda *a: None)
    inputs = keras.ops.convert_to_tensor(images).clone().requires_grad_(images.is_floating_point())
    output = model(inputs, training=training)
    loss = (output.float() * torch.sin(output.float())).sum()
    names = [weight.path for weight in model.trainable_weights]
    weights = [weight.value for weight in model.trainable_weights]
    if inputs.requires_grad:
        names, weights = ["images", *names], [inputs, *weights]
    grads = torch.autograd.grad(loss, weights)
    monkeypatch.undo()
    arrays = [output.detach(), *grads]
    results = {name: a.float().cpu().numpy() for name, a in zip(["output", *names], arrays, strict=True)}
    return results, len(ran)


_DRAWS = 4  # random weights and images per case: one draw's error ratio is a wide sample (`helpers.rounding`)
_MODEL_CASES = {  # name: (dtype policy, ViTConfig fields, ViT arguments, LoRA rank)
    "float32": ("float32", {}, {}, 0),
    "bfloat16": ("mixed_bfloat16", {}, {}, 0),
    "gap_fc_norm_pre_logits": ("float32", {"pooling": "gap", "fc_norm": True}, {"representation_size": 8}, 0),
    "map_no_class_token": ("mixed_bfloat16", {"pooling": "map", "class_token": False}, {}, 0),
    "tokens": ("float32", {"pooling": None}, {"include_top": False}, 0),
    "uint8": ("float32", {}, {"image_dtype": "uint8", "classifier_activation": "softmax"}, 0),
    "uint8_fc_norm": ("mixed_bfloat16", {"pooling": "gap", "fc_norm": True}, {"image_dtype": "uint8"}, 0),
    "lora_plain_attention": ("float32", {}, {"attention_implementation": "plain"}, 2),
    "lora_bfloat16": ("mixed_bfloat16", {}, {}, 2),
    "pure_bfloat16": ("bfloat16", {}, {}, 0),
}


def _lora_model(policy: str, config: ViTConfig, arguments: dict, lora_rank: int) -> ViT:
    """A `ViT` under dtype `policy`; with a `lora_rank`, LoRA in a block's MLP, another's attention
    and the head."""
    keras.config.set_dtype_policy(policy)
    model = ViT(config, num_classes=5, **arguments)
    lora_layers = (model.blocks[0].fc2, model.blocks[1].attention.value_dense, model.head)
    for layer in lora_layers if lora_rank else ():
        layer.enable_lora(lora_rank)
    return model


@_TORCH_ONLY
def test_eager_torch_model_equals_the_functional_graph(rng, monkeypatch):
    """On PyTorch a `ViT` whose blocks are plain runs `eager_torch.model_call` (no Keras layer call per
    layer): its outputs and the gradients of every weight are the functional graph's within rounding,
    training and not, across dtype policies, poolings, heads, uint8 input and LoRA (`_MODEL_CASES`),
    each over 4 draws of random weights and images (`helpers.rounding`)."""
    config = ViTConfig("tiny", patch_size=8, hidden_size=24, depth=2, num_heads=3, mlp_dim=48, image_size=16)
    for case, (policy, fields, arguments, lora_rank) in _MODEL_CASES.items():
        exact_model = _lora_model("float64", config.replace(**fields), arguments, lora_rank)
        model = _lora_model(policy, config.replace(**fields), arguments, lora_rank)
        draws = {training: ([], [], []) for training in (False, True)}  # fast, graph, exact
        for _ in range(_DRAWS):
            _randomize(model, rng, scale=0.5)
            exact_model.set_weights(model.get_weights())
            shape = (2, 16, 16, 3)
            if model.image_dtype == "uint8":
                images = torch.tensor(rng.integers(0, 256, shape, dtype="uint8"))
            else:
                images = torch.tensor(rng.normal(0, 1, shape).astype("float32"))
            exact_images = images if model.image_dtype == "uint8" else images.double()
            runs = ((model, images, True), (model, images, False), (exact_model, exact_images, False))
            for training, collected in draws.items():
                for found, (run_model, run_images, fast) in zip(collected, runs, strict=True):
                    results, calls = _model_results(run_model, run_images, monkeypatch, fast, training)
                    assert calls == 1 or not fast, (case, training)
                    found.append(results)
        for training, results in draws.items():
            assert not accuracy_failures(*results), (case, training)


@_TORCH_ONLY
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "bfloat16"])
def test_eager_torch_layer_norms_take_one_dtype(policy, rng, monkeypatch):
    """The direct path's LayerNorms give `F.layer_norm` tokens, gamma and beta in one dtype, float32 for
    half-precision tokens (Keras's `ops.layer_normalization`), with and without gradients: PyTorch's
    CUDA kernel refuses bfloat16 tokens with float32 gamma, which a CPU takes."""
    import torch.nn.functional as F

    config = ViTConfig("tiny", patch_size=8, hidden_size=24, depth=2, num_heads=3, mlp_dim=48, image_size=16)
    model = _lora_model(policy, config, {}, 0)
    _randomize(model, rng, scale=0.5)
    images = torch.tensor(rng.normal(0, 1, (2, 16, 16, 3)).astype("float32"))
    seen, layer_norm = [], F.layer_norm

    def recording(tokens, shape, weight, bias, *rest, **options):
        seen.append((tokens.dtype, weight.dtype, bias.dtype))
        return layer_norm(tokens, shape, weight, bias, *rest, **options)

    monkeypatch.setattr(F, "layer_norm", recording)
    with torch.inference_mode():
        model(images)
    model(images, training=True).float().sum().backward()
    assert seen == [(torch.float32,) * 3] * 10  # two per block and the encoder's, twice


@_TORCH_ONLY
def test_eager_torch_model_reads_variables_as_keras_does(rng, monkeypatch):
    """`model_call` reads each variable as `Variable.value` would, with its checks made once per call:
    inside a `stateless_call` the values it is given (not the model's own), and in a symbolic call
    (Keras tracing a model that calls the `ViT` on PyTorch's meta device) meta tensors."""
    from keras_vit.models import eager_torch

    config = ViTConfig("tiny", patch_size=8, hidden_size=24, depth=2, num_heads=3, mlp_dim=48, image_size=16)
    model = ViT(config, num_classes=5, classifier_activation=None)
    _randomize(model, rng, scale=0.5)
    images = torch.tensor(rng.normal(0, 1, (2, 16, 16, 3)).astype("float32"))
    values = [torch.tensor(rng.normal(0, 0.5, w.shape).astype("float32")) for w in model.trainable_weights]
    others = [w.value for w in model.non_trainable_weights]
    own = keras.ops.convert_to_numpy(model(images))
    ran, original = [], eager_torch.model_call
    monkeypatch.setattr(eager_torch, "model_call", lambda *a: ran.append(1) or original(*a))
    fast = keras.ops.convert_to_numpy(model.stateless_call(values, others, images)[0])
    monkeypatch.setattr(eager_torch, "model_applies", lambda *a: None)
    graph = keras.ops.convert_to_numpy(model.stateless_call(values, others, images)[0])
    monkeypatch.undo()
    assert ran == [1]
    np.testing.assert_allclose(fast, graph, rtol=1e-5, atol=1e-5 * np.abs(graph).max())  # bias in addmm
    assert np.abs(fast - own).max() > 1e-3  # the values given, not the model's own

    class Outer(keras.Model):  # a subclassed model: Keras traces its call on PyTorch's meta device
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def call(self, images):
            return self.inner(images)

    devices = []

    def spy(*arguments):
        output = original(*arguments)
        devices.append(str(output.device))
        return output

    monkeypatch.setattr(eager_torch, "model_call", spy)
    outer = Outer(model)
    assert outer.compute_output_spec(keras.KerasTensor((2, 16, 16, 3))).shape == (2, 5)
    assert devices == ["meta"]  # traced there, not failed and traced again with real tensors
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(outer(images)), own)


@_TORCH_ONLY
def test_eager_torch_model_trains_after_a_call_in_inference_mode(rng):
    """The constants the PyTorch path caches (`torch_step.device_constant`) are made outside inference
    mode: a model first called under `torch.inference_mode()` (as a serving loop or timm-style
    evaluation does) trains afterwards, rather than failing with "Inference tensors cannot be saved for
    backward"."""
    from keras_vit.models import torch_step

    torch_step._CONSTANTS.clear()  # the first call below makes them
    config = ViTConfig("tiny", patch_size=8, hidden_size=24, depth=2, num_heads=3, mlp_dim=48, image_size=16)
    model = ViT(config, num_classes=5, classifier_activation=None)
    images = keras.ops.convert_to_tensor(rng.normal(0, 1, (2, 16, 16, 3)).astype("float32"))
    with torch.inference_mode():
        expected = model(images, training=False)
    logits = model(images, training=True)
    np.testing.assert_array_equal(logits.detach().cpu().numpy(), expected.cpu().numpy())
    logits.sum().backward()
    assert all(weight.value.grad is not None for weight in model.trainable_weights)


@_TORCH_ONLY
def test_eager_torch_jit_compile_compiles_the_forward(rng):
    """On PyTorch `compile(jit_compile=True)` runs the forward pass through `torch.compile`
    (`eager_torch.compiled_model_call`, one compiled function per model) and leaves Keras's step
    eager: the outputs and the weights after `fit` are the eager model's within float rounding."""
    from keras_vit.models import eager_torch
    from keras_vit.training.device_input import DeviceInput

    config = ViTConfig("tiny", patch_size=8, hidden_size=24, depth=2, num_heads=3, mlp_dim=48, image_size=16)
    models = [ViT(config, num_classes=5, classifier_activation=None) for _ in range(2)]
    _randomize(models[0], rng, scale=0.5)
    models[1].set_weights(models[0].get_weights())
    for model, jit_compile in zip(models, (False, True), strict=True):
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, jit_compile=jit_compile)
    eager, compiled = models
    assert compiled.compiled_forward and not compiled.jit_compile  # Keras's step stays eager
    assert not eager.compiled_forward and eager not in eager_torch._COMPILED
    images = rng.normal(0, 1, (4, 16, 16, 3)).astype("float32")
    labels = np.arange(4) % 5
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(compiled(images)), keras.ops.convert_to_numpy(eager(images)), atol=1e-5
    )
    assert compiled in eager_torch._COMPILED
    initial = compiled.get_weights()
    for model in models:
        model.fit(images, labels, batch_size=2, epochs=1, shuffle=False, verbose=0)
    for got, expected in zip(compiled.get_weights(), eager.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert not np.allclose(compiled.get_weights()[-2], initial[-2])  # the head's kernel trained
    # the driver's wrapper (uint8 batches normalised in the step) compiles its ViT's forward the same way
    wrapper = DeviceInput(ViT(config, num_classes=5), (0.5,) * 3, (0.5,) * 3, 5)
    wrapper.compile(optimizer="sgd", loss="mse", jit_compile=True)
    assert wrapper.network.compiled_forward and not wrapper.jit_compile


@_TORCH_ONLY
def test_eager_torch_model_leaves_what_it_does_not_compute_to_the_graph():
    """Dropout to draw, a quantized, hybrid or rematerialised model and inputs other than one image
    array run the functional graph (each layer's own call)."""
    from keras_vit.models import eager_torch

    config = ViTConfig("tiny", patch_size=8, hidden_size=24, depth=2, num_heads=3, mlp_dim=48, image_size=16)
    images = torch.zeros((2, 16, 16, 3))
    plain = ViT(config, num_classes=5)
    assert eager_torch.model_applies(plain, images, True) == ("fused", "fused")
    assert not eager_torch.model_applies(plain, {"images": images}, False)
    assert not eager_torch.model_applies(plain, images[0], False)
    for option in ("dropout", "attention_dropout", "drop_path_rate"):
        model = ViT(config, num_classes=5, **{option: 0.1})
        assert eager_torch.model_applies(model, images, False), option
        assert not eager_torch.model_applies(model, images, True), option
    plain.blocks[1].fc1.quantize("int8")
    assert not eager_torch.model_applies(plain, images, False)
    hybrid = ViT(config.replace(resnet_stages=(), patch_size=1), num_classes=5)
    assert not eager_torch.model_applies(hybrid, images, False)
    with keras.RematScope("full"):
        rematerialised = ViT(config, num_classes=5)
    assert not eager_torch.model_applies(rematerialised, images, False)


def test_transformer_block_attention_scores_are_softmax_qk(rng):
    dim, num_heads, length = 24, 3, 7
    head_dim = dim // num_heads
    tokens = rng.normal(size=(2, length, dim)).astype("float32")
    block = TransformerBlock(num_heads, 48)
    block.build(tokens.shape)
    _randomize(block, rng, scale=0.3)
    output, scores = block(tokens, return_attention_scores=True)
    scores = keras.ops.convert_to_numpy(scores)
    assert scores.shape == (2, num_heads, length, length)
    np.testing.assert_allclose(scores.sum(-1), 1.0, atol=1e-6)
    plain_output = keras.ops.convert_to_numpy(block(tokens))  # the same computation without the scores
    # bit for bit, unless this backend's fused attention kernel (PyTorch) serves the call without scores
    np.testing.assert_allclose(keras.ops.convert_to_numpy(output), plain_output, atol=1e-6, rtol=0)
    if keras.backend.backend() == "tensorflow":
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(output), plain_output)

    normed = _layer_norm(tokens, block.norm1.gamma.numpy(), block.norm1.beta.numpy())
    query = np.einsum("bnd,dhk->bhnk", normed, block.attention.query_dense.kernel.numpy())
    query += block.attention.query_dense.bias.numpy()[None, :, None]
    key = np.einsum("bnd,dhk->bhnk", normed, block.attention.key_dense.kernel.numpy())
    key += block.attention.key_dense.bias.numpy()[None, :, None]
    logits = query @ key.transpose(0, 1, 3, 2) / np.sqrt(head_dim)
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(scores, expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("option", ["dropout", "attention_dropout", "drop_path"])
def test_transformer_block_regularisation_only_in_training(option, rng):
    """Inference equals the unregularised block on the same weights; training does not."""
    tokens = rng.normal(size=(32, 5, 8)).astype("float32")
    block = TransformerBlock(2, 16, **{option: 0.5})
    plain = TransformerBlock(2, 16)
    block.build(tokens.shape)
    plain.build(tokens.shape)
    _randomize(block, rng)
    plain.set_weights(block.get_weights())
    expected = keras.ops.convert_to_numpy(plain(tokens))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(block(tokens)), expected)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(block(tokens, training=False)), expected)
    trained = keras.ops.convert_to_numpy(block(tokens, training=True))
    changed = np.abs(trained - expected).max(axis=(1, 2)) > 1e-4
    assert changed.any()
    if option == "drop_path":  # samples whose two residual branches were both dropped pass through
        unchanged = np.all(trained == tokens, axis=(1, 2))
        assert unchanged.any() and not unchanged.all()


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_self_attention_equals_keras_multi_head_attention(policy, rng):
    """Same variables (paths, shapes) and outputs as keras.layers.MultiHeadAttention(x, x)."""
    dim, num_heads = 24, 3
    tokens = rng.normal(size=(2, 7, dim)).astype("float32")
    attention = MultiHeadSelfAttention(num_heads, dtype=policy, name="attention")
    reference = keras.layers.MultiHeadAttention(num_heads, dim // num_heads, dtype=policy, name="attention")
    attention.build(tokens.shape)
    reference.build(tokens.shape, tokens.shape)
    _randomize(attention, rng, scale=0.3)
    assert [(v.path, v.shape) for v in attention.weights] == [(v.path, v.shape) for v in reference.weights]
    reference.set_weights(attention.get_weights())
    output, scores = attention(tokens, return_attention_scores=True)
    expected, expected_scores = reference(tokens, tokens, return_attention_scores=True)
    tolerance = TOLERANCE if policy == "float32" else 0.05
    for ours, theirs in ((output, expected), (scores, expected_scores)):
        assert ours.dtype == theirs.dtype
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(ours).astype("float32"),
            keras.ops.convert_to_numpy(theirs).astype("float32"),
            atol=tolerance,
            rtol=0,
        )
    restored = MultiHeadSelfAttention.from_config(attention.get_config())
    assert (restored.num_heads, restored.dropout, restored.dtype_policy.name) == (num_heads, 0.0, policy)


def test_transformer_block_rejects_indivisible_heads():
    with pytest.raises(ValueError, match=r"hidden size 10 is not divisible by 3 heads"):
        TransformerBlock(3, 16)(np.zeros((1, 4, 10), "float32"))


# -------------------------------------------------------------------------------------------- DropPath


def test_drop_path_drops_whole_samples_and_keeps_the_expectation(rng):
    rate = 0.25
    inputs = rng.uniform(0.5, 1.5, size=(4000, 3, 2)).astype("float32")
    outputs = keras.ops.convert_to_numpy(DropPath(rate, seed=1)(inputs, training=True))
    dropped = np.all(outputs == 0.0, axis=(1, 2))
    kept = np.all(np.isclose(outputs, inputs / (1 - rate), rtol=1e-6, atol=0), axis=(1, 2))
    assert np.all(dropped ^ kept), "every sample must be either fully dropped or fully kept"
    assert abs(dropped.mean() - rate) < 0.03  # binomial std ~0.007
    np.testing.assert_allclose(outputs.mean(axis=0), inputs.mean(axis=0), rtol=0.04)  # E[out] == in


def test_drop_path_is_identity_at_inference_and_at_rate_zero(rng):
    inputs = rng.normal(size=(8, 3)).astype("float32")
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(DropPath(0.5)(inputs)), inputs)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(DropPath(0.5)(inputs, training=False)), inputs)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(DropPath(0.0)(inputs, training=True)), inputs)


@pytest.mark.parametrize("rate", [-0.1, 1.0])
def test_drop_path_rejects_bad_rate(rate):
    with pytest.raises(ValueError, match=r"rate must be in \[0, 1\)"):
        DropPath(rate)


# ---------------------------------------------------------------- serialisation and mixed precision

LAYER_CASES = [  # (factory taking extra layer kwargs, input shape)
    (lambda **kw: PatchEncoder(4, 8, kernel_initializer="glorot_uniform", name="pe", **kw), (2, 8, 12, 3)),
    (lambda **kw: ClassToken(initializer="ones", **kw), (2, 6, 8)),
    (lambda **kw: PositionEmbedding((2, 3), num_prefix_tokens=1, **kw), (2, 7, 8)),
    (lambda **kw: DropPath(0.2, seed=3, **kw), (2, 7, 8)),
    (
        lambda **kw: TransformerBlock(
            2, 12, dropout=0.1, attention_dropout=0.2, drop_path=0.3, layer_norm_epsilon=1e-5, **kw
        ),
        (2, 7, 8),
    ),
    (lambda **kw: TokenPooling("gap", num_prefix_tokens=2, **kw), (2, 7, 8)),
]
LAYER_IDS = [
    "PatchEncoder",
    "ClassToken",
    "PositionEmbedding",
    "DropPath",
    "TransformerBlock",
    "TokenPooling",
]


@pytest.mark.parametrize("factory,shape", LAYER_CASES, ids=LAYER_IDS)
def test_config_round_trip(factory, shape, rng):
    """from_config (also via the registered name) rebuilds the same layer; same weights, same outputs."""
    layer = factory()
    layer.build(shape)
    _randomize(layer, rng)
    inputs = rng.normal(size=shape).astype("float32")
    expected = keras.ops.convert_to_numpy(layer(inputs))
    config = layer.get_config()

    for clone in (
        type(layer).from_config(config),
        keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer)),
    ):
        assert type(clone) is type(layer)
        assert clone.get_config() == config
        if not clone.built:  # the serialised form carries a build config and comes back built
            clone.build(shape)
        clone.set_weights(layer.get_weights())
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(clone(inputs)), expected)


@pytest.mark.parametrize("factory,shape", LAYER_CASES, ids=LAYER_IDS)
@pytest.mark.parametrize("policy_from", ["global", "argument"])
def test_mixed_bfloat16(factory, shape, policy_from, rng):
    """Under mixed_bfloat16 each layer (and every sublayer) computes in bfloat16 on float32 variables.

    "argument" passes `dtype=` to the layer alone, so sublayers only get it if the layer hands it on.
    """
    inputs = rng.normal(size=shape).astype("float32")
    reference = factory()
    expected = keras.ops.convert_to_numpy(reference(inputs))
    if policy_from == "global":
        keras.config.set_dtype_policy("mixed_bfloat16")
        layer = factory()
    else:
        layer = factory(dtype="mixed_bfloat16")
    layer.build(shape)
    layer.set_weights(reference.get_weights())
    output = layer(inputs)
    assert keras.backend.standardize_dtype(output.dtype) == "bfloat16"
    sublayers = layer._flatten_layers(include_self=True, recursive=True)
    assert {sub.dtype_policy.name for sub in sublayers} == {"mixed_bfloat16"}
    assert all(variable.dtype == "float32" for variable in layer.weights)
    output = keras.ops.convert_to_numpy(keras.ops.cast(output, "float32"))
    np.testing.assert_allclose(output, expected, atol=0.05 * (np.abs(expected).max() + 1), rtol=0)


# ------------------------------------------------------------------------------------ resize_pos_embed

RESIZE_GRIDS = [  # (old grid, new grid, pass old_grid explicitly)
    ((7, 7), (12, 12), False),  # up
    ((14, 14), (8, 8), False),  # down
    ((6, 9), (10, 4), True),  # non-square, mixed up/down
    ((5, 5), (5, 8), False),  # one axis unchanged
]


@pytest.mark.parametrize("old_grid,new_grid,explicit", RESIZE_GRIDS)
@pytest.mark.parametrize("method", ["bicubic", "bilinear"])
@pytest.mark.parametrize("antialias", [True, False])
@pytest.mark.parametrize("prefix", [0, 1])
def test_resize_pos_embed_matches_timm(old_grid, new_grid, explicit, method, antialias, prefix, rng):
    source = rng.normal(size=(1, prefix + old_grid[0] * old_grid[1], 16)).astype("float32")
    given = old_grid if explicit else None
    result = resize_pos_embed(
        source, new_grid, num_prefix_tokens=prefix, old_grid=given, method=method, antialias=antialias
    )
    expected = _timm_resample(source, new_grid, given, prefix, method, antialias)
    assert result.shape == expected.shape == (1, prefix + new_grid[0] * new_grid[1], 16)
    assert result.dtype == np.float32
    np.testing.assert_allclose(result, expected, atol=TOLERANCE, rtol=0)


def test_resize_pos_embed_accepts_two_dimensional_input(rng):
    source = rng.normal(size=(1 + 16, 4)).astype("float32")
    result = resize_pos_embed(source, 6)
    np.testing.assert_allclose(result, _timm_resample(source[None], (6, 6))[0], atol=TOLERANCE, rtol=0)


def test_resize_pos_embed_errors():
    non_square = np.zeros((1, 1 + 15, 4), "float32")
    with pytest.raises(ValueError, match=r"15 patch tokens.*pass old_grid=\(height, width\)"):
        resize_pos_embed(non_square, (4, 4))
    with pytest.raises(ValueError, match=r"old_grid 4x4 has 16 patches but pos_embed has 15"):
        resize_pos_embed(non_square, (4, 4), old_grid=(4, 4))
    with pytest.raises(ValueError, match=r"Unknown interpolation method 'nearest'"):
        resize_pos_embed(non_square, (4, 4), old_grid=(3, 5), method="nearest")
    with pytest.raises(ValueError, match=r"pos_embed must have shape"):
        resize_pos_embed(np.zeros((2, 17, 4), "float32"), (4, 4))


# ---- mixed precision: every layer in its policy's dtype, the model's values those of float32 -------

MIXED_FLOAT16_TOLERANCE = 5e-3  # max |logit difference| / max |float32 logit|


@pytest.mark.parametrize(
    "config",
    [
        ViTConfig("tiny_plain", 4, 32, 2, 2, 64, image_size=(16, 24)),
        ViTConfig("tiny_hybrid", 1, 64, 1, 2, 128, resnet_stages=(1, 1), image_size=32),
    ],
    ids=["plain", "hybrid"],
)
def test_mixed_float16_logits_are_float32_logits(config, parity, rng):
    """`mixed_float16`: float16 compute, float32 weights and logits, within MIXED_FLOAT16_TOLERANCE."""
    reference = build_vit(config, num_classes=5, classifier_activation=None)
    reference.set_weights([w + rng.normal(0, 0.05, w.shape).astype(w.dtype) for w in reference.get_weights()])
    images = rng.uniform(-1, 1, (2, *config.image_hw, 3)).astype("float32")
    expected = keras.ops.convert_to_numpy(reference(images, training=False))

    keras.config.set_dtype_policy("mixed_float16")
    model = build_vit(config, num_classes=5, classifier_activation=None)
    model.set_weights(reference.get_weights())
    assert model.blocks[0].fc1.compute_dtype == "float16" and model.blocks[0].fc1.kernel.dtype == "float32"
    logits = keras.ops.convert_to_numpy(model(images, training=False))
    assert logits.dtype == np.float32
    scale = np.abs(expected).max()
    parity(logits / scale, expected / scale, MIXED_FLOAT16_TOLERANCE, "relative to max |logit|")

"""The original ViT code's forward pass, re-implemented in plain JAX from its source, for tests.

A transcription of google-research/vision_transformer `vit_jax/models_vit.py`
(`VisionTransformer`, `Encoder`, `Encoder1DBlock`, `MlpBlock`, `AddPositionEmbs`, `MAPHead`) and
`vit_jax/models_resnet.py` (`StdConv`, `ResidualUnit`, `ResNetStage`), with the Flax modules
they call written out with their defaults (Flax is not installed):

- `nn.LayerNorm`, `nn.GroupNorm` (32 groups): epsilon 1e-6, statistics in float32 with the
  "fast" variance E[x^2] - E[x]^2 clipped at 0, then (x - mean) * rsqrt(var + eps) * scale + bias;
- `nn.gelu` = `jax.nn.gelu`, whose default is the tanh approximation (`approximate=True`);
- `nn.MultiHeadDotProductAttention`: `DenseGeneral` projections to (heads, head_dim), the query
  divided by sqrt(head_dim), softmax over the keys, output `DenseGeneral` over (heads, head_dim);
- `nn.Conv`: padding "SAME" (TensorFlow rules) unless given, here "VALID" for `embedding`;
  `StdConv` standardises its kernel per output channel: (w - mean) / (std + 1e-5);
- `nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")`.

Parameters are the flat `np.savez` dict of the published files (the original naming:
`Transformer/encoderblock_{i}/LayerNorm_0`, `MultiHeadDotProductAttention_1`, `LayerNorm_2`,
`MlpBlock_3`, `Transformer/posembed_input/pos_embedding`, `cls`, optional `pre_logits`, and
for hybrids `conv_root`, `gn_root`, `block{s}/unit{u}/...`; GroupNorm parameters may be
(1, 1, 1, C), squeezed as `checkpoint._fix_groupnorm` does). `resize_posemb` is
`checkpoint.load_pretrained`'s position-embedding resampling (`scipy.ndimage.zoom(order=1)`),
`random_params` writes a random checkpoint with the names and shapes the original code saves.
The classifier is read from the parameters: `"token"` with a `cls`, `"map"` with `MAPHead_0/probe`
(`MAPHead`: the probe attends over the tokens, then `x + MlpBlock(LayerNorm(x))`, token 0), else
`"gap"` (the mean of the tokens after `encoder_norm`).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import scipy.ndimage
from jax import lax

LN_EPSILON = 1e-6  # flax.linen.LayerNorm / GroupNorm default
GROUPS = 32  # flax.linen.GroupNorm default num_groups
_UNIT = re.compile(r"block(\d+)/unit(\d+)/")
# The ResNet stem's numerics: the original code's (`models_resnet.weight_standardize(..., eps=1e-5)`,
# Flax GroupNorm's epsilon) and timm's (`StdConv2dSame(eps=1e-8)`: (w - mean) / sqrt(var + eps);
# `GroupNormAct` epsilon 1e-5), the latter only to check the transcription's structure against timm.
STEM_NUMERICS = {
    "original": {"standardize": "std", "std_conv_epsilon": 1e-5, "group_norm_epsilon": LN_EPSILON},
    "timm": {"standardize": "variance", "std_conv_epsilon": 1e-8, "group_norm_epsilon": 1e-5},
}


def _norm_stats(x, axes):
    """Flax `_compute_stats` with `use_fast_variance=True`: mean and E[x^2] - mean^2, clipped at 0."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axes, keepdims=True)
    mean2 = jnp.mean(jnp.square(x), axes, keepdims=True)
    return mean, jnp.maximum(0.0, mean2 - jnp.square(mean))


def layer_norm(x, scale, bias):
    """`nn.LayerNorm()`: over the last axis."""
    mean, var = _norm_stats(x, (-1,))
    return (x - mean) * lax.rsqrt(var + LN_EPSILON) * scale + bias


def group_norm(x, scale, bias, epsilon=LN_EPSILON):
    """`nn.GroupNorm()`: 32 groups of channels, statistics over (H, W, channels of the group)."""
    n, h, w, c = x.shape
    grouped = x.reshape(n, h, w, GROUPS, c // GROUPS)
    mean, var = _norm_stats(grouped, (1, 2, 4))
    normed = ((grouped - mean) * lax.rsqrt(var + epsilon)).reshape(x.shape)
    return normed * scale.reshape(-1) + bias.reshape(-1)


def conv(x, kernel, strides=1, padding="SAME", bias=None):
    """`nn.Conv` on NHWC inputs with an HWIO kernel."""
    y = lax.conv_general_dilated(
        x, kernel, (strides, strides), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return y if bias is None else y + bias


def std_conv(x, kernel, strides=1, numerics="original"):
    """`models_resnet.StdConv` (no bias): the kernel standardised by `weight_standardize`."""
    numerics = STEM_NUMERICS[numerics]
    kernel = kernel - jnp.mean(kernel, axis=(0, 1, 2))
    if numerics["standardize"] == "std":
        kernel = kernel / (jnp.std(kernel, axis=(0, 1, 2)) + numerics["std_conv_epsilon"])
    else:
        kernel = kernel * lax.rsqrt(jnp.var(kernel, axis=(0, 1, 2)) + numerics["std_conv_epsilon"])
    return conv(x, kernel, strides)


def max_pool(x):
    """`nn.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding="SAME")`."""
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")


def dense(x, params, name):
    return x @ params[f"{name}/kernel"] + params[f"{name}/bias"]


def attention(x, params, name, inputs_kv=None):
    """`nn.MultiHeadDotProductAttention(...)(x, inputs_kv)` (`inputs_kv` defaults to `x`), kernels
    (D, heads, hd) and (heads, hd, D)."""
    inputs_kv = x if inputs_kv is None else inputs_kv
    query, key, value = (
        jnp.einsum("...d,dhk->...hk", inputs, params[f"{name}/{part}/kernel"]) + params[f"{name}/{part}/bias"]
        for inputs, part in ((x, "query"), (inputs_kv, "key"), (inputs_kv, "value"))
    )
    query = query / jnp.sqrt(query.shape[-1]).astype(query.dtype)
    weights = jax.nn.softmax(jnp.einsum("...qhd,...khd->...hqk", query, key), axis=-1)
    context = jnp.einsum("...hqk,...khd->...qhd", weights, value)
    return jnp.einsum("...hk,hkd->...d", context, params[f"{name}/out/kernel"]) + params[f"{name}/out/bias"]


def encoder_block(x, params, prefix, approximate_gelu=True):
    """`Encoder1DBlock` (deterministic): x + MHA(LN_0(x)), then + MlpBlock_3(LN_2(.)).

    `MlpBlock` calls `nn.gelu`, which is `jax.nn.gelu` with its default `approximate=True`
    (the tanh form); `approximate_gelu=False` gives the exact form of timm and transformers.
    """
    y = layer_norm(x, params[f"{prefix}LayerNorm_0/scale"], params[f"{prefix}LayerNorm_0/bias"])
    x = attention(y, params, f"{prefix}MultiHeadDotProductAttention_1") + x
    y = layer_norm(x, params[f"{prefix}LayerNorm_2/scale"], params[f"{prefix}LayerNorm_2/bias"])
    y = jax.nn.gelu(dense(y, params, f"{prefix}MlpBlock_3/Dense_0"), approximate=approximate_gelu)
    return x + dense(y, params, f"{prefix}MlpBlock_3/Dense_1")


def resnet_stages(params) -> list[int]:
    """Units per stage of a hybrid's ResNet, from the `block{s}/unit{u}` keys ([] for the root only)."""
    units = {}
    for key in params:
        match = _UNIT.match(key)
        if match:
            stage, unit = int(match.group(1)), int(match.group(2))
            units[stage] = max(units.get(stage, 0), unit)
    return [units[stage] for stage in sorted(units)]


def residual_unit(x, params, prefix, strides, numerics="original"):
    """`ResidualUnit`: the bottleneck (not pre-activation), projection when width or stride change."""
    epsilon = STEM_NUMERICS[numerics]["group_norm_epsilon"]

    def gn(y, name):
        return group_norm(y, params[f"{prefix}{name}/scale"], params[f"{prefix}{name}/bias"], epsilon)

    residual = x
    if f"{prefix}conv_proj/kernel" in params:  # needs_projection
        residual = gn(std_conv(x, params[f"{prefix}conv_proj/kernel"], strides, numerics), "gn_proj")
    y = jax.nn.relu(gn(std_conv(x, params[f"{prefix}conv1/kernel"], 1, numerics), "gn1"))
    y = jax.nn.relu(gn(std_conv(y, params[f"{prefix}conv2/kernel"], strides, numerics), "gn2"))
    y = gn(std_conv(y, params[f"{prefix}conv3/kernel"], 1, numerics), "gn3")
    return jax.nn.relu(residual + y)


def resnet(x, params, numerics="original"):
    """The hybrid's root block and `ResNetStage`s (first stride 1, then 2)."""
    epsilon = STEM_NUMERICS[numerics]["group_norm_epsilon"]
    x = std_conv(x, params["conv_root/kernel"], 2, numerics)
    x = jax.nn.relu(group_norm(x, params["gn_root/scale"], params["gn_root/bias"], epsilon))
    x = max_pool(x)
    for stage, units in enumerate(resnet_stages(params), 1):
        for unit in range(1, units + 1):
            strides = 2 if stage > 1 and unit == 1 else 1
            x = residual_unit(x, params, f"block{stage}/unit{unit}/", strides, numerics)
    return x


def apply(
    params: dict[str, np.ndarray],
    images: np.ndarray,
    approximate_gelu: bool = True,
    stem_numerics: str = "original",
) -> np.ndarray:
    """`VisionTransformer(classifier="token")(images, train=False)`: logits (or pre-logits without a head).

    `approximate_gelu=False` swaps the original code's tanh GELU for the exact one, and
    `stem_numerics="timm"` its weight standardisation and GroupNorm epsilon for timm's (to compare
    the rest with timm). Compiled whole with `jax.jit`: eager JAX compiles every operation of a
    new shape on its own (~20 s for a small hybrid on 2 CPU cores, against ~5 s).
    """
    params = {key: jnp.asarray(value) for key, value in params.items()}
    return np.asarray(_forward(params, jnp.asarray(images), approximate_gelu, stem_numerics))


def stem_features(params: dict[str, np.ndarray], images: np.ndarray, stem_numerics: str = "original"):
    """The hybrid's ResNet output (NHWC), before the patch embedding."""
    params = {key: jnp.asarray(value) for key, value in params.items()}
    return np.asarray(_stem(params, jnp.asarray(images), stem_numerics))


@functools.partial(jax.jit, static_argnames="numerics")
def _stem(params, x, numerics):
    return resnet(x, params, numerics)


@functools.partial(jax.jit, static_argnames=("approximate_gelu", "stem_numerics"))
def _forward(params, x, approximate_gelu, stem_numerics):
    if "conv_root/kernel" in params:
        x = resnet(x, params, stem_numerics)
    patch = params["embedding/kernel"].shape[0]
    x = conv(x, params["embedding/kernel"], patch, "VALID", params["embedding/bias"])
    n, h, w, c = x.shape
    x = jnp.reshape(x, [n, h * w, c])
    if "cls" in params:  # classifier="token"
        cls = jnp.tile(params["cls"], [n, 1, 1])
        x = jnp.concatenate([cls, x], axis=1)
    x = x + params["Transformer/posembed_input/pos_embedding"]  # AddPositionEmbs
    depth = len({key.split("/")[1] for key in params if key.startswith("Transformer/encoderblock_")})
    for index in range(depth):
        x = encoder_block(x, params, f"Transformer/encoderblock_{index}/", approximate_gelu)
    x = layer_norm(x, params["Transformer/encoder_norm/scale"], params["Transformer/encoder_norm/bias"])
    if "cls" in params:
        x = x[:, 0]
    elif "MAPHead_0/probe" in params:  # classifier="map"
        probe = jnp.tile(params["MAPHead_0/probe"], [n, 1, 1])
        x = attention(probe, params, "MAPHead_0/MultiHeadDotProductAttention_0", inputs_kv=x)
        y = layer_norm(x, params["MAPHead_0/LayerNorm_0/scale"], params["MAPHead_0/LayerNorm_0/bias"])
        y = jax.nn.gelu(dense(y, params, "MAPHead_0/MlpBlock_0/Dense_0"), approximate=approximate_gelu)
        x = (x + dense(y, params, "MAPHead_0/MlpBlock_0/Dense_1"))[:, 0]
    else:  # classifier="gap"
        x = jnp.mean(x, axis=1)
    if "pre_logits/kernel" in params:
        x = jnp.tanh(dense(x, params, "pre_logits"))
    if "head/kernel" in params:
        x = dense(x, params, "head")
    return x


def resize_posemb(params: dict[str, np.ndarray], grid: tuple[int, int]) -> dict[str, np.ndarray]:
    """`checkpoint.load_pretrained`'s resampling: the square grid zoomed with `scipy.ndimage.zoom(order=1)`.

    The [class] token's row is kept; the original code takes square grids (zoom `gs_new / gs_old`
    on both axes), generalised here to `(new_h / old_h, new_w / old_w)`.
    """
    key = "Transformer/posembed_input/pos_embedding"
    posemb = params[key]
    posemb_tok, posemb_grid = posemb[:, :1], posemb[0, 1:]
    gs_old = int(np.sqrt(len(posemb_grid)))
    posemb_grid = posemb_grid.reshape(gs_old, gs_old, -1)
    zoom = (grid[0] / gs_old, grid[1] / gs_old, 1)
    posemb_grid = scipy.ndimage.zoom(posemb_grid, zoom, order=1)
    posemb_grid = posemb_grid.reshape(1, grid[0] * grid[1], -1)
    return {**params, key: np.concatenate([posemb_tok, posemb_grid], axis=1)}


def random_params(
    *,
    hidden_size: int,
    depth: int,
    num_heads: int,
    mlp_dim: int,
    patch_size: int,
    grid: int,
    num_classes: int,
    resnet_stages: tuple[int, ...] | None = None,
    representation_size: int | None = None,
    groupnorm_4d: bool = False,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """A random checkpoint with the keys and shapes `VisionTransformer` creates (float32).

    Kernels are N(0, 1/fan_in) (ResNet kernels with a mean and a small spread, so that the
    standardisation's epsilon counts), norms' scales 1 + N(0, 0.1), biases, token, position
    embedding and head N(0, 0.1): every tensor is non-trivial.
    """
    rng = np.random.default_rng(seed)
    params: dict[str, np.ndarray] = {}

    def normal(shape, scale, mean=0.0):
        return (mean + scale * rng.standard_normal(shape)).astype(np.float32)

    def norm(name, channels, shape=None):
        shape = shape or (channels,)
        params[f"{name}/scale"] = normal(shape, 0.1, 1.0)
        params[f"{name}/bias"] = normal(shape, 0.1)

    channels = 3
    if resnet_stages is not None:
        gn_shape = (lambda c: (1, 1, 1, c)) if groupnorm_4d else (lambda c: (c,))
        params["conv_root/kernel"] = normal((7, 7, 3, 64), 0.02, 0.01)
        norm("gn_root", 64, gn_shape(64))
        channels = 64
        for stage, units in enumerate(resnet_stages, 1):
            width = 64 * 2 ** (stage - 1)
            for unit in range(1, units + 1):
                prefix = f"block{stage}/unit{unit}/"
                if unit == 1:  # the first unit changes the width (and, after stage 1, the stride)
                    params[f"{prefix}conv_proj/kernel"] = normal((1, 1, channels, 4 * width), 0.02, 0.01)
                    norm(f"{prefix}gn_proj", 4 * width, gn_shape(4 * width))
                for index, shape in enumerate(
                    ((1, 1, channels, width), (3, 3, width, width), (1, 1, width, 4 * width)), 1
                ):
                    params[f"{prefix}conv{index}/kernel"] = normal(shape, 0.02, 0.01)
                    norm(f"{prefix}gn{index}", shape[-1], gn_shape(shape[-1]))
                channels = 4 * width
    fan_in = patch_size * patch_size * channels
    params["embedding/kernel"] = normal((patch_size, patch_size, channels, hidden_size), fan_in**-0.5)
    params["embedding/bias"] = normal((hidden_size,), 0.1)
    params["cls"] = normal((1, 1, hidden_size), 0.1)
    params["Transformer/posembed_input/pos_embedding"] = normal((1, 1 + grid * grid, hidden_size), 0.1)
    head_dim = hidden_size // num_heads
    for index in range(depth):
        prefix = f"Transformer/encoderblock_{index}/"
        norm(f"{prefix}LayerNorm_0", hidden_size)
        norm(f"{prefix}LayerNorm_2", hidden_size)
        attention_prefix = f"{prefix}MultiHeadDotProductAttention_1/"
        for part in ("query", "key", "value"):
            params[f"{attention_prefix}{part}/kernel"] = normal(
                (hidden_size, num_heads, head_dim), hidden_size**-0.5
            )
            params[f"{attention_prefix}{part}/bias"] = normal((num_heads, head_dim), 0.1)
        params[f"{attention_prefix}out/kernel"] = normal(
            (num_heads, head_dim, hidden_size), hidden_size**-0.5
        )
        params[f"{attention_prefix}out/bias"] = normal((hidden_size,), 0.1)
        params[f"{prefix}MlpBlock_3/Dense_0/kernel"] = normal((hidden_size, mlp_dim), hidden_size**-0.5)
        params[f"{prefix}MlpBlock_3/Dense_0/bias"] = normal((mlp_dim,), 0.1)
        params[f"{prefix}MlpBlock_3/Dense_1/kernel"] = normal((mlp_dim, hidden_size), mlp_dim**-0.5)
        params[f"{prefix}MlpBlock_3/Dense_1/bias"] = normal((hidden_size,), 0.1)
    norm("Transformer/encoder_norm", hidden_size)
    width = hidden_size
    if representation_size:
        params["pre_logits/kernel"] = normal((hidden_size, representation_size), hidden_size**-0.5)
        params["pre_logits/bias"] = normal((representation_size,), 0.1)
        width = representation_size
    params["head/kernel"] = normal((width, num_classes), width**-0.5)
    params["head/bias"] = normal((num_classes,), 0.1)
    return params

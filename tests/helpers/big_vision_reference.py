"""A test-only re-implementation of big_vision's ViT forward pass in `jax.numpy`, and its `.npz` layout.

Written line by line from google-research/big_vision `big_vision/models/vit.py` (`_Model`,
`Encoder`, `Encoder1DBlock`, `MlpBlock`, `MAPHead`) with the Flax modules it calls spelled out:

- `nn.Conv(width, patch, strides=patch, padding="VALID", name="embedding")`: an HWIO convolution;
- `nn.LayerNorm()`: epsilon 1e-6, `(x - mean) / sqrt(var + eps) * scale + bias` over the last axis;
- `nn.gelu`: `jax.nn.gelu(approximate=True)` (the tanh form; Flax's default);
- `nn.MultiHeadDotProductAttention`: `DenseGeneral` query/key/value kernels `(D, heads, hd)`,
  biases `(heads, hd)`, the query divided by sqrt(hd), softmax over the keys, output kernel
  `(heads, hd, D)`;
- the position embedding is added to the patch tokens *before* the `cls` token is prepended
  (`pool_type="tok"` only); `"gap"` is the mean of all tokens after `encoder_norm`; `"map"` is
  `MAPHead` (a `probe` `(1, 1, D)` as the query over all tokens, then `x + MlpBlock(LayerNorm(x))`,
  token 0); `rep_size` adds `pre_logits` (Dense + tanh); `head` is a Dense.

It reads the parameters as big_vision's `.npz` files hold them (flat '/'-joined Flax paths), with
or without a prefix and with unscanned (`Transformer/encoderblock_{i}/...`) or scan-stacked
(`Transformer/encoderblock/...`, leading depth axis) blocks. `random_params` makes such a
parameter set with the exact names and shapes `_Model.init` gives; `saved_arrays` lays it out
as a saved file (prefix, scan). It shares no code with keras_vit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

LAYER_NORM_EPSILON = 1e-6  # flax.linen.LayerNorm's default
_HIGHEST = jax.lax.Precision.HIGHEST


def random_params(
    *,
    width: int,
    depth: int,
    num_heads: int,
    mlp_dim: int,
    patch_size: int,
    grid: tuple[int, int],
    pool_type: str,
    num_classes: int | None = None,
    rep_size: int | None = None,
    channels: int = 3,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Random float32 parameters of big_vision's `_Model`, unscanned, keyed by their '/'-joined paths.

    Every tensor (LayerNorm scales and biases included) is random: a trivial value would hide a
    swapped or transposed tensor.
    """
    rng = np.random.default_rng(seed)
    head_dim = width // num_heads

    def normal(*shape, scale=0.05):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def layer_norm(prefix):
        return {f"{prefix}/scale": 1.0 + normal(width, scale=0.1), f"{prefix}/bias": normal(width)}

    def attention(prefix):
        arrays = {f"{prefix}/out/kernel": normal(num_heads, head_dim, width, scale=width**-0.5)}
        arrays[f"{prefix}/out/bias"] = normal(width)
        for name in ("query", "key", "value"):
            arrays[f"{prefix}/{name}/kernel"] = normal(width, num_heads, head_dim, scale=width**-0.5)
            arrays[f"{prefix}/{name}/bias"] = normal(num_heads, head_dim)
        return arrays

    def mlp(prefix):
        return {
            f"{prefix}/Dense_0/kernel": normal(width, mlp_dim, scale=width**-0.5),
            f"{prefix}/Dense_0/bias": normal(mlp_dim),
            f"{prefix}/Dense_1/kernel": normal(mlp_dim, width, scale=mlp_dim**-0.5),
            f"{prefix}/Dense_1/bias": normal(width),
        }

    params = {
        "embedding/kernel": normal(patch_size, patch_size, channels, width, scale=0.1),
        "embedding/bias": normal(width),
        "pos_embedding": normal(1, grid[0] * grid[1], width, scale=width**-0.5),
        **layer_norm("Transformer/encoder_norm"),
    }
    if pool_type == "tok":
        params["cls"] = normal(1, 1, width, scale=0.5)
    for index in range(depth):
        block = f"Transformer/encoderblock_{index}"
        params |= layer_norm(f"{block}/LayerNorm_0") | layer_norm(f"{block}/LayerNorm_1")
        params |= attention(f"{block}/MultiHeadDotProductAttention_0") | mlp(f"{block}/MlpBlock_0")
    if pool_type == "map":
        params["MAPHead_0/probe"] = normal(1, 1, width, scale=0.5)
        params |= attention("MAPHead_0/MultiHeadDotProductAttention_0")
        params |= layer_norm("MAPHead_0/LayerNorm_0") | mlp("MAPHead_0/MlpBlock_0")
    features = width
    if rep_size:
        params |= {"pre_logits/kernel": normal(width, rep_size, scale=width**-0.5)}
        params["pre_logits/bias"] = normal(rep_size)
        features = rep_size
    if num_classes:
        params |= {"head/kernel": normal(features, num_classes, scale=features**-0.5)}
        params["head/bias"] = normal(num_classes)
    return params


def saved_arrays(params: dict[str, np.ndarray], *, prefix: str = "params/", scan: bool = False) -> dict:
    """`params` as a saved `.npz` holds them: under `prefix`; with `scan`, blocks stacked on a depth axis."""
    arrays = {}
    stacked: dict[str, list[tuple[int, np.ndarray]]] = {}
    for key, value in params.items():
        if scan and key.startswith("Transformer/encoderblock_"):
            index, _, inner = key[len("Transformer/encoderblock_") :].partition("/")
            stacked.setdefault(f"Transformer/encoderblock/{inner}", []).append((int(index), value))
        else:
            arrays[prefix + key] = value
    for key, layers in stacked.items():
        arrays[prefix + key] = np.stack([value for _, value in sorted(layers, key=lambda item: item[0])])
    return arrays


def _unprefixed(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    for prefix in ("params/img/", "params/", ""):
        if f"{prefix}embedding/kernel" in arrays:
            return {key[len(prefix) :]: value for key, value in arrays.items() if key.startswith(prefix)}
    raise KeyError("no embedding/kernel under any prefix")


def _block_params(params: dict[str, np.ndarray], index: int) -> dict[str, np.ndarray]:
    """Block `index`'s parameters by their key inside the block, unscanned or scan-stacked."""
    unscanned = f"Transformer/encoderblock_{index}/"
    found = {key[len(unscanned) :]: value for key, value in params.items() if key.startswith(unscanned)}
    if found:
        return found
    stacked = "Transformer/encoderblock/"
    return {key[len(stacked) :]: value[index] for key, value in params.items() if key.startswith(stacked)}


def _depth(params: dict[str, np.ndarray]) -> int:
    stacked = [value for key, value in params.items() if key.startswith("Transformer/encoderblock/")]
    if stacked:
        return int(stacked[0].shape[0])
    return len({key.split("/")[1] for key in params if key.startswith("Transformer/encoderblock_")})


def layer_norm(x, scale, bias):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + LAYER_NORM_EPSILON) * scale + bias


def attention(inputs_q, inputs_kv, p: dict, prefix: str):
    """`nn.MultiHeadDotProductAttention()(inputs_q, inputs_kv)` with the parameters under `prefix`."""

    def project(x, name):
        kernel = p[f"{prefix}/{name}/kernel"]
        return jnp.einsum("bld,dhk->blhk", x, kernel, precision=_HIGHEST) + p[f"{prefix}/{name}/bias"]

    query, key, value = project(inputs_q, "query"), project(inputs_kv, "key"), project(inputs_kv, "value")
    query = query / jnp.sqrt(query.shape[-1]).astype(query.dtype)
    weights = jax.nn.softmax(jnp.einsum("bqhk,bthk->bhqt", query, key, precision=_HIGHEST), axis=-1)
    context = jnp.einsum("bhqt,bthk->bqhk", weights, value, precision=_HIGHEST)
    out = jnp.einsum("bqhk,hkd->bqd", context, p[f"{prefix}/out/kernel"], precision=_HIGHEST)
    return out + p[f"{prefix}/out/bias"]


def mlp_block(x, p: dict, prefix: str):
    """`MlpBlock`: Dense -> nn.gelu (tanh) -> Dense."""
    x = (
        jnp.einsum("...d,df->...f", x, p[f"{prefix}/Dense_0/kernel"], precision=_HIGHEST)
        + p[f"{prefix}/Dense_0/bias"]
    )
    x = jax.nn.gelu(x, approximate=True)
    return (
        jnp.einsum("...f,fd->...d", x, p[f"{prefix}/Dense_1/kernel"], precision=_HIGHEST)
        + p[f"{prefix}/Dense_1/bias"]
    )


def encoder_block(x, p: dict):
    """`Encoder1DBlock` (deterministic): pre-LayerNorm attention and MLP, each with a residual."""
    y = layer_norm(x, p["LayerNorm_0/scale"], p["LayerNorm_0/bias"])
    x = x + attention(y, y, p, "MultiHeadDotProductAttention_0")
    y = layer_norm(x, p["LayerNorm_1/scale"], p["LayerNorm_1/bias"])
    return x + mlp_block(y, p, "MlpBlock_0")


def map_head(x, p: dict):
    """`MAPHead`: the probe attends over the tokens, then `x + MlpBlock(LayerNorm(x))`, token 0."""
    probe = jnp.tile(p["MAPHead_0/probe"], (x.shape[0], 1, 1))
    x = attention(probe, x, p, "MAPHead_0/MultiHeadDotProductAttention_0")
    y = layer_norm(x, p["MAPHead_0/LayerNorm_0/scale"], p["MAPHead_0/LayerNorm_0/bias"])
    x = x + mlp_block(y, p, "MAPHead_0/MlpBlock_0")
    return x[:, 0]


def forward(arrays: dict[str, np.ndarray], images: np.ndarray, pool_type: str) -> np.ndarray:
    """big_vision `_Model(...).apply({"params": ...}, images)[0]` for NHWC float32 `images`.

    `arrays`: the `.npz` contents (any prefix, scanned or not). Returns the logits, or the
    head input (pre-logits) for a checkpoint without `head`.
    """
    params = {key: np.asarray(value) for key, value in _unprefixed(arrays).items()}
    blocks = [_block_params(params, index) for index in range(_depth(params))]
    params = {key: value for key, value in params.items() if not key.startswith("Transformer/encoderblock")}
    return np.asarray(_forward(params, blocks, np.asarray(images), pool_type))


@functools.partial(jax.jit, static_argnames="pool_type")
def _forward(p: dict, blocks: list[dict], images, pool_type: str):
    """`forward` on unprefixed parameters and per-block ones (scanned files unstacked), compiled
    once per layout: eager JAX compiles every operation on its first use."""
    kernel = p["embedding/kernel"]
    x = jax.lax.conv_general_dilated(
        jnp.asarray(images),
        kernel,
        window_strides=kernel.shape[:2],
        padding="VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=_HIGHEST,
    )
    x = x + p["embedding/bias"]
    n, h, w, c = x.shape
    x = jnp.reshape(x, (n, h * w, c))
    x = x + p["pos_embedding"]  # before the [class] token is prepended
    if pool_type == "tok":
        x = jnp.concatenate([jnp.tile(p["cls"], (n, 1, 1)), x], axis=1)
    for block in blocks:
        x = encoder_block(x, block)
    x = layer_norm(x, p["Transformer/encoder_norm/scale"], p["Transformer/encoder_norm/bias"])
    if pool_type == "map":
        x = map_head(x, p)
    elif pool_type == "gap":
        x = jnp.mean(x, axis=1)
    elif pool_type == "tok":
        x = x[:, 0]
    else:
        raise ValueError(f"Unknown pool type: {pool_type!r}")
    if "pre_logits/kernel" in p:
        x = jnp.tanh(
            jnp.einsum("bd,dr->br", x, p["pre_logits/kernel"], precision=_HIGHEST) + p["pre_logits/bias"]
        )
    if "head/kernel" in p:
        x = jnp.einsum("bd,dk->bk", x, p["head/kernel"], precision=_HIGHEST) + p["head/bias"]
    return x

"""Looking inside a ViT (paper §4.5, Figures 6 and 7): attention maps, attention rollout, mean
attention distance, position-embedding similarity and the principal components of the patch
embedding filters.

Everything works on any keras_vit model, plain or hybrid, with or without a [class] token
(`class_token=False`: GAP and MAP models), at the resolution it was built for, without
rebuilding it: `attention_weights` runs the model's own layers in order (the ResNet stem
of a hybrid as a sub-model up to `patch_embed`, then `patch_embed`, `class_token`, `pos_embed`
and every `TransformerBlock` with `return_attention_scores=True`, which returns the softmax
weights the block multiplies the values by). Inference mode throughout: dropout off.

Reach it as `keras_vit.inspection.analysis` (`keras_vit.inspect`, its name before, still works, with a
deprecation warning: a module named `inspect` inside the package hid the standard library's).
Pictures of each result: `keras_vit.inspection.plots`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import keras
import numpy as np
from keras import ops

from keras_vit.models.layers import PositionEmbedding, TransformerBlock
from keras_vit.registry.variants import config_of
from keras_vit.utils.defaults import HEAD_FUSIONS

__all__ = [
    "HEAD_FUSIONS",
    "attention_distance",
    "attention_rollout",
    "attention_weights",
    "embedding_filters",
    "mean_attention_distance",
    "position_embedding_similarity",
    "rollout",
    "token_grid",
    "uniform_attention_distance",
]


@dataclass(frozen=True)
class _Layout:
    """The parts of a keras_vit model that the attention walk calls, in order."""

    stem: keras.Model | None  # hybrids: image -> ResNet feature map (input of `patch_embed`)
    chain: tuple[keras.layers.Layer, ...]  # `patch_embed` ... the last TransformerBlock
    pos_embed: PositionEmbedding
    image_shape: tuple[int | None, ...]  # (H, W, C) of the model input


def _layout(model: keras.Model) -> _Layout:
    config_of(model)
    embedding = (model.patch_embed, model.class_token, model.pos_embed)  # dropout: identity at inference
    chain = tuple(layer for layer in embedding if layer is not None) + tuple(model.blocks)
    stem = keras.Model(model.input, model.patch_embed.input, name="stem") if model.config.is_hybrid else None
    return _Layout(stem, chain, model.pos_embed, model.image_shape)


def _check_images(images, layout: _Layout, model: keras.Model) -> np.ndarray:
    images = np.asarray(images)
    if images.dtype.kind in "iub":
        raise TypeError(
            f"Model {model.name!r} takes normalised float images, got {images.dtype} pixels: pass them "
            "through keras_vit.preprocess_input(images, model) first."
        )
    images = images.astype("float32", copy=False)
    if not np.isfinite(images).all():
        raise ValueError("images hold NaN or infinite pixel values: they are no image.")
    expected = layout.image_shape
    if images.ndim == 3:
        raise ValueError(
            f"images must be a batch (batch, height, width, channels); got one image of shape "
            f"{images.shape}: add a batch axis (`images[None]`)."
        )
    if images.ndim != 4 or any(
        want is not None and got != want for got, want in zip(images.shape[1:], expected, strict=True)
    ):
        raise ValueError(
            f"Model {model.name!r} takes images of shape (batch, {', '.join(map(str, expected))}), got "
            f"{images.shape}: resize the images (keras_vit.load_image), or build the model for their "
            "size (create_model(..., image_size=(height, width)) resizes the position embedding)."
        )
    if len(images) == 0:
        raise ValueError("images is an empty batch.")
    return images


def _check_batch_size(batch_size: int) -> int:
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
    return int(batch_size)


def _block_attention(layout: _Layout, images: np.ndarray) -> Iterator[np.ndarray]:
    """Yield each block's attention weights `(batch, heads, tokens, tokens)` for one batch."""
    tokens = ops.convert_to_tensor(images)
    if layout.stem is not None:
        tokens = layout.stem(tokens, training=False)
    for layer in layout.chain:
        if isinstance(layer, TransformerBlock):
            tokens, scores = layer(tokens, training=False, return_attention_scores=True)
            yield ops.convert_to_numpy(ops.cast(scores, "float32"))
        else:
            tokens = layer(tokens, training=False)


def _batches(images: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    for start in range(0, len(images), batch_size):
        yield images[start : start + batch_size]


def attention_weights(model: keras.Model, images, *, batch_size: int = 8) -> list[np.ndarray]:
    """Every block's attention weights for `images`: a list (one per block) of float32 arrays
    `(batch, heads, tokens, tokens)`, each row a softmax over the keys (token 0 is [class] in a
    model with a [class] token; all tokens are patches in a `class_token=False` model).

    `images` are the model's input, `(batch, H, W, C)` at its resolution, already normalised
    (`keras_vit.preprocess_input`). Runs `batch_size` images at a time; the result holds
    `depth * heads * tokens**2` floats per image (ViT-B/16 at 224: 22 MB), so for many images
    prefer the reducing functions (`attention_rollout`, `mean_attention_distance`).
    """
    layout = _layout(model)
    images = _check_images(images, layout, model)
    per_batch = [
        list(_block_attention(layout, chunk)) for chunk in _batches(images, _check_batch_size(batch_size))
    ]
    return [np.concatenate(block, axis=0) for block in zip(*per_batch, strict=True)]


def token_grid(model: keras.Model) -> tuple[int, int]:
    """The patch grid `(rows, columns)` of a keras_vit model (its position embedding's grid)."""
    return tuple(_layout(model).pos_embed.grid_size)


def _pixels_per_token(layout: _Layout) -> tuple[float, float]:
    rows, columns = layout.pos_embed.grid_size
    height, width = layout.image_shape[:2]
    return height / rows, width / columns


def _check_rollout_arguments(discard_ratio: float, head_fusion: str) -> None:
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"Unknown head_fusion {head_fusion!r}: use one of {HEAD_FUSIONS}.")
    if not 0.0 <= discard_ratio < 1.0:
        raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio!r}.")


def rollout(
    attentions: Sequence[np.ndarray], discard_ratio: float = 0.0, head_fusion: str = "mean"
) -> np.ndarray:
    """Attention rollout (Abnar & Zuidema 2020) of per-block weights `(batch, heads, T, T)`.

    Per block, the heads are fused (`head_fusion`: "mean" as in the paper, or "max" / "min"),
    the `discard_ratio` fraction of smallest fused weights are set to zero (per image, over the
    whole matrix, keeping the [class] token's weight on itself, as the vit-explain code does;
    0 = the paper's rollout), the identity is added for the residual connection and rows are
    renormalised: `A = (W + I) / 2`, rows summing to 1. The product `A_L ... A_1` is returned,
    `(batch, T, T)`: row `i` says how much each input token contributes to output token `i`;
    every row is non-negative and sums to 1.
    """
    _check_rollout_arguments(discard_ratio, head_fusion)
    if not attentions:
        raise ValueError("rollout needs the attention weights of at least one block.")
    batch, _, tokens, _ = np.shape(attentions[0])
    identity = np.eye(tokens)
    result = np.broadcast_to(identity, (batch, tokens, tokens))
    for weights in attentions:
        weights = np.asarray(weights, dtype="float64")
        fused = getattr(weights, head_fusion)(axis=1)
        discard = int(tokens * tokens * discard_ratio)
        if discard:
            flat = fused.reshape(batch, -1)
            smallest = np.argsort(flat, axis=1, kind="stable")[:, :discard]
            keep_class_self = np.take_along_axis(flat, smallest, axis=1) * (smallest == 0)
            np.put_along_axis(flat, smallest, keep_class_self, axis=1)
        mixed = (fused + identity) / 2.0
        mixed /= mixed.sum(axis=-1, keepdims=True)
        result = mixed @ result
    return result


def attention_rollout(
    model: keras.Model,
    images,
    discard_ratio: float = 0.0,
    head_fusion: str = "mean",
    *,
    batch_size: int = 8,
) -> np.ndarray:
    """Per-image heat maps `(batch, H, W)` of where the [class] token looks (paper Figure 6).

    The [class] row of `rollout(...)` over all blocks, restricted to the patch tokens, resized
    bilinearly from the patch grid to the input resolution and divided by its maximum: every
    map is non-negative with maximum 1. `images` as for `attention_weights`.

    A model without a [class] token (`class_token=False`: GAP or MAP pooling) has no token
    that reads out the image; its map is the mean of the rollout's rows over all patch tokens:
    how much each input patch contributes to the average output token, which is what global
    average pooling reads (for MAP pooling, the probe's own attention is not included).
    """
    _check_rollout_arguments(discard_ratio, head_fusion)
    layout = _layout(model)
    images = _check_images(images, layout, model)
    prefix = layout.pos_embed.num_prefix_tokens
    rows, columns = layout.pos_embed.grid_size
    height, width = images.shape[1:3]
    maps = []
    for chunk in _batches(images, _check_batch_size(batch_size)):
        rolled = rollout(list(_block_attention(layout, chunk)), discard_ratio, head_fusion)
        readout = rolled[:, 0, prefix:] if prefix else rolled.mean(axis=1)
        grid = readout.reshape(-1, rows, columns, 1).astype("float32")
        maps.append(ops.convert_to_numpy(ops.image.resize(grid, (height, width), "bilinear"))[..., 0])
    maps = np.concatenate(maps, axis=0)
    return maps / np.maximum(maps.max(axis=(1, 2), keepdims=True), np.finfo("float32").tiny)


def _grid_distances(grid_size: Sequence[int], pixels_per_token: float | Sequence[float]) -> np.ndarray:
    """Euclidean pixel distances `(N, N)` between the centres of a row-major patch grid."""
    step_y, step_x = np.broadcast_to(np.asarray(pixels_per_token, dtype="float64"), (2,))
    rows, columns = np.meshgrid(np.arange(grid_size[0]), np.arange(grid_size[1]), indexing="ij")
    centres = np.stack([rows.ravel() * step_y, columns.ravel() * step_x], axis=-1)
    return np.linalg.norm(centres[:, None] - centres[None], axis=-1)


def attention_distance(
    attention: np.ndarray,
    grid_size: Sequence[int],
    pixels_per_token: float | Sequence[float],
    num_prefix_tokens: int = 1,
) -> np.ndarray:
    """Mean attention distance in pixels of one block's weights `(batch, heads, T, T)` → `(batch, heads)`.

    For each patch query, the distance between its patch centre and every patch key's centre,
    weighted by the attention (renormalised over the patch keys: the [class] token has no
    position), averaged over the queries (paper Figure 7 right, App. D.7). `pixels_per_token`
    is the patch spacing in pixels, one number or `(vertical, horizontal)`; `grid_size` is
    `(rows, columns)` in row-major token order after `num_prefix_tokens` prefix tokens.
    """
    attention = np.asarray(attention, dtype="float64")
    patches = int(grid_size[0]) * int(grid_size[1])
    if attention.ndim != 4 or attention.shape[-2:] != (num_prefix_tokens + patches,) * 2:
        raise ValueError(
            f"Expected attention weights (batch, heads, {num_prefix_tokens + patches}, "
            f"{num_prefix_tokens + patches}) for grid {tuple(grid_size)} with {num_prefix_tokens} "
            f"prefix token(s), got shape {attention.shape}."
        )
    weights = attention[..., num_prefix_tokens:, num_prefix_tokens:]
    weights = weights / np.maximum(weights.sum(axis=-1, keepdims=True), np.finfo("float64").tiny)
    distances = _grid_distances(grid_size, pixels_per_token)
    return np.einsum("bhqk,qk->bh", weights, distances) / patches


def uniform_attention_distance(grid_size: Sequence[int], pixels_per_token: float | Sequence[float]) -> float:
    """The mean attention distance of a head that attends uniformly: the mean distance between
    two patch centres of the grid (a reference line for `mean_attention_distance`)."""
    return float(_grid_distances(grid_size, pixels_per_token).mean())


def mean_attention_distance(model: keras.Model, images, *, batch_size: int = 8) -> np.ndarray:
    """Mean attention distance in pixels of every head, `(layers, heads)`, averaged over `images`.

    The data of the paper's Figure 7 (right; 128 images there): see `attention_distance`. The
    patch spacing is the input size over the token grid (the patch size for plain models, the
    patch times the ResNet stride for hybrids). `images` as for `attention_weights`.
    """
    layout = _layout(model)
    images = _check_images(images, layout, model)
    grid, spacing = layout.pos_embed.grid_size, _pixels_per_token(layout)
    prefix = layout.pos_embed.num_prefix_tokens
    total = 0.0
    for chunk in _batches(images, _check_batch_size(batch_size)):
        per_block = [
            attention_distance(weights, grid, spacing, prefix).sum(axis=0)
            for weights in _block_attention(layout, chunk)
        ]
        total = total + np.stack(per_block)
    return total / len(images)


def position_embedding_similarity(model: keras.Model) -> np.ndarray:
    """Cosine similarity of every patch's position embedding with every other's, on the grid.

    Returns `(rows, columns, rows, columns)` (float32): `[i, j]` is the similarity map of the
    patch at row `i`, column `j` with all patches (paper Figure 7 centre). The [class]
    embedding is left out. The matrix is symmetric with a unit diagonal.
    """
    pos_embed = _layout(model).pos_embed
    rows, columns = pos_embed.grid_size
    embedding = ops.convert_to_numpy(pos_embed.embedding).astype("float64")[0, pos_embed.num_prefix_tokens :]
    unit = embedding / np.maximum(np.linalg.norm(embedding, axis=-1, keepdims=True), np.finfo("float64").tiny)
    return (unit @ unit.T).reshape(rows, columns, rows, columns).astype("float32")


def embedding_filters(model: keras.Model, n_components: int = 28) -> np.ndarray:
    """The top `n_components` principal components of the patch-embedding filters, as images.

    The `hidden_size` filters of `patch_embed` (each `P x P x C`) are centred and decomposed
    (SVD, as `sklearn.decomposition.PCA`): returns `(n_components, P, P, C)` float32, in
    decreasing order of explained variance, orthonormal when flattened, each with its largest
    entry positive (paper Figure 7 left shows 28). Hybrids are refused: their patch embedding
    sees ResNet features, not pixels.
    """
    layout = _layout(model)
    if layout.stem is not None:
        raise ValueError(
            f"Model {model.name!r} is a hybrid: its patch embedding filters ResNet features, not "
            "pixels, so they are no images; use a plain ViT (e.g. vit_b16)."
        )
    kernel = ops.convert_to_numpy(layout.chain[0].projection.kernel).astype("float64")
    patch_h, patch_w, channels, filters = kernel.shape
    flat = kernel.reshape(-1, filters).T
    most = min(filters - 1, flat.shape[1])
    if not isinstance(n_components, (int, np.integer)) or not 1 <= n_components <= most:
        raise ValueError(
            f"n_components must be an int in [1, {most}] for {filters} filters of "
            f"{patch_h}x{patch_w}x{channels}, got {n_components!r}."
        )
    # TensorFlow's SVD: NumPy's OpenBLAS one can stall for seconds next to TF's thread pools.
    _, _, components = ops.svd(ops.convert_to_tensor(flat - flat.mean(axis=0)), full_matrices=False)
    components = ops.convert_to_numpy(components)[:n_components]
    signs = np.sign(components[np.arange(n_components), np.abs(components).argmax(axis=1)])
    components *= signs[:, None]
    return components.reshape(n_components, patch_h, patch_w, channels).astype("float32")

"""2-D resampling of position embeddings, numerically identical to each reference's own.

TensorFlow's bicubic kernel uses a = -0.5 where PyTorch's uses a = -0.75, and TF has no
antialiased upsampling that matches PyTorch's, so the interpolation is written here as two
separable 1-D weight matrices (rows = output pixels) that reproduce PyTorch's `F.interpolate`
exactly (timm, transformers), and, with `method="zoom"`, `scipy.ndimage.zoom(grid, zoom,
order=1)`: the original code's resampling (vision_transformer `checkpoint.py`
`load_pretrained`, big_vision `resample_posemb`), linear with corner-aligned sampling, i.e.
output pixel `o` reads input position `o * (n_in - 1) / (n_out - 1)`.

`POS_EMBED_INTERPOLATIONS` names each reference's recipe, for the loaders' `pos_embed_interpolation`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["POS_EMBED_INTERPOLATIONS", "resize_pos_embed", "interpolation_matrix"]

_METHODS = ("bicubic", "bilinear", "zoom")
# A reference's resampling -> `resize_pos_embed(method=..., antialias=...)`.
POS_EMBED_INTERPOLATIONS: dict[str, dict] = {
    # the original code: scipy.ndimage.zoom(order=1) (vision_transformer and big_vision)
    "jax": {"method": "zoom", "antialias": False},
    # timm's `resample_abs_pos_embed` defaults, as its `checkpoint_filter_fn` loads checkpoints
    "timm": {"method": "bicubic", "antialias": True},
    # transformers' `interpolate_pos_encoding`
    "hf": {"method": "bicubic", "antialias": False},
}


def _cubic(x: np.ndarray, a: float) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _triangle(x: np.ndarray) -> np.ndarray:
    return np.clip(1.0 - np.abs(x), 0.0, None)


def _plain_matrix(size_in: int, size_out: int, method: str) -> np.ndarray:
    """PyTorch `upsample_{bilinear,bicubic}2d` with align_corners=False, antialias=False."""
    scale = size_in / size_out
    src = scale * (np.arange(size_out) + 0.5) - 0.5
    matrix = np.zeros((size_out, size_in))
    rows = np.arange(size_out)
    if method == "bilinear":
        src = np.maximum(src, 0.0)
        low = np.floor(src).astype(int)
        frac = src - low
        high = np.minimum(low + 1, size_in - 1)
        np.add.at(matrix, (rows, low), 1.0 - frac)
        np.add.at(matrix, (rows, high), frac)
        return matrix
    low = np.floor(src).astype(int)
    frac = src - low
    for offset in range(-1, 3):  # the four taps, clamped to the border as PyTorch does
        weight = _cubic(frac - offset, a=-0.75)
        np.add.at(matrix, (rows, np.clip(low + offset, 0, size_in - 1)), weight)
    return matrix


def _zoom_matrix(size_in: int, size_out: int) -> np.ndarray:
    """`scipy.ndimage.zoom(order=1)` along one axis: corner-aligned linear interpolation.

    scipy samples input position `o * (size_in - 1) / (size_out - 1)` (position 0 for one
    output pixel); the positions stay inside the input, so its boundary mode never applies.
    """
    step = (size_in - 1) / (size_out - 1) if size_out > 1 else 0.0
    src = np.arange(size_out) * step
    low = np.minimum(np.floor(src).astype(int), size_in - 1)
    frac = src - low
    high = np.minimum(low + 1, size_in - 1)
    matrix = np.zeros((size_out, size_in))
    rows = np.arange(size_out)
    np.add.at(matrix, (rows, low), 1.0 - frac)
    np.add.at(matrix, (rows, high), frac)
    return matrix


def _antialiased_matrix(size_in: int, size_out: int, method: str) -> np.ndarray:
    """PyTorch's antialiased kernel (PIL's algorithm): a stretched, renormalised filter."""
    scale = size_in / size_out
    half_width = 2.0 if method == "bicubic" else 1.0
    stretch = max(scale, 1.0)
    support = half_width * stretch
    matrix = np.zeros((size_out, size_in))
    for row in range(size_out):
        center = scale * (row + 0.5)
        start = max(int(center - support + 0.5), 0)
        stop = min(int(center + support + 0.5), size_in)
        taps = (np.arange(start, stop) - center + 0.5) / stretch
        weights = _cubic(taps, a=-0.5) if method == "bicubic" else _triangle(taps)
        total = weights.sum()
        matrix[row, start:stop] = weights / total if total != 0 else weights
    return matrix


def interpolation_matrix(
    size_in: int, size_out: int, method: str = "bicubic", antialias: bool = True
) -> np.ndarray:
    """The (size_out, size_in) matrix that resamples one axis like `torch.nn.functional.interpolate`.

    `method="zoom"` is `scipy.ndimage.zoom(order=1)` instead (`antialias` does not apply).
    """
    if method not in _METHODS:
        raise ValueError(f"Unknown interpolation method {method!r}; use one of {_METHODS}.")
    if method == "zoom":
        return _zoom_matrix(size_in, size_out)
    if antialias:
        return _antialiased_matrix(size_in, size_out, method)
    return _plain_matrix(size_in, size_out, method)


def _as_grid(grid: int | Sequence[int], what: str) -> tuple[int, int]:
    if isinstance(grid, int):
        return grid, grid
    grid = tuple(int(g) for g in grid)
    if len(grid) != 2 or min(grid) < 1:
        raise ValueError(f"{what} must be an int or a (height, width) pair of positive ints, got {grid}.")
    return grid


def resize_pos_embed(
    pos_embed,
    new_grid: int | Sequence[int],
    num_prefix_tokens: int = 1,
    old_grid: int | Sequence[int] | None = None,
    method: str = "bicubic",
    antialias: bool = True,
) -> np.ndarray:
    """Resample a ViT position embedding to a new patch grid.

    The patch part of `pos_embed` (shape `(1, prefix + h*w, D)` or `(prefix + h*w, D)`) is
    viewed as an `h x w` image with `D` channels and interpolated to `new_grid` (an int or
    `(height, width)`); the `num_prefix_tokens` leading tokens ([class] token) are kept as
    they are. The old grid is taken as square unless `old_grid` is given. With the defaults
    (bicubic, antialias) the result equals timm's `resample_abs_pos_embed`; Hugging Face's
    `interpolate_pos_encoding` is `method="bicubic", antialias=False`; `method="zoom"` is the
    original code's `scipy.ndimage.zoom(grid, (new_h / old_h, new_w / old_w, 1), order=1)`
    (any grid; the original code resizes square ones). Computed in float64, returned in the
    input's dtype.
    """
    array = np.asarray(pos_embed)
    squeeze = array.ndim == 2
    if squeeze:
        array = array[None]
    if array.ndim != 3 or array.shape[0] != 1:
        raise ValueError(
            f"pos_embed must have shape (1, tokens, dim) or (tokens, dim), got {np.shape(pos_embed)}."
        )
    num_patches = array.shape[1] - num_prefix_tokens
    if old_grid is None:
        side = math.isqrt(max(num_patches, 0))
        if side * side != num_patches:
            raise ValueError(
                f"Cannot infer the grid of a position embedding with {num_patches} patch tokens "
                f"({array.shape[1]} tokens, {num_prefix_tokens} prefix): pass old_grid=(height, width)."
            )
        old_grid = (side, side)
    old_h, old_w = _as_grid(old_grid, "old_grid")
    new_h, new_w = _as_grid(new_grid, "new_grid")
    if old_h * old_w != num_patches:
        raise ValueError(
            f"old_grid {old_h}x{old_w} has {old_h * old_w} patches but pos_embed has {num_patches}."
        )
    prefix, patches = array[:, :num_prefix_tokens], array[0, num_prefix_tokens:]
    if (old_h, old_w) != (new_h, new_w):
        grid = patches.astype(np.float64).reshape(old_h, old_w, -1)
        rows = interpolation_matrix(old_h, new_h, method, antialias)
        cols = interpolation_matrix(old_w, new_w, method, antialias)
        grid = np.einsum("ih,hwd,jw->ijd", rows, grid, cols)
        patches = grid.reshape(new_h * new_w, -1).astype(array.dtype)
    result = np.concatenate([prefix, patches[None]], axis=1)
    return result[0] if squeeze else result

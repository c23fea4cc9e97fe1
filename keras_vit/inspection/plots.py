"""Pictures of `keras_vit.inspection.analysis`'s results, as in the paper's Figures 6 and 7, written to PNG.

Needs matplotlib (the `plots` extra: `pip install -e ".[plots]"` in a checkout), imported only when a
plot is drawn. Figures are drawn on matplotlib's Agg canvas directly (no `pyplot`, no global
backend switch, no open windows), so plotting works headless and from threads. Each `plot_*`
function returns the `matplotlib.figure.Figure` and, given `path`, also writes it as a PNG.
`write_inspection` writes all four pictures for one image and model.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import keras
import numpy as np

from keras_vit.inspection import analysis as vit_inspect
from keras_vit.utils.environment import install_hint
from keras_vit.utils.files import replace_file

__all__ = [
    "DEFAULT_DPI",
    "FIGURE_NAMES",
    "plot_attention_rollout",
    "plot_embedding_filters",
    "plot_mean_attention_distance",
    "plot_position_embedding_similarity",
    "write_inspection",
]

FIGURE_NAMES = (
    "attention_rollout",
    "attention_distance",
    "position_embedding_similarity",
    "embedding_filters",
)
DEFAULT_DPI = 100


def _figure(width: float, height: float):
    """A Figure on its own Agg canvas (matplotlib imported here, lazily)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            f"keras_vit's plots need matplotlib: {install_hint('plots')} (or pip install matplotlib)."
        ) from None
    figure = Figure(figsize=(width, height), dpi=DEFAULT_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _finish(figure, path: str | os.PathLike | None, title: str | None, dpi: float):
    if title:
        figure.suptitle(title, fontsize="medium")
    if isinstance(path, (str, os.PathLike)):  # a file of its own, never written through a link there
        replace_file(path, lambda staging: figure.savefig(staging, dpi=dpi))
    elif path is not None:  # a file object
        figure.savefig(path, dpi=dpi)
    return figure


def plot_attention_rollout(
    image,
    heatmap,
    path: str | os.PathLike | None = None,
    *,
    title: str | None = None,
    dpi: float = DEFAULT_DPI,
):
    """The input, the rollout map over it, and the image weighted by the map (paper Figure 6).

    `image`: `(H, W, 3)` or `(H, W)` pixels in [0, 255]; `heatmap`: `(H, W)` in [0, 1], one map
    of `keras_vit.inspection.analysis.attention_rollout`.
    """
    image = np.asarray(image, dtype="float32") / 255.0
    heatmap = np.asarray(heatmap, dtype="float32")
    if heatmap.ndim != 2 or image.shape[:2] != heatmap.shape:
        raise ValueError(
            f"heatmap must be (H, W) like the image's {image.shape[:2]}, got {heatmap.shape}: pass one "
            "map of attention_rollout(model, images) with the image the model saw."
        )
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=-1)
    figure = _figure(8.0, 2.9)
    axes = figure.subplots(1, 3)
    axes[0].imshow(np.clip(image, 0, 1))
    axes[0].set_title("input")
    axes[1].imshow(np.clip(image, 0, 1))
    overlay = axes[1].imshow(heatmap, cmap="jet", alpha=0.5, vmin=0.0, vmax=1.0)
    axes[1].set_title("attention rollout")
    axes[2].imshow(np.clip(image * heatmap[..., None], 0, 1))
    axes[2].set_title("image x attention")
    for axis in axes:
        axis.set_axis_off()
    figure.colorbar(overlay, ax=axes, shrink=0.8)
    return _finish(figure, path, title, dpi)


def plot_mean_attention_distance(
    distances,
    path: str | os.PathLike | None = None,
    *,
    reference: float | None = None,
    title: str | None = None,
    dpi: float = DEFAULT_DPI,
):
    """One dot per head at each depth (paper Figure 7 right).

    `distances`: `(layers, heads)` from `keras_vit.inspection.analysis.mean_attention_distance`;
    `reference`: an optional dashed line, e.g. `uniform_attention_distance(...)`.
    """
    distances = np.asarray(distances, dtype="float64")
    if distances.ndim != 2:
        raise ValueError(f"distances must be (layers, heads), got shape {distances.shape}.")
    layers, heads = distances.shape
    figure = _figure(6.0, 3.8)
    axis = figure.subplots()
    from matplotlib import colormaps

    palette = colormaps["tab20"]
    depth = np.arange(1, layers + 1)
    for head in range(heads):
        axis.scatter(depth, distances[:, head], s=14, color=palette(head % 20), label=f"head {head + 1}")
    if reference is not None:
        axis.axhline(reference, color="grey", linestyle="--", linewidth=1, label="uniform attention")
    axis.set_xlabel("network depth (layer)")
    axis.set_ylabel("mean attention distance (pixels)")
    axis.set_xticks(depth if layers <= 16 else depth[:: max(1, layers // 8)])
    axis.set_ylim(bottom=0)
    if heads <= 16:
        figure.legend(fontsize="x-small", loc="outside right center")
    return _finish(figure, path, title, dpi)


def plot_position_embedding_similarity(
    similarity,
    path: str | os.PathLike | None = None,
    *,
    title: str | None = None,
    dpi: float = DEFAULT_DPI,
):
    """One tile per patch: its position embedding's cosine similarity with all patches (Figure 7 centre).

    `similarity`: `(rows, columns, rows, columns)` from
    `keras_vit.inspection.analysis.position_embedding_similarity`.
    """
    similarity = np.asarray(similarity, dtype="float32")
    if similarity.ndim != 4 or similarity.shape[:2] != similarity.shape[2:]:
        raise ValueError(f"similarity must be (rows, columns, rows, columns), got shape {similarity.shape}.")
    rows, columns = similarity.shape[:2]
    mosaic = np.full((rows * (rows + 1) - 1, columns * (columns + 1) - 1), np.nan, dtype="float32")
    for row in range(rows):
        for column in range(columns):
            top, left = row * (rows + 1), column * (columns + 1)
            mosaic[top : top + rows, left : left + columns] = similarity[row, column]
    figure = _figure(5.2, 4.4 * rows / columns + 0.4)
    axis = figure.subplots()
    shown = axis.imshow(mosaic, cmap="viridis", vmin=-1.0, vmax=1.0, interpolation="nearest")
    centres = np.arange(columns) * (columns + 1) + (columns - 1) / 2
    axis.set_xticks(centres, [str(c + 1) for c in range(columns)], fontsize="x-small")
    centres = np.arange(rows) * (rows + 1) + (rows - 1) / 2
    axis.set_yticks(centres, [str(r + 1) for r in range(rows)], fontsize="x-small")
    axis.set_xlabel("input patch column")
    axis.set_ylabel("input patch row")
    axis.tick_params(length=0)
    for spine in axis.spines.values():
        spine.set_visible(False)
    figure.colorbar(shown, ax=axis, shrink=0.8, label="cosine similarity")
    return _finish(figure, path, title, dpi)


def plot_embedding_filters(
    components,
    path: str | os.PathLike | None = None,
    *,
    columns: int = 7,
    title: str | None = None,
    dpi: float = DEFAULT_DPI,
):
    """The principal components of the patch-embedding filters as images (Figure 7 left).

    `components`: `(n, P, P, C)` from `keras_vit.inspection.analysis.embedding_filters`, C = 3 (shown as
    RGB) or 1 (grey); each is min-max scaled to [0, 1] for display. They are laid out in rows
    of `columns`, first component top left, in one image (white gaps between filters).
    """
    components = np.asarray(components, dtype="float32")
    if components.ndim != 4 or components.shape[-1] not in (1, 3):
        raise ValueError(f"components must be (n, P, P, 1 or 3) images, got shape {components.shape}.")
    count, patch_h, patch_w, _ = components.shape
    columns = max(1, min(int(columns), count))
    rows = -(-count // columns)
    low = components.min(axis=(1, 2, 3), keepdims=True)
    span = np.maximum(components.max(axis=(1, 2, 3), keepdims=True) - low, 1e-12)
    scaled = np.broadcast_to((components - low) / span, (count, patch_h, patch_w, 3))
    gap_h, gap_w = max(1, patch_h // 4), max(1, patch_w // 4)
    mosaic = np.ones((rows * (patch_h + gap_h) - gap_h, columns * (patch_w + gap_w) - gap_w, 3), "float32")
    for index in range(count):
        row, column = divmod(index, columns)
        top, left = row * (patch_h + gap_h), column * (patch_w + gap_w)
        mosaic[top : top + patch_h, left : left + patch_w] = scaled[index]
    figure = _figure(1.0 * columns + 0.2, 1.0 * rows + 0.5)
    axis = figure.subplots()
    axis.imshow(mosaic, interpolation="nearest")
    axis.set_axis_off()
    return _finish(figure, path, title, dpi)


def write_inspection(
    model: keras.Model,
    image,
    out_dir: str | os.PathLike,
    *,
    discard_ratio: float = 0.0,
    head_fusion: str = "mean",
    label: str | None = None,
    dpi: float = DEFAULT_DPI,
) -> dict[str, Path]:
    """Write the four pictures of `image` seen by `model` to `out_dir` (created if needed).

    `image`: a file path, PIL image or `(H, W, 3)` uint8 array at any size; it is resized and
    cropped as the model's checkpoint is evaluated (`keras_vit.load_image`) and normalised
    (`keras_vit.preprocess_input`). Writes `<name>.png` for each of `FIGURE_NAMES` and returns
    `{name: path}`; for a hybrid model the embedding filters are skipped with a warning (its
    patch embedding filters ResNet features). `label` (default: the model's name) heads every
    picture; `discard_ratio` and `head_fusion` go to `attention_rollout`; `dpi` is the PNGs'
    resolution.
    """
    from keras_vit.data.preprocessing import Preprocessing, load_image, preprocess_input

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    label = label or model.name
    spec = Preprocessing.for_model(model)
    height, width = spec.image_size
    pixels = load_image(image, spec)
    inputs = preprocess_input(pixels[None], spec)
    grid = vit_inspect.token_grid(model)
    spacing = (height / grid[0], width / grid[1])
    paths = {name: out_dir / f"{name}.png" for name in FIGURE_NAMES}

    heatmap = vit_inspect.attention_rollout(model, inputs, discard_ratio, head_fusion)[0]
    plot_attention_rollout(pixels, heatmap, paths["attention_rollout"], title=label, dpi=dpi)
    plot_mean_attention_distance(
        vit_inspect.mean_attention_distance(model, inputs),
        paths["attention_distance"],
        reference=vit_inspect.uniform_attention_distance(grid, spacing),
        title=f"{label}: mean attention distance (1 image)",
        dpi=dpi,
    )
    plot_position_embedding_similarity(
        vit_inspect.position_embedding_similarity(model),
        paths["position_embedding_similarity"],
        title=f"{label}: position embedding similarity",
        dpi=dpi,
    )
    patch_h, patch_w, channels, filters = model.get_layer("patch_embed").projection.kernel.shape
    try:
        components = vit_inspect.embedding_filters(model, min(28, filters - 1, patch_h * patch_w * channels))
    except ValueError as error:
        warnings.warn(f"embedding_filters.png skipped: {error}", stacklevel=2)
        del paths["embedding_filters"]
    else:
        plot_embedding_filters(
            components, paths["embedding_filters"], title=f"{label}: embedding filters (PCA)", dpi=dpi
        )
    return paths

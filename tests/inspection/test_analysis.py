"""keras_vit.inspection (analysis, plots): attention weights, rollout, attention distance,
position-embedding similarity, embedding filters, their pictures and `keras-vit inspect`."""

import itertools
import math
import os
import runpy
from pathlib import Path

import keras
import numpy as np
import pytest
from helpers import REPO, random_images

import keras_vit
from keras_vit.inspection import analysis as vit_inspect
from keras_vit.inspection import plots

TINY = keras_vit.ViTConfig("vit_tiny_test", patch_size=8, hidden_size=32, depth=2, num_heads=2, mlp_dim=64)
# Hybrid: BiT root block (stride 4), then 2x2 patches of the feature map: 8 px per token.
TINY_HYBRID = keras_vit.ViTConfig(
    "vit_tiny_hybrid_test", patch_size=2, hidden_size=32, depth=2, num_heads=2, mlp_dim=64, resnet_stages=()
)


def _randomise(model, seed=0):
    """Random weights everywhere (biases, norms, class token included) so no term is trivially 0 or 1."""
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0.0, 0.3, w.shape).astype("float32") for w in model.get_weights()])
    return model


@pytest.fixture(scope="module")
def tiny():
    """A plain tiny ViT on a non-square 24x40 input: a 3x5 patch grid, 16 tokens."""
    keras.utils.set_random_seed(0)
    return _randomise(keras_vit.build_vit(TINY, image_size=(24, 40), num_classes=3))


@pytest.fixture(scope="module")
def hybrid():
    keras.utils.set_random_seed(0)
    model = keras_vit.build_vit(TINY_HYBRID, image_size=32, num_classes=3)
    return _randomise(model, seed=2)


def _hand_attention(model, block_name, images):
    """Softmax(q k^T / sqrt(d)) from the block's own LayerNorm and query/key kernels, in NumPy.

    The block input comes from the model's fused (no-scores) path, so equality also shows that
    the walk with `return_attention_scores=True` reproduces every earlier block's output.
    """
    block = model.get_layer(block_name)
    tokens = keras.ops.convert_to_numpy(keras.Model(model.input, block.input)(images)).astype("float64")
    gamma, beta = (w.astype("float64") for w in block.norm1.get_weights())
    mean = tokens.mean(-1, keepdims=True)
    var = tokens.var(-1, keepdims=True)
    normed = (tokens - mean) / np.sqrt(var + block.norm1.epsilon) * gamma + beta
    attention = block.attention
    wq, bq = (w.astype("float64") for w in attention.query_dense.get_weights())
    wk, bk = (w.astype("float64") for w in attention.key_dense.get_weights())
    query = np.einsum("btd,dhk->bhtk", normed, wq) + bq[None, :, None, :]
    key = np.einsum("btd,dhk->bhtk", normed, wk) + bk[None, :, None, :]
    logits = query @ key.transpose(0, 1, 3, 2) / math.sqrt(wq.shape[-1])
    logits -= logits.max(-1, keepdims=True)
    weights = np.exp(logits)
    return weights / weights.sum(-1, keepdims=True)


# ---- attention weights ------------------------------------------------------------------------


def test_attention_weights_shapes_and_rows_sum_to_one(tiny):
    images = random_images(3, (24, 40), seed=1)
    weights = vit_inspect.attention_weights(tiny, images, batch_size=2)  # 2 batches: 2 + 1
    assert len(weights) == TINY.depth
    for block in weights:
        assert block.shape == (3, TINY.num_heads, 16, 16)
        assert block.dtype == np.float32
        assert np.all(block >= 0)
        np.testing.assert_allclose(block.sum(-1), 1.0, atol=1e-5)
    assert vit_inspect.token_grid(tiny) == (3, 5)


@pytest.mark.parametrize("block_index", range(TINY.depth))
def test_attention_weights_equal_hand_computation(tiny, block_index):
    images = random_images(2, (24, 40), seed=1)
    expected = _hand_attention(tiny, f"block_{block_index}", images)
    weights = vit_inspect.attention_weights(tiny, images)[block_index]
    np.testing.assert_allclose(weights, expected, atol=2e-5)
    # The heads really differ: a comparison that ignores the head axis would not pass this.
    assert np.abs(expected[:, 0] - expected[:, 1]).max() > 1e-2


def test_hybrid_attention_weights_equal_hand_computation(hybrid):
    images = random_images(2, (32, 32), seed=1)
    weights = vit_inspect.attention_weights(hybrid, images)
    assert [w.shape for w in weights] == [(2, 2, 17, 17)] * TINY_HYBRID.depth
    assert vit_inspect.token_grid(hybrid) == (4, 4)
    np.testing.assert_allclose(weights[-1], _hand_attention(hybrid, "block_1", images), atol=2e-5)


def test_attention_weights_refuse_wrong_inputs(tiny):
    with pytest.raises(ValueError, match="image_size"):
        vit_inspect.attention_weights(tiny, random_images(1, (32, 32), seed=1))
    with pytest.raises(ValueError, match="batch axis"):
        vit_inspect.attention_weights(tiny, random_images(1, (24, 40), seed=1)[0])
    with pytest.raises(ValueError, match="batch_size"):
        vit_inspect.attention_weights(tiny, random_images(1, (24, 40), seed=1), batch_size=0)
    not_a_vit = keras.Sequential([keras.Input((24, 40, 3)), keras.layers.Flatten()])
    with pytest.raises(ValueError, match="not a keras_vit.ViT"):
        vit_inspect.attention_weights(not_a_vit, random_images(1, (24, 40), seed=1))


def test_inspecting_leaves_the_model_unchanged(tiny, hybrid):
    for model, size in ((tiny, (24, 40)), (hybrid, (32, 32))):
        images = random_images(1, size, seed=1)
        before = keras.ops.convert_to_numpy(model(images))
        vit_inspect.attention_rollout(model, images)
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(model(images)), before)
        for layer in model.layers:  # the walk calls layers eagerly: no new graph nodes
            assert len(layer._inbound_nodes) <= 1, layer.name


# ---- rollout ----------------------------------------------------------------------------------


def _random_attention(rng, batch=2, heads=3, tokens=5, blocks=3):
    logits = rng.normal(0, 2, (blocks, batch, heads, tokens, tokens))
    weights = np.exp(logits)
    return list(weights / weights.sum(-1, keepdims=True))


def test_rollout_of_one_block_is_the_mixed_head_average(rng):
    (weights,) = _random_attention(rng, blocks=1)
    expected = (weights.mean(1) + np.eye(5)) / 2  # rows of W and I both sum to 1: already normalised
    np.testing.assert_allclose(vit_inspect.rollout([weights]), expected, atol=1e-12)


def test_rollout_multiplies_blocks_later_on_the_left(rng):
    first, second = _random_attention(rng, blocks=2)
    mixed = [(w.max(1) + np.eye(5)) / (w.max(1) + np.eye(5)).sum(-1, keepdims=True) for w in (first, second)]
    np.testing.assert_allclose(
        vit_inspect.rollout([first, second], head_fusion="max"), mixed[1] @ mixed[0], atol=1e-12
    )


@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("discard_ratio", [0.0, 0.5, 0.9])
def test_rollout_rows_are_distributions(rng, head_fusion, discard_ratio):
    rolled = vit_inspect.rollout(_random_attention(rng), discard_ratio, head_fusion)
    assert rolled.shape == (2, 5, 5)
    assert np.all(rolled >= 0)
    np.testing.assert_allclose(rolled.sum(-1), 1.0, atol=1e-12)


def test_rollout_discards_the_smallest_weights_but_keeps_class_self_attention():
    weights = np.full((1, 1, 2, 2), 0.5)
    weights[0, 0, 0] = [0.1, 0.9]  # the [class] token's self-weight is the smallest
    weights[0, 0, 1] = [0.3, 0.7]
    rolled = vit_inspect.rollout([weights], discard_ratio=0.5)  # drops 2 of 4: 0.1 (kept) and 0.3
    fused = np.array([[0.1, 0.9], [0.0, 0.7]]) + np.eye(2)
    np.testing.assert_allclose(rolled[0], fused / fused.sum(-1, keepdims=True), atol=1e-12)


def test_rollout_rejects_bad_arguments(rng):
    weights = _random_attention(rng)
    with pytest.raises(ValueError, match="head_fusion"):
        vit_inspect.rollout(weights, head_fusion="median")
    with pytest.raises(ValueError, match="discard_ratio"):
        vit_inspect.rollout(weights, discard_ratio=1.0)
    with pytest.raises(ValueError, match="at least one block"):
        vit_inspect.rollout([])


def test_attention_rollout_maps_are_normalised_at_input_resolution(tiny, hybrid):
    for model, size in ((tiny, (24, 40)), (hybrid, (32, 32))):
        images = random_images(3, size, seed=1)
        maps = vit_inspect.attention_rollout(model, images, discard_ratio=0.5, batch_size=2)
        assert maps.shape == (3, *size)
        assert np.all(maps >= 0)
        np.testing.assert_allclose(maps.max(axis=(1, 2)), 1.0, rtol=1e-6)
        assert np.all(maps.min(axis=(1, 2)) < 0.999)  # a real map, not a constant


def _smooth(values, axis):
    """The [1/8, 3/4, 1/8] filter (edges repeated) along `axis`."""
    padded = np.concatenate([np.take(values, [0], axis), values, np.take(values, [-1], axis)], axis)
    size = values.shape[axis]
    return sum(
        weight * np.take(padded, np.arange(shift, shift + size), axis)
        for shift, weight in enumerate((0.125, 0.75, 0.125))
    )


def test_attention_rollout_maps_are_the_upsampled_class_row(tiny):
    images = random_images(1, (24, 40), seed=1)
    rolled = vit_inspect.rollout(vit_inspect.attention_weights(tiny, images))
    class_row = rolled[0, 0, 1:].reshape(3, 5)  # the [class] token's row, patch tokens only
    heatmap = vit_inspect.attention_rollout(tiny, images)[0]
    # Bilinear upsampling by 8 (half-pixel centres, edges clamped): each 8x8 block of pixels
    # averages to its patch's value smoothed by [1/8, 3/4, 1/8] along rows and columns.
    block_means = heatmap.reshape(3, 8, 5, 8).mean(axis=(1, 3))
    expected = _smooth(_smooth(class_row, 0), 1)
    np.testing.assert_allclose(block_means / block_means.max(), expected / expected.max(), rtol=1e-5)


# ---- attention distance -----------------------------------------------------------------------


def _brute_force_mean_distance(rows, columns, step_y, step_x):
    centres = [(r * step_y, c * step_x) for r in range(rows) for c in range(columns)]
    pairs = list(itertools.product(centres, repeat=2))
    return sum(math.dist(a, b) for a, b in pairs) / len(pairs)


def test_uniform_attention_distance_is_the_grid_mean():
    # 2x2 grid, spacing s: from each centre the distances are 0, s, s and s*sqrt(2).
    assert vit_inspect.uniform_attention_distance((2, 2), 16) == pytest.approx(16 * (2 + math.sqrt(2)) / 4)
    expected = _brute_force_mean_distance(3, 5, 8.0, 12.0)
    assert vit_inspect.uniform_attention_distance((3, 5), (8.0, 12.0)) == pytest.approx(expected, rel=1e-12)


def test_attention_distance_of_synthetic_heads():
    rows, columns, prefix = 3, 4, 1
    tokens = prefix + rows * columns
    uniform = np.full((tokens, tokens), 1.0 / tokens)  # includes weight on [class]: renormalised away
    identity = np.eye(tokens)
    right = np.zeros((tokens, tokens))  # every patch looks at its right neighbour (the last column at itself)
    for index in range(rows * columns):
        row, column = divmod(index, columns)
        right[prefix + index, prefix + row * columns + min(column + 1, columns - 1)] = 1.0
    right[0, 0] = 1.0
    attention = np.stack([uniform, identity, right])[None]  # (1, 3 heads, T, T)
    distances = vit_inspect.attention_distance(attention, (rows, columns), 10.0, prefix)
    assert distances.shape == (1, 3)
    assert distances[0, 0] == pytest.approx(_brute_force_mean_distance(rows, columns, 10.0, 10.0))
    assert distances[0, 1] == 0.0
    assert distances[0, 2] == pytest.approx(10.0 * (columns - 1) / columns)
    with pytest.raises(ValueError, match="grid"):
        vit_inspect.attention_distance(attention, (4, 4), 10.0)


def test_mean_attention_distance_of_a_uniform_head_is_analytic(tiny):
    model = tiny.rebuild()  # a copy: same config, same weights
    attention = model.blocks[1].attention
    for dense in (attention.query_dense, attention.key_dense):  # q.k = 0: uniform attention
        dense.set_weights([np.zeros_like(w) for w in dense.get_weights()])
    distances = vit_inspect.mean_attention_distance(model, random_images(3, (24, 40), seed=1), batch_size=2)
    assert distances.shape == (TINY.depth, TINY.num_heads)
    expected = _brute_force_mean_distance(3, 5, 8.0, 8.0)
    np.testing.assert_allclose(distances[1], expected, rtol=1e-5)
    assert np.all(np.abs(distances[0] - expected) > 1e-3)  # the random block is not uniform
    assert np.all(distances[0] <= math.hypot(2 * 8, 4 * 8))


def test_mean_attention_distance_averages_images(tiny):
    images = random_images(3, (24, 40), seed=1)
    weights = vit_inspect.attention_weights(tiny, images)
    expected = [vit_inspect.attention_distance(w, (3, 5), 8.0).mean(0) for w in weights]
    np.testing.assert_allclose(
        vit_inspect.mean_attention_distance(tiny, images, batch_size=2), expected, rtol=1e-5
    )


def test_hybrid_attention_distance_counts_pixels_not_feature_cells(hybrid):
    weights = vit_inspect.attention_weights(hybrid, random_images(1, (32, 32), seed=1))
    expected = vit_inspect.attention_distance(weights[0], (4, 4), 8.0).mean(0)  # 32 px / 4 tokens
    np.testing.assert_allclose(
        vit_inspect.mean_attention_distance(hybrid, random_images(1, (32, 32), seed=1))[0],
        expected,
        rtol=1e-5,
    )


# ---- position embeddings and filters ----------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny", "hybrid"])
def test_position_embedding_similarity(fixture, request):
    model = request.getfixturevalue(fixture)
    similarity = vit_inspect.position_embedding_similarity(model)
    rows, columns = vit_inspect.token_grid(model)
    assert similarity.shape == (rows, columns, rows, columns)
    matrix = similarity.reshape(rows * columns, rows * columns)
    np.testing.assert_allclose(np.diag(matrix), 1.0, atol=1e-6)
    np.testing.assert_allclose(matrix, matrix.T, atol=1e-6)
    assert np.all(np.abs(matrix) <= 1 + 1e-6)
    embedding = model.get_layer("pos_embed").get_weights()[0][0, 1:]  # the [class] row left out
    a, b = embedding[1], embedding[columns + 2]  # patch (0, 1) and patch (1, 2)
    cosine = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
    assert similarity[0, 1, 1, 2] == pytest.approx(cosine, abs=1e-6)


def test_embedding_filters_are_orthonormal_principal_components(tiny):
    from sklearn.decomposition import PCA

    components = vit_inspect.embedding_filters(tiny, n_components=6)
    assert components.shape == (6, 8, 8, 3)
    flat = components.reshape(6, -1).astype("float64")
    np.testing.assert_allclose(flat @ flat.T, np.eye(6), atol=1e-5)
    kernel = tiny.get_layer("patch_embed").projection.get_weights()[0]
    reference = PCA(n_components=6, svd_solver="full").fit(kernel.reshape(-1, 32).T).components_
    np.testing.assert_allclose(np.abs(np.sum(flat * reference, axis=1)), 1.0, atol=1e-5)  # same up to sign
    assert np.all(flat[np.arange(6), np.abs(flat).argmax(1)] > 0)


def test_embedding_filters_reject_bad_requests(tiny, hybrid):
    with pytest.raises(ValueError, match=r"\[1, 31\]"):  # 32 filters, centred: rank 31
        vit_inspect.embedding_filters(tiny, n_components=32)
    with pytest.raises(ValueError, match="hybrid"):
        vit_inspect.embedding_filters(hybrid)


# ---- pictures, command line, example ----------------------------------------------------------


@pytest.fixture
def tiny_factory(monkeypatch):
    """`keras_vit.create_model` (and the CLI's, `keras_vit.models.build.create_model`) replaced by a tiny
    random model; records what it was asked for."""
    calls = []

    def create_model(variant, pretrained=False, **kwargs):
        calls.append((variant, pretrained))
        return keras_vit.build_vit(TINY, image_size=(24, 40), num_classes=3, name=variant)

    monkeypatch.setattr(keras_vit, "create_model", create_model)
    monkeypatch.setattr("keras_vit.models.build.create_model", create_model)
    return calls


def _check_png(path: Path, max_bytes: int | None = None):
    from PIL import Image

    if max_bytes is not None:
        assert path.stat().st_size < max_bytes, path
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"), dtype="float32")
    assert pixels.shape[0] >= 150 and pixels.shape[1] >= 200, path
    assert pixels.std() > 10, path  # drawn, not a blank canvas


def test_write_inspection_draws_four_pictures(tiny, tmp_path):
    from skimage import data

    written = plots.write_inspection(tiny, data.chelsea(), tmp_path / "out", label="tiny test")
    assert list(written) == list(plots.FIGURE_NAMES)
    for path in written.values():
        _check_png(path)


def test_write_inspection_of_a_hybrid_skips_the_filters(hybrid, tmp_path):
    image = (np.random.default_rng(0).uniform(0, 255, (50, 60, 3))).astype("uint8")
    with pytest.warns(UserWarning, match="embedding_filters.png skipped"):
        written = plots.write_inspection(hybrid, image, tmp_path)
    assert set(written) == set(plots.FIGURE_NAMES) - {"embedding_filters"}
    for path in written.values():
        _check_png(path)


def test_plots_show_the_numbers(tmp_path):
    similarity = np.zeros((2, 3, 2, 3), dtype="float32")
    similarity[0, 0] = 1.0  # the top-left tile all +1: the brightest colour of viridis
    figure = plots.plot_position_embedding_similarity(similarity)
    (axis,) = [a for a in figure.axes if a.images]  # the colour bar has none
    mosaic = np.ma.filled(np.ma.asarray(axis.images[0].get_array(), dtype="float64"), np.nan)
    assert mosaic.shape == (2 * 3 - 1, 3 * 4 - 1)  # 2x3 tiles of 2x3, one-pixel gaps
    np.testing.assert_array_equal(mosaic[:2, :3], 1.0)
    np.testing.assert_array_equal(mosaic[:2, 4:7], 0.0)
    assert np.isnan(mosaic).sum() == mosaic.size - 6 * 6
    figure = plots.plot_mean_attention_distance(np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
    offsets = np.concatenate([c.get_offsets() for c in figure.axes[0].collections])
    np.testing.assert_array_equal(
        sorted(map(tuple, offsets)), [(1, 1), (1, 2), (2, 3), (2, 4), (3, 5), (3, 6)]
    )
    with pytest.raises(ValueError, match="heatmap"):
        plots.plot_attention_rollout(np.zeros((8, 8, 3)), np.zeros((4, 4)))
    with pytest.raises(ValueError, match="components"):
        plots.plot_embedding_filters(np.zeros((4, 1, 1, 64)))


def test_cli_inspect_writes_the_pictures(tmp_path, capsys, tiny_factory):
    from PIL import Image
    from skimage import data

    from keras_vit.cli import main

    Image.fromarray(data.chelsea()).save(tmp_path / "cat.jpg")
    out = tmp_path / "pictures"
    arguments = ["inspect", str(tmp_path / "cat.jpg"), "--model", "vit_ti16", "--weights", "random"]
    assert main([*arguments, "--out", str(out), "--head-fusion", "max"]) == 0
    assert tiny_factory == [("vit_ti16", False)]
    assert capsys.readouterr().out.count("wrote ") == 4
    for name in plots.FIGURE_NAMES:
        _check_png(out / f"{name}.png")
    with pytest.raises(SystemExit) as stopped:  # refused while parsing: argparse's usage line, no traceback
        main([*arguments, "--out", str(out), "--discard-ratio", "1.5"])
    assert stopped.value.code == 2 and "--discard-ratio" in capsys.readouterr().err


def test_example_runs_offline_with_random_weights(tmp_path, capsys, tiny_factory):
    example = runpy.run_path(str(REPO / "examples" / "inspect_photo.py"), run_name="inspect_photo")
    assert example["main"](["--model", "vit_s16", "--out", str(tmp_path), "--dpi", "72"]) == 0
    assert tiny_factory == [("vit_s16", False)]
    assert "random weights" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.png" for n in plots.FIGURE_NAMES)


def test_docs_images_render():
    """The README's pictures (made by examples/inspect_photo.py) open, are drawn and stay small."""
    for name in plots.FIGURE_NAMES:
        _check_png(REPO / "docs" / "images" / f"{name}.png", max_bytes=200_000)


def test_star_import_keeps_the_standard_inspect():
    namespace = {}
    exec("import inspect\nfrom keras_vit import *", namespace)
    assert namespace["inspect"].__name__ == "inspect"
    assert "inspect" not in keras_vit.__all__ and "inspection" not in keras_vit.__all__


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_plot_replaces_a_link_at_its_path_never_writes_through_it(link, tmp_path):
    """`keras-vit inspect` writes its pictures as files of its own: a link planted under a picture's
    name is replaced, what it points to stays as it was."""
    precious = tmp_path / "precious.png"
    precious.write_bytes(b"the user's")
    path = tmp_path / "out.png"
    path.symlink_to(precious) if link == "symbolic" else os.link(precious, path)
    plots.plot_position_embedding_similarity(np.zeros((2, 3, 2, 3), dtype="float32"), path)
    assert precious.read_bytes() == b"the user's"
    _check_png(path)

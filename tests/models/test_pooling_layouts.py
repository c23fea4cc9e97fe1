"""Class-token-free models (GAP, MAP) and their checkpoints: big_vision `pool_type="gap"/"map"` `.npz`
files and timm `class_token=False` / `global_pool="avg"|"map"` state dicts.

Two independent references: timm (its own forward pass, and for big_vision files its own `.npz`
loader) and `big_vision_reference` (big_vision's forward pass re-written in `jax.numpy`). The
big_vision reference is checked against timm loading the same file, so neither is trusted alone.
Models are tiny (width 32, 2 blocks, 32 px images: 16 tokens).
"""

import keras
import numpy as np
import pytest
import timm
import torch
from helpers import big_vision_reference as bv
from helpers import checkpoint_writers as writers
from helpers import count_params_without_weights, random_images

import keras_vit
from keras_vit.checkpoints import CheckpointError, inspect_checkpoint, load_checkpoint
from keras_vit.inspection import analysis as vit_inspect
from keras_vit.models.layers import MultiheadAttentionPooling, TokenPooling
from keras_vit.registry.variants import ViTConfig

TINY = ViTConfig("tiny", patch_size=8, hidden_size=32, depth=2, num_heads=4, mlp_dim=64, image_size=32)
# timm files do not record the head count: keras_vit reads width / 64 heads for a width it does not list.
TIMM_TINY = ViTConfig(
    "timm_tiny", patch_size=8, hidden_size=128, depth=2, num_heads=2, mlp_dim=256, image_size=32
)
NUM_CLASSES = 5
# Max |logit difference| allowed, float32: about twice the largest gap measured on the TensorFlow, JAX
# and PyTorch backends (the "parity gaps" this file lists under `python -m pytest -n 0 -rA`).
ATOL = 1.5e-6


def _images(batch: int = 2) -> np.ndarray:
    return random_images(batch, (32, 32))


def _logits(model: keras.Model, images: np.ndarray) -> np.ndarray:
    return keras.ops.convert_to_numpy(model(images, training=False))


# ---- the option on factories and configs --------------------------------------------------------


def test_class_token_false_on_factories():
    model = keras_vit.vit_digits(class_token=False, pooling="gap")
    assert (model.config.class_token, model.config.pooling) == (False, "gap")
    assert model.class_token is None and model.pos_embed.num_prefix_tokens == 0
    assert model.pos_embed.embedding.shape == (1, 64, 64)  # 8x8 patches, no [class] row
    assert isinstance(model.pool, TokenPooling)

    model = keras_vit.create_model("vit_digits", class_token=False, pooling="map")
    assert isinstance(model.pool, MultiheadAttentionPooling)
    assert _logits(model, random_images(1, (32, 32))).shape == (1, 1000)

    with pytest.raises(ValueError, match="pooling='gap' or 'map'"):
        keras_vit.vit_digits(class_token=False)


def test_class_token_free_hybrid_parameter_count():
    """A hybrid factory too: no [class] token and its position row, plus the MAP head's weights."""
    width, mlp = 192, 768  # R+ViT-Ti/16
    default = count_params_without_weights(lambda: keras_vit.vit_r_ti16())
    free = count_params_without_weights(lambda: keras_vit.vit_r_ti16(class_token=False, pooling="map"))
    map_head = width + 4 * (width * width + width) + 2 * width + 2 * width * mlp + mlp + width
    assert free == default - 2 * width + map_head
    with pytest.raises(ValueError, match="fc_norm=True .* needs pooling='gap'"):
        keras_vit.vit_digits(class_token=False, pooling="map", fc_norm=True)


@pytest.mark.parametrize(
    "layout",
    [
        dict(class_token=False, pooling="gap"),
        dict(class_token=False, pooling="map"),
        dict(class_token=False, pooling="gap", fc_norm=True),
        dict(class_token=True, pooling="map"),
    ],
    ids=["gap", "map", "gap_fc_norm", "cls_map"],
)
def test_keras_round_trip(layout, tmp_path):
    model = keras_vit.build_vit(TINY, num_classes=NUM_CLASSES, classifier_activation=None, **layout)
    for variable in model.weights:  # non-trivial values everywhere (zero head, unit norms otherwise)
        variable.assign(variable + np.random.default_rng(0).normal(0, 0.05, variable.shape))
    path = tmp_path / "model.keras"
    model.save(path)
    restored = keras.saving.load_model(path)
    assert restored.config == model.config
    np.testing.assert_array_equal(_logits(restored, _images()), _logits(model, _images()))


def test_fc_norm_views():
    """LayerNorm after the pooling: the token view is the last block's output, the features normalised."""
    model = keras_vit.build_vit(TINY, class_token=False, pooling="gap", fc_norm=True, include_top=False)
    images = _images()
    tokens = keras.ops.convert_to_numpy(model.token_model()(images))
    features = keras.ops.convert_to_numpy(model.feature_model()(images))
    np.testing.assert_allclose(features, _logits(model, images), atol=1e-6)
    mean = tokens.mean(axis=1)
    norm = model.encoder_norm
    expected = (mean - mean.mean(-1, keepdims=True)) / np.sqrt(mean.var(-1, keepdims=True) + norm.epsilon)
    expected = expected * keras.ops.convert_to_numpy(norm.gamma) + keras.ops.convert_to_numpy(norm.beta)
    np.testing.assert_allclose(features, expected, atol=1e-5)


# ---- the MAP layer --------------------------------------------------------------------------------


def test_map_layer_config_and_dtypes():
    layer = MultiheadAttentionPooling(4, 64, num_prefix_tokens=1, approximate_gelu=True, name="pool")
    tokens = np.random.default_rng(0).normal(size=(2, 17, 32)).astype("float32")
    output = keras.ops.convert_to_numpy(layer(tokens))
    assert output.shape == (2, 32) and layer.compute_output_shape((2, 17, 32)) == (2, 32)
    clone = MultiheadAttentionPooling.from_config(layer.get_config())
    clone.build((None, 17, 32))
    clone.set_weights(layer.get_weights())
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(clone(tokens)), output)
    # The [class] token is left out: changing it changes nothing.
    changed = tokens.copy()
    changed[:, 0] += 1.0
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer(changed)), output, atol=1e-6)

    mixed = MultiheadAttentionPooling(4, 64, dtype="mixed_bfloat16")
    result = mixed(tokens)
    assert keras.backend.standardize_dtype(result.dtype) == "bfloat16"
    assert all(keras.backend.standardize_dtype(weight.dtype) == "float32" for weight in mixed.weights)


# ---- timm ----------------------------------------------------------------------------------------


@torch.no_grad()
def _timm_logits(model: torch.nn.Module, images: np.ndarray) -> np.ndarray:
    return model(writers.to_torch(images)).numpy()


@pytest.mark.parametrize(
    "timm_kwargs, layout",
    [
        (dict(global_pool="avg"), dict(class_token=False, pooling="gap", fc_norm=True)),
        (dict(global_pool="avg", fc_norm=False), dict(class_token=False, pooling="gap", fc_norm=False)),
        (dict(global_pool="map"), dict(class_token=False, pooling="map", fc_norm=False)),
    ],
    ids=["avg_fc_norm", "avg", "map"],
)
def test_timm_class_token_free_parity(timm_kwargs, layout, tmp_path, parity):
    reference = writers.random_timm_vit_like(
        TIMM_TINY.replace(class_token=False, pooling="gap"), num_classes=NUM_CLASSES, **timm_kwargs
    )
    path = writers.save_timm_safetensors(reference, tmp_path / "model.safetensors")
    assert inspect_checkpoint(path).layout == layout
    # pretrained=FILE takes the checkpoint's layout: no class_token / pooling arguments needed.
    model = keras_vit.create_model(TIMM_TINY, pretrained=path, classifier_activation=None)
    assert {key: getattr(model.config, key) for key in layout} == layout
    images = _images()
    parity(_logits(model, images), _timm_logits(reference, images), ATOL)


@pytest.mark.parametrize("global_pool, pooling", [("map", "map"), ("avg", "gap")])
def test_timm_pooling_with_class_token_parity(global_pool, pooling, tmp_path, parity):
    """timm's attention and average pooling skip the [class] token (`avg` then normalises: fc_norm)."""
    reference = writers.random_timm_vit_like(TIMM_TINY, num_classes=NUM_CLASSES, global_pool=global_pool)
    path = writers.save_timm_safetensors(reference, tmp_path / "model.safetensors")
    model = keras_vit.create_model(TIMM_TINY, pretrained=path, classifier_activation=None)
    layout = (model.config.class_token, model.config.pooling, model.config.fc_norm)
    assert layout == (True, pooling, global_pool == "avg")
    images = _images()
    parity(_logits(model, images), _timm_logits(reference, images), ATOL)


# ---- big_vision ----------------------------------------------------------------------------------


def _big_vision_arrays(pool_type: str, prefix: str, scan: bool, seed: int = 0) -> dict[str, np.ndarray]:
    params = bv.random_params(
        width=TINY.hidden_size,
        depth=TINY.depth,
        num_heads=TINY.num_heads,
        mlp_dim=TINY.mlp_dim,
        patch_size=TINY.patch_size,
        grid=TINY.token_grid(),
        pool_type=pool_type,
        num_classes=NUM_CLASSES,
        seed=seed,
    )
    return bv.saved_arrays(params, prefix=prefix, scan=scan)


@pytest.mark.parametrize(
    "pool_type, prefix, scan",
    [
        ("gap", "params/", False),
        ("gap", "", True),
        ("map", "params/", True),
        ("map", "", False),
        ("tok", "params/img/", True),  # the [class]-token layout the reference must agree on too
    ],
)
def test_big_vision_reference_agrees_with_timm(pool_type, prefix, scan, tmp_path, parity):
    """The JAX re-implementation and timm's own big_vision loader + forward give the same logits."""
    arrays = _big_vision_arrays(pool_type, prefix, scan)
    timm_arrays = dict(arrays)
    if pool_type == "tok":  # big_vision adds the position embedding before prepending [class]: a zero row
        key = f"{prefix}pos_embedding"
        timm_arrays[key] = np.pad(arrays[key], ((0, 0), (1, 0), (0, 0)))
    path = writers.save_npz(timm_arrays, tmp_path / "big_vision.npz")
    global_pool = {"gap": "avg", "map": "map", "tok": "token"}[pool_type]
    timm_model = writers.random_timm_vit_like(
        TINY.replace(class_token=pool_type == "tok", pooling="token" if pool_type == "tok" else "gap"),
        num_classes=NUM_CLASSES,
        global_pool=global_pool,
        fc_norm=False,
        act_layer="gelu_tanh",
    )
    timm.models.vision_transformer._load_weights(timm_model, str(path))
    images = _images()
    parity(bv.forward(arrays, images, pool_type), _timm_logits(timm_model, images), ATOL)


@pytest.mark.parametrize(
    "pool_type, prefix, scan",
    [("gap", "params/", False), ("gap", "", True), ("map", "params/", True), ("map", "", False)],
)
def test_big_vision_class_token_free_parity(pool_type, prefix, scan, tmp_path, parity):
    arrays = _big_vision_arrays(pool_type, prefix, scan)
    path = writers.save_npz(arrays, tmp_path / "big_vision.npz")
    info = inspect_checkpoint(path)
    assert info.layout == {"class_token": False, "pooling": pool_type, "fc_norm": False}
    assert (info.depth, info.grid, info.num_heads, info.num_classes) == (2, (4, 4), 4, NUM_CLASSES)
    model = keras_vit.create_model(TINY, pretrained=path, classifier_activation=None)
    assert (model.config.class_token, model.config.pooling) == (False, pool_type)
    images = _images()
    parity(_logits(model, images), bv.forward(arrays, images, pool_type), ATOL)


# ---- layouts that do not fit ---------------------------------------------------------------------


def test_layout_mismatch_names_the_arguments(tmp_path):
    gap = writers.save_npz(_big_vision_arrays("gap", "params/", False), tmp_path / "gap.npz")
    with pytest.raises(CheckpointError, match=r'no \[class\] token.*class_token=False, pooling="gap"'):
        load_checkpoint(keras_vit.build_vit(TINY, num_classes=NUM_CLASSES), gap)
    with pytest.raises(CheckpointError, match=r'class_token=False, pooling="gap"'):
        keras_vit.create_model(TINY, pretrained=gap, pooling="map")

    map_path = writers.save_npz(_big_vision_arrays("map", "", True), tmp_path / "map.npz")
    with pytest.raises(CheckpointError, match=r'attention pooling.*class_token=False, pooling="map"'):
        load_checkpoint(
            keras_vit.build_vit(TINY, class_token=False, pooling="gap", num_classes=NUM_CLASSES), map_path
        )

    fc_norm = writers.random_timm_vit_like(
        TIMM_TINY.replace(class_token=False, pooling="gap"), num_classes=NUM_CLASSES, global_pool="avg"
    )
    fc_norm_path = writers.save_timm_safetensors(fc_norm, tmp_path / "fc_norm.safetensors")
    with pytest.raises(CheckpointError, match=r'timm fc_norm.*pooling="gap", fc_norm=True'):
        load_checkpoint(
            keras_vit.build_vit(TIMM_TINY, class_token=False, pooling="gap", num_classes=NUM_CLASSES),
            fc_norm_path,
        )

    with_token = writers.random_timm_vit_like(TIMM_TINY, num_classes=NUM_CLASSES)
    token_path = writers.save_timm_safetensors(with_token, tmp_path / "token.safetensors")
    with pytest.raises(CheckpointError, match=r'has a \[class\] token.*class_token=True, pooling="token"'):
        keras_vit.create_model(TIMM_TINY, pretrained=token_path, class_token=False, pooling="gap")


def test_features_of_a_class_token_free_checkpoint(tmp_path):
    """`pooling=None` on a GAP checkpoint: the layout's class_token comes from the file, tokens come out."""
    arrays = _big_vision_arrays("gap", "params/", False)
    path = writers.save_npz(arrays, tmp_path / "gap.npz")
    model = keras_vit.create_model(TINY, pretrained=path, pooling=None, include_top=False)
    assert model.config.class_token is False
    tokens = _logits(model, _images())
    assert tokens.shape == (2, 16, 32)
    features = keras.ops.convert_to_numpy(model.feature_model()(_images()))
    np.testing.assert_allclose(features, tokens.mean(axis=1), atol=1e-6)  # no [class] token: the mean


# ---- inspection ----------------------------------------------------------------------------------


def test_inspection_tools_without_class_token():
    model = keras_vit.build_vit(TINY, class_token=False, pooling="map", num_classes=NUM_CLASSES)
    images = _images()
    weights = vit_inspect.attention_weights(model, images)
    assert [block.shape for block in weights] == [(2, 4, 16, 16)] * 2

    maps = vit_inspect.attention_rollout(model, images)
    expected = vit_inspect.rollout(weights).mean(axis=1).reshape(2, 4, 4, 1).astype("float32")
    expected = keras.ops.convert_to_numpy(keras.ops.image.resize(expected, (32, 32), "bilinear"))[..., 0]
    expected /= expected.max(axis=(1, 2), keepdims=True)
    np.testing.assert_allclose(maps, expected, atol=1e-6)

    distances = vit_inspect.mean_attention_distance(model, images)
    expected = np.stack(
        [vit_inspect.attention_distance(block, (4, 4), 8.0, 0).mean(axis=0) for block in weights]
    )
    np.testing.assert_allclose(distances, expected, rtol=1e-6)
    assert distances.shape == (2, 4) and np.all(distances > 0)

    similarity = vit_inspect.position_embedding_similarity(model)
    assert similarity.shape == (4, 4, 4, 4)
    np.testing.assert_allclose(similarity.reshape(16, 16).diagonal(), 1.0, atol=1e-6)

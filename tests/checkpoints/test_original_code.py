"""Checkpoints computed as their own code computes them: numerics and position-embedding resampling.

The reference for Google `.npz` files is `jax_reference`, a plain-JAX transcription of the
original code's forward pass (vision_transformer `models_vit.py` / `models_resnet.py`) and of
its position-embedding resampling (`checkpoint.py`: `scipy.ndimage.zoom(order=1)`), on random
checkpoints written with the keys and shapes that code saves; recorded logits pin the
reference itself. timm and transformers checkpoints are checked against those libraries.
"""

import json
import zipfile

import jax
import keras
import numpy as np
import pytest
from helpers import checkpoint_writers as writers
from helpers import jax_reference as reference
from helpers import random_images
from scipy import ndimage as scipy_ndimage

import keras_vit
from keras_vit.checkpoints import inspect_checkpoint, load_checkpoint
from keras_vit.checkpoints.loading import source_numerics
from keras_vit.checkpoints.pos_embed import POS_EMBED_INTERPOLATIONS, resize_pos_embed
from keras_vit.models.vit import ViT
from keras_vit.registry.catalog import catalog_markdown, get_entry, list_pretrained
from keras_vit.registry.variants import NUMERICS, ViTConfig

TRANSFORMER = dict(hidden_size=64, depth=2, num_heads=2, mlp_dim=128, num_classes=10)
# (checkpoint arguments, keras_vit config) at 32 px: a plain ViT/4 (8x8 tokens); a hybrid with two
# stages of bottleneck units as R26's (projection and identity units, a strided stage; 4x4 tokens),
# and R26's full ResNet (2, 2, 2, 2), 2048 channels into the patch embedding (1x1 token at 32 px).
MODELS = {
    "plain": (dict(patch_size=4, grid=8), ViTConfig("tiny", 4, 64, 2, 2, 128, image_size=32)),
    "hybrid": (
        dict(patch_size=1, grid=4, resnet_stages=(2, 2), groupnorm_4d=True),
        ViTConfig("tiny_hybrid", 1, 64, 2, 2, 128, resnet_stages=(2, 2), image_size=32),
    ),
    "r26": (
        dict(patch_size=1, grid=1, resnet_stages=(2, 2, 2, 2)),
        ViTConfig("tiny_r26", 1, 64, 2, 2, 128, resnet_stages=(2, 2, 2, 2), image_size=32),
    ),
}
# Max |logit difference| allowed, float32: about twice the largest gap measured on the TensorFlow, JAX
# and PyTorch backends (the "parity gaps" this file lists under `python -m pytest -n 0 -rA`).
TOLERANCE = {
    "plain": 2.5e-6,
    "hybrid": 1.2e-5,
    "r26": 4e-5,
    "reference-timm": 1.2e-6,  # the plain ViT with exact GELU
    "stem-logits": 3.5e-6,  # the hybrids with timm's stem numerics
    "stem": 1.3e-5,
    "timm": 1.2e-6,
    "hf": 6e-7,
    "hf-interpolation": 1e-6,
    "written-hybrid": 1.2e-6,
    "written": 3e-7,
}
# jax_reference.apply on random_params(seed=1) and random_images(2, (32, 32)): logits [0, :4].
RECORDED_LOGITS = {
    "plain": [-1.3597133, 1.5236448, 1.0910237, -1.4219959],
    "hybrid": [0.7883239, -1.4407625, -0.7060647, 0.0264709],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """`checkpoints(kind)` -> `(params, .npz path, config)`, each written once for the module, when asked."""
    directory = tmp_path_factory.mktemp("original")
    made = {}

    def get(kind: str):
        if kind not in made:
            arguments, config = MODELS[kind]
            params = reference.random_params(**TRANSFORMER, **arguments, seed=1)
            made[kind] = params, writers.save_npz(params, directory / f"{kind}.npz"), config
        return made[kind]

    yield get
    made.clear()
    keras.backend.clear_session()


def _logits(model, images) -> np.ndarray:
    return keras.ops.convert_to_numpy(model(images, training=False))


def _max_diff(actual, expected) -> float:
    assert actual.shape == expected.shape
    return float(np.max(np.abs(actual - expected)))


# ---- the reference itself ----------------------------------------------------------------------


def test_flax_gelu_is_the_tanh_approximation():
    """`nn.gelu` (= `jax.nn.gelu`) defaults to tanh, and keras_vit's approximate GELU is the same."""
    x = np.linspace(-6, 6, 1001, dtype="float32")
    flax_gelu = np.asarray(jax.nn.gelu(x))  # what `nn.gelu(x)` calls
    np.testing.assert_array_equal(flax_gelu, np.asarray(jax.nn.gelu(x, approximate=True)))
    assert np.abs(flax_gelu - np.asarray(jax.nn.gelu(x, approximate=False))).max() > 1e-4
    keras_tanh = keras.ops.convert_to_numpy(keras.ops.gelu(x, approximate=True))
    np.testing.assert_allclose(keras_tanh, flax_gelu, atol=1e-6, rtol=0)


@pytest.mark.backend_free  # the reference alone: collected on TensorFlow only
@pytest.mark.parametrize("kind", ["plain", pytest.param("hybrid", marks=pytest.mark.slow)])
def test_reference_logits_are_recorded(kind, checkpoints):
    """The reference's logits on its random checkpoint are pinned, independently of keras_vit."""
    params, _, _ = checkpoints(kind)
    logits = reference.apply(params, random_images(2, (32, 32)))
    np.testing.assert_allclose(logits[0, :4], RECORDED_LOGITS[kind], atol=1e-5, rtol=0)


def _tiny_timm_vit():
    """A perturbed random timm ViT of `MODELS["plain"]`'s architecture (32 px, patches of 4)."""
    import timm
    import torch

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        img_size=32,
        patch_size=4,
        embed_dim=64,
        depth=2,
        num_heads=2,
        mlp_ratio=2.0,
        num_classes=10,
        weight_init="skip",
    )
    with torch.no_grad():  # left uninitialised by weight_init="skip"
        model.cls_token.zero_()
        model.pos_embed.zero_()
    return writers.perturb_(model)


@pytest.mark.backend_free  # the reference alone: collected on TensorFlow only
def test_reference_with_exact_gelu_is_timm(parity):
    """The transcription's layout (attention, tokens, head) agrees with timm, an independent
    implementation, once its one numerical difference, the tanh GELU, is made exact."""
    import torch

    timm_model = _tiny_timm_vit()
    params = writers.timm_to_google_npz(writers.state_dict_numpy(timm_model), num_heads=2)
    images = random_images(2, (32, 32))
    with torch.no_grad():
        expected = timm_model(writers.to_torch(images)).numpy()
    parity(reference.apply(params, images, approximate_gelu=False), expected, TOLERANCE["reference-timm"])


def _tiny_timm_hybrid(stages: tuple[int, ...], size):
    """A perturbed random timm hybrid: a ResNetV2 of `stages` bottleneck units, 2 blocks on 1x1 patches."""
    import torch
    from timm.models.vision_transformer_hybrid import _create_vision_transformer_hybrid, _resnetv2

    torch.manual_seed(0)
    model = _create_vision_transformer_hybrid(
        "vit_small_r26_s32_224",  # a name for timm's config only: the architecture is the arguments'
        backbone=_resnetv2(stages),
        img_size=size,
        patch_size=1,
        embed_dim=64,
        depth=2,
        num_heads=2,
        mlp_ratio=2.0,
        num_classes=10,
    )
    with torch.no_grad():  # no trivial values: tokens, position embedding and head included
        for parameter in (model.cls_token, model.pos_embed, model.head.weight, model.head.bias):
            parameter.normal_(0, 0.1)
    return writers.perturb_(model)


STEMS = {"hybrid": (2, 2), "r26": (2, 2, 2, 2), "r50": (3, 4, 9)}


@pytest.mark.backend_free  # the reference alone: collected on TensorFlow only
@pytest.mark.parametrize(
    "stem,size",
    [
        ("hybrid", (32, 32)),
        pytest.param("r26", (35, 49), marks=pytest.mark.slow),
        pytest.param("r50", (35, 49), marks=pytest.mark.slow),
    ],
    ids=["hybrid-32", "r26-35x49", "r50-35x49"],
)
def test_reference_resnet_with_timm_numerics_is_timm(stem, size, parity):
    """The transcription's ResNet (units, strides, TensorFlow-SAME padding at odd sizes, projections)
    agrees with timm's ResNetV2, an independent implementation, once its two numerical differences
    (weight standardisation and GroupNorm epsilon) are timm's; so do the hybrid's logits."""
    import torch

    timm_model = _tiny_timm_hybrid(STEMS[stem], size)
    params = writers.timm_to_google_npz(writers.state_dict_numpy(timm_model), num_heads=2, groupnorm_4d=True)
    images = random_images(2, size)
    with torch.no_grad():
        features = timm_model.patch_embed.backbone(writers.to_torch(images)).permute(0, 2, 3, 1).numpy()
        logits = timm_model(writers.to_torch(images)).numpy()
    parity(reference.stem_features(params, images, "timm"), features, TOLERANCE["stem"], "stem")
    reference_logits = reference.apply(params, images, approximate_gelu=False, stem_numerics="timm")
    parity(reference_logits, logits, TOLERANCE["stem-logits"], "logits")
    # ... and the original numerics are another function: the stem's difference shows
    assert _max_diff(reference.stem_features(params, images), features) > 5 * TOLERANCE["stem"]


# ---- numerics follow the checkpoint's source ---------------------------------------------------


@pytest.mark.parametrize("kind", ["plain", "hybrid", pytest.param("r26", marks=pytest.mark.slow)])
def test_google_npz_computes_like_the_original_code(kind, checkpoints, parity):
    params, path, config = checkpoints(kind)
    images = random_images(2, (32, 32))
    expected = reference.apply(params, images)
    info = inspect_checkpoint(path)
    assert (info.numerics, info.pos_embed_interpolation) == ("jax", "jax")

    model = keras_vit.create_model(config, pretrained=path, classifier_activation=None)
    assert model.config.numerics == "jax"
    parity(_logits(model, images), expected, TOLERANCE[kind])

    # timm's numerics on the same weights miss the original code's logits by far more
    other = keras_vit.create_model(config, pretrained=path, classifier_activation=None, numerics="timm")
    assert other.config.numerics == "timm"
    assert _max_diff(_logits(other, images), expected) > 1e-4


# Models keras_vit writes as Google `.npz` that no published file covers here: a hybrid with stages of
# both unit kinds (R26's), one with the root block only (R+Ti's), and the GAP and MAP heads.
WRITTEN = {
    "staged-hybrid": ViTConfig(
        "staged", 1, 32, 1, 2, 64, resnet_stages=(1, 2), image_size=32, numerics="jax"
    ),
    "root-hybrid": ViTConfig("root", 8, 32, 1, 2, 64, resnet_stages=(), image_size=64, numerics="jax"),
    "gap": ViTConfig("gap", 4, 32, 2, 2, 64, image_size=32, class_token=False, pooling="gap", numerics="jax"),
    "map": ViTConfig("map", 4, 32, 2, 2, 64, image_size=32, class_token=False, pooling="map", numerics="jax"),
}


@pytest.mark.parametrize("kind", WRITTEN)
def test_written_google_npz_runs_in_the_original_code(kind, tmp_path, parity):
    """keras_vit's `.npz` writer checked by the original code (the JAX transcription) computing the
    written file, not by keras_vit reading it back."""
    model = keras_vit.build_vit(WRITTEN[kind], num_classes=5, classifier_activation=None)
    rng = np.random.default_rng(0)
    for variable in model.weights:  # LayerNorm/GroupNorm scales around 1: no trivial tensor
        noise = rng.normal(0, 0.1, variable.shape) + (1.0 if variable.path.endswith("gamma") else 0.0)
        variable.assign(noise.astype("float32"))
    directory = keras_vit.save_pretrained(model, tmp_path / kind, "google_npz")
    params = dict(np.load(directory / "model.npz"))
    images = random_images(2, model.config.image_hw)
    tolerance = TOLERANCE["written-hybrid" if "hybrid" in kind else "written"]
    parity(reference.apply(params, images), _logits(model, images), tolerance)


@pytest.mark.parametrize(
    "kind,size",
    [
        ("plain", (48, 48)),
        ("plain", (32, 48)),
        # the reference compiles the hybrid anew for each size (~5 s)
        pytest.param("hybrid", (32, 48), marks=pytest.mark.slow),
    ],
    ids=["plain-square", "plain-non-square", "hybrid-non-square"],
)
def test_google_npz_at_another_resolution(kind, size, checkpoints, parity):
    """A 32 px checkpoint at 48 px and 32x48 px: resampled as the original code does (scipy zoom)."""
    params, path, config = checkpoints(kind)
    target_grid = config.token_grid(size)
    images = random_images(1, size)
    expected = reference.apply(reference.resize_posemb(params, target_grid), images)

    model = keras_vit.create_model(config, pretrained=path, image_size=size, classifier_activation=None)
    assert model.pos_embed.grid_size == target_grid
    parity(_logits(model, images), expected, TOLERANCE[kind])
    # the override: timm's bicubic resampling, a different position embedding
    load_checkpoint(model, path, pos_embed_interpolation="timm")
    assert _max_diff(_logits(model, images), expected) > 1e-3


def test_zoom_resampling_equals_scipy(rng):
    cases = [
        ((8, 8), (12, 12)),
        ((14, 14), (24, 24)),
        ((14, 14), (8, 8)),
        ((6, 9), (10, 4)),
        ((5, 5), (5, 8)),
    ]
    cases += [((7, 7), (1, 3)), ((1, 1), (3, 2))]  # one row or column: scipy samples position 0
    for old_grid, new_grid in cases:
        for prefix in (0, 1):
            source = rng.normal(size=(1, prefix + old_grid[0] * old_grid[1], 8)).astype("float32")
            grid = source[0, prefix:].reshape(*old_grid, 8)
            zoom = (new_grid[0] / old_grid[0], new_grid[1] / old_grid[1], 1)
            expected = scipy_ndimage.zoom(grid, zoom, order=1)
            result = resize_pos_embed(source, new_grid, prefix, old_grid=old_grid, method="zoom")
            assert result.dtype == np.float32
            np.testing.assert_array_equal(result[:, :prefix], source[:, :prefix])
            patches = result[0, prefix:].reshape(expected.shape)
            np.testing.assert_allclose(
                patches, expected, atol=1e-6, rtol=0, err_msg=f"{old_grid}->{new_grid}"
            )
    assert POS_EMBED_INTERPOLATIONS["jax"] == {"method": "zoom", "antialias": False}


def test_numerics_round_trip_and_old_configs(checkpoints, tmp_path):
    _, path, config = checkpoints("plain")
    model = keras_vit.create_model(config, pretrained=path, classifier_activation=None)
    assert model.get_config()["config"]["numerics"] == "jax"
    block = model.blocks[0]
    assert block.approximate_gelu and block.layer_norm_epsilon == model.encoder_norm.epsilon == 1e-6
    model.save(tmp_path / "jax.keras")
    loaded = keras.saving.load_model(tmp_path / "jax.keras")
    assert loaded.config.numerics == "jax" and loaded.blocks[0].approximate_gelu
    images = random_images(2, (32, 32))
    np.testing.assert_array_equal(_logits(loaded, images), _logits(model, images))

    # a .keras file written before `numerics` existed names `stem_numerics`
    with zipfile.ZipFile(tmp_path / "jax.keras") as archive:
        saved = json.loads(archive.read("config.json"))["config"]
    saved["config"].pop("numerics")
    saved["config"]["stem_numerics"] = "timm"
    old = ViT.from_config(saved)
    assert old.config.numerics == "timm" and not old.blocks[0].approximate_gelu


def test_hf_numerics_set_every_epsilon():
    model = keras_vit.build_vit(MODELS["hybrid"][1].replace(numerics="hf"), num_classes=3)
    assert model.encoder_norm.epsilon == NUMERICS["hf"].layer_norm_epsilon == 1e-12
    assert all(b.norm1.epsilon == b.norm2.epsilon == 1e-12 and not b.approximate_gelu for b in model.blocks)
    assert model.stem["conv_root"].epsilon_mode == "variance"  # transformers' BiT: timm's epsilons
    assert model.stem["gn_root"].epsilon == NUMERICS["timm"].group_norm_epsilon


def test_source_numerics():
    assert source_numerics("google_npz") == "jax" and source_numerics("timm") == "timm"
    assert (
        source_numerics("hf")
        == source_numerics("hf", {"hidden_act": "gelu", "layer_norm_eps": 1e-12})
        == "hf"
    )
    assert source_numerics("hf", {"layer_norm_eps": 1e-6}) == "timm"
    assert source_numerics("hf", {"hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}) == "jax"
    with pytest.warns(
        UserWarning, match="layer_norm_eps=1e-05, which no keras_vit numerics has: using numerics='timm'"
    ):
        assert source_numerics("hf", {"layer_norm_eps": 1e-5}) == "timm"
    with pytest.raises(keras_vit.CheckpointError, match="hidden_act='relu'"):
        source_numerics("hf", {"hidden_act": "relu"})


def test_timm_and_hf_checkpoints_select_their_numerics(tmp_path, parity):
    import torch
    import transformers

    config = MODELS["plain"][1]
    images = random_images(2, (32, 32))

    timm_model = _tiny_timm_vit()
    path = writers.save_timm_safetensors(timm_model, tmp_path / "model.safetensors")
    model = keras_vit.create_model(config, pretrained=path, classifier_activation=None)
    assert model.config.numerics == "timm"
    with torch.no_grad():
        expected = timm_model(writers.to_torch(images)).numpy()
    parity(_logits(model, images), expected, TOLERANCE["timm"], "timm")

    hf_config = transformers.ViTConfig(  # transformers' defaults: exact GELU, layer_norm_eps 1e-12
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        image_size=32,
        patch_size=4,
        num_labels=10,
    )
    torch.manual_seed(0)
    hf_model = writers.perturb_(transformers.ViTForImageClassification(hf_config))
    directory = writers.save_hf(hf_model, tmp_path / "hf", pytorch_bin=False)
    assert inspect_checkpoint(directory).numerics == "hf"
    model = keras_vit.create_model(config, pretrained=directory, classifier_activation=None)
    assert model.config.numerics == "hf"
    with torch.no_grad():
        expected = hf_model(pixel_values=writers.to_torch(images)).logits.numpy()
    parity(_logits(model, images), expected, TOLERANCE["hf"], "hf")


@pytest.mark.parametrize("size", [(48, 48), (32, 48)], ids=["square", "non-square"])
def test_hf_interpolation_is_transformers_interpolate_pos_encoding(size, tmp_path, parity):
    """`pos_embed_interpolation="hf"` on a transformers checkpoint at another size: the logits of
    transformers' own `interpolate_pos_encoding=True`."""
    import torch

    hf_model = writers.random_hf_vit(
        "vit_ti16",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        image_size=32,
        patch_size=4,
        num_labels=10,
    )
    directory = writers.save_hf(hf_model, tmp_path / "hf", pytorch_bin=False)
    images = random_images(2, size)
    with torch.no_grad():
        pixels = writers.to_torch(images)
        expected = hf_model(pixel_values=pixels, interpolate_pos_encoding=True).logits.numpy()
    options = dict(image_size=size, pos_embed_interpolation="hf", classifier_activation=None)
    model = keras_vit.create_model(MODELS["plain"][1], pretrained=directory, **options)
    parity(_logits(model, images), expected, TOLERANCE["hf-interpolation"])
    # the default for transformers files, timm's antialiased resampling, is another embedding
    load_checkpoint(model, directory, pos_embed_interpolation="timm")
    assert _max_diff(_logits(model, images), expected) > 1e-3


def test_catalog_rows_name_their_sources_numerics():
    for tag in list_pretrained():
        entry = get_entry(tag)
        # every transformers row (google/vit-*) has hidden_act "gelu" and layer_norm_eps 1e-12
        assert entry.numerics == source_numerics(entry.format), tag
    assert "| Numerics |" in catalog_markdown()
    assert "| `vit_b16.augreg2_in21k_ft_in1k` (default) | 224 | 1000 | timm |" in catalog_markdown()


def test_bad_pos_embed_interpolation(checkpoints):
    _, path, config = checkpoints("plain")
    with pytest.raises(ValueError, match="Unknown pos_embed_interpolation 'cubic'.*'hf', 'jax', 'timm'"):
        load_checkpoint(keras_vit.build_vit(config), path, pos_embed_interpolation="cubic")
    with pytest.raises(ValueError, match="needs pretrained="):
        keras_vit.create_model(config, pos_embed_interpolation="jax")

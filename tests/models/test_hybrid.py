"""Hybrid ResNet+ViT models: the BiT stem's numerics and padding, parameter counts, and exact parity
with timm's `vision_transformer_hybrid` models on random weights."""

import dataclasses

import keras
import numpy as np
import pytest
from helpers import HYBRID_TIMM_NAMES, count_params_without_weights, load_into_scrambled, random_images
from helpers import checkpoint_writers as writers

import keras_vit
from keras_vit.checkpoints.common import stem_name_map, stem_weights
from keras_vit.checkpoints.errors import CheckpointError
from keras_vit.checkpoints.formats import FORMATS
from keras_vit.models.build import build_vit
from keras_vit.models.hybrid import STEM_NUMERICS, BottleneckUnit, StdConv2D, feature_map_size
from keras_vit.registry.variants import ViTConfig, architecture, get_config, variant_for

NPZ_STEM = FORMATS["google_npz"].stem  # how each format names a hybrid's ResNet stem
TIMM_STEM = FORMATS["timm"].stem
HYBRIDS = ["vit_r50_b16", "vit_r50_l32", "vit_r26_b32", "vit_r26_s32", "vit_r_ti16"]
# Exact counts at 224 px with the 1000-class head (paper configs as counted by timm).
REFERENCE_PARAMS = {
    "vit_r50_b16": 98_659_112,
    "vit_r50_l32": 328_994_856,
    "vit_r26_b32": 101_383_976,
    "vit_r26_s32": 36_431_912,
    "vit_r_ti16": 6_337_704,
}
# Max |logit difference| allowed against timm, float32: about twice the largest gap measured on the
# TensorFlow, JAX and PyTorch backends (the "parity gaps" `python -m pytest -n 0 -m "slow or not slow"
# tests/models/test_hybrid.py` lists).
TOLERANCE = 1e-5
TOLERANCES = {"vit_r_ti16": 3e-6}  # the stem-only R+Ti: its gaps are ~1.4e-6 at most
# The big hybrids' parity runs with 2 Transformer blocks (timm's and keras_vit's alike): the claim is the
# mapping of the real ResNet stem, width, heads and patching, which block 1 repeats for every later block
# (same keys, same code); 12 blocks cost ~10x the time and check nothing more. R+Ti keeps all 12.
PARITY_DEPTH = {"vit_r26_s32": 2, "vit_r50_b16": 2}
# A small hybrid with both unit kinds (projection and identity shortcut) for the cheap tests.
SMALL = ViTConfig("small_hybrid", 1, 64, 1, 2, 128, resnet_stages=(2, 1))


def _randomise(model, seed=1):
    """Random values for every weight, so GroupNorm affine parameters and the head matter."""
    rng = np.random.default_rng(seed)
    for variable in model.weights:
        noise = rng.normal(0, 0.1, variable.shape)
        if variable.path.endswith("gamma"):
            noise += 1.0
        variable.assign(noise.astype("float32"))


def _hw(size):
    return (size, size) if isinstance(size, int) else tuple(size)


# --- timm references -------------------------------------------------------------------------


_REFERENCES = {}


def _timm_reference(name):
    """A 224-px timm hybrid, norms, biases, tokens, head and stem kernels perturbed, and its state dict."""
    if name not in _REFERENCES:
        import timm
        import torch

        torch.manual_seed(0)
        reference = timm.create_model(
            HYBRID_TIMM_NAMES[name], pretrained=False, num_classes=1000, **_depth(name)
        )
        reference.eval()
        with torch.no_grad():
            for key, parameter in reference.named_parameters():
                if "norm" in key:
                    parameter.add_(0.1 * torch.randn_like(parameter))
                elif parameter.ndim < 2 or key in ("cls_token", "pos_embed") or key.startswith("head"):
                    parameter.copy_(0.02 * torch.randn_like(parameter))
                elif key.startswith("patch_embed.backbone."):
                    # Standardisation ignores the kernels' scale but not its epsilon: small kernels
                    # make the epsilons count (JAX numerics then differ from timm by > 1e-4).
                    parameter.mul_(0.02)
        state = {key: value.numpy().copy() for key, value in reference.state_dict().items()}
        _REFERENCES[name] = reference, state
    return _REFERENCES[name]


def _depth(name) -> dict:
    """timm's and keras_vit's `depth` argument for `name`'s parity models (none: the variant's own)."""
    return {"depth": PARITY_DEPTH[name]} if name in PARITY_DEPTH else {}


def _timm_at(name, size, state):
    """timm's model at another input size, loaded through its own `checkpoint_filter_fn`."""
    import timm
    import torch
    from timm.models.vision_transformer_hybrid import checkpoint_filter_fn

    model = timm.create_model(
        HYBRID_TIMM_NAMES[name], pretrained=False, num_classes=1000, img_size=size, **_depth(name)
    ).eval()
    tensors = {key: torch.from_numpy(value) for key, value in state.items()}
    model.load_state_dict(checkpoint_filter_fn(tensors, model))
    return model


@pytest.fixture(scope="module", autouse=True)
def _drop_references():
    yield
    _REFERENCES.clear()


PARITY_CASES = [
    pytest.param("vit_r26_s32", 224, id="vit_r26_s32-224", marks=pytest.mark.slow),  # native
    # 224 checkpoint, position embedding resampled; odd, non-square: TF-SAME padding differs per side
    pytest.param("vit_r26_s32", (225, 289), id="vit_r26_s32-(225, 289)", marks=pytest.mark.slow),
    # the paper's R50+ViT-B/16 (resized like the R26: same code; R50's stem, B's width and heads)
    pytest.param("vit_r50_b16", 224, id="vit_r50_b16-224", marks=pytest.mark.slow),
    pytest.param("vit_r50_b16", (289, 225), id="vit_r50_b16-(289, 225)", marks=pytest.mark.slow),
    # stem only: timm keys `patch_embed.backbone.conv/norm`
    pytest.param("vit_r_ti16", 224, id="vit_r_ti16-224"),
    pytest.param("vit_r_ti16", 288, id="vit_r_ti16-288"),
    # odd, non-square (timm's R+Ti needs a stem output divisible by its 8-px patches: 64x56 here)
    pytest.param("vit_r_ti16", (253, 221), id="vit_r_ti16-(253, 221)"),
]


@pytest.mark.parametrize("name,size", PARITY_CASES)
def test_logits_match_timm(name, size, tmp_path, parity):
    """Loaded from timm's safetensors and from the Google .npz of the same weights, at any size."""
    import torch

    reference, state = _timm_reference(name)
    height, width = _hw(size)
    if (height, width) != (224, 224):
        reference = _timm_at(name, (height, width), state)
    images = random_images(1, (height, width))
    with torch.no_grad():
        expected = reference(torch.from_numpy(images).permute(0, 3, 1, 2)).numpy()
    assert np.abs(expected).max() > 0.5  # the head and every norm really take part
    model = keras_vit.create_model(  # logits
        name, image_size=(height, width), classifier_activation=None, **_depth(name)
    )
    num_heads = model.get_layer("block_0").num_heads
    files = {
        "timm": writers.save_timm_safetensors(state, tmp_path / "model.safetensors"),
        "google_npz": writers.save_npz(
            writers.timm_to_google_npz(state, num_heads, groupnorm_4d=True), tmp_path / "model.npz"
        ),
    }
    for format_name, path in files.items():
        info = keras_vit.inspect_checkpoint(path)
        grid = (224 // get_config(name).stride,) * 2  # the checkpoint's own grid, whatever the model's
        assert (info.format, info.grid, architecture(info)) == (format_name, grid, architecture(model.config))
        # the variant's architecture: at its own depth, the file would be read as `name`
        assert variant_for(dataclasses.replace(info, depth=get_config(name).depth)) == name
        # timm's resampling for both files (a Google .npz defaults to the original code's)
        load_into_scrambled(model, path, pos_embed_interpolation="timm")  # nothing left from the last
        tolerance = TOLERANCES.get(name, TOLERANCE)
        parity(keras.ops.convert_to_numpy(model(images)), expected, tolerance, format_name)
    del model, reference
    keras.backend.clear_session()


@pytest.mark.backend_free  # timm and the test writer only: collected on TensorFlow only
@pytest.mark.parametrize("name", [pytest.param("vit_r26_s32", marks=pytest.mark.slow), "vit_r_ti16"])
def test_google_npz_writer_is_what_timm_loads(name, tmp_path):
    """The .npz the parity test writes is right: timm's own Google-checkpoint loader reproduces the model."""
    import timm
    import torch
    from timm.models.vision_transformer import _load_weights

    reference, state = _timm_reference(name)
    heads = reference.blocks[0].attn.num_heads
    path = writers.save_npz(writers.timm_to_google_npz(state, heads, groupnorm_4d=True), tmp_path / "m.npz")
    loaded = timm.create_model(
        HYBRID_TIMM_NAMES[name], pretrained=False, num_classes=1000, **_depth(name)
    ).eval()
    _load_weights(loaded, str(path))
    images = torch.from_numpy(random_images(1, (224, 224))).permute(0, 3, 1, 2)
    with torch.no_grad():
        np.testing.assert_array_equal(loaded(images).numpy(), reference(images).numpy())


def test_hybrid_and_plain_checkpoints_do_not_mix(tmp_path):
    _, state = _timm_reference("vit_r_ti16")
    with pytest.raises(CheckpointError, match="is a hybrid ResNet\\+ViT .* but model .* is a plain ViT"):
        keras_vit.load_checkpoint(keras_vit.vit_ti16(image_size=32), state)
    plain = {key: value for key, value in state.items() if not key.startswith("patch_embed.backbone.")}
    with pytest.raises(CheckpointError, match="is a hybrid ResNet\\+ViT but the timm checkpoint"):
        keras_vit.load_checkpoint(keras_vit.vit_r_ti16(image_size=64), plain)
    with pytest.raises(ValueError, match="vit_r_ti16 checkpoint: load it with keras_vit.vit_r_ti16"):
        keras_vit.vit_r26_s32(pretrained=writers.save_timm_safetensors(state, tmp_path / "ti.safetensors"))


@pytest.mark.parametrize("name", HYBRIDS)
def test_parameter_count_matches_reference(name):
    import timm
    import torch

    # Variable shapes only (no weights allocated): R50+ViT-L/32 alone would take 1.3 GB and seconds.
    assert count_params_without_weights(getattr(keras_vit, name)) == REFERENCE_PARAMS[name]
    with torch.device("meta"):  # shapes only: no memory, no init time
        reference = timm.create_model(HYBRID_TIMM_NAMES[name], pretrained=False, num_classes=1000)
    assert sum(p.numel() for p in reference.parameters()) == REFERENCE_PARAMS[name]


# --- the stem's building blocks --------------------------------------------------------------


@pytest.mark.parametrize("numerics", sorted(STEM_NUMERICS))
def test_weight_standardisation_formulas(numerics):
    epsilon, mode, _ = STEM_NUMERICS[numerics]
    layer = StdConv2D(4, 3, epsilon=epsilon, epsilon_mode=mode)
    layer.build((None, 8, 8, 2))
    # A small spread makes the two epsilon placements differ by ~1e-3 relative.
    kernel = np.random.default_rng(0).normal(0.3, 1e-2, (3, 3, 2, 4)).astype("float32")
    layer.kernel.assign(kernel)
    mean, std = kernel.mean(axis=(0, 1, 2)), kernel.std(axis=(0, 1, 2))
    timm_formula = (kernel - mean) / np.sqrt(std**2 + 1e-8)
    jax_formula = (kernel - mean) / (std + 1e-5)
    expected, other = (timm_formula, jax_formula) if mode == "variance" else (jax_formula, timm_formula)
    standardized = keras.ops.convert_to_numpy(layer.standardized_kernel())
    np.testing.assert_allclose(standardized, expected, rtol=2e-5, atol=2e-5)
    assert np.abs(standardized - other).max() > 1e-4


@pytest.mark.parametrize("height,width", [(224, 224), (225, 289), (17, 10)])
def test_conv_and_max_pool_pad_like_timm_same(height, width, parity):
    """Keras 'same' equals timm's TF-SAME `pad_same` (extra pad bottom/right; -inf for max-pool)."""
    import torch
    from timm.layers import StdConv2dSame
    from timm.layers.pool2d_same import MaxPool2dSame

    images = np.random.default_rng(0).normal(size=(1, height, width, 3)).astype("float32")
    ours = StdConv2D(8, 7, 2)
    reference = StdConv2dSame(3, 8, 7, stride=2, eps=1e-8)
    ours.build(images.shape)
    ours.kernel.assign(reference.weight.detach().numpy().transpose(2, 3, 1, 0))
    pool = keras.layers.MaxPooling2D(3, strides=2, padding="same")
    torch_images = torch.from_numpy(images).permute(0, 3, 1, 2)
    with torch.no_grad():
        expected_conv = reference(torch_images).permute(0, 2, 3, 1).numpy()
        # Negative inputs: a zero-padded max-pool would differ from the -inf padding at the border.
        expected_pool = MaxPool2dSame(3, 2)(-torch_images.abs()).permute(0, 2, 3, 1).numpy()
    parity(keras.ops.convert_to_numpy(ours(images)), expected_conv, 5e-5, "weight-standardised conv")
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(pool(-np.abs(images))), expected_pool)


def test_bottleneck_unit_matches_timm():
    from functools import partial

    import torch
    from timm.layers import GroupNormAct, StdConv2dSame
    from timm.models.resnetv2 import Bottleneck, DownsampleConv

    reference = Bottleneck(
        64,
        256,
        stride=2,
        conv_layer=partial(StdConv2dSame, eps=1e-8),
        norm_layer=partial(GroupNormAct, num_groups=32),
        proj_layer=DownsampleConv,
    ).eval()
    with torch.no_grad():
        for key, parameter in reference.named_parameters():
            if "norm" in key:
                parameter.add_(0.3 * torch.randn_like(parameter))
    unit = BottleneckUnit(64, strides=2)
    images = np.random.default_rng(0).normal(size=(2, 15, 12, 64)).astype("float32")
    unit.build(images.shape)
    names = {
        "conv1": "conv1",
        "conv2": "conv2",
        "conv3": "conv3",
        "downsample.conv": "conv_proj",
        "norm1": "gn1",
        "norm2": "gn2",
        "norm3": "gn3",
        "downsample.norm": "gn_proj",
    }
    for key, value in reference.state_dict().items():
        module, _, kind = key.rpartition(".")
        layer = getattr(unit, names[module])
        if isinstance(layer, StdConv2D):
            layer.kernel.assign(value.numpy().transpose(2, 3, 1, 0))
        else:
            getattr(layer, {"weight": "gamma", "bias": "beta"}[kind]).assign(value.numpy())
    with torch.no_grad():
        expected = reference(torch.from_numpy(images).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(keras.ops.convert_to_numpy(unit(images)), expected, atol=2e-5)


def test_numerics_option_sets_every_stem_epsilon():
    for numerics, (epsilon, mode, gn_epsilon) in STEM_NUMERICS.items():
        model = build_vit(dataclasses.replace(SMALL, numerics=numerics), image_size=64)
        convs = [layer for layer in model.layers if isinstance(layer, StdConv2D)]
        units = [layer for layer in model.layers if isinstance(layer, BottleneckUnit)]
        assert len(convs) == 1 and len(units) == 3
        assert (convs[0].epsilon, convs[0].epsilon_mode) == (epsilon, mode)
        assert model.get_layer("resnet_gn_root").epsilon == gn_epsilon
        for unit in units:
            assert (unit.conv2.epsilon, unit.conv2.epsilon_mode, unit.gn2.epsilon) == (
                epsilon,
                mode,
                gn_epsilon,
            )
    with pytest.raises(ValueError, match=r"unknown numerics 'flax'.*\['hf', 'jax', 'timm'\]"):
        build_vit(dataclasses.replace(SMALL, numerics="flax"), image_size=64)


def test_std_conv_rejects_unknown_epsilon_mode():
    with pytest.raises(ValueError, match="Unknown epsilon_mode 'var'"):
        StdConv2D(8, 3, epsilon_mode="var")


# --- model layout, sizes, serialisation, precision -------------------------------------------


def test_feature_map_and_token_grid():
    assert feature_map_size(get_config("vit_r50_b16"), 224, 224) == (14, 14)
    assert feature_map_size(get_config("vit_r50_b16"), 225, 289) == (15, 19)
    assert feature_map_size(get_config("vit_r26_s32"), 224, 384) == (7, 12)
    assert feature_map_size(get_config("vit_r_ti16"), 224, 224) == (56, 56)
    assert [get_config(name).stride for name in HYBRIDS] == [16, 32, 32, 32, 32]
    model = keras_vit.vit_r_ti16(image_size=(64, 96), num_classes=3)
    assert model.get_layer("pos_embed").embedding.shape == (1, 1 + 2 * 3, 192)
    assert model.get_layer("patch_embed").projection.kernel.shape == (8, 8, 64, 192)
    with pytest.raises(ValueError, match="not a hybrid"):
        feature_map_size(get_config("vit_b16"), 224, 224)


def test_image_size_that_misses_the_patch_grid_names_valid_sizes():
    with pytest.raises(ValueError, match=r"height 100 \(ResNet feature map 25\).*patch size 8.*96 or 128"):
        keras_vit.vit_r_ti16(image_size=100)


def test_hybrids_are_listed_and_exported():
    assert set(HYBRIDS) <= set(keras_vit.list_models())
    for name in HYBRIDS:
        assert getattr(keras_vit, name).__doc__


def test_keras_file_round_trip(tmp_path):
    model = build_vit(dataclasses.replace(SMALL, numerics="jax"), image_size=(64, 48), num_classes=5)
    _randomise(model)
    images = random_images(2, (64, 48))
    expected = keras.ops.convert_to_numpy(model(images))
    path = tmp_path / "hybrid.keras"
    model.save(path)
    keras.backend.clear_session()
    restored = keras.saving.load_model(path)
    assert isinstance(restored.get_layer("resnet_block1_unit1"), BottleneckUnit)
    assert restored.get_layer("resnet_conv_root").epsilon_mode == "std"
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(restored(images)), expected)


def test_mixed_bfloat16_runs_the_stem_in_bfloat16():
    reference = build_vit(SMALL, image_size=64, num_classes=5)
    _randomise(reference)
    images = random_images(2, (64, 64))
    expected = keras.ops.convert_to_numpy(reference(images))

    keras.config.set_dtype_policy("mixed_bfloat16")
    model = build_vit(SMALL, image_size=64, num_classes=5)
    model.set_weights(reference.get_weights())
    unit = model.get_layer("resnet_block1_unit1")
    assert unit.conv1.compute_dtype == "bfloat16" and unit.conv1.kernel.dtype == "float32"
    assert unit.gn1.compute_dtype == "bfloat16"
    stem = keras.Model(model.input, model.get_layer("resnet_block2_unit1").output)
    assert keras.ops.convert_to_numpy(stem(images)).dtype == "bfloat16"
    logits = keras.ops.convert_to_numpy(model(images))
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, expected, atol=0.05 * np.abs(expected).max())


# --- checkpoint name maps --------------------------------------------------------------------


def test_google_npz_map_loads_what_the_timm_map_loads():
    _, state = _timm_reference("vit_r26_s32")
    model = keras_vit.vit_r26_s32(image_size=64)
    from_timm = {variable.path: value for variable, value in stem_weights(state, TIMM_STEM, model)}
    npz = {}
    for key, value in state.items():
        if key.startswith("patch_embed.backbone."):
            value = value.transpose(2, 3, 1, 0) if value.ndim == 4 else value.reshape(1, 1, 1, -1)
            npz["opt/target/" + writers.timm_stem_key_to_npz(key)] = (
                value  # (1,1,1,C) GroupNorm, as pre-0.3.6 Flax
            )
    from_npz = {
        variable.path: value for variable, value in stem_weights(npz, NPZ_STEM, model, prefix="opt/target/")
    }
    assert len(from_npz) == len(from_timm) == len(stem_name_map(model, TIMM_STEM)) == 3 + 8 * 9 + 4 * 3
    assert from_npz.keys() == from_timm.keys()
    for path, value in from_timm.items():
        np.testing.assert_array_equal(from_npz[path], value)


def test_stem_weights_errors_name_the_problem():
    model = build_vit(SMALL, image_size=64)
    state = {key: np.zeros(variable.shape) for key, variable in stem_name_map(model, NPZ_STEM).items()}
    assert "block1/unit2/conv2/kernel" in state and "block1/unit2/conv_proj/kernel" not in state
    deeper = build_vit(dataclasses.replace(SMALL, resnet_stages=(2, 2)), image_size=64)
    with pytest.raises(CheckpointError, match=r"lacks 9 of the 45 ResNet stem weights.*block2/unit2/conv1"):
        stem_weights(state, NPZ_STEM, deeper)
    deeper_state = {
        key: np.zeros(variable.shape) for key, variable in stem_name_map(deeper, TIMM_STEM).items()
    }
    deeper_state["patch_embed.proj.weight"] = np.zeros((64, 512, 1, 1))  # not a stem key: ignored
    with pytest.raises(CheckpointError, match=r"9 ResNet stem weights that .* lacks.*stages\.1\.blocks\.1"):
        stem_weights(deeper_state, TIMM_STEM, model)
    state["block1/unit1/conv2/kernel"] = np.zeros((3, 3, 64, 32))
    with pytest.raises(CheckpointError, match=r"1 shapes differ.*conv2/kernel: checkpoint \(3, 3, 64, 32\)"):
        stem_weights(state, NPZ_STEM, model)
    with pytest.raises(CheckpointError, match="no hybrid ResNet stem"):
        stem_weights(state, NPZ_STEM, keras_vit.vit_ti16(image_size=32))
    assert FORMATS["hf"].stem is None  # transformers files hold no hybrids

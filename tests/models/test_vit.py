"""The model family: factories, shapes, precision, serialisation and input errors."""

import subprocess
import sys

import keras
import numpy as np
import pytest
from helpers import TIMM_NAMES, count_params_without_weights, random_images

import keras_vit
from keras_vit.registry.variants import VARIANTS

PLAIN = [
    "vit_ti16",
    "vit_s16",
    "vit_s32",
    "vit_s8",
    "vit_b8",
    "vit_b16",
    "vit_b32",
    "vit_l16",
    "vit_l32",
    "vit_h14",
]

# Exact counts at 224 px with the 1000-class head, from timm / the paper's reference code.
REFERENCE_PARAMS = {
    "vit_ti16": 5_717_416,
    "vit_s16": 22_050_664,
    "vit_s32": 22_878_952,
    "vit_s8": 22_055_272,
    "vit_b8": 86_576_872,
    "vit_b16": 86_567_656,
    "vit_b32": 88_224_232,
    "vit_l16": 304_326_632,
    "vit_l32": 306_535_400,
    "vit_h14": 632_045_800,
}


def _randomise_head(model):
    head = model.get_layer("head")
    rng = np.random.default_rng(1)
    head.set_weights([rng.normal(0, 0.02, w.shape).astype("float32") for w in head.get_weights()])


def test_list_models_has_every_factory():
    names = keras_vit.list_models()
    assert set(PLAIN) <= set(names)
    assert names == sorted(VARIANTS)
    for name in names:
        assert callable(getattr(keras_vit, name)), name


def _timm_param_count(timm_name: str) -> int:
    import timm
    import torch

    with torch.device("meta"):  # shapes only: no memory, no init time
        reference = timm.create_model(timm_name, pretrained=False, num_classes=1000)
    return sum(p.numel() for p in reference.parameters())


@pytest.mark.parametrize("name", PLAIN)
def test_parameter_count_matches_reference(name):
    # Variable shapes only (no weights allocated): ViT-H/14 alone would take 2.5 GB and seconds.
    count = count_params_without_weights(getattr(keras_vit, name))
    assert count == REFERENCE_PARAMS[name]
    assert count == _timm_param_count(TIMM_NAMES[name])


def test_parameter_count_without_weights_is_the_built_models():
    built = keras_vit.vit_ti16().count_params()
    assert count_params_without_weights(keras_vit.vit_ti16) == built == REFERENCE_PARAMS["vit_ti16"]


@pytest.mark.parametrize("size", [224, 384])
def test_forward_gives_logits(size):
    model = keras_vit.vit_ti16(image_size=size, num_classes=7)
    out = model(random_images(size=(size, size)))
    assert out.shape == (2, 7)
    assert model.get_layer("pos_embed").embedding.shape == (1, 1 + (size // 16) ** 2, 192)


def test_vit_b16_forward_and_head_is_zero():
    model = keras_vit.vit_b16(classifier_activation=None)  # logits (the factories default to softmax)
    logits = keras.ops.convert_to_numpy(model(random_images()))
    assert logits.shape == (2, 1000)
    np.testing.assert_array_equal(logits, 0.0)  # zero-initialised head (paper §3.2)


def test_non_square_images():
    model = keras_vit.vit_s32(image_size=(224, 320), num_classes=5)
    assert model(random_images(size=(224, 320))).shape == (2, 5)
    assert model.get_layer("pos_embed").grid_size == (7, 10)


@pytest.mark.parametrize(
    "kwargs, shape",
    [
        (dict(pooling="token"), (2, 192)),
        (dict(pooling="gap"), (2, 192)),
        (dict(pooling=None), (2, 197, 192)),
        (dict(pooling="token", representation_size=64), (2, 64)),
    ],
)
def test_include_top_false_outputs(kwargs, shape):
    model = keras_vit.vit_ti16(include_top=False, **kwargs)
    assert model(random_images()).shape == shape
    assert model.output_shape == (None, *shape[1:])


def test_pooling_semantics_match_numpy():
    tokens_model = keras_vit.vit_ti16(include_top=False, pooling=None)
    gap_model = keras_vit.vit_ti16(include_top=False, pooling="gap")
    token_model = keras_vit.vit_ti16(include_top=False, pooling="token")
    gap_model.set_weights(tokens_model.get_weights())
    token_model.set_weights(tokens_model.get_weights())
    x = random_images()
    tokens = keras.ops.convert_to_numpy(tokens_model(x))
    to_numpy = keras.ops.convert_to_numpy
    np.testing.assert_allclose(to_numpy(gap_model(x)), tokens[:, 1:].mean(axis=1), atol=1e-5)
    np.testing.assert_allclose(to_numpy(token_model(x)), tokens[:, 0], atol=1e-6)


def test_representation_layer_and_classifier_activation():
    model = keras_vit.vit_ti16(representation_size=192, num_classes=4, classifier_activation="softmax")
    assert model.get_layer("pre_logits").units == 192
    _randomise_head(model)
    probs = keras.ops.convert_to_numpy(model(random_images()))
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_gives_float32_logits(policy):
    keras.config.set_dtype_policy(policy)
    model = keras_vit.vit_ti16(num_classes=3)
    _randomise_head(model)
    block = model.get_layer("block_0")
    assert block.compute_dtype == policy.split("_")[1]
    assert block.attention.query_dense.kernel.dtype == "float32"
    logits = model(random_images())
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    assert np.isfinite(keras.ops.convert_to_numpy(logits)).all()


@pytest.mark.slow
def test_mixed_precision_trains_one_step():
    keras.config.set_dtype_policy("mixed_bfloat16")
    # A two-block model: tracing a training step costs ~0.1 s per variable in TF, the math is the same.
    tiny = keras_vit.ViTConfig(
        "vit_tiny_test", patch_size=8, hidden_size=32, depth=2, num_heads=2, mlp_dim=64
    )
    model = keras_vit.build_vit(tiny, image_size=64, num_classes=3, dropout=0.1, drop_path_rate=0.1)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")  # the softmax head's default
    history = model.fit(random_images(4, (64, 64)), np.array([0, 1, 2, 0]), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


@pytest.mark.slow
def test_keras_file_round_trip(tmp_path):
    model = keras_vit.vit_ti16(image_size=(64, 96), num_classes=4, representation_size=32, drop_path_rate=0.1)
    _randomise_head(model)
    x = random_images(size=(64, 96))
    expected = keras.ops.convert_to_numpy(model(x))
    path = tmp_path / "vit.keras"
    model.save(path)
    restored = keras.models.load_model(path)  # no custom_objects: registered on import
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(restored(x)), expected)
    assert restored.get_layer("block_11").get_config() == model.get_layer("block_11").get_config()

    # A fresh process that only imports keras_vit loads it too, with safe_mode on.
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "expected.npy", expected)
    script = (
        "import keras, numpy as np, keras_vit\n"
        f"m = keras.models.load_model(r'{path}', safe_mode=True)\n"
        f"x = np.load(r'{tmp_path / 'x.npy'}'); e = np.load(r'{tmp_path / 'expected.npy'}')\n"
        "np.testing.assert_array_equal(keras.ops.convert_to_numpy(m(x)), e)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, timeout=300)


def test_image_size_not_divisible_by_patch():
    with pytest.raises(ValueError, match=r"225 is not divisible by the patch size 16.*224 or 240"):
        keras_vit.vit_b16(image_size=225)
    with pytest.raises(ValueError, match=r"width 300 is not divisible by the patch size 32"):
        keras_vit.vit_b32(image_size=(224, 300))


def test_channel_mismatch_names_the_fix():
    model = keras_vit.vit_ti16(image_size=32, num_classes=2)
    with pytest.raises(
        ValueError,
        match=r"takes images of shape \(batch, 32, 32, 3\), got shape \(2, 32, 32, 1\).*channels=1",
    ):
        model(random_images(size=(32, 32), channels=1))
    grayscale = keras_vit.vit_ti16(image_size=32, num_classes=2, channels=1)
    assert grayscale(random_images(size=(32, 32), channels=1)).shape == (2, 2)
    with pytest.raises(ValueError, match=r"channels .*must be an integer >= 1"):
        keras_vit.vit_ti16(channels=0)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match=r"Unknown pooling 'max'.*'token'.*'gap'"):
        keras_vit.vit_ti16(pooling="max")
    with pytest.raises(ValueError, match="pooling=None .* include_top=False"):
        keras_vit.vit_ti16(pooling=None)
    with pytest.raises(ValueError, match=r"Unknown ViT variant 'vit_x16'.*vit_b16"):
        keras_vit.create_model("vit_x16")
    with pytest.raises(ValueError, match="image_size must be an int or a"):
        keras_vit.vit_ti16(image_size="big")


@pytest.mark.slow
def test_xla_compiled_predict_matches_eager():
    model = keras_vit.vit_ti16(image_size=64, num_classes=3)
    _randomise_head(model)
    x = random_images(size=(64, 64))
    eager = keras.ops.convert_to_numpy(model(x))
    model.compile(jit_compile=True)
    np.testing.assert_allclose(model.predict(x, verbose=0), eager, atol=1e-5)

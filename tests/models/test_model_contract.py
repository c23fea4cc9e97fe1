"""The model contract (`keras_vit.ViT` carries its config and names its parts), the registry, lazy imports."""

import json
import os
import subprocess
import sys
import warnings
import zipfile

import keras
import numpy as np
import pytest
from helpers import REPO, random_images

import keras_vit
from keras_vit import ViT, ViTConfig

TINY = ViTConfig(
    "tiny_contract", patch_size=4, hidden_size=16, depth=2, num_heads=2, mlp_dim=32, image_size=16
)
TINY_HYBRID = ViTConfig(
    "tiny_hybrid_contract", 1, 32, 1, 2, 64, resnet_stages=(1, 2), image_size=32
)  # root, stage 1 (1 unit), stage 2 (2 units)


def _randomised(model: keras.Model, seed: int = 0) -> keras.Model:
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        weight.assign(rng.normal(0, 0.2, weight.shape).astype("float32"))
    return model


def test_every_registry_row_has_a_one_line_factory():
    assert keras_vit.list_models() == sorted(keras_vit.VARIANTS)
    assert "vit_digits" in keras_vit.list_models()  # the small CPU model lives in the same registry
    for name, config in keras_vit.VARIANTS.items():
        factory = getattr(keras_vit, name)
        assert factory.__name__ == name and config.description in factory.__doc__
        assert config.name == name
    model = keras_vit.vit_digits(num_classes=10)
    assert isinstance(model, ViT) and model.config == keras_vit.VARIANTS["vit_digits"]
    assert model.output_shape == (None, 10) and model.name == "vit_digits"


def test_model_carries_its_config_and_parts_by_role():
    model = keras_vit.build_vit(TINY, image_size=(16, 24), num_classes=3, representation_size=8)
    assert model.config == TINY.replace(image_size=(16, 24)) and model.image_shape == (16, 24, 3)
    assert model.patch_embed.patch_size == 4 and model.pos_embed.grid_size == (4, 6)
    assert [block.name for block in model.blocks] == ["block_0", "block_1"]
    assert model.class_token is not None and model.encoder_norm.epsilon == 1e-6
    assert model.pool.mode == "token" and model.pre_logits.units == 8 and model.head.units == 3
    assert model.stem == {}
    features = keras_vit.build_vit(TINY, include_top=False, pooling=None)
    assert features.head is None and features.pool is None and features.output_shape == (None, 17, 16)


def test_hybrid_stem_by_original_checkpoint_names():
    model = keras_vit.build_vit(TINY_HYBRID)
    assert list(model.stem) == ["conv_root", "gn_root", "block1/unit1", "block2/unit1", "block2/unit2"]
    assert model.stem["block2/unit1"].strides == 2 and model.stem["block2/unit2"].strides == 1
    assert model.stem["conv_root"].filters == 64 and model.patch_embed.input.shape[1:3] == (4, 4)


def test_class_token_free_model_pools_the_patches():
    model = _randomised(keras_vit.build_vit(TINY, class_token=False, pooling="gap", num_classes=3))
    assert model.class_token is None and model.pos_embed.num_prefix_tokens == 0
    assert model.pos_embed.embedding.shape == (1, 16, 16)
    tokens = model.token_model()(random_images(2, (16, 16), seed=1))
    pooled = keras.ops.convert_to_numpy(model.feature_model()(random_images(2, (16, 16), seed=1)))
    np.testing.assert_allclose(pooled, keras.ops.convert_to_numpy(tokens).mean(axis=1), atol=1e-6)
    with pytest.raises(ValueError, match="pooling='token' reads the \\[class\\] token.*pooling='gap'"):
        keras_vit.build_vit(TINY, class_token=False)


def test_keras_round_trip_keeps_the_config(tmp_path):
    for config in (TINY.replace(pooling="gap"), TINY_HYBRID.replace(numerics="jax")):
        model = _randomised(keras_vit.build_vit(config, num_classes=5, dropout=0.1, pretrained_tag="x.y"))
        path = tmp_path / f"{config.name}.keras"
        model.save(path)
        loaded = keras.saving.load_model(path)
        assert type(loaded) is ViT and loaded.config == model.config
        assert loaded.get_config() == model.get_config() and loaded.pretrained_tag == "x.y"
        images = random_images(2, (config.image_hw[0],) * 2, seed=1)
        np.testing.assert_array_equal(loaded.predict(images, verbose=0), model.predict(images, verbose=0))
        saved = json.loads(zipfile.ZipFile(path).read("config.json"))
        assert saved["class_name"] == "ViT" and saved["config"]["config"]["name"] == config.name


def test_compiled_forward_is_pytorchs_and_refused_elsewhere_naming_what_to_use():
    model = keras_vit.build_vit(TINY, num_classes=3)
    model.compile(jit_compile=True)  # XLA on TensorFlow and JAX, the compiled forward pass on PyTorch
    assert model.compiled_forward == (keras.backend.backend() == "torch")
    if keras.backend.backend() != "torch":
        with pytest.raises(ValueError, match=r"PyTorch's torch.compile .* use compile\(jit_compile=True\)"):
            model.compiled_forward = True
        assert not model.compiled_forward
    model.compile(jit_compile=False)
    assert not model.compiled_forward


def test_a_compiled_model_loads_compiled_with_its_optimizer_state(tmp_path):
    """`ViT` overrides `compile` (PyTorch's compiled forward pass), so it restores the compile
    config itself: Keras skips a custom `compile` on load, with only a warning."""
    model = _randomised(keras_vit.build_vit(TINY, num_classes=3, classifier_activation=None))
    model.compile(
        optimizer=keras.optimizers.AdamW(2e-3, weight_decay=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    images, labels = random_images(4, (16, 16), seed=2), np.arange(4) % 3
    model.fit(images, labels, batch_size=2, epochs=1, verbose=0)
    model.save(tmp_path / "compiled.keras")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "compile() was not called as part of model loading"
        loaded = keras.saving.load_model(tmp_path / "compiled.keras")
    assert loaded.compiled and isinstance(loaded.optimizer, keras.optimizers.AdamW)
    assert float(loaded.optimizer.learning_rate) == float(model.optimizer.learning_rate)
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 2
    for got, expected in zip(loaded.optimizer.variables, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(got), keras.ops.convert_to_numpy(expected))
    assert loaded.evaluate(images, labels, verbose=0)  # compiled: loss and metric


def test_with_head_and_without_head_copy_the_weights():
    model = _randomised(keras_vit.build_vit(TINY, num_classes=5))
    before = [w.copy() for w in model.get_weights()]
    classifier = model.with_head(7, drop_path_rate=0.1)
    assert isinstance(classifier, ViT) and classifier.head.units == 7 and classifier.drop_path_rate == 0.1
    assert not np.any(keras.ops.convert_to_numpy(classifier.head.kernel))  # a new zero head (paper §3.2)
    for ours, theirs in zip(classifier.blocks, model.blocks, strict=True):
        for a, b in zip(ours.get_weights(), theirs.get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
    tokens = model.without_head(pooling=None)
    assert tokens.output_shape == (None, 17, 16) and tokens.config.pooling is None
    np.testing.assert_array_equal(
        tokens.predict(random_images(1, (16, 16), seed=1), verbose=0),
        model.token_model().predict(random_images(1, (16, 16), seed=1), verbose=0),
    )
    features = model.without_head()
    np.testing.assert_array_equal(
        features.predict(random_images(1, (16, 16), seed=1), verbose=0),
        model.feature_model().predict(random_images(1, (16, 16), seed=1), verbose=0),
    )
    for a, b in zip(model.get_weights(), before, strict=True):  # the original is untouched
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="Unknown argument"):
        model.rebuild(colour="blue")


def test_views_share_the_weights():
    """A weight changed on the model changes the view's output: the view holds the same variables."""
    model = _randomised(keras_vit.build_vit(TINY, num_classes=5))
    view = model.feature_model()
    assert view.get_layer("block_0") is model.blocks[0]
    images = random_images(2, (16, 16), seed=1)
    before = keras.ops.convert_to_numpy(view(images))
    model.blocks[0].norm1.gamma.assign(np.zeros(16, "float32"))
    after = keras.ops.convert_to_numpy(view(images))
    expected = keras.ops.convert_to_numpy(model.feature_model()(images))
    assert np.abs(after - before).max() > 1e-3  # the zeroed scale reached the view
    np.testing.assert_array_equal(after, expected)


def test_config_and_factory_arguments_are_checked():
    with pytest.raises(TypeError, match="Unknown argument.*'colour'"):
        keras_vit.vit_digits(colour="blue")
    with pytest.raises(TypeError, match="Unknown ViTConfig field"):
        TINY.replace(width=3)
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        TINY.replace(num_heads=3)
    with pytest.raises(TypeError, match="config must be a keras_vit.ViTConfig"):
        ViT("vit_b16")
    with pytest.raises(ValueError, match="not a keras_vit.ViT"):
        keras_vit.load_weights(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), "x.npz")


def _run(code: str) -> str:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_import_and_cli_help_load_neither_tensorflow_nor_keras():
    out = _run(
        "import contextlib, io, sys\n"
        "import keras_vit\n"
        "from keras_vit import cli\n"
        "assert keras_vit.list_models() and keras_vit.ViTConfig\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    cli.main(['models'])\n"
        "    try:\n"
        "        cli.main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('tensorflow', 'keras', 'torch', 'jax') if m in sys.modules))\n"
    )
    assert out.strip() == "[]"


def test_load_model_in_a_fresh_process(tmp_path):
    path = tmp_path / "tiny.keras"
    model = _randomised(keras_vit.build_vit(TINY, num_classes=3))
    model.save(path)
    expected = model.predict(random_images(1, (16, 16), seed=1), verbose=0)
    np.save(tmp_path / "images.npy", random_images(1, (16, 16), seed=1))
    images = str(tmp_path / "images.npy")
    out = _run(
        "import numpy as np, keras_vit\n"
        f"model = keras_vit.load_model({str(path)!r})\n"
        f"logits = model.predict(np.load({images!r}), verbose=0)[0]\n"
        "print(type(model).__name__, model.config.name, *logits)\n"
    )
    name, config_name, *logits = out.split()
    assert (name, config_name) == ("ViT", "tiny_contract")
    np.testing.assert_allclose(np.array(logits, dtype="float32"), expected[0], rtol=1e-6)


def test_onnx_export_of_a_model_never_called_gives_its_logits(tmp_path):
    """`model.export(format="onnx")` straight after building (Keras's exporter asks for a model called
    once), run by onnxruntime at two batch sizes: the model's logits. TensorFlow converts with tf2onnx;
    PyTorch traces the model's direct PyTorch path, without the TracerWarnings Keras means to silence.
    JAX's exporter needs jax2onnx, which the test set-up does not install."""
    if keras.backend.backend() == "jax":
        pytest.skip("ONNX export on JAX needs jax2onnx (not installed)")
    import onnxruntime

    model = _randomised(keras_vit.build_vit(TINY, num_classes=3, classifier_activation=None))
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.export(str(path), format="onnx", verbose=False)
    assert not [w for w in caught if type(w.message).__name__ == "TracerWarning"]
    session = onnxruntime.InferenceSession(str(path))
    name = session.get_inputs()[0].name
    for batch in (1, 3):
        images = random_images(batch, (16, 16), seed=batch)
        expected = keras.ops.convert_to_numpy(model(images))
        np.testing.assert_allclose(session.run(None, {name: images})[0], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_every_layer_computes_in_its_policy_dtype(policy):
    keras.config.set_dtype_policy(policy)
    for config in (TINY, TINY_HYBRID):
        model = _randomised(keras_vit.build_vit(config, num_classes=3, classifier_activation=None))
        images = random_images(1, config.image_hw)
        wrong = []
        for layer in model.layers[1:]:
            output = keras.Model(model.input, layer.output)(images)
            if keras.backend.standardize_dtype(output.dtype) != layer.compute_dtype:
                wrong.append((layer.name, str(output.dtype), layer.compute_dtype))
        assert not wrong, wrong
        logits = model(images)
        assert keras.backend.standardize_dtype(logits.dtype) == "float32"  # the float32 head
        assert np.all(np.isfinite(keras.ops.convert_to_numpy(logits)))

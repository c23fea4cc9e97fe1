"""Post-training quantization (`model.quantize`) and LoRA (`keras_vit.enable_lora`) of keras_vit models.

Backend-neutral: Keras and NumPy only (torch and timm, when installed, only write the reference
checkpoint of the photo test). Quantized models are compared with the float model on the same
inputs: the logits' relative error and the top-1 agreement, on real photos through a converted
(random-weight) timm checkpoint and on held-out digits with a model trained for a few seconds here
(random weights have no meaningful top-1).
"""

from __future__ import annotations

import gc

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit.deploy.lora import LORA_TARGETS, lora_layers, lora_parameter_count, max_lora_rank
from keras_vit.models.vit import ViT

# `Model.quantize` warns about every layer Keras cannot quantize (LayerNormalization, Conv2D, ...).
pytestmark = pytest.mark.filterwarnings("ignore:Layer .* does not have a `quantize` method")

# A digits-sized ViT: 8x8 images, 2x2 grid of 4-px patches, 2 blocks (trains in a few seconds).
SMALL = dict(image_size=8, patch_size=4, depth=2, hidden_size=64, num_heads=4, mlp_dim=128)
# Relative logit error (`_relative_error`) and top-1 agreement with the float model, per mode.
BOUNDS = {"int8": (0.03, 0.98), "int8_weight_only": (0.03, 0.98), "int4": (0.2, 0.95), "float8": (0.15, 0.95)}


def _relative_error(reference: np.ndarray, actual: np.ndarray) -> float:
    """||actual - reference|| / ||reference|| over all rows, each centred (a logit offset is free)."""
    reference = reference - reference.mean(axis=1, keepdims=True)
    actual = actual - actual.mean(axis=1, keepdims=True)
    return float(np.linalg.norm(actual - reference) / np.linalg.norm(reference))


def _quantize(model: keras.Model, mode: str) -> None:
    """`model.quantize(mode)` with the garbage collector's objects frozen meanwhile.

    `"int8_weight_only"`: int8 weights, float activations (`activation_quantizer=None`).

    Keras runs a full `gc.collect()` for every kernel it replaces (`Layer.__delattr__`): with
    TensorFlow, torch and timm loaded that is ~0.5 s per layer, about a minute for ViT-Ti/16.
    Frozen objects are not scanned, so the collections take milliseconds.
    """
    gc.freeze()
    try:
        if mode == "int8_weight_only":
            model.quantize(config=keras.quantizers.Int8QuantizationConfig(activation_quantizer=None))
        else:
            model.quantize(mode)
    finally:
        gc.unfreeze()


def _agreement(reference: np.ndarray, actual: np.ndarray) -> float:
    return float(np.mean(reference.argmax(axis=1) == actual.argmax(axis=1)))


def _digits(num_train: int = 1400):
    """sklearn's 8x8 digits as RGB in [-1, 1]: (train images, train labels), (test images, labels)."""
    from sklearn import datasets

    digits = datasets.load_digits()
    images = np.repeat((digits.images / 8.0 - 1.0).astype("float32")[..., None], 3, axis=-1)
    labels = digits.target.astype("int32")
    return (images[:num_train], labels[:num_train]), (images[num_train:], labels[num_train:])


def _small_model(**kwargs) -> ViT:
    # logits (the factories default to softmax): the tests train with a from-logits loss
    return keras_vit.vit_digits(num_classes=10, **{"classifier_activation": None, **SMALL, **kwargs})


@pytest.fixture(scope="module")
def trained():
    """A small ViT trained for 200 steps on digits (~90% test accuracy), and the test split."""
    keras.utils.set_random_seed(0)
    (train_x, train_y), test = _digits()
    model = _small_model()
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    order = np.random.default_rng(0).integers(0, len(train_x), 200 * 64)
    model.fit(train_x[order], train_y[order], batch_size=64, epochs=1, verbose=0)
    return model, test


def _float_copy(model: ViT) -> ViT:
    return model.rebuild()


def _randomized(model: keras.Model, seed: int = 0, scale: float = 0.02) -> keras.Model:
    """Perturb every weight, so no bias is 0 and no LayerNorm scale is 1."""
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        weight.assign(weight.numpy() + rng.normal(0.0, scale, weight.shape).astype("float32"))
    return model


# ------------------------------------------------------------------------------------- quantization


def test_attention_sublayer_path_equals_fused_path(rng):
    """The quantized models' attention path (the `EinsumDense` calls) computes what the fused GEMM does."""
    layer = keras_vit.MultiHeadSelfAttention(4)
    tokens = rng.normal(size=(2, 5, 32)).astype("float32")
    layer.build(tokens.shape)
    layer.set_weights([rng.normal(0.0, 0.3, w.shape).astype("float32") for w in layer.get_weights()])
    fused, fused_scores = layer(tokens, return_attention_scores=True)
    assert not layer._runs_sublayers()
    called, called_scores = layer._call_sublayers(tokens, training=False, return_attention_scores=True)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(called), keras.ops.convert_to_numpy(fused), atol=1e-5
    )
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(called_scores), keras.ops.convert_to_numpy(fused_scores), atol=1e-6
    )


def test_int8_quantizes_every_dense_but_not_the_patch_projection():
    model = _randomized(_small_model())
    _quantize(model, "int8")
    block = model.blocks[0]
    assert all(dense.quantization_mode == "int8" for dense in (*lora_layers(model, LORA_TARGETS), model.head))
    assert block.attention._runs_sublayers()
    # Keras does not quantize convolutions: the patch embedding (read as a matrix) stays float.
    assert model.patch_embed.projection.quantization_mode is None
    assert keras.backend.standardize_dtype(model.patch_embed.projection.kernel.dtype) == "float32"
    images = np.random.default_rng(0).uniform(-1, 1, (2, 8, 8, 3)).astype("float32")
    assert np.isfinite(keras.ops.convert_to_numpy(model(images))).all()


def test_weight_only_int8_multiplies_float_activations_by_rounded_weights(rng):
    """Each Dense keeps the float kernel rounded to int8 per output channel (scale 127 / max |w|) and
    multiplies float activations by it: the layer's output is `x @ (int8 / scale) + bias`."""
    model = _randomized(_small_model())
    denses = [layer for block in model.blocks for layer in (block.fc1, block.fc2)] + [model.head]
    kernels = [keras.ops.convert_to_numpy(dense.kernel) for dense in denses]
    _quantize(model, "int8_weight_only")
    for dense, kernel in zip(denses, kernels, strict=True):
        assert keras.backend.standardize_dtype(dense._kernel.dtype) == "int8", dense.path
        scale = keras.ops.convert_to_numpy(dense.kernel_scale)
        np.testing.assert_allclose(scale, 127 / np.abs(kernel).max(axis=0), rtol=1e-5)
        weights = keras.ops.convert_to_numpy(dense._kernel).astype("float32") / scale
        assert np.all(np.abs(weights - kernel) <= 0.5 / scale + 1e-7), dense.path  # rounded, not clipped
        inputs = rng.normal(size=(3, kernel.shape[0])).astype("float32")
        expected = inputs @ weights + keras.ops.convert_to_numpy(dense.bias)
        # quantized activations would be ~1e-2 off
        np.testing.assert_allclose(keras.ops.convert_to_numpy(dense(inputs)), expected, atol=1e-5, rtol=1e-5)


def test_quantize_model_built_from_config(tmp_path):
    """A loaded model's call never ran: its weightless sublayers (DropPath, Dropout) are built anyway."""
    path = tmp_path / "float.keras"
    _small_model(drop_path_rate=0.1, dropout=0.1).save(path)
    model = keras_vit.load_model(path)
    assert all(layer.built for layer in model._flatten_layers())
    _quantize(model, "int8")
    assert model.blocks[-1].fc2.quantization_mode == "int8"


@pytest.mark.parametrize("mode", sorted(BOUNDS))
def test_quantized_trained_model_agrees_with_float(mode, trained):
    trained_model, (images, labels) = trained
    model = _float_copy(trained_model)
    reference = keras.ops.convert_to_numpy(model.predict(images, batch_size=128, verbose=0))
    accuracy = np.mean(reference.argmax(axis=1) == labels)
    assert accuracy > 0.8
    _quantize(model, mode)
    logits = keras.ops.convert_to_numpy(model.predict(images, batch_size=128, verbose=0))
    max_error, min_agreement = BOUNDS[mode]
    error, agreement = _relative_error(reference, logits), _agreement(reference, logits)
    quantized_accuracy = np.mean(logits.argmax(axis=1) == labels)
    print(
        f"{mode}: relative logit error {error:.4f}, top-1 agreement {agreement:.4f} on {len(images)} "
        f"digits (accuracy {accuracy:.4f} float, {quantized_accuracy:.4f} {mode})"
    )
    assert error < max_error
    assert agreement >= min_agreement


def _photos(size: int) -> np.ndarray:
    """11 real photos (scikit-image's and scikit-learn's samples), preprocessed as the models expect."""
    from skimage import data as skimage_data
    from sklearn import datasets

    names = ("astronaut", "chelsea", "coffee", "rocket", "cat", "immunohistochemistry", "hubble_deep_field")
    pictures = [getattr(skimage_data, name)() for name in names]
    pictures += [skimage_data.camera(), skimage_data.horse().astype("uint8") * 255]  # grayscale
    pictures += list(datasets.load_sample_images().images)  # china, flower
    return keras_vit.preprocess_input(np.stack([keras_vit.load_image(picture, size) for picture in pictures]))


@pytest.mark.parametrize("variant", ["vit_ti16", "vit_r_ti16"])
def test_int8_on_photos_through_a_checkpoint(variant, tmp_path):
    """A (random-weight) timm checkpoint, converted and quantized: logits and features stay close."""
    import timm
    import torch
    from helpers import HYBRID_TIMM_NAMES
    from helpers import checkpoint_writers as writers

    if variant in HYBRID_TIMM_NAMES:
        torch.manual_seed(0)
        reference = writers.perturb_(timm.create_model(HYBRID_TIMM_NAMES[variant], pretrained=False))
    else:
        reference = writers.random_timm_vit(variant)
    path = writers.save_timm_safetensors(reference, tmp_path / "model.safetensors")
    images = _photos(224)
    model = getattr(keras_vit, variant)(pretrained=str(path), classifier_activation=None)
    view = keras.Model(model.input, [model.output, model.pool.output])  # logits and pooled features
    logits, features = (keras.ops.convert_to_numpy(x) for x in view(images))
    _quantize(model, "int8")
    quantized, quantized_features = (keras.ops.convert_to_numpy(x) for x in view(images))
    error, feature_error = _relative_error(logits, quantized), _relative_error(features, quantized_features)
    agreement = _agreement(logits, quantized)
    print(
        f"{variant} int8: logits {error:.4f}, features {feature_error:.4f}, top-1 agreement {agreement:.3f}"
    )
    assert feature_error < 0.05
    assert error < 0.05
    assert agreement >= 0.8


@pytest.mark.parametrize("mode", ["int8", "int8_weight_only", "int4", "float8"])
def test_quantized_keras_round_trip(mode, tmp_path):
    model = _randomized(_small_model())
    _quantize(model, mode)
    images = np.random.default_rng(0).uniform(-1, 1, (4, 8, 8, 3)).astype("float32")
    expected = keras.ops.convert_to_numpy(model(images))
    model.save(tmp_path / "quantized.keras")
    loaded = keras_vit.load_model(tmp_path / "quantized.keras")
    assert isinstance(loaded, ViT)
    assert loaded.blocks[0].attention.query_dense.quantization_mode == mode.removesuffix("_weight_only")
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded(images)), expected)


# --------------------------------------------------------------------------------------------- LoRA


def _expected_lora_parameters(rank: int, targets, depth=2, width=64, heads=4, mlp=128) -> int:
    """Keras's factors: kernel (*leading, n) gets A (*leading, rank) and B (rank, n)."""
    head_dim = width // heads
    per_role = {
        "query": width * heads * rank + rank * head_dim,  # kernel (D, heads, D/heads)
        "key": width * heads * rank + rank * head_dim,
        "value": width * heads * rank + rank * head_dim,
        "attention_output": heads * head_dim * rank + rank * width,  # kernel (heads, D/heads, D)
        "fc1": width * rank + rank * mlp,
        "fc2": mlp * rank + rank * width,
    }
    return depth * sum(per_role[role] for role in targets)


def _count(variables) -> int:
    return sum(int(np.prod(variable.shape)) for variable in variables)


@pytest.mark.parametrize(
    "rank, targets, train_head",
    [(4, ("query", "value"), True), (8, LORA_TARGETS, True), (2, ("fc1",), False)],
)
def test_lora_trainable_parameter_count(rank, targets, train_head):
    model = _small_model()
    keras_vit.enable_lora(model, rank, targets=targets, train_head=train_head)
    expected = _expected_lora_parameters(rank, targets) + (64 * 10 + 10 if train_head else 0)
    assert _count(model.trainable_weights) == expected
    assert lora_parameter_count(model, rank, targets) == _expected_lora_parameters(rank, targets)
    assert _count(model.weights) == _count(model.trainable_weights) + _count(model.non_trainable_weights)


def _fit(model: keras.Model, steps: int = 4, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    images = rng.uniform(-1, 1, (8 * steps, 8, 8, 3)).astype("float32")
    labels = rng.integers(0, 10, 8 * steps)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(images, labels, batch_size=8, epochs=1, verbose=0)


@pytest.mark.parametrize("train_head", [True, False])
def test_lora_fit_changes_only_the_adapters_and_head(train_head):
    model = _randomized(_small_model())
    images = np.random.default_rng(1).uniform(-1, 1, (4, 8, 8, 3)).astype("float32")
    before = keras.ops.convert_to_numpy(model(images))
    keras_vit.enable_lora(model, 4, train_head=train_head)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model(images)), before)  # B starts at 0
    initial = {weight.path: keras.ops.convert_to_numpy(weight).copy() for weight in model.weights}
    _fit(model)
    adapters = {
        weight.path for layer in lora_layers(model) for weight in (layer.lora_kernel_a, layer.lora_kernel_b)
    }
    head = {weight.path for weight in model.head.weights} if train_head else set()
    for weight in model.weights:
        value = keras.ops.convert_to_numpy(weight)
        if weight.path in adapters | head:
            assert not np.array_equal(value, initial[weight.path]), weight.path
        else:
            np.testing.assert_array_equal(value, initial[weight.path], err_msg=weight.path)
    assert {weight.path for weight in model.trainable_weights} == adapters | head
    assert not np.allclose(keras.ops.convert_to_numpy(model(images)), before)


@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer")  # all trainable once loaded
def test_lora_keras_round_trip(tmp_path):
    """Keras saves the kernels with the LoRA product merged in: the loaded plain model computes the same."""
    model = _randomized(_small_model())
    keras_vit.enable_lora(model, 4, targets=LORA_TARGETS)
    _fit(model)
    images = np.random.default_rng(1).uniform(-1, 1, (4, 8, 8, 3)).astype("float32")
    expected = keras.ops.convert_to_numpy(model(images))
    model.save(tmp_path / "lora.keras")
    loaded = keras_vit.load_model(tmp_path / "lora.keras")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(loaded(images)), expected, rtol=0, atol=1e-6)


def test_lora_on_an_int8_model():
    """QLoRA-style: int8 base kernels frozen, float32 factors trained through the quantized call."""
    model = _randomized(_small_model())
    _quantize(model, "int8")
    keras_vit.enable_lora(model, 4, targets=("query", "value", "fc1"))
    frozen = {w.path: keras.ops.convert_to_numpy(w).copy() for w in model.weights if not w.trainable}
    _fit(model)
    for weight in model.weights:
        if weight.path in frozen:
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(weight), frozen[weight.path])
    query = model.blocks[0].attention.query_dense
    assert np.abs(keras.ops.convert_to_numpy(query.lora_kernel_b)).max() > 0


def test_lora_arguments_are_checked():
    model = _small_model()
    with pytest.raises(ValueError, match="Unknown LoRA target"):
        keras_vit.enable_lora(model, 4, targets=("qkv",))
    with pytest.raises(ValueError, match="positive int"):
        keras_vit.enable_lora(model, 0)
    with pytest.raises(ValueError, match="no keras_vit TransformerBlock"):
        keras_vit.enable_lora(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="head")]), 4)


@pytest.mark.parametrize("alpha", [0, -1.0, float("nan"), float("inf"), True])
def test_lora_alpha_must_be_positive(alpha):
    """alpha = 0 scales the adapters' product to nothing (only the head would train): refused."""
    model = _small_model()
    with pytest.raises(ValueError, match="LoRA alpha"):
        keras_vit.enable_lora(model, 4, alpha=alpha)
    assert not any(layer.lora_enabled for layer in lora_layers(model, LORA_TARGETS))


def test_lora_rank_above_what_the_update_can_reach_is_refused_before_allocating():
    model = _small_model()  # width 64, 4 heads: query's update per head is (64, 16), rank <= 16
    assert max_lora_rank(model) == 16 and max_lora_rank(model, ("fc1",)) == 64
    weights = len(model.weights)
    with pytest.raises(ValueError, match=r"rank 17 is above 16.*MiB"):
        keras_vit.enable_lora(model, 17)
    with pytest.raises(ValueError, match=r"rank 10000000 is above 64.*MiB"):
        keras_vit.enable_lora(model, 10_000_000, targets=("fc1",))
    assert len(model.weights) == weights  # nothing allocated
    keras_vit.enable_lora(model, 16)  # the largest useful rank works

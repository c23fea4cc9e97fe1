"""The paper's recipes: schedule formula, optimizers, loss, EMA weights, mixed precision."""

import math

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit.training import optimization


def _tiny_vit(num_classes=3):
    config = keras_vit.ViTConfig(
        "vit_tiny_test", patch_size=4, hidden_size=16, depth=1, num_heads=2, mlp_dim=32
    )
    # logits: optimization.loss is a cross-entropy from logits
    return keras_vit.build_vit(config, image_size=8, num_classes=num_classes, classifier_activation=None)


def _tiny_data(rng, count=32, num_classes=3):
    images = rng.uniform(-1, 1, (count, 8, 8, 3)).astype("float32")
    return images, (np.arange(count) % num_classes).astype("int32")


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_warmup_decay_matches_formula(decay):
    peak, end, total, warmup = 0.3, 0.01, 110, 10
    schedule = optimization.WarmupDecay(peak, total, warmup_steps=warmup, decay=decay, end_learning_rate=end)

    def expected(step):
        if step < warmup:
            return peak * step / warmup
        progress = min(1.0, (step - warmup) / (total - warmup))
        if decay == "cosine":
            return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * progress))
        return end + (peak - end) * (1 - progress)

    for step in (0, 1, 5, 9, 10, 11, 35, 60, 85, 109, 110, 500):
        np.testing.assert_allclose(float(schedule(step)), expected(step), rtol=1e-6, atol=1e-9, err_msg=step)
    # Spot values that do not depend on the helper above.
    assert float(schedule(0)) == 0.0
    np.testing.assert_allclose(float(schedule(5)), 0.15, rtol=1e-6)
    np.testing.assert_allclose(float(schedule(10)), peak, rtol=1e-6)
    np.testing.assert_allclose(float(schedule(60)), (peak + end) / 2, rtol=1e-6)  # half-way, both decays
    np.testing.assert_allclose(float(schedule(110)), end, rtol=1e-6)


def test_warmup_decay_serialises_and_validates():
    schedule = optimization.WarmupDecay(1e-3, 1000, warmup_steps=100, decay="linear", end_learning_rate=1e-5)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    assert isinstance(restored, optimization.WarmupDecay)
    assert restored.get_config() == schedule.get_config()
    for step in (0, 50, 100, 550, 1000):
        assert float(restored(step)) == float(schedule(step))
    optimizer = optimization.pretraining_optimizer(1000, warmup_steps=100)
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(optimizer))
    assert isinstance(clone, optimization.KernelDecayAdamW)
    assert clone.get_config()["learning_rate"] == optimizer.get_config()["learning_rate"]
    assert "WarmupDecay" in str(clone.get_config()["learning_rate"])

    with pytest.raises(ValueError, match="warmup_steps"):
        optimization.WarmupDecay(0.1, 100, warmup_steps=100)
    with pytest.raises(ValueError, match="Unknown decay"):
        optimization.WarmupDecay(0.1, 100, decay="exponential")


def test_pretraining_optimizer_decays_only_kernels():
    model = _tiny_vit()
    learning_rate, weight_decay = 0.1, 0.5
    optimizer = optimization.pretraining_optimizer(
        10, learning_rate=learning_rate, weight_decay=weight_decay, warmup_steps=0
    )
    assert isinstance(optimizer, keras.optimizers.AdamW)  # KernelDecayAdamW
    assert (optimizer.beta_1, optimizer.beta_2, optimizer.global_clipnorm) == (0.9, 0.999, 1.0)
    rng = np.random.default_rng(0)
    for variable in model.trainable_variables:  # make every weight non-zero so decay would show
        variable.assign(rng.uniform(0.5, 1.0, variable.shape).astype("float32"))
    before = {variable.path: variable.numpy() for variable in model.trainable_variables}
    # Zero gradients: Adam's own update is 0, so only the decoupled weight decay moves weights.
    optimizer.apply(
        [np.zeros(v.shape, "float32") for v in model.trainable_variables], model.trainable_variables
    )
    names = set()
    for variable in model.trainable_variables:
        names.add(variable.name)
        factor = 1 - learning_rate * weight_decay if variable.name == "kernel" else 1.0
        np.testing.assert_allclose(
            variable.numpy(), before[variable.path] * factor, rtol=1e-6, err_msg=variable.path
        )
    assert {"kernel", "bias", "gamma", "beta", "token", "embedding"} <= names


def test_finetuning_optimizer_is_sgd_momentum_with_clipping():
    optimizer = optimization.finetuning_optimizer(100, learning_rate=0.1, warmup_steps=0)
    assert isinstance(optimizer, keras.optimizers.SGD)
    assert (optimizer.momentum, optimizer.global_clipnorm, optimizer.weight_decay) == (0.9, 1.0, None)
    weights = keras.Variable(np.zeros(4, "float32"))
    gradient = np.array([30.0, 40.0, 0.0, 0.0], "float32")  # norm 50, clipped to 1
    optimizer.apply([gradient], [weights])
    np.testing.assert_allclose(weights.numpy(), -0.1 * gradient / 50.0, rtol=1e-6)
    with pytest.raises(ValueError, match="ema_momentum"):
        optimization.finetuning_optimizer(1000, ema_momentum=1.5)


def test_loss_takes_sparse_labels_with_label_smoothing():
    logits = np.array([[2.0, -1.0, 0.5], [0.1, 0.2, 3.0], [1.0, 1.0, 1.0]], "float32")
    labels = np.array([0, 2, 1])
    onehot = np.eye(3, dtype="float32")[labels]
    smoothed = optimization.loss(label_smoothing=0.1)(labels, logits)
    reference = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)(onehot, logits)
    np.testing.assert_allclose(float(smoothed), float(reference), rtol=1e-6)
    plain = optimization.loss()(labels[:, None], logits)
    reference = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits)
    np.testing.assert_allclose(float(plain), float(reference), rtol=1e-6)
    assert float(smoothed) != pytest.approx(float(plain))
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(optimization.loss(0.2))
    )
    assert restored.label_smoothing == 0.2


def test_loss_and_accuracy_take_mixed_labels():
    """Class distributions `(batch, classes)` (mixup's) are the targets as they are, smoothed like
    one-hot ones; `LabelAccuracy` reads integer labels and a distribution's largest class alike."""
    logits = np.array([[2.0, -1.0, 0.5], [0.1, 0.2, 3.0], [1.0, 2.0, 1.0]], "float32")
    mixed = np.array([[0.7, 0.3, 0.0], [0.0, 0.4, 0.6], [0.2, 0.0, 0.8]], "float32")
    for smoothing in (0.0, 0.1):
        got = optimization.loss(label_smoothing=smoothing)(mixed, logits)
        reference = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=smoothing)
        expected = reference(mixed, logits)
        np.testing.assert_allclose(float(got), float(expected), rtol=1e-6)
    for labels in (mixed, np.array([0, 2, 2]), np.array([[0], [2], [2]])):
        accuracy = optimization.LabelAccuracy()
        accuracy.update_state(labels, logits)
        assert float(accuracy.result()) == pytest.approx(2 / 3)
    config = keras.saving.serialize_keras_object(optimization.LabelAccuracy())
    restored = keras.saving.deserialize_keras_object(config)
    assert isinstance(restored, optimization.LabelAccuracy) and restored.name == "accuracy"


def test_ema_weights_differ_from_raw_and_are_left_after_fit(rng, tmp_path):
    model = _tiny_vit()
    momentum = 0.8
    model.compile(
        optimizer=optimization.finetuning_optimizer(
            8, learning_rate=0.05, warmup_steps=1, ema_momentum=momentum
        ),
        loss=optimization.loss(),
    )
    raw_history = []

    class RecordRawWeights(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raw_history.append([v.numpy() for v in self.model.trainable_variables])

    images, labels = _tiny_data(rng)
    model.fit(images, labels, batch_size=4, epochs=1, verbose=0, callbacks=[RecordRawWeights()])
    assert len(raw_history) == 8
    # Keras's EMA: the average starts as the weights after the first update, then
    # average = momentum * average + (1 - momentum) * weights after each later update.
    expected = raw_history[0]
    for raw in raw_history[1:]:
        expected = [momentum * e + (1 - momentum) * r for e, r in zip(expected, raw, strict=True)]
    final = [v.numpy() for v in model.trainable_variables]
    for average, weights in zip(expected, final, strict=True):
        np.testing.assert_allclose(weights, average, rtol=1e-5, atol=1e-6)
    assert max(float(np.abs(w - r).max()) for w, r in zip(final, raw_history[-1], strict=True)) > 1e-4

    path = tmp_path / "ema.keras"
    model.save(path)
    reloaded = keras.saving.load_model(path)
    for saved, weights in zip(reloaded.trainable_variables, final, strict=True):
        np.testing.assert_array_equal(saved.numpy(), weights)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_recipes_train_under_mixed_precision(policy, rng):
    keras.config.set_dtype_policy(policy)
    model = _tiny_vit()
    model.compile(
        optimizer=optimization.pretraining_optimizer(4, learning_rate=1e-2, warmup_steps=1),
        loss=optimization.loss(0.1),
    )
    # compile wraps the optimizer in a LossScaleOptimizer for float16 only.
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer) == (policy == "mixed_float16")
    assert model.get_layer("block_0").fc1.kernel.dtype == "float32"
    assert model.get_layer("block_0").compute_dtype == policy.split("_")[1]
    before = [v.numpy() for v in model.trainable_variables]
    images, labels = _tiny_data(rng, count=16)
    history = model.fit(images, labels, batch_size=4, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    moved = [not np.allclose(b, v.numpy()) for b, v in zip(before, model.trainable_variables, strict=True)]
    assert sum(moved) > len(moved) // 2

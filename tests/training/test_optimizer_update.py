"""keras_vit's optimizers (`keras_vit.training.optimization.AdamW`, `KernelDecayAdamW` built on it, and `SGD`)
update as Keras's `AdamW` and `SGD` do, bit for bit, on every backend: on PyTorch through their own lean
foreach updates, elsewhere through Keras's."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_vit.training import optimization

SHAPES = [(3, 4), (4,), (2, 3, 5)]
STEPS = 4


def _trained(optimizer_class, init, grads, excluded: bool, **options) -> list[np.ndarray]:
    """The variables and the optimizer's variables after `STEPS` updates with `grads`."""
    variables = [keras.Variable(value, name="kernel" if value.ndim > 1 else "bias") for value in init]
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=2, decay_rate=0.5)
    optimizer = optimizer_class(learning_rate=schedule, **{"weight_decay": 0.1, **options})
    if excluded:
        optimizer.exclude_from_weight_decay(var_list=[v for v in variables if v.name != "kernel"])
    for step_grads in grads:
        optimizer.apply([keras.ops.convert_to_tensor(grad) for grad in step_grads], variables)
    return [keras.ops.convert_to_numpy(v) for v in (*variables, *optimizer.variables)]


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("excluded", [False, True])
def test_adamw_updates_as_keras_adamw_bit_for_bit(amsgrad, excluded, rng):
    """Weights, moments, velocities and the step count after 4 steps with a decaying learning rate,
    weight decay (on every variable, or on the kernels only) and amsgrad on and off."""
    init = [rng.normal(size=shape).astype("float32") for shape in SHAPES]
    grads = [[rng.normal(size=shape).astype("float32") for shape in SHAPES] for _ in range(STEPS)]
    expected = _trained(keras.optimizers.AdamW, init, grads, excluded, amsgrad=amsgrad)
    got = _trained(optimization.AdamW, init, grads, excluded, amsgrad=amsgrad)
    assert len(got) == len(expected)
    for mine, keras_own in zip(got, expected, strict=True):
        np.testing.assert_array_equal(mine, keras_own)
    assert np.abs(got[0] - init[0]).max() > 1e-3  # the weights moved


@pytest.mark.parametrize(
    "options",
    [
        {"momentum": 0.0},
        {"momentum": 0.9},
        {"momentum": 0.9, "nesterov": True},
        {"momentum": 0.9, "weight_decay": 0.1},
    ],
    ids=["plain", "momentum", "nesterov", "weight_decay"],
)
def test_sgd_updates_as_keras_sgd_bit_for_bit(options, rng):
    init = [rng.normal(size=shape).astype("float32") for shape in SHAPES]
    grads = [[rng.normal(size=shape).astype("float32") for shape in SHAPES] for _ in range(STEPS)]
    options = {"weight_decay": None, **options}
    expected = _trained(keras.optimizers.SGD, init, grads, excluded=False, **options)
    got = _trained(optimization.SGD, init, grads, excluded=False, **options)
    for mine, keras_own in zip(got, expected, strict=True):
        np.testing.assert_array_equal(mine, keras_own)
    assert np.abs(got[0] - init[0]).max() > 1e-3


def test_kernel_decay_adamw_is_adamw_excluding_all_but_kernels(rng):
    """`KernelDecayAdamW` gives Keras's AdamW with every variable not named `kernel` excluded from decay."""
    init = [rng.normal(size=shape).astype("float32") for shape in SHAPES]
    grads = [[rng.normal(size=shape).astype("float32") for shape in SHAPES] for _ in range(STEPS)]
    expected = _trained(keras.optimizers.AdamW, init, grads, excluded=True)
    got = _trained(optimization.KernelDecayAdamW, init, grads, excluded=False)
    for mine, keras_own in zip(got, expected, strict=True):
        np.testing.assert_array_equal(mine, keras_own)


@pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="PyTorch backend only: the lean update is PyTorch's"
)
def test_pytorch_fit_runs_the_lean_update_stateless_apply_not(rng, monkeypatch):
    """`fit` updates through the lean foreach update (once per step); a `stateless_apply` (the values
    given, not the variables') runs Keras's update and leaves the variables as they were."""
    calls = []
    original = optimization.AdamW._foreach_update
    monkeypatch.setattr(optimization.AdamW, "_foreach_update", lambda *a: calls.append(1) or original(*a))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=optimization.AdamW(1e-2, weight_decay=0.1), loss="mse")
    x, y = rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert calls == [1, 1]
    optimizer = model.optimizer
    before = [keras.ops.convert_to_numpy(v) for v in model.trainable_variables]
    grads = [keras.ops.ones_like(v) for v in model.trainable_variables]
    new_trainable, _ = optimizer.stateless_apply(
        [v.value.clone() for v in optimizer.variables],
        grads,
        [v.value.clone() for v in model.trainable_variables],
    )
    assert calls == [1, 1]
    for variable, value, new in zip(model.trainable_variables, before, new_trainable, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), value)
        assert np.abs(keras.ops.convert_to_numpy(new) - value).max() > 1e-4


def test_adamw_round_trips_through_its_config():
    optimizer = optimization.KernelDecayAdamW(learning_rate=3e-4, weight_decay=0.05, amsgrad=True)
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert type(clone) is optimization.KernelDecayAdamW and isinstance(clone, keras.optimizers.AdamW)
    assert clone.get_config() == optimizer.get_config()

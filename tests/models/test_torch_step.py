"""keras_vit's training step on PyTorch (`keras_vit.models.torch_step`): Keras's step bit for bit, and no
host-device synchronisation per step (no tensor made from host data, no value read back).

A CPU has no synchronisation to show, so the step's calls are watched instead: a `TorchFunctionMode`
records every tensor made from Python or NumPy data (`torch.as_tensor`, `torch.tensor`, `torch.from_numpy`:
on a GPU, a copy from pageable memory that waits for every queued kernel) and every value read back to
the host (`item`, `bool`, `float`, `numpy`, ...: a wait for the device), except inside an explicit
`keras.device("cpu")` scope, which keeps its work on the host by design.
"""

from __future__ import annotations

import math
import random
import traceback
import types

import keras
import numpy as np
import pytest
import torch

from keras_vit.models import torch_step
from keras_vit.models.vit import ViT
from keras_vit.registry.variants import ViTConfig
from keras_vit.training import optimization
from keras_vit.training.device_input import DeviceInput
from keras_vit.training.masked_patch import masked_patch_model

_TORCH_ONLY = pytest.mark.skipif(keras.backend.backend() != "torch", reason="PyTorch's training step")
CONFIG = ViTConfig("tiny", patch_size=8, hidden_size=24, depth=2, num_heads=3, mlp_dim=48, image_size=16)
CLASSES, BATCH, STEPS = 5, 4, 3


def _watched_calls():
    """A `TorchFunctionMode` that lists (what, where) for each call that would synchronise on a GPU."""
    from keras.src.backend.common.global_state import get_global_attribute
    from torch.overrides import TorchFunctionMode

    def host_scope() -> bool:
        return str(get_global_attribute("torch_device", None)) == "cpu"  # inside `keras.device("cpu")`

    makers = {torch.as_tensor, torch.tensor, torch.from_numpy}
    reads = {
        torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__array__,
        torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__,
    }  # fmt: skip

    class Watch(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if host_scope():  # work on the host by design (`torch_step.uniform`'s seeds)
                return func(*args, **(kwargs or {}))
            if func in reads or (func in makers and not isinstance(args[0], torch.Tensor)):
                frames = reversed(traceback.extract_stack()[-8:-1])
                self.calls.append((func.__name__, " <- ".join(f"{f.name}:{f.lineno}" for f in frames)))
            return func(*args, **(kwargs or {}))

    return Watch()


def _model(case: dict, rng) -> keras.Model:
    keras.config.set_dtype_policy(case.get("dtype_policy", "float32"))
    if case["kind"] == "masked_patch":  # uint8 images: the model normalises and corrupts them itself
        return masked_patch_model(CONFIG, seed=5)
    network = ViT(
        CONFIG, num_classes=CLASSES, classifier_activation=None, drop_path_rate=case.get("drop_path", 0.0)
    )
    network.set_weights([rng.normal(0, 0.3, w.shape).astype("float32") for w in network.get_weights()])
    return (
        network if case["kind"] == "vit" else DeviceInput(network, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), CLASSES)
    )


CASES = {
    # the pre-training recipe: AdamW with kernel-only decay, clipping, warm-up + linear decay; bfloat16
    "vit_pretraining_bf16": dict(
        kind="vit",
        dtype_policy="mixed_bfloat16",
        optimizer=lambda: optimization.pretraining_optimizer(100, warmup_steps=2),
        loss=lambda: optimization.loss(label_smoothing=0.1),
        metrics=lambda: [optimization.LabelAccuracy()],
    ),
    # the fine-tuning recipe on uint8 batches with mixup, normalised and mixed in the step
    "device_input_finetuning_mixup": dict(
        kind="device_input_mixup",
        optimizer=lambda: optimization.finetuning_optimizer(100, warmup_steps=2),
        loss=lambda: optimization.loss(),
        metrics=lambda: [optimization.LabelAccuracy()],
    ),
    # Keras's own optimizer, loss and metric; stochastic depth
    "vit_keras_adamw_drop_path": dict(
        kind="vit",
        drop_path=0.3,
        optimizer=lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.05),
        loss=lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=lambda: ["accuracy"],
    ),
    # masked patch prediction: the patches corrupted in the step (uniform and randint draws)
    "masked_patch_pretraining": dict(
        kind="masked_patch",
        optimizer=lambda: optimization.pretraining_optimizer(100, warmup_steps=2),
        loss=lambda: None,
        metrics=lambda: None,
    ),
}


def _batches(case: dict, rng):
    """`STEPS` batches as the case's model takes them (uint8 images, with mixup weights)."""
    batches = []
    for _ in range(STEPS):
        labels = rng.integers(0, CLASSES, BATCH)
        if case["kind"] == "vit":
            images = rng.normal(0, 1, (BATCH, 16, 16, 3)).astype("float32")
        else:
            images = rng.integers(0, 256, (BATCH, 16, 16, 3)).astype("uint8")
            if case["kind"] == "device_input_mixup":
                images = {"images": images, "mixup_weight": rng.uniform(0.5, 1, BATCH).astype("float32")}
        batches.append((images, labels))
    return batches


def _compiled(case: dict, rng, keras_step: bool) -> keras.Model:
    model = _model(case, rng)
    model.compile(optimizer=case["optimizer"](), loss=case["loss"](), metrics=case["metrics"]())
    if keras_step:  # Keras's own steps, not TorchTrainStep's
        model.train_step = types.MethodType(keras.Model.train_step, model)
        model.test_step = types.MethodType(keras.Model.test_step, model)
    return model


def _generator(batches):
    def stream():
        yield from batches

    return stream()


@pytest.mark.parametrize("name", list(CASES))
def test_training_and_evaluation_steps_are_keras_steps_bit_for_bit(name):
    """`fit` and `evaluate` through `TorchTrainStep` give Keras's own steps' weights, optimizer state, losses
    and metrics exactly (on PyTorch its own step; elsewhere Keras's)."""
    case, results = CASES[name], []
    for keras_step in (False, True):
        random.seed(7)  # the seeds Keras draws for seed generators made without one (stochastic depth's)
        rng = np.random.default_rng(7)
        model = _compiled(case, rng, keras_step)
        batches = _batches(case, rng)
        history = model.fit(_generator(batches), steps_per_epoch=STEPS, epochs=1, verbose=0, shuffle=False)
        evaluation = model.evaluate(_generator(batches[:2]), steps=2, verbose=0, return_dict=True)
        weights = [keras.ops.convert_to_numpy(v) for v in (*model.weights, *model.optimizer.variables)]
        results.append((history.history, evaluation, weights))
    (history, evaluation, weights), (keras_history, keras_evaluation, keras_weights) = results
    assert history == keras_history and evaluation == keras_evaluation
    assert math.isfinite(history["loss"][0])
    for mine, keras_own in zip(weights, keras_weights, strict=True):
        np.testing.assert_array_equal(mine, keras_own)


@_TORCH_ONLY
def test_pytorch_training_step_never_waits_for_the_device():
    """Steps 2 and on of `fit` (the recipes' optimizers and loss, mixed bfloat16, uint8 batches with
    mixup on the device, Keras's own AdamW, stochastic depth, masked patch prediction) make no tensor
    from host data and read no value back: on a GPU, the host never waits for the device. Keras's
    own step makes several."""
    for name, case in CASES.items():
        counts = {}
        for keras_step in (False, True):
            rng = np.random.default_rng(3)
            model = _compiled(case, rng, keras_step)
            batches = [
                keras.tree.map_structure(keras.ops.convert_to_tensor, batch) for batch in _batches(case, rng)
            ]
            # the first step builds the optimizer and the metrics
            model.fit(_generator(batches[:1]), steps_per_epoch=1, epochs=1, verbose=0, shuffle=False)
            step, watch = model.train_function, _watched_calls()

            def watched_step(data, step=step, watch=watch):
                with watch:
                    return step(data)

            model.train_function = watched_step
            model.fit(_generator(batches[1:]), steps_per_epoch=STEPS - 1, epochs=1, verbose=0, shuffle=False)
            counts[keras_step] = watch.calls
        assert counts[False] == [], f"{name}: {counts[False]}"
        assert len(counts[True]) >= 3 * (STEPS - 1), f"{name}: Keras's own step, {counts[True]}"


@_TORCH_ONLY
def test_device_constants_give_fresh_copies_of_tensors_made_once():
    """Inside `device_constants()`, `torch.as_tensor` / `torch.tensor` of Python numbers or a small NumPy
    array give the same values as without it, from one tensor per value (NaN and -0.0 too), as new
    tensors a caller may write into; other arguments run as without it."""
    torch_step._CONSTANTS.clear()
    values = [0.5, -0.0, 0.0, float("nan"), 3, True, (2, 3), [1.5, 2.5]]
    dtypes = [*[torch.float32] * 4, torch.int64, torch.bool, torch.int32, torch.bfloat16]
    with torch_step.device_constants():
        first = [torch.as_tensor(v, dtype=d, device="cpu") for v, d in zip(values, dtypes, strict=True)]
        second = [torch.tensor(v, dtype=d, device="cpu") for v, d in zip(values, dtypes, strict=True)]
        array = torch.as_tensor(np.arange(3.0), dtype=torch.float32, device="cpu")
        tracked = torch.tensor(1.0, dtype=torch.float32, device="cpu", requires_grad=True)
    assert len(torch_step._CONSTANTS) == len(values) + 1  # one each and the array; requires_grad not kept
    for value, dtype, made, again in zip(values, dtypes, first, second, strict=True):
        expected = torch.as_tensor(value, dtype=dtype, device="cpu")
        assert made.dtype == dtype and made.shape == expected.shape
        np.testing.assert_array_equal(made.float().numpy(), expected.float().numpy())
        assert torch.equal(made.signbit(), expected.signbit())
        assert made.data_ptr() != again.data_ptr()  # copies: writing into one leaves the others
    first[0].add_(1.0)
    buffer = np.arange(4, dtype="float32")  # written after its conversion: the constant is a copy of it
    with torch_step.device_constants():
        assert torch.as_tensor(0.5, dtype=torch.float32, device="cpu").item() == 0.5
        torch.as_tensor(buffer, dtype=torch.float32, device="cpu")
        buffer[:] = 7.0
        again = torch.as_tensor(np.arange(4, dtype="float32"), dtype=torch.float32, device="cpu")
        assert again.tolist() == [0, 1, 2, 3]
    assert tracked.requires_grad and array.tolist() == [0.0, 1.0, 2.0]


@_TORCH_ONLY
def test_draws_are_keras_numbers_from_a_seed_kept_on_the_host():
    """`torch_step.uniform` and `randint` of a `host_seed_generator` (on the CPU) give `keras.random`'s
    numbers of a Keras generator of the same seed, draw after draw, and leave the same state."""
    host, keras_own = torch_step.host_seed_generator(11), keras.random.SeedGenerator(11)
    assert host.state.value.device.type == "cpu"
    for shape in [(4, 1, 1), (3,), (2, 5)]:
        got = keras.ops.convert_to_numpy(torch_step.uniform(shape, host))
        expected = keras.ops.convert_to_numpy(keras.random.uniform(shape, seed=keras_own))
        np.testing.assert_array_equal(got, expected)
        got = keras.ops.convert_to_numpy(torch_step.randint(shape, 1, 50, host))
        expected = keras.ops.convert_to_numpy(keras.random.randint(shape, 1, 50, seed=keras_own))
        np.testing.assert_array_equal(got, expected)
    states = [keras.ops.convert_to_numpy(generator.state) for generator in (host, keras_own)]
    np.testing.assert_array_equal(*states)

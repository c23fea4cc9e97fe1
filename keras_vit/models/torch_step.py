"""Keras's PyTorch training step without a host-device synchronisation per step.

On a GPU an eager PyTorch step takes as long as the longer of its kernels and the host's Python work
that launches them, so long as the host never waits for the device. A tensor made from Python
numbers for the GPU (`torch.as_tensor(0.5, device="cuda")`) is a copy from pageable host memory,
which PyTorch makes with a stream synchronisation: the host waits until every queued kernel has run,
and the GPU then idles while the host launches the next ones. Keras's step makes such tensors eight
times per step of a ViT compiled with a sparse cross-entropy, AdamW and an accuracy metric: the loss's
divisor, the loss tracker's and each metric's sample count, the optimizer's step count and
constants, and more per schedule. `device_constants` makes each such tensor once, on the device, and
hands out copies of it (a device-to-device copy, queued like any kernel); `TorchTrainStep.train_step`
runs Keras's step so, op for op, with the forward pass outside it (no per-op cost there, and nothing
for `torch.compile` to guard on).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings

import keras
import numpy as np

__all__ = [
    "TorchTrainStep",
    "device_constant",
    "device_constants",
    "host_seed_generator",
    "keras_constant",
    "randint",
    "uniform",
]

_LIMIT = 1024  # distinct constants kept; past it, constants are made as before (a changing value per step)
_CONSTANTS: dict = {}
_MAX_SEQUENCE = 64
_MAX_ARRAY_BYTES = 65536
_ACTIVE = threading.local()  # whether this thread is inside `device_constants()`


def _data_key(data):
    """A hashable key for Python numbers or a flat tuple/list of them (bool, int and float told apart,
    -0.0 from 0.0 and every NaN alike) or a small numeric NumPy array (its bytes), or None for anything
    else."""
    if isinstance(data, bool):
        return ("b", data)
    if isinstance(data, int):
        return ("i", data)
    if isinstance(data, float):
        return ("f", data.hex())
    if isinstance(data, np.ndarray) and data.dtype.kind in "biuf" and data.nbytes <= _MAX_ARRAY_BYTES:
        return ("a", data.dtype.str, data.shape, data.tobytes())
    if isinstance(data, (tuple, list)) and len(data) <= _MAX_SEQUENCE:
        keys = tuple(_data_key(item) for item in data if not isinstance(item, (tuple, list)))
        if len(keys) == len(data) and None not in keys:
            return (type(data).__name__, keys)
    return None


def device_constant(data, dtype, device):
    """`torch.as_tensor(data, dtype=dtype, device=device)` made once per value, dtype and device, outside
    inference mode and autograd: one shared tensor, never to be written into. `data`: Python numbers,
    a flat tuple/list of them or a small NumPy array (else made anew each time). Under `torch.compile`
    made where it is called: a constant of the compiled graph."""
    import torch

    if torch.compiler.is_compiling():
        return torch.tensor(data, dtype=dtype, device=device)
    key = (_data_key(data), dtype, str(device))
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        with torch.inference_mode(False), torch.no_grad():  # a copy: never a view of a NumPy array
            tensor = torch.tensor(data, dtype=dtype, device=device)
        if key[0] is not None and len(_CONSTANTS) < _LIMIT:
            _CONSTANTS[key] = tensor
    return tensor


def keras_constant(array: np.ndarray):
    """`keras.ops.convert_to_tensor(array)`, on PyTorch made once per value on Keras's device
    (`device_constant`)."""
    if keras.backend.backend() != "torch":
        return keras.ops.convert_to_tensor(array)
    from keras.src.backend.torch.core import get_device, to_torch_dtype

    return device_constant(array, to_torch_dtype(array.dtype), get_device())


@functools.cache
def _device_constants_mode() -> type:
    import torch
    from torch.overrides import TorchFunctionMode

    makers = (torch.as_tensor, torch.tensor)

    class DeviceConstants(TorchFunctionMode):
        """See `device_constants`."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (
                func in makers
                and len(args) == 1
                and kwargs.keys() == {"dtype", "device"}
                and kwargs["dtype"] is not None
                and kwargs["device"] is not None
                and _data_key(args[0]) is not None
                and not torch.compiler.is_compiling()
            ):
                return device_constant(args[0], kwargs["dtype"], kwargs["device"]).clone()
            return func(*args, **kwargs)

    return DeviceConstants


def device_constants():
    """A context (a `TorchFunctionMode`) within which `torch.as_tensor` / `torch.tensor` of Python
    numbers, a flat tuple of them or a small NumPy array, given a `dtype` and a `device` (as Keras's
    `convert_to_tensor` calls it), give a copy of `device_constant`'s tensor: the same values, made on
    the device without waiting for it. Anything else runs as without it. On other backends, a context
    that does nothing."""
    if keras.backend.backend() != "torch" or getattr(_ACTIVE, "on", False):
        return contextlib.nullcontext()  # inside one already: a second would see every call again
    return _active(_device_constants_mode()())


@contextlib.contextmanager
def _active(mode):
    _ACTIVE.on = True
    try:
        with mode:
            yield
    finally:
        _ACTIVE.on = False


def host_seed_generator(seed: int | None = None, name: str | None = None) -> keras.random.SeedGenerator:
    """`keras.random.SeedGenerator(seed, name)`; on PyTorch its state lives on the CPU, for `uniform`
    and `randint`."""
    if keras.backend.backend() != "torch":
        return keras.random.SeedGenerator(seed, name=name)
    with keras.device("cpu"):
        return keras.random.SeedGenerator(seed, name=name)


def uniform(shape: tuple[int, ...], seed_generator: keras.random.SeedGenerator, dtype: str = "float32"):
    """`keras.random.uniform(shape, seed=seed_generator, dtype=dtype)`, the same values; drawn without a
    wait for the GPU from a `host_seed_generator` (`_device_generator`)."""
    generator = _device_generator(seed_generator)
    if generator is None:
        return keras.random.uniform(shape, seed=seed_generator, dtype=dtype)
    import torch
    from keras.src.backend.torch.core import get_device, to_torch_dtype

    return torch.rand(shape, generator=generator, dtype=to_torch_dtype(dtype), device=get_device())


def randint(shape: tuple[int, ...], minval: int, maxval: int, seed_generator, dtype: str = "int32"):
    """`keras.random.randint(shape, minval, maxval, seed=seed_generator, dtype=dtype)`, the same values;
    drawn without a wait for the GPU from a `host_seed_generator` (`_device_generator`)."""
    generator = _device_generator(seed_generator)
    if generator is None:
        return keras.random.randint(shape, minval, maxval, seed=seed_generator, dtype=dtype)
    import torch
    from keras.src.backend.torch.core import get_device, to_torch_dtype

    dtype, device = to_torch_dtype(dtype), get_device()
    return torch.randint(low=minval, high=maxval, size=shape, generator=generator, dtype=dtype, device=device)


def _device_generator(seed_generator: keras.random.SeedGenerator):
    """On PyTorch, Keras's `torch_seed_generator(seed_generator)` for a generator whose state is on the
    CPU: the seed drawn and advanced there, and a `torch.Generator` on Keras's device seeded with it.
    Keras's own draw reads the seed back from the device and copies an increment to it, two waits for
    the GPU per draw. None where Keras's draw runs: other backends, a symbolic call, `torch.compile`, a
    state on the device."""
    if keras.backend.backend() != "torch":
        return None
    import torch
    from keras.src.backend.torch.core import get_device
    from keras.src.random.seed_generator import draw_seed

    device = get_device()
    if device == "meta" or torch.compiler.is_compiling() or seed_generator.state.value.device.type != "cpu":
        return None
    with keras.device("cpu"):
        first_seed, second_seed = draw_seed(seed_generator)
        seed = int(first_seed + second_seed) & 0xFFFFFFFF
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class TorchTrainStep:
    """A `keras.Model` mixin: on PyTorch, `train_step` and `test_step` are Keras's (`TorchTrainer`'s,
    their operations in their order: the same weights after `fit` and the same metrics, bit for bit)
    with the loss, the loss tracker, the optimizer's update and the metrics inside `device_constants()`
    (not the forward and backward passes: it costs ~1 µs per torch call), and the trainable weights
    listed once per step instead of three times. Other backends run Keras's steps."""

    def train_step(self, *args):
        if keras.backend.backend() != "torch":
            return super().train_step(*args)  # JAX's takes the state too
        import torch

        (data,) = args
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=True) if self._call_has_training_arg else self(x)
        self.zero_grad()  # torch.nn.Module's: the last step's gradients
        with device_constants():
            loss = self._tracked_loss(x, y, y_pred, sample_weight, training=True)
            if self.optimizer is not None:
                loss = self.optimizer.scale_loss(loss)
        trainable_weights = self.trainable_weights
        if trainable_weights:
            loss.backward()
            gradients = [variable.value.grad for variable in trainable_weights]
            with torch.no_grad(), device_constants():
                self.optimizer.apply(gradients, trainable_weights)
        else:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
        with device_constants():
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def test_step(self, *args):
        if keras.backend.backend() != "torch":
            return super().test_step(*args)
        (data,) = args
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False) if self._call_has_training_arg else self(x)
        with device_constants():
            self._tracked_loss(x, y, y_pred, sample_weight, training=False)
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _tracked_loss(self, x, y, y_pred, sample_weight, training: bool):
        """Keras's loss of the batch, also added to the model's loss tracker."""
        loss = self._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        batch_size = next(item for item in keras.tree.flatten(x) if item is not None).shape[0]
        self._loss_tracker.update_state(loss, sample_weight=batch_size)
        return loss

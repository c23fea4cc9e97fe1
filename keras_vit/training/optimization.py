"""The Keras objects the training recipes compile with (paper §4.1, Appendix B).

The recipes themselves (which optimizer, which defaults) are declared in `keras_vit.training.recipes`;
this module holds what they build:

* `WarmupDecay`: linear warm-up, then cosine or linear decay; the learning-rate schedule
  of every ViT run.
* `AdamW` and `SGD`: Keras's, with a leaner update on PyTorch (bit for bit Keras's);
  `KernelDecayAdamW`, AdamW with weight decay on kernels only.
* `pretraining_optimizer`: AdamW (β1 0.9, β2 0.999, decoupled weight decay 0.1), global
  gradient clipping at norm 1, warm-up + linear decay.
* `finetuning_optimizer`: SGD with momentum 0.9, no weight decay, global clipping at norm 1,
  warm-up + cosine decay.
* `loss`: softmax cross-entropy from logits, optional label smoothing.
* `LabelAccuracy`: top-1 accuracy against integer labels or mixed (soft) ones.

Labels: every pipeline in `keras_vit.data.tfdata` yields SPARSE integer class indices, except the
training stream with mixup, which yields class distributions `(batch, classes)`. `loss()` takes
both, with or without label smoothing (it one-hot encodes sparse labels itself), and so does
`LabelAccuracy`: compile with `loss=optimization.loss(...)` and `metrics=[optimization.LabelAccuracy()]`
(Keras's `"accuracy"` picks its sparse or one-hot form from the first labels it sees, so it
would misread the integer labels of evaluation after training on mixed ones).

Polyak averaging (`ema_momentum=0.9999` in the paper's fine-tuning): the optimizers then use
Keras's built-in EMA (`use_ema=True`). Keras 3 keeps the average inside the optimizer; at the
end of `model.fit` it calls `optimizer.finalize_variable_values`, which copies the averages
into the model's trainable weights, so the model saved after `fit` holds the EMA weights.
During training the model holds the raw weights: add `keras.callbacks.SwapEMAWeights()` to
evaluate with the averages (`swap_on_epoch=True`, placed before `ModelCheckpoint`, to save
them each epoch). Keras's EMA has no bias correction: the average is set to the weights after
the first update, then `average = m * average + (1 - m) * weights` after each later one, so
it trails the raw weights by about `1 / (1 - m)` steps (10,000 for 0.9999): use it only for
runs much longer than that. The averages are optimizer variables, so optimizer checkpoints
(e.g. `BackupAndRestore`) carry them.

Mixed precision: under `keras.config.set_dtype_policy("mixed_float16")`, `model.compile`
wraps these optimizers in a `keras.optimizers.LossScaleOptimizer` itself (its default
`auto_scale_loss=True`); gradients are unscaled before the inner optimizer clips them.
`mixed_bfloat16` needs no loss scaling. The ViT head is float32 in both, so the loss is.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_vit.models.torch_step import device_constants

__all__ = [
    "AdamW",
    "KernelDecayAdamW",
    "LabelAccuracy",
    "SGD",
    "SparseCrossentropy",
    "WarmupDecay",
    "finetuning_optimizer",
    "loss",
    "pretraining_optimizer",
]

_PACKAGE = "keras_vit"
DECAYS = ("cosine", "linear")


@keras.saving.register_keras_serializable(package=_PACKAGE)
class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up from 0 to `peak_learning_rate`, then decay to `end_learning_rate`.

    For `step < warmup_steps`: `peak * step / warmup_steps`. After it, with
    `p = (step - warmup_steps) / (total_steps - warmup_steps)` clipped to [0, 1]:
    cosine `end + (peak - end) * (1 + cos(pi * p)) / 2`, linear `end + (peak - end) * (1 - p)`.
    Keras evaluates the schedule at `optimizer.iterations` (0 for the first update), as
    big_vision and the ViT reference code do with their step counter.
    """

    def __init__(
        self,
        peak_learning_rate: float,
        total_steps: int,
        warmup_steps: int = 0,
        decay: str = "cosine",
        end_learning_rate: float = 0.0,
        name: str = "warmup_decay",
    ):
        super().__init__()
        if decay not in DECAYS:
            raise ValueError(f"Unknown decay {decay!r}: use one of {DECAYS}.")
        if int(total_steps) < 1:
            raise ValueError(f"total_steps must be a positive int, got {total_steps!r}.")
        if not 0 <= int(warmup_steps) < int(total_steps):
            raise ValueError(
                f"warmup_steps must be in [0, total_steps) = [0, {int(total_steps)}), got {warmup_steps!r}: "
                "shorten the warm-up or train for more steps."
            )
        if peak_learning_rate <= 0 or end_learning_rate < 0:
            raise ValueError(
                f"Learning rates must be positive (peak) and non-negative (end), got peak "
                f"{peak_learning_rate!r}, end {end_learning_rate!r}."
            )
        self.peak_learning_rate = float(peak_learning_rate)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.decay = decay
        self.end_learning_rate = float(end_learning_rate)
        self.name = name

    def __call__(self, step):
        step = ops.cast(step, "float32")
        peak, end = self.peak_learning_rate, self.end_learning_rate
        warmup = float(self.warmup_steps)
        progress = ops.clip((step - warmup) / float(self.total_steps - self.warmup_steps), 0.0, 1.0)
        if self.decay == "cosine":
            decayed = end + (peak - end) * 0.5 * (1.0 + ops.cos(math.pi * progress))
        else:
            decayed = end + (peak - end) * (1.0 - progress)
        if self.warmup_steps == 0:
            return decayed
        return ops.where(step < warmup, peak * step / warmup, decayed)

    def get_config(self) -> dict:
        return {
            "peak_learning_rate": self.peak_learning_rate,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "decay": self.decay,
            "end_learning_rate": self.end_learning_rate,
            "name": self.name,
        }


def _ema_arguments(ema_momentum: float | None) -> dict:
    if ema_momentum is None:
        return {"use_ema": False}
    if not 0.0 < ema_momentum < 1.0:
        raise ValueError(f"ema_momentum must be in (0, 1), e.g. 0.9999, or None; got {ema_momentum!r}.")
    return {"use_ema": True, "ema_momentum": float(ema_momentum)}


def _torch_reader():
    """`eager_torch.VariableReader` where Keras's PyTorch update may run on the variables' tensors
    directly (PyTorch, outside a stateless scope and a symbolic call), else None."""
    if keras.backend.backend() != "torch":
        return None
    from keras_vit.models.eager_torch import VariableReader

    read = VariableReader()
    return read if read.direct else None


class _ReadOnceOnPyTorch:
    """What keras_vit's optimizers change of Keras's: on PyTorch, the update (weight decay, then
    `_foreach_update`, Keras's own foreach operations in Keras's order) runs on tensors read once
    per step (`eager_torch.VariableReader`) instead of through `Variable.value` and its scope
    checks for every variable and slot, and the tensors Keras makes of Python numbers (the step
    count, constants, a schedule's) come from `torch_step.device_constants` (no host-device
    synchronisation on a GPU). Other backends, a stateless scope and a symbolic call run Keras's
    update."""

    def apply(self, grads, trainable_variables=None):
        if keras.backend.backend() != "torch":
            return super().apply(grads, trainable_variables)
        with device_constants():
            return super().apply(grads, trainable_variables)

    def _apply_weight_decay(self, variables):
        read = _torch_reader()
        if read is None or self.weight_decay is None:
            return super()._apply_weight_decay(variables)
        import torch

        with torch.no_grad():
            torch._foreach_mul_(
                [read(variable) for variable in variables if self._use_weight_decay(variable)],
                1 - self.weight_decay * self._get_current_learning_rate(),
            )

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        read = _torch_reader()
        if read is None:
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        import torch

        with torch.no_grad():
            self._foreach_update(grads, trainable_variables, learning_rate, read)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class AdamW(_ReadOnceOnPyTorch, keras.optimizers.AdamW):
    """`keras.optimizers.AdamW` whose PyTorch update reads each variable once per step.

    Keras's own AdamW on PyTorch runs its update as `torch._foreach_*` operations, but reads every
    variable, first and second moment through `Variable.value` and its scope checks (~800 reads
    per step of ViT-B/16's 200 weights), and a subclass of it gets Keras's per-variable update
    instead (~8x slower than Keras's own). This class runs Keras's foreach operations on tensors
    read once: bit for bit Keras's `AdamW` on PyTorch (weight decay, amsgrad, schedules), with less
    host work.
    """

    def _foreach_update(self, grads, keras_variables, learning_rate, read) -> None:
        """Keras's PyTorch Adam update (`torch_adam.Adam._parallel_update_step`), its operations in
        its order, on the tensors `read` gives."""
        import torch

        variables = [read(variable) for variable in keras_variables]
        indices = [self._get_variable_index(variable) for variable in keras_variables]
        dtype = variables[0].dtype
        lr = ops.cast(learning_rate, dtype)
        local_step = ops.cast(self.iterations + 1, dtype)
        beta_1_power = ops.power(ops.cast(self.beta_1, dtype), local_step)
        beta_2_power = ops.power(ops.cast(self.beta_2, dtype), local_step)
        alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        m_list = [read(self._momentums[index]) for index in indices]
        v_list = [read(self._velocities[index]) for index in indices]
        torch._foreach_mul_(m_list, self.beta_1)
        torch._foreach_add_(m_list, grads, alpha=1 - self.beta_1)
        torch._foreach_mul_(v_list, self.beta_2)
        torch._foreach_add_(v_list, torch._foreach_mul(grads, grads), alpha=1 - self.beta_2)
        if self.amsgrad:
            v_hat_list = [read(self._velocity_hats[index]) for index in indices]
            torch._foreach_maximum_(v_hat_list, v_list)
            v_list = v_hat_list
        denominators = torch._foreach_add(torch._foreach_sqrt(v_list), self.epsilon)
        steps = torch._foreach_div(torch._foreach_mul(m_list, alpha), denominators)
        torch._foreach_add_(variables, steps, alpha=-1)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class KernelDecayAdamW(AdamW):
    """AdamW whose decoupled weight decay applies to kernels only (variables named `kernel`).

    Biases, LayerNorm/GroupNorm scales and offsets, the [class] token and the position
    embedding are not decayed, as in big_vision (`wd_mults` default `('.*/kernel$', 1.0)`).
    The exclusion is made from the variables themselves when the optimizer is built (a
    name pattern would not do: the TensorFlow backend checks the names of the underlying
    `tf.Variable`s, e.g. `kernel:0`), and survives `get_config` / saving as the class.
    """

    def build(self, var_list):
        if not self.built:
            self.exclude_from_weight_decay(var_list=[v for v in var_list if v.name != "kernel"])
        super().build(var_list)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class SGD(_ReadOnceOnPyTorch, keras.optimizers.SGD):
    """`keras.optimizers.SGD` whose PyTorch update reads each variable once per step (see `AdamW`):
    bit for bit Keras's `SGD` on PyTorch (momentum, Nesterov, weight decay)."""

    def _foreach_update(self, grads, keras_variables, learning_rate, read) -> None:
        """Keras's PyTorch SGD update (`torch_sgd.SGD._parallel_update_step`), its operations in its
        order, on the tensors `read` gives."""
        import torch

        variables = [read(variable) for variable in keras_variables]
        if self.momentum == 0:
            torch._foreach_add_(variables, grads, alpha=-learning_rate)
            return
        buffers = [read(self.momentums[self._get_variable_index(variable)]) for variable in keras_variables]
        torch._foreach_mul_(buffers, self.momentum)
        torch._foreach_add_(buffers, grads, alpha=-learning_rate)
        if self.nesterov:
            torch._foreach_add_(variables, grads, alpha=-learning_rate)
            torch._foreach_add_(variables, buffers, alpha=self.momentum)
        else:
            torch._foreach_add_(variables, buffers)


def pretraining_optimizer(
    total_steps: int,
    *,
    learning_rate: float = 1e-3,
    weight_decay: float = 0.1,
    warmup_steps: int = 10_000,
    decay: str = "linear",
    ema_momentum: float | None = None,
) -> keras.optimizers.Optimizer:
    """The paper's pre-training optimizer: AdamW, clipping at global norm 1, warm-up + decay.

    Adam β1 0.9, β2 0.999; weight decay decoupled from the gradient and scaled by the
    learning rate (`w -= lr * weight_decay * w`, as the Flax `optim.Adam(weight_decay=...)`
    of the reference code), applied to kernels only (`KernelDecayAdamW`: not to biases,
    norms, the [class] token or the position embedding, as big_vision, the maintained
    reference). Defaults: the ImageNet-21k recipe (LR 1e-3, 10k warm-up steps, linear decay
    to 0); `decay="cosine"` for ImageNet-1k runs. `ema_momentum` turns on Polyak averaging.
    """
    return KernelDecayAdamW(
        learning_rate=WarmupDecay(learning_rate, total_steps, warmup_steps, decay=decay),
        weight_decay=weight_decay,
        beta_1=0.9,
        beta_2=0.999,
        global_clipnorm=1.0,
        **_ema_arguments(ema_momentum),
    )


def finetuning_optimizer(
    total_steps: int,
    *,
    learning_rate: float = 0.01,
    warmup_steps: int = 500,
    momentum: float = 0.9,
    ema_momentum: float | None = None,
) -> keras.optimizers.Optimizer:
    """The paper's fine-tuning optimizer (App. B.1.1): SGD momentum, clipping at norm 1, cosine.

    No weight decay; warm-up (500 steps in the reference code) then cosine decay to 0 at
    `total_steps`. The paper sweeps the learning rate in {0.001, 0.003, 0.01, 0.03};
    `ema_momentum=0.9999` gives the Polyak averaging of its Table 2 runs.
    """
    return SGD(
        learning_rate=WarmupDecay(learning_rate, total_steps, warmup_steps, decay="cosine"),
        momentum=momentum,
        global_clipnorm=1.0,
        **_ema_arguments(ema_momentum),
    )


@keras.saving.register_keras_serializable(package=_PACKAGE)
class SparseCrossentropy(keras.losses.Loss):
    """Softmax cross-entropy from logits for sparse integer labels, with optional label smoothing.

    Keras's `SparseCategoricalCrossentropy` has no label smoothing and `CategoricalCrossentropy`
    needs one-hot labels; this loss one-hot encodes the sparse labels (`(batch,)` or
    `(batch, 1)`) to the logits' width and smooths them to `(1 - s) * onehot + s / classes`.
    Labels already shaped like the logits, `(batch, classes)`, are taken as class
    distributions (mixup's) and smoothed the same way.
    """

    def __init__(self, label_smoothing: float = 0.0, name: str = "sparse_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}.")
        self.label_smoothing = float(label_smoothing)

    def call(self, y_true, y_pred):
        if _are_distributions(y_true, y_pred):
            targets = ops.cast(y_true, y_pred.dtype)
        else:
            labels = ops.reshape(ops.cast(y_true, "int32"), (-1,))
            targets = ops.one_hot(labels, ops.shape(y_pred)[-1], dtype=y_pred.dtype)
        return keras.losses.categorical_crossentropy(
            targets, y_pred, from_logits=True, label_smoothing=self.label_smoothing
        )

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(label_smoothing=self.label_smoothing)
        return config


def _are_distributions(y_true, y_pred) -> bool:
    """Whether labels are per-class distributions `(batch, classes)` rather than class indices."""
    classes = y_pred.shape[-1]
    return len(y_true.shape) == len(y_pred.shape) and y_true.shape[-1] == classes and classes != 1


def _top1_matches(y_true, y_pred):
    """1.0 where the logits' top class is the label (a distribution's: its largest entry), else 0.0."""
    if _are_distributions(y_true, y_pred):
        y_true = ops.argmax(y_true, axis=-1)
    labels = ops.reshape(ops.cast(y_true, "int32"), (-1,))
    predicted = ops.cast(ops.argmax(y_pred, axis=-1), "int32")
    return ops.cast(ops.equal(labels, ops.reshape(predicted, (-1,))), "float32")


@keras.saving.register_keras_serializable(package=_PACKAGE)
class LabelAccuracy(keras.metrics.MeanMetricWrapper):
    """Top-1 accuracy for integer labels and for mixed ones (the class with the largest share)."""

    def __init__(self, name: str = "accuracy", dtype=None):
        super().__init__(fn=_top1_matches, name=name, dtype=dtype)
        self._direction = "up"

    def get_config(self) -> dict:
        return {"name": self.name, "dtype": self.dtype}


def loss(label_smoothing: float = 0.0) -> keras.losses.Loss:
    """The recipes' classification loss: softmax cross-entropy from logits on sparse or mixed labels."""
    return SparseCrossentropy(label_smoothing=label_smoothing)

"""Training input finished on the device: uint8 pixels normalised, and mixup, inside the training step.

The host's readers (`keras_vit.data.pyinput` and `keras_vit.data.tfdata`, `train_pipeline(pixels="uint8")`)
crop, resize and flip in uint8 and ship uint8 batches, 4x fewer bytes than float32; with mixup each row
also carries its batch's `Beta(alpha, alpha)` weight (`{"images": uint8, "mixup_weight": float32 (B,)}`),
drawn on the host from `(seed, global batch index)` as before, so batches stay a pure function of
`(seed, epoch, index)` and exact resume holds. `DeviceInput` wraps the model the driver trains:

* normalisation: `keras_vit.models.layers.normalize_pixels` (a `(256, C)` table lookup equal to the
  host's `normalize` bit for bit, as the `image_dtype="uint8"` models' `PixelNormalization`);
* mixup: `w * x + (1 - w) * x[::-1]` of the normalised batch and the same of the one-hot labels, which
  become the class distributions the recipes' loss and `LabelAccuracy` take. The batch reversed is the
  step's: the global batch on JAX (keras.distribution's step is one program over it, every process
  feeding its rows), the one device's batch on PyTorch, and each replica's share under a tf.distribute
  strategy with several replicas (TensorFlow's step runs per replica), where a row is then mixed with
  another row of its own share.

The driver's held-out evaluation reads uint8 batches too (`eval_pipeline(pixels="uint8")`) and runs
them through `DeviceInput`: the host never builds float32 images. The wrapped model is the one that is
saved and returned: it keeps its float input (normalised images, as documented), and `DeviceInput`
passes float batches through to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
from keras import ops

from keras_vit.data.pyinput import IMAGES, MIXUP_WEIGHT
from keras_vit.models import eager_torch
from keras_vit.models.layers import normalize_pixels
from keras_vit.models.torch_step import TorchTrainStep

__all__ = ["DeviceInput", "unwrapped"]


class DeviceInput(TorchTrainStep, keras.Model):
    """Trains `network` on uint8 batches: normalises them (`mean`, `std`) and mixes them in the step.

    Input: uint8 images `(B, H, W, C)`, or `{"images": uint8, "mixup_weight": float32 (B,)}` for mixup
    (labels then sparse int `(B,)`, mixed into `(B, num_classes)` distributions for the loss and the
    metrics); float images pass through unchanged (normalised evaluation batches). A `network` built
    with `image_dtype="uint8"` normalises itself: it gets the uint8 pixels (and cannot be mixed).
    Holds no variables of its own: its weights are `network`'s. Not saved: save `network`.
    """

    def __init__(
        self,
        network: keras.Model,
        mean: Sequence[float],
        std: Sequence[float],
        num_classes: int | None = None,
    ):
        # float32: a mixed-precision policy would cast the mixup weights (the network casts its input).
        super().__init__(dtype="float32", name=f"{network.name}_device_input")
        self.network = network
        self.mean, self.std = tuple(float(value) for value in mean), tuple(float(value) for value in std)
        self.num_classes = num_classes
        self.normalizes_itself = getattr(network, "image_dtype", "float32") == "uint8"
        self.built = True

    def images(self, inputs):
        """The batch `network` takes: normalised (unless it normalises itself) and mixed."""
        mixing = isinstance(inputs, dict)
        images = inputs[IMAGES] if mixing else inputs
        uint8 = keras.backend.standardize_dtype(images.dtype) == "uint8"
        if uint8 and not self.normalizes_itself:
            images = normalize_pixels(images, self.mean, self.std)
        if mixing:
            if self.normalizes_itself:
                raise ValueError(
                    f"{self.network.name} takes uint8 pixels (image_dtype='uint8'): mixup needs a model "
                    "with a float input; train without mixup (mixup_alpha=0)."
                )
            weight = ops.reshape(ops.cast(inputs[MIXUP_WEIGHT], "float32"), (-1, 1, 1, 1))
            images = weight * images + (1.0 - weight) * ops.flip(images, axis=0)
        return images

    def labels(self, x, y):
        """`y` as the loss and metrics take it: mixed like the images when `x` carries mixup weights."""
        if not isinstance(x, dict) or y is None:
            return y
        weight = ops.reshape(ops.cast(x[MIXUP_WEIGHT], "float32"), (-1, 1))
        one_hot = ops.one_hot(ops.cast(y, "int32"), self.num_classes, dtype="float32")
        return weight * one_hot + (1.0 - weight) * ops.flip(one_hot, axis=0)

    def compile(self, *args, jit_compile="auto", **kwargs):
        """`keras.Model.compile`; on PyTorch, `jit_compile=True` compiles the network's forward pass
        (`ViT.compiled_forward`) and leaves Keras's step eager, as `ViT.compile` does."""
        if eager_torch.compiles_forward(jit_compile) and hasattr(self.network, "compiled_forward"):
            self.network.compiled_forward, jit_compile = True, False
        super().compile(*args, jit_compile=jit_compile, **kwargs)

    def call(self, inputs, training=None):
        return self.network(self.images(inputs), training=training)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return super().compute_loss(x, self.labels(x, y), y_pred, sample_weight, training=training)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return super().compute_metrics(x, self.labels(x, y), y_pred, sample_weight)


def unwrapped(model: keras.Model) -> keras.Model:
    """The model a `DeviceInput` trains, or `model` itself."""
    return model.network if isinstance(model, DeviceInput) else model

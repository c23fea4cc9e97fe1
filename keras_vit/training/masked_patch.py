"""Masked patch prediction (paper §4.6, Appendix B.1.2): the task's Keras model, on any backend.

BERT-style, on patch embeddings: per image, `corrupt_rate` (50%) of the patch embeddings are
corrupted; each corrupted one is replaced by a learnable [mask] embedding (80% of them), by
another patch's embedding drawn from the batch (10%), or left as it is (10%). The Transformer
then predicts, for every corrupted patch, a target from the ORIGINAL image:

* `"mean_color"` (the paper's main setting): the patch's mean colour quantised to `bits`
  (3) bits per channel, one class out of `(2**bits)**channels` (512 for RGB, 8 for one
  channel);
* `"grid_4x4"`: the 3-bit mean colours of a 4x4 grid of sub-patches, 16 predictions per patch;
* `"regression"`: the patch's pixels as the model sees them (normalised), with an L2 loss.

The loss (softmax cross-entropy, or squared error) is averaged over the corrupted patches
only. Colour targets are computed inside the model from its normalised input by undoing the
normalisation (`pixels = x * std + mean`, clipped to [0, 1]), so any image pipeline feeds it
unchanged, and labels, if the data has any, are never read.

`MaskedPatchPredictor` is assembled from a keras_vit backbone's OWN layers: `patch_embed` ->
`PatchCorruption` -> `class_token` -> `pos_embed` -> blocks -> `encoder_norm` -> a linear head
on the patch tokens. Training it trains the backbone itself: afterwards `model.backbone` is the
pre-trained ViT (token output), and `to_classifier(model, num_classes)` gives an independent
classifier holding a copy of its weights for fine-tuning. `keras_vit.training.pretrain.pretrain`
(`keras-vit pretrain`) runs the paper's recipe with the package's training driver.

This module imports no TensorFlow. Under a tf.distribute strategy (TensorFlow backend) each
replica's step sees its share of the batch, and the corruption and the loss take the replicas
into account. On JAX, keras.distribution's data-parallel step is one program over the global
batch (sharded over the devices): the corruption draws for, and picks random patches from, the
whole batch and the loss is its mean, exactly as on one device (a data-parallel run is one
device's up to float rounding, tested); PyTorch trains on one device.

For hybrids the ResNet stem sees the whole image before the corruption, so a corrupted token's
neighbours still carry some of its colours through their receptive fields: the task is easier
than for plain ViTs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import keras
import numpy as np
from keras import ops

from keras_vit.models.build import build_vit
from keras_vit.models.layers import normalize_pixels
from keras_vit.models.torch_step import (
    TorchTrainStep,
    device_constants,
    host_seed_generator,
    randint,
    uniform,
)
from keras_vit.models.vit import ViT
from keras_vit.registry.catalog import GOOGLE_MEAN, GOOGLE_STD
from keras_vit.registry.variants import ViTConfig, config_of, model_config
from keras_vit.utils import defaults, validation
from keras_vit.utils.defaults import MPP_TARGETS
from keras_vit.utils.files import load_keras_file

__all__ = [
    "MaskedPatchPredictor",
    "PatchCorruption",
    "masked_patch_loss",
    "masked_patch_model",
    "patch_targets",
    "to_classifier",
]

_PACKAGE = "keras_vit"
_GRID_CELLS = {"mean_color": 1, "grid_4x4": 4}
# A mean this close (in bins) below a bin edge counts in the upper bin: undoing the
# normalisation in float32 cannot then move a mean that lies exactly on an edge (e.g. 0.125
# from uint8 pixels) into the lower bin.
_EDGE_TOLERANCE = 1e-4


def _replica_context():
    """The tf.distribute replica context on the TensorFlow backend; `None` elsewhere (a step there
    sees the global batch: keras.distribution on JAX, one device on PyTorch)."""
    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    return tf.distribute.get_replica_context()


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PatchCorruption(keras.layers.Layer):
    """BERT-style corruption of patch embeddings `(batch, N, D)` with a learnable [mask] embedding.

    Per image exactly `round(corrupt_rate * N)` patches, chosen uniformly at random, are
    corrupted (so every image and every replica has the same number of loss terms). Each
    corrupted patch independently becomes the [mask] embedding with probability `mask_rate`,
    the embedding of another patch of the batch (any image, never itself; under tf.distribute,
    of the replica's share of the batch; under JAX's keras.distribution, of the global batch)
    with probability `random_rate`, and stays unchanged
    otherwise. Returns `(corrupted_embeddings,
    corrupted)`, the second a float `(batch, N)` indicator of the corrupted patches (the loss
    weights). The corruption is the pre-training task, so it applies in training and
    evaluation alike; draws come from a `keras.random.SeedGenerator` (reproducible with
    `seed`, and its state is a model variable, so backups resume it; on PyTorch kept on the CPU).
    """

    def __init__(
        self,
        corrupt_rate: float = 0.5,
        mask_rate: float = 0.8,
        random_rate: float = 0.1,
        seed: int | None = None,
        mask_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not 0.0 < corrupt_rate <= 1.0:
            raise ValueError(f"corrupt_rate must be in (0, 1], e.g. 0.5 (the paper's), got {corrupt_rate!r}.")
        if mask_rate < 0.0 or random_rate < 0.0 or mask_rate + random_rate > 1.0:
            raise ValueError(
                f"mask_rate and random_rate must be >= 0 with a sum <= 1 (the rest of the corrupted "
                f"patches is kept unchanged), e.g. 0.8 and 0.1; got {mask_rate!r} and {random_rate!r}."
            )
        self.corrupt_rate = float(corrupt_rate)
        self.mask_rate = float(mask_rate)
        self.random_rate = float(random_rate)
        self.seed = seed
        self.mask_initializer = keras.initializers.get(mask_initializer)
        # Named after the layer: its state's path (which backups restore by) is then stable.
        # On PyTorch its state is on the host: a draw never waits for the GPU (`torch_step.uniform`).
        self.seed_generator = host_seed_generator(seed, name=f"{self.name}_seed_generator")

    def corrupted_count(self, num_patches: int) -> int:
        """Patches corrupted per image: `round(corrupt_rate * num_patches)`, at least 1."""
        count = round(self.corrupt_rate * num_patches)
        if count < 1:
            raise ValueError(
                f"corrupt_rate {self.corrupt_rate} of {num_patches} patches rounds to no patch: raise "
                "corrupt_rate or use more patches (a larger image or a smaller patch size)."
            )
        return count

    def build(self, input_shape):
        if len(input_shape) != 3 or input_shape[1] is None:
            raise ValueError(
                f"{self.name} expects patch embeddings (batch, patches, D) with a known number of "
                f"patches, got shape {tuple(input_shape)}."
            )
        self.corrupted_count(input_shape[1])
        self.mask_token = self.add_weight(
            name="mask_token", shape=(1, 1, input_shape[-1]), initializer=self.mask_initializer
        )

    def _draw(self, sample, batch, num_patches):
        """`sample(shape)` for this replica's `(batch, num_patches)` share of the global batch.

        Under a tf.distribute strategy every replica holds the same seed state: each draws for
        the whole global batch and keeps its own rows, so replicas corrupt independently and
        the corruption of each example is the one a single device would draw.
        """
        context = _replica_context()
        replicas = 1 if context is None else context.num_replicas_in_sync
        if replicas == 1:
            return sample((batch, num_patches))
        rows = sample((batch * replicas, num_patches))
        return ops.slice(rows, (context.replica_id_in_sync_group * batch, 0), (batch, num_patches))

    def call(self, patches):
        batch, num_patches, width = ops.shape(patches)[0], patches.shape[1], patches.shape[2]
        count = self.corrupted_count(num_patches)
        seed = self.seed_generator
        # Rank of each patch under i.i.d. uniform noise: the `count` lowest are a uniform subset.
        noise = self._draw(lambda shape: uniform(shape, seed), batch, num_patches)
        ranks = ops.argsort(ops.argsort(noise, axis=-1), axis=-1)
        corrupted = ranks < count
        choice = self._draw(lambda shape: uniform(shape, seed), batch, num_patches)
        use_mask = ops.logical_and(corrupted, choice < self.mask_rate)
        use_random = ops.logical_and(
            corrupted,
            ops.logical_and(choice >= self.mask_rate, choice < self.mask_rate + self.random_rate),
        )
        # Another patch of the (replica's) batch: flat index shifted by 1 .. total-1, never itself.
        total = batch * num_patches
        high = max(total, 2) if isinstance(total, int) else ops.maximum(total, 2)  # an int where eager
        shift = self._draw(lambda shape: randint(shape, 1, high, seed), batch, num_patches)
        source = ops.mod(ops.reshape(ops.arange(total), (batch, num_patches)) + shift, total)
        flat = ops.reshape(patches, (-1, width))
        replacement = ops.reshape(ops.take(flat, ops.reshape(source, (-1,)), axis=0), ops.shape(patches))
        mask = ops.broadcast_to(ops.cast(self.mask_token, patches.dtype), ops.shape(patches))
        outputs = ops.where(use_random[..., None], replacement, patches)
        outputs = ops.where(use_mask[..., None], mask, outputs)
        return outputs, ops.cast(corrupted, "float32")

    def compute_output_shape(self, input_shape):
        return input_shape, tuple(input_shape[:2])

    def get_config(self):
        config = super().get_config()
        config.update(
            corrupt_rate=self.corrupt_rate,
            mask_rate=self.mask_rate,
            random_rate=self.random_rate,
            seed=self.seed,
            mask_initializer=keras.initializers.serialize(self.mask_initializer),
        )
        return config


def _check_target(target: str, bits: int) -> None:
    if target not in MPP_TARGETS:
        raise ValueError(f"Unknown target {target!r}: use one of {MPP_TARGETS}.")
    if not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in [1, 8] (the paper uses 3), got {bits!r}.")


def _per_channel(values: Sequence[float], channels: int, what: str) -> np.ndarray:
    array = np.resize(np.asarray(values, dtype="float32"), channels)
    if what == "std" and np.any(array <= 0):
        raise ValueError(f"std must be positive, got {tuple(np.asarray(values).tolist())}.")
    return array


def patch_targets(
    images,
    patch_size: int,
    *,
    target: str = "mean_color",
    bits: int = 3,
    mean: Sequence[float] = GOOGLE_MEAN,
    std: Sequence[float] = GOOGLE_STD,
):
    """Prediction targets of every `patch_size` patch of normalised `images` `(B, H, W, C)`.

    Patches are in the row-major order of `patch_embed`'s tokens (N = (H/P) * (W/P)).
    Colour targets undo the normalisation (`pixels = images * std + mean`, clipped to [0, 1]),
    average each patch (or each cell of its 4x4 grid, for `"grid_4x4"`; P must then be a
    multiple of 4) per channel, quantise each mean to `q = min(floor(v * 2**bits), 2**bits - 1)`
    (a mean within 1e-4 bin of an edge below it counts in the upper bin) and combine the
    channels into one class `sum_c q_c * (2**bits)**(C - 1 - c)` (first channel most
    significant): int32 `(B, N, cells)` with cells 1 or 16. `"regression"`: the normalised
    pixels themselves, float32 `(B, N, P * P * C)` in (row, column, channel) order.
    """
    _check_target(target, bits)
    images = ops.cast(images, "float32")
    height, width, channels = images.shape[1:]
    if height % patch_size or width % patch_size:
        raise ValueError(
            f"Image size {height}x{width} is not divisible by the patch size {patch_size}: resize or crop "
            "the images to a multiple of it."
        )
    rows, cols = height // patch_size, width // patch_size
    if target == "regression":
        patches = ops.reshape(images, (-1, rows, patch_size, cols, patch_size, channels))
        patches = ops.transpose(patches, (0, 1, 3, 2, 4, 5))
        return ops.reshape(patches, (-1, rows * cols, patch_size * patch_size * channels))
    cells = _GRID_CELLS[target]
    if patch_size % cells:
        raise ValueError(
            f"target {target!r} splits each patch into a {cells}x{cells} grid: the patch size "
            f"(in pixels) {patch_size} must be a multiple of {cells}; use target='mean_color'."
        )
    cell = patch_size // cells
    mean = ops.convert_to_tensor(_per_channel(mean, channels, "mean"))
    std = ops.convert_to_tensor(_per_channel(std, channels, "std"))
    pixels = ops.clip(images * std + mean, 0.0, 1.0)
    pixels = ops.reshape(pixels, (-1, rows, cells, cell, cols, cells, cell, channels))
    means = ops.mean(pixels, axis=(3, 6))  # (B, rows, cells, cols, cells, C)
    means = ops.reshape(ops.transpose(means, (0, 1, 3, 2, 4, 5)), (-1, rows * cols, cells * cells, channels))
    levels = 2**bits
    quantised = ops.clip(ops.floor(means * levels + _EDGE_TOLERANCE), 0, levels - 1)
    place = ops.convert_to_tensor(levels ** np.arange(channels - 1, -1, -1, dtype="float32"))
    return ops.cast(ops.sum(quantised * place, axis=-1), "int32")


def masked_patch_loss(targets, predictions, corrupted, target: str = "mean_color"):
    """Mean loss over the corrupted patches: cross-entropy (averaged over cells) or squared error.

    `targets` from `patch_targets`; `predictions` logits `(B, N, cells, classes)` or pixels
    `(B, N, P*P*C)`; `corrupted` `(B, N)`, 1 for a corrupted patch. Uncorrupted patches get
    weight 0, so their predictions cannot change the loss.
    """
    _check_target(target, 3)
    predictions = ops.cast(predictions, "float32")
    if target == "regression":
        per_patch = ops.mean(ops.square(predictions - ops.cast(targets, "float32")), axis=-1)
    else:
        per_patch = ops.mean(
            keras.losses.sparse_categorical_crossentropy(targets, predictions, from_logits=True), axis=-1
        )
    weights = ops.cast(corrupted, "float32")
    return ops.sum(per_patch * weights) / ops.maximum(ops.sum(weights), 1.0)


def _token_backbone(model: keras.Model) -> ViT:
    """A keras_vit model with token output: the model itself, or a copy of a classifier's weights."""
    if config_of(model).pooling is None:
        return model
    return model.without_head(pooling=None)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MaskedPatchPredictor(TorchTrainStep, keras.Model):
    """A keras_vit backbone trained to predict corrupted patches (see the module docstring).

    Built from `backbone` (any keras_vit model, plain or hybrid; a classifier's pooling and
    head are dropped) and made of its own layers: `patch_embed` (and the ResNet stem) ->
    `PatchCorruption` -> `class_token` -> `pos_embed` -> blocks -> `encoder_norm` -> a
    zero-initialised float32 Dense head on each patch token. `model.backbone` is the backbone
    (token output `(B, 1 + N, D)`), whose weights are the ones trained here.

    Input: images normalised with `mean`/`std` (Google's 0.5/0.5, i.e. [-1, 1], by default), or
    uint8 pixels, which it normalises itself on the device (`normalize_pixels`: equal to the
    host's normalisation bit for bit; what `keras-vit pretrain`'s input ships).
    Output: `{"predictions": (B, N, cells, classes) logits, or (B, N, P*P*C) pixels for
    "regression", "corrupted": (B, N)}`. `model.fit` on batches of images, or of
    `(images, labels)` (labels are ignored), minimises `masked_patch_loss`, and reports
    `patch_accuracy` (the share of corrupted patches' colour classes predicted right) for the
    colour targets. Compile with an optimizer only (no `loss`).
    """

    def __init__(
        self,
        backbone: keras.Model,
        *,
        target: str = "mean_color",
        bits: int = 3,
        corrupt_rate: float = 0.5,
        mask_rate: float = 0.8,
        random_rate: float = 0.1,
        mean: Sequence[float] = GOOGLE_MEAN,
        std: Sequence[float] = GOOGLE_STD,
        seed: int | None = None,
        **kwargs,
    ):
        _check_target(target, bits)
        backbone = _token_backbone(backbone)
        kwargs.setdefault("name", f"{backbone.name}_mpp")
        super().__init__(**kwargs)
        self.backbone = backbone
        self.target = target
        self.bits = int(bits)
        self.mean = tuple(float(value) for value in mean)
        self.std = tuple(float(value) for value in std)
        height, width, channels = backbone.input_shape[1:]
        patch_embed = backbone.patch_embed
        rows, cols = backbone.pos_embed.grid_size
        # Pixels per token side: the patch, or the ResNet's stride times the patch for hybrids.
        self.pixel_patch = height // rows
        if height != rows * self.pixel_patch or width != cols * self.pixel_patch:
            raise ValueError(
                f"{backbone.name}: image {height}x{width} is not tiled by its {rows}x{cols} tokens."
            )
        _per_channel(self.std, channels, "std")
        num_patches, hidden = rows * cols, patch_embed.hidden_size
        # The backbone split at the corruption point; both halves are the backbone's layers.
        self._embed = keras.Model(backbone.input, patch_embed.output, name="embed")
        self._encode = keras.Model(patch_embed.output, backbone.output, name="encode")
        self.corruption = PatchCorruption(
            corrupt_rate, mask_rate, random_rate, seed=seed, dtype=self.dtype_policy, name="patch_corruption"
        )
        if target == "regression":
            self.cells, self.classes = 1, self.pixel_patch**2 * channels
        else:
            self.cells, self.classes = _GRID_CELLS[target] ** 2, (2**self.bits) ** channels
            patch_targets(  # checks the grid fits the patch, before any training
                keras.KerasTensor((None, height, width, channels)), self.pixel_patch, target=target, bits=bits
            )
        self.head = keras.layers.Dense(
            self.cells * self.classes, kernel_initializer="zeros", dtype="float32", name="mpp_head"
        )
        self.corruption.build((None, num_patches, hidden))
        self.head.build((None, num_patches, hidden))
        self.patch_accuracy = keras.metrics.Mean(name="patch_accuracy")
        self.built = True

    def normalized(self, images):
        """uint8 pixels normalised with `mean`/`std` (for a backbone with a float input); else `images`."""
        uint8 = keras.backend.standardize_dtype(images.dtype) == "uint8"
        if uint8 and getattr(self.backbone, "image_dtype", "float32") != "uint8":
            return normalize_pixels(images, self.mean, self.std)
        return images

    def call(self, images, training=None):
        patches = self._embed(self.normalized(images), training=training)
        with device_constants():  # PyTorch: the corruption's constants made without a host-to-device copy
            corrupted_patches, corrupted = self.corruption(patches)
        tokens = self._encode(corrupted_patches, training=training)
        outputs = self.head(tokens[:, self.backbone.config.num_prefix_tokens :])
        if self.target != "regression":
            outputs = ops.reshape(outputs, (-1, outputs.shape[1], self.cells, self.classes))
        return {"predictions": outputs, "corrupted": corrupted}

    def targets(self, images):
        """`patch_targets` of normalised `images` (or uint8 pixels) with this model's patch, target and
        normalisation."""
        if keras.backend.standardize_dtype(images.dtype) == "uint8":
            images = normalize_pixels(images, self.mean, self.std)
        return patch_targets(
            images, self.pixel_patch, target=self.target, bits=self.bits, mean=self.mean, std=self.std
        )

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """`masked_patch_loss` of the batch (plus any layer losses); `y` is ignored."""
        loss = masked_patch_loss(self.targets(x), y_pred["predictions"], y_pred["corrupted"], self.target)
        for extra in self.losses:
            loss = loss + ops.cast(extra, "float32")
        # Keras sums the replicas' gradients: each replica's mean loss counts 1 / replicas.
        context = _replica_context()
        replicas = 1 if context is None else context.num_replicas_in_sync
        return loss / replicas if replicas > 1 else loss

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        """Updates `patch_accuracy` (colour targets: the share of corrupted cells classified right)."""
        if self.target != "regression":
            hits = ops.cast(ops.argmax(y_pred["predictions"], axis=-1) == self.targets(x), "float32")
            self.patch_accuracy.update_state(ops.mean(hits, axis=-1), sample_weight=y_pred["corrupted"])
        return self.get_metrics_result()

    def get_config(self):
        return {
            "name": self.name,
            "backbone": keras.saving.serialize_keras_object(self.backbone),
            "target": self.target,
            "bits": self.bits,
            "corrupt_rate": self.corruption.corrupt_rate,
            "mask_rate": self.corruption.mask_rate,
            "random_rate": self.corruption.random_rate,
            "mean": self.mean,
            "std": self.std,
            "seed": self.corruption.seed,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)


def masked_patch_model(
    model: str | ViTConfig | keras.Model = defaults.TRAIN_MODEL,
    *,
    image_size: int | Sequence[int] | None = None,
    channels: int = 3,
    dropout: float = 0.0,
    drop_path_rate: float = 0.0,
    target: str = MPP_TARGETS[0],
    bits: int = defaults.MPP_BITS,
    corrupt_rate: float = defaults.MPP_CORRUPT_RATE,
    mask_rate: float = defaults.MPP_MASK_RATE,
    random_rate: float = defaults.MPP_RANDOM_RATE,
    mean: Sequence[float] = GOOGLE_MEAN,
    std: Sequence[float] = GOOGLE_STD,
    seed: int | None = None,
) -> MaskedPatchPredictor:
    """A `MaskedPatchPredictor` around `model`: a keras_vit model, or a new backbone.

    A registry name (e.g. `"vit_digits"`, see `keras_vit.list_models()`) or a `ViTConfig` gives
    a randomly initialised backbone at `image_size` (default the config's) with `channels`,
    `dropout` and `drop_path_rate`; a built keras_vit model with token output is used as it is
    (its weights are trained in place; a classifier's weights are copied into a token-output
    backbone). Other arguments as `MaskedPatchPredictor`.
    """
    if not isinstance(model, keras.Model):
        model = build_vit(
            model_config(model),
            image_size=image_size,
            include_top=False,
            pooling=None,
            dropout=dropout,
            drop_path_rate=drop_path_rate,
            channels=channels,
        )
    return MaskedPatchPredictor(
        model,
        target=target,
        bits=bits,
        corrupt_rate=corrupt_rate,
        mask_rate=mask_rate,
        random_rate=random_rate,
        mean=mean,
        std=std,
        seed=seed,
    )


def to_classifier(
    model: keras.Model | str | os.PathLike,
    num_classes: int,
    *,
    pooling: str = "token",
    dropout: float | None = None,
    drop_path_rate: float | None = None,
    classifier_activation: str | None = None,
    name: str | None = None,
) -> keras.Model:
    """A new classifier for fine-tuning that starts from a (pre-trained) backbone's weights.

    `model`: a `MaskedPatchPredictor`, a backbone (e.g. `pretrain`'s `backbone.keras`, or its
    path), or any keras_vit model (its pooling and head are replaced). The classifier has the
    layout of `keras_vit.build_vit` (`pool` with `pooling`, a zero-initialised float32 `head`
    with `num_classes`) and its OWN copy of the backbone's weights, so fine-tuning it leaves
    `model` unchanged. `dropout` and `drop_path_rate` (stochastic depth growing linearly over
    the blocks, as `build_vit`) replace the backbone's when given.
    """
    if isinstance(model, (str, os.PathLike)):
        model = load_keras_file(model)  # a damaged file: one clear error naming it
    num_classes = validation.positive_int("num_classes", num_classes)
    backbone = model.backbone if isinstance(model, MaskedPatchPredictor) else _token_backbone(model)
    changes = {"dropout": dropout, "drop_path_rate": drop_path_rate, "name": name or backbone.name}
    return backbone.with_head(
        int(num_classes),
        pooling=pooling,
        classifier_activation=classifier_activation,
        **{key: value for key, value in changes.items() if value is not None},
    )

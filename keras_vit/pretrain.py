"""Self-supervised pre-training by masked patch prediction (paper §4.6, Appendix B.1.2): the run.

`pretrain(...)` (`keras-vit pretrain`) trains a `keras_vit.masked_patch.MaskedPatchPredictor`
with the paper's recipe (Adam, LR 2e-4, warm-up then cosine decay) through the package's one
training driver (`keras_vit.runs.fit_task`): any tf.distribute strategy, XLA, exact resume,
reports. The task's model, targets and loss live in `keras_vit.masked_patch` (no TensorFlow);
their names are re-exported here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from keras_vit import data, defaults, recipes, runs
from keras_vit import validation as check
from keras_vit.defaults import BAD_IMAGE_ACTIONS, MPP_TARGETS
from keras_vit.masked_patch import (
    MaskedPatchPredictor,
    PatchCorruption,
    masked_patch_loss,
    masked_patch_model,
    patch_targets,
    to_classifier,
)
from keras_vit.variants import ViTConfig, model_config

__all__ = [
    "MaskedPatchPredictor",
    "MaskedPatchTask",
    "PatchCorruption",
    "PretrainingResult",
    "masked_patch_loss",
    "masked_patch_model",
    "patch_targets",
    "pretrain",
    "to_classifier",
]


@dataclass
class PretrainingResult:
    """What `pretrain` returns: the trained `MaskedPatchPredictor` and the report it wrote."""

    model: MaskedPatchPredictor
    report: dict


def _train_source(
    dataset, train_split: str, data_dir: str | os.PathLike | None, on_bad_image: str = BAD_IMAGE_ACTIONS[0]
) -> tuple[data.Source, bool]:
    """The unlabeled training images as a `data.Source`, and whether they are the digits."""
    if isinstance(dataset, data.Source):
        return dataset, False
    if isinstance(dataset, np.ndarray):
        return data.from_arrays(dataset, np.zeros(len(dataset), "int32"), num_classes=1), False
    if isinstance(dataset, str) and dataset == "digits":
        return data.load_digits()[0], True  # the train split only: the test split stays unseen
    path = os.path.expanduser(os.fspath(dataset))
    if not data.is_folder_name(dataset):  # a tfds name, e.g. imagenette/320px or mnist:3.0.1
        return data.from_tfds(path, train_split, data_dir=data_dir), False
    if os.path.isdir(path):
        if os.path.isdir(os.path.join(path, "train")):
            path = os.path.join(path, "train")
        try:
            return data.from_directory(path, on_bad_image=on_bad_image), False
        except ValueError as error:
            raise ValueError(
                f"{error} For unlabeled images any grouping will do: e.g. put them all in {path}/images/."
            ) from None
    if os.path.exists(path):
        raise ValueError(f"Dataset {path!r} is a file: pass an image folder, 'digits' or a tfds name.")
    raise FileNotFoundError(f"Dataset folder {path!r} does not exist.")


def pretrain(
    model: str | ViTConfig = defaults.TRAIN_MODEL,
    dataset: str | os.PathLike | data.Source | np.ndarray = defaults.DATASET,
    *,
    output_dir: str | os.PathLike = defaults.PRETRAIN_OUTPUT_DIR,
    image_size: int | None = None,
    batch_size: int = defaults.BATCH_SIZE,
    steps: int | None = None,
    epochs: float | None = None,
    steps_per_epoch: int | None = None,
    learning_rate: float = defaults.PRETRAIN_LEARNING_RATE,
    warmup_steps: int | None = None,
    weight_decay: float = defaults.PRETRAIN_WEIGHT_DECAY,
    target: str = MPP_TARGETS[0],
    bits: int = defaults.MPP_BITS,
    corrupt_rate: float = defaults.MPP_CORRUPT_RATE,
    mask_rate: float = defaults.MPP_MASK_RATE,
    random_rate: float = defaults.MPP_RANDOM_RATE,
    dropout: float = defaults.DROPOUT,
    crop_scale: Sequence[float] | None = None,
    flip: bool | None = None,
    strategy: str | tf.distribute.Strategy = defaults.STRATEGIES[0],
    precision: str = defaults.PRECISIONS[0],
    jit_compile: bool | str = defaults.JIT_CHOICES[0],
    steps_per_execution: int | str = defaults.STEPS_PER_EXECUTION,
    seed: int = defaults.SEED,
    train_split: str = defaults.TRAIN_SPLIT,
    data_dir: str | os.PathLike | None = None,
    on_bad_image: str = BAD_IMAGE_ACTIONS[0],
    callbacks: Sequence[keras.callbacks.Callback] = (),
    verbose: int | str = "auto",
) -> PretrainingResult:
    """Masked-patch pre-training with `model.fit` under a tf.distribute strategy; resumable exactly.

    The paper's setting (App. B.1.2): Adam (β1 0.9, β2 0.999; `weight_decay` > 0 makes it
    AdamW on kernels), gradients clipped at global norm 1, peak `learning_rate` 2e-4 after a
    linear warm-up (default 10% of the steps, at most 10k), cosine decay to 0.

    Args:
        model: a registry name (`keras_vit.list_models()`), or a `ViTConfig` (random initialisation).
        dataset: `"digits"` (its train split), an image folder (its `train/` if present; any
            sub-folders, whose names are ignored), a prepared tensorflow-datasets name
            (`train_split` of it), a `keras_vit.data.Source`, or uint8-range images
            `(N, H, W[, C])`. Labels are never used. (A `tf.data.Dataset` of normalised image
            batches goes straight to `masked_patch_model(...).fit`.)
        output_dir: receives `backbone.keras` (the pre-trained ViT, token output: load it with
            `to_classifier(path, num_classes)` to fine-tune), `report.json`, TensorBoard `logs/`
            and, while unfinished, `backup/`. Running again with the same arguments resumes.
        steps, epochs, steps_per_epoch: as `keras_vit.training.train` (default 50 passes).
        target, bits, corrupt_rate, mask_rate, random_rate: the task (see `MaskedPatchPredictor`).
        crop_scale, flip: augmentation; defaults (0.7, 1) without flips for digits, else (0.08, 1)
            with flips.
        Other arguments as `keras_vit.training.train`: every one is checked before anything
        runs, and a non-finite loss stops the run without saving a model.

    Returns:
        `PretrainingResult(model, report)`; the report (also `report.json`) holds the per-epoch
        loss and patch accuracy, steps, seconds, images/s and the arguments.
    """
    arguments = {key: runs.describe(value) for key, value in dict(locals()).items() if key != "callbacks"}
    runs.check_run_arguments(
        image_size=image_size,
        learning_rate=learning_rate,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        dropout=dropout,
        crop_scale=crop_scale,
        on_bad_image=on_bad_image,
    )
    check.positive_number("learning_rate", learning_rate)
    check.one_of("target", target, MPP_TARGETS)
    check.integer("bits", bits, minimum=1, maximum=8)
    check.number("corrupt_rate", corrupt_rate, minimum=0.0, maximum=1.0, exclusive_minimum=True)
    check.fraction("mask_rate", mask_rate, allow_one=True)
    check.fraction("random_rate", random_rate, allow_one=True)
    task = MaskedPatchTask(
        model_config(model),
        dataset,
        image_size=image_size,
        batch_size=batch_size,
        learning_rate=learning_rate,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        target=target,
        bits=bits,
        corrupt_rate=corrupt_rate,
        mask_rate=mask_rate,
        random_rate=random_rate,
        dropout=dropout,
        crop_scale=crop_scale,
        flip=flip,
        seed=seed,
        train_split=train_split,
        data_dir=data_dir,
        on_bad_image=on_bad_image,
    )
    result = runs.fit_checked(
        task,
        arguments,
        output_dir=output_dir,
        batch_size=batch_size,
        steps=steps,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        strategy=strategy,
        precision=precision,
        jit_compile=jit_compile,
        steps_per_execution=steps_per_execution,
        seed=seed,
        callbacks=callbacks,
        verbose=verbose,
    )
    return PretrainingResult(result.model, result.report)


@dataclass
class MaskedPatchTask:
    """Masked patch prediction (`runs.Task`): a `MaskedPatchPredictor`, Adam(W) + warm-up + cosine.

    Arguments as `pretrain`; the saved model is the backbone (`backbone.keras`); labels are never read.
    """

    config: ViTConfig
    dataset: str | os.PathLike | data.Source | np.ndarray
    image_size: int | None
    batch_size: int
    learning_rate: float
    warmup_steps: int | None
    weight_decay: float
    target: str
    bits: int
    corrupt_rate: float
    mask_rate: float
    random_rate: float
    dropout: float
    crop_scale: Sequence[float] | None
    flip: bool | None
    seed: int
    train_split: str
    data_dir: str | os.PathLike | None
    on_bad_image: str = BAD_IMAGE_ACTIONS[0]
    default_epochs: float = defaults.PRETRAIN_EPOCHS
    saved_file: str = "backbone.keras"

    def prepare(self, batch_size: int) -> int:
        self.source, self.is_digits = _train_source(
            self.dataset, self.train_split, self.data_dir, self.on_bad_image
        )
        return data.epoch_steps(self.source, batch_size)

    def sources(self) -> list[data.Source]:
        """The source read so far (for naming undecodable files)."""
        return [self.source] if hasattr(self, "source") else []

    def build(self) -> keras.Model:
        return masked_patch_model(
            self.config,
            image_size=self.image_size,
            dropout=self.dropout,
            target=self.target,
            bits=self.bits,
            corrupt_rate=self.corrupt_rate,
            mask_rate=self.mask_rate,
            random_rate=self.random_rate,
            seed=self.seed,
        )

    def compile(
        self, network: keras.Model, total_steps: int, jit_compile: bool, steps_per_execution: int
    ) -> None:
        self.used_warmup_steps = runs.warmup_steps(
            self.warmup_steps, total_steps, defaults.SCRATCH_WARMUP_CAP
        )
        network.compile(
            optimizer=recipes.pretraining_optimizer(
                total_steps,
                learning_rate=self.learning_rate,
                weight_decay=self.weight_decay,
                warmup_steps=self.used_warmup_steps,
                decay="cosine",
            ),
            jit_compile=jit_compile,
            steps_per_execution=steps_per_execution,
        )

    def train_data(self, network: keras.Model, start_epoch: int, steps_per_epoch: int) -> tf.data.Dataset:
        return data.train_pipeline(
            self.source,
            image_size=tuple(network.backbone.input_shape[1:3]),
            batch_size=self.batch_size,
            mean=network.mean,
            std=network.std,
            seed=self.seed,
            start_epoch=start_epoch,
            steps_per_epoch=steps_per_epoch,
            **runs.augmentation(self.is_digits, self.crop_scale, self.flip),
        ).map(lambda image, label: image)  # unlabeled: labels are dropped before the model

    def finish(self, network: keras.Model, history: dict[str, list[float]]) -> dict:
        return {
            "loss": history["loss"][-1] if history.get("loss") else None,
            "patch_accuracy": history["patch_accuracy"][-1] if history.get("patch_accuracy") else None,
            "chance_loss": None if self.target == "regression" else math.log(network.classes),
            "target": self.target,
            "classes": network.classes,
            "pretraining_examples": self.source.num_examples,
        }

    def saved_model(self, network: keras.Model) -> keras.Model:
        return network.backbone

    def describe(self, network: keras.Model) -> dict:
        """What the run used (`runs.fit_task` puts it in the report): task, data, every value."""
        augment = runs.augmentation(self.is_digits, self.crop_scale, self.flip)
        optimizer = "AdamW (weight decay on kernels)" if self.weight_decay else "Adam"
        return {
            "recipe": "masked_patch_prediction",
            "recipe_description": f"masked patch prediction (paper §4.6); {optimizer}, warm-up + cosine",
            "checkpoint": None,
            "data": {
                "dataset": runs.describe(self.dataset),
                "train_examples": self.source.num_examples,
                "labels_used": False,
            },
            "hyperparameters": {
                "learning_rate": self.learning_rate,
                "warmup_steps": self.used_warmup_steps,
                "decay": "cosine",
                "weight_decay": self.weight_decay,
                "target": self.target,
                "bits": self.bits,
                "classes": network.classes,
                "corrupt_rate": self.corrupt_rate,
                "mask_rate": self.mask_rate,
                "random_rate": self.random_rate,
                "dropout": self.dropout,
                "image_size": [int(side) for side in network.backbone.input_shape[1:3]],
                "mean": list(network.mean),
                "std": list(network.std),
                **{key: list(value) if isinstance(value, tuple) else value for key, value in augment.items()},
            },
        }

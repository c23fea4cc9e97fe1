"""Self-supervised pre-training by masked patch prediction (paper §4.6, Appendix B.1.2): the run.

`pretrain(...)` (`keras-vit pretrain`) trains a `keras_vit.training.masked_patch.MaskedPatchPredictor`
with the paper's recipe (`keras_vit.training.recipes.MASKED_PATCH_PREDICTION`: Adam, warm-up then
cosine decay) through the package's one training driver (`keras_vit.training.runs.fit_task`) on every
Keras backend: a tf.distribute strategy and tf.data on TensorFlow, keras.distribution (data
parallel over the local devices) on JAX, one device on PyTorch, their input a
`keras.utils.PyDataset` (`keras_vit.data.pyinput`, without TensorFlow); XLA, exact resume, reports.
Its keyword arguments are the run options of `keras_vit.training.options.MaskedPatchOptions`. The task's
model, targets and loss live in `keras_vit.training.masked_patch`; their names are re-exported here.
This module imports no TensorFlow.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import keras
import numpy as np

from keras_vit.data.datasets import bad_images_record, input_module, load_unlabeled
from keras_vit.registry.variants import ViTConfig, model_config
from keras_vit.training import runs
from keras_vit.training.masked_patch import (
    MaskedPatchPredictor,
    PatchCorruption,
    masked_patch_loss,
    masked_patch_model,
    patch_targets,
    to_classifier,
)
from keras_vit.training.options import MaskedPatchOptions, takes_options
from keras_vit.training.recipes import MASKED_PATCH_PREDICTION, Recipe
from keras_vit.utils import defaults

if TYPE_CHECKING:
    from keras_vit.data import tfdata as data

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


@takes_options(MaskedPatchOptions, MASKED_PATCH_PREDICTION, "backbone.keras")
def pretrain(
    model: str | ViTConfig = defaults.TRAIN_MODEL,
    dataset: str | os.PathLike | data.Source | np.ndarray = defaults.DATASET,
    *,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    options: MaskedPatchOptions,
) -> PretrainingResult:
    """Masked-patch pre-training with `model.fit` on any Keras backend; resumable exactly.

    The paper's setting (App. B.1.2, `keras_vit.training.recipes.MASKED_PATCH_PREDICTION`): Adam (β1
    0.9, β2 0.999; `weight_decay` > 0 makes it AdamW on kernels), gradients clipped at global
    norm 1, the peak `learning_rate` after a linear warm-up, cosine decay to 0 (the recipe's
    values are the defaults listed below).

    Args:
        model: a registry name (`keras_vit.list_models()`), or a `ViTConfig` (random initialisation).
        dataset: `"digits"` (its train split), an image folder (its `train/` if present; any
            sub-folders, whose names are ignored), a prepared tensorflow-datasets name
            (`train_split` of it; TensorFlow only), a source of the backend's reader
            (`keras_vit.data.tfdata.Source` on TensorFlow, `keras_vit.data.pyinput.Source` on JAX and
            PyTorch), or uint8-range images `(N, H, W[, C])`. Labels are never used. (Batches
            of normalised images, a `tf.data.Dataset` or a `keras.utils.PyDataset`, go straight
            to `masked_patch_model(...).fit`.)
        callbacks: extra Keras callbacks for `fit`.
        The run options below (`keras_vit.training.options.MaskedPatchOptions`; `target`, `bits`,
        `corrupt_rate`, `mask_rate`, `random_rate`: see `MaskedPatchPredictor`) are checked
        before anything runs, and a non-finite loss stops the run without saving a model.

    Returns:
        `PretrainingResult(model, report)`; `output_dir` receives `backbone.keras` (the
        pre-trained ViT, token output: load it with `to_classifier(path, num_classes)` to
        fine-tune), `report.json` (the per-epoch loss and patch accuracy, steps, seconds,
        images/s and the arguments), TensorBoard `logs/` and, while unfinished, `backup/`.
        TensorBoard logs on TensorFlow only. Running again with the same arguments resumes.
    """
    options.check()
    arguments = runs.run_arguments(options, model=model, dataset=dataset)
    task = MaskedPatchTask(model_config(model), dataset, options)
    result = runs.fit_checked(task, arguments, options, callbacks)
    return PretrainingResult(result.model, result.report)


@dataclass
class MaskedPatchTask:
    """Masked patch prediction (`runs.Task`): a `MaskedPatchPredictor`, Adam(W) + warm-up + cosine.

    The saved model is the backbone (`backbone.keras`); labels are never read.
    """

    config: ViTConfig
    dataset: str | os.PathLike | data.Source | np.ndarray
    options: MaskedPatchOptions
    recipe: Recipe = MASKED_PATCH_PREDICTION
    saved_file: str = "backbone.keras"

    def prepare(self, batch_size: int) -> int:
        options = self.options
        self.source = load_unlabeled(
            self.dataset, options.train_split, options.data_dir, options.on_bad_image
        )
        return input_module().epoch_steps(self.source, batch_size)

    def sources(self) -> list[data.Source]:
        """The source read so far (for naming undecodable files)."""
        return [self.source] if hasattr(self, "source") else []

    @property
    def augmentation(self) -> dict:
        return self.source.augmentation(self.options.crop_scale, self.options.flip)

    def build(self) -> keras.Model:
        options = self.options
        return masked_patch_model(
            self.config,
            image_size=options.image_size,
            dropout=options.dropout,
            target=options.target,
            bits=options.bits,
            corrupt_rate=options.corrupt_rate,
            mask_rate=options.mask_rate,
            random_rate=options.random_rate,
            seed=options.seed,
        )

    def compile(
        self, network: keras.Model, total_steps: int, jit_compile: bool, steps_per_execution: int
    ) -> None:
        self.schedule, optimizer = self.recipe.run_optimizer(total_steps, self.options)
        network.compile(
            optimizer=optimizer,
            jit_compile=jit_compile,
            steps_per_execution=steps_per_execution,
        )

    def train_data(self, network: keras.Model, start_epoch: int, steps_per_epoch: int):
        """uint8 batches of images only (labels dropped), from this backend's input (`input_module`)."""
        batches = input_module().train_pipeline(
            self.source,
            image_size=tuple(network.backbone.input_shape[1:3]),
            batch_size=self.options.batch_size,
            mean=network.mean,
            std=network.std,
            seed=self.options.seed,
            start_epoch=start_epoch,
            steps_per_epoch=steps_per_epoch,
            **self.augmentation,
            pixels="uint8",  # normalised on the device by the model (`MaskedPatchPredictor.normalized`)
        )
        return input_module().images_only(batches)  # unlabeled: labels are dropped before the model

    def finish(self, network: keras.Model, history: dict[str, list[float]]) -> dict:
        target = self.options.target
        return {
            "loss": history["loss"][-1] if history.get("loss") else None,
            "patch_accuracy": history["patch_accuracy"][-1] if history.get("patch_accuracy") else None,
            "chance_loss": None if target == "regression" else math.log(network.classes),
            "target": target,
            "classes": network.classes,
            "pretraining_examples": self.source.num_examples,
        }

    def saved_model(self, network: keras.Model) -> keras.Model:
        return network.backbone

    def describe(self, network: keras.Model) -> dict:
        """What the run used (`runs.fit_task` puts it in the report): task, data, every value."""
        options = self.options
        optimizer = "AdamW (weight decay on kernels)" if self.schedule["weight_decay"] else "Adam"
        return {
            "recipe": self.recipe.name,
            "recipe_description": f"masked patch prediction (paper §4.6); {optimizer}, warm-up + cosine",
            "checkpoint": None,
            "data": {
                "dataset": runs.describe(self.dataset),
                "train_examples": self.source.num_examples,
                "labels_used": False,
                **bad_images_record(train=self.source),
            },
            "hyperparameters": {
                **self.schedule,
                "target": options.target,
                "bits": options.bits,
                "classes": network.classes,
                "corrupt_rate": options.corrupt_rate,
                "mask_rate": options.mask_rate,
                "random_rate": options.random_rate,
                "dropout": options.dropout,
                "image_size": [int(side) for side in network.backbone.input_shape[1:3]],
                "mean": list(network.mean),
                "std": list(network.std),
                **{
                    key: list(value) if isinstance(value, tuple) else value
                    for key, value in self.augmentation.items()
                },
            },
        }

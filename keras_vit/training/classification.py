"""The training driver behind `keras-vit train` / `keras-vit finetune`: `model.fit` on any backend.

`train(...)` builds the model, optimizer and metrics inside `strategy.scope()`, compiles with
a recipe of `keras_vit.training.recipes` (`FROM_SCRATCH`: AdamW + warm-up + cosine, stochastic depth,
mixup; `FINE_TUNING`: SGD momentum + warm-up + cosine, from a pretrained checkpoint with a new
zero-initialised head), fits with a progress bar and TensorBoard logs, evaluates on the held-out
split, saves `model.keras` and writes `report.json` in `output_dir`. `finetune(...)` is `train`
with the fine-tuning recipe. Their keyword arguments are the run options of
`keras_vit.training.options.ClassifierOptions` (declared there once, with the `keras-vit` flags); the
run itself is the shared driver's (`keras_vit.training.runs.fit_task`).

Exact resume. Training runs in short epochs of `steps_per_epoch` batches. After each epoch
`EpochBackup` writes the complete training state (model and optimizer variables, EMA
averages, dropout seed states, the loss history) to `output_dir/backup`, atomically: a kill
at any moment leaves the previous complete backup. A run started again with the same
arguments restores it and rebuilds the input stream at that epoch
(`keras_vit.data.tfdata.train_pipeline(start_epoch=k)`, whose epoch `k` is a pure function of the
seed and `k`), so a run killed with SIGKILL and restarted ends with the same weights, bit for
bit, as an uninterrupted one: no step lost, none repeated. (Keras's own `BackupAndRestore`
restores only epoch boundaries, not the data position, and writes its file in place.)

The main job: `train()` with no arguments trains `vit_digits` (a ViT small enough for a CPU)
from scratch on scikit-learn's handwritten digits (`keras_vit.data.tfdata.load_digits`) and reports
the held-out accuracy.

Backends. On TensorFlow the input is tf.data (`keras_vit.data.tfdata`) and the run a tf.distribute
strategy's; on JAX and PyTorch the input is a `keras.utils.PyDataset` (`keras_vit.data.pyinput`:
the same augmentation and the same resumable plan, in NumPy and Pillow, without TensorFlow)
and the run keras.distribution's on JAX (data parallel over the local devices, or over several
processes' with `--coordinator`), one device's on PyTorch. tensorflow-datasets names need
TensorFlow.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import keras
import numpy as np

from keras_vit.checkpoints.pretrained import checkpoint_record
from keras_vit.data.datasets import bad_images_record, input_module, load_dataset
from keras_vit.models.build import build_vit, create_model
from keras_vit.registry.catalog import preprocessing_for
from keras_vit.registry.variants import VARIANTS, ViTConfig, model_config
from keras_vit.training import optimization, runs
from keras_vit.training.device_input import DeviceInput, unwrapped
from keras_vit.training.options import ClassifierOptions, takes_options
from keras_vit.training.recipes import FINE_TUNING, FROM_SCRATCH, Recipe, get_recipe
from keras_vit.utils import defaults
from keras_vit.utils import validation as check

if TYPE_CHECKING:
    from keras_vit.data import tfdata as data

__all__ = [
    "TrainingResult",
    "finetune",
    "load_dataset",
    "model_config",
    "train",
]


@dataclass
class TrainingResult:
    """What `train` returns: the final model (EMA weights if enabled) and the report it wrote."""

    model: keras.Model
    report: dict


def _build_model(
    config: ViTConfig,
    pretrained: bool | str | os.PathLike | keras.Model,
    image_size: int,
    num_classes: int,
    dropout: float,
    drop_path_rate: float,
) -> keras.Model:
    # Logits: the recipes' loss (`optimization.loss`) is a softmax cross-entropy from logits.
    regularisation = dict(dropout=dropout, drop_path_rate=drop_path_rate, classifier_activation=None)
    if isinstance(pretrained, keras.Model) or (
        isinstance(pretrained, (str, os.PathLike)) and os.fspath(pretrained).endswith(".keras")
    ):  # a keras_vit model, e.g. the backbone `keras-vit pretrain` writes
        from keras_vit.training.masked_patch import to_classifier

        classifier = to_classifier(pretrained, num_classes, **regularisation)
        if image_size is not None and tuple(classifier.input_shape[1:3]) != check.image_size(
            "image_size", image_size
        ):
            raise ValueError(
                f"The pre-trained model takes {tuple(classifier.input_shape[1:3])} images, not {image_size}: "
                "leave image_size unset, or pre-train at the size you fine-tune at."
            )
        return classifier
    if config.name in VARIANTS and VARIANTS[config.name] == config:
        return create_model(
            config.name, pretrained, image_size=image_size, num_classes=num_classes, **regularisation
        )
    if pretrained:
        raise ValueError(
            f"pretrained weights need a published variant (`keras-vit models`), not the custom model "
            f"{config.name!r}."
        )
    return build_vit(config, image_size=image_size, num_classes=num_classes, **regularisation)


@takes_options(ClassifierOptions, FROM_SCRATCH, "model.keras")
def train(
    model: str | ViTConfig = defaults.TRAIN_MODEL,
    dataset: str | os.PathLike | tuple[data.Source, data.Source] = defaults.DATASET,
    *,
    recipe: str | Recipe = FROM_SCRATCH.name,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    options: ClassifierOptions,
) -> TrainingResult:
    """Train (or fine-tune) a ViT with `model.fit` on any backend; resumable exactly.

    Args:
        model: a variant (`"vit_b16"`), a small registry model (`"vit_digits"`) or a `ViTConfig`.
        dataset: `"digits"`, an image folder with `train/` and `test/`, a prepared
            tensorflow-datasets name, or `(train, test)` `keras_vit.data.tfdata.Source`s.
        recipe: `"pretrain"` (`keras_vit.training.recipes.FROM_SCRATCH`: AdamW with weight decay,
            stochastic depth and mixup) or `"finetune"` (`FINE_TUNING`: SGD momentum, nothing
            else), or a `keras_vit.training.recipes.Recipe`: the defaults of the options left `None`.
        callbacks: extra Keras callbacks for `fit`.
        The run options below (`keras_vit.training.options.ClassifierOptions`): `pretrained` is a
        checkpoint to start from (tag, file or hub id, as `create_model`: its position
        embeddings are resized to `image_size` and a new zero head is made), or a keras_vit
        model or `.keras` file such as the backbone `keras-vit pretrain` writes (`model` is then
        ignored, and `image_size` must be the model's).

    Returns:
        `TrainingResult(model, report)`; the report (also `report.json` in `output_dir`) has
        the held-out accuracy and loss, steps, seconds, images/s, per-epoch history, the values
        the run used (model config, recipe, checkpoint and its sha256, hyper-parameters, data
        sizes, strategy, versions, machine; see `keras_vit.training.runs`) and the arguments as given.
        The class names, when the data has them, are also written to `output_dir/labels.txt`.
        The model outputs logits (`classifier_activation=None`), as the recipes' loss expects.
        Running again with the same arguments resumes an unfinished run exactly.

    Every argument is checked before anything runs: a value out of range raises `ValueError`
    naming it (0 is never read as "the default"). A fit whose loss becomes NaN or infinite
    stops at once with `keras_vit.training.runs.NonFiniteLossError`: no `model.keras` is written, and
    `report.json` records the failure. Fewer than two classes with examples in the training
    data are refused.
    """
    recipe = get_recipe(recipe)
    options.check()
    recipe.check_weight_decay(options.weight_decay)
    arguments = runs.run_arguments(options, model=model, dataset=dataset, recipe=recipe.name)
    task = ClassificationTask(model_config(model), dataset, recipe, options)
    result = runs.fit_checked(task, arguments, options, callbacks)
    return TrainingResult(task.saved_model(result.model), result.report)


@dataclass
class ClassificationTask:
    """Supervised classification (`runs.Task`): a ViT classifier, a recipe, held-out accuracy.

    `prepare` reads the data, `build` makes the model (a variant, a checkpoint with a new
    head, or a keras_vit backbone via `ViT.with_head`) and wraps it in a `DeviceInput`, which the
    driver fits: the input ships uint8 batches (`train_pipeline(pixels="uint8")`) that the step
    normalises and mixes on the device, and the held-out uint8 batches likewise; the ViT inside (the
    same weights) is what is saved and returned.
    The options left `None` take the recipe's values, the augmentation the data's own.
    """

    config: ViTConfig
    dataset: str | os.PathLike | tuple[data.Source, data.Source]
    recipe: Recipe
    options: ClassifierOptions
    saved_file: str = "model.keras"

    def prepare(self, batch_size: int) -> int:
        options = self.options
        if isinstance(self.dataset, tuple):
            self.train_source, self.test_source = self.dataset
        else:
            self.train_source, self.test_source = load_dataset(
                self.dataset,
                train_split=options.train_split,
                test_split=options.test_split,
                data_dir=options.data_dir,
                on_bad_image=options.on_bad_image,
            )
        source = self.train_source
        missing = source.missing_classes()
        if source.num_classes - len(missing) < 2:
            empty = f" ({', '.join(missing)} without examples)" if missing else ""
            raise ValueError(
                f"The training data has {source.num_classes - len(missing)} class with examples{empty}: a "
                "classifier needs at least two (with one, every prediction is right and nothing is "
                "learned). Add a folder of images per class, or use keras-vit pretrain for unlabeled images."
            )
        return input_module().epoch_steps(self.train_source, batch_size)

    def sources(self) -> list[data.Source]:
        """The sources read so far (for naming undecodable files)."""
        return [getattr(self, name) for name in ("train_source", "test_source") if hasattr(self, name)]

    @property
    def used_drop_path_rate(self) -> float:
        given = self.options.drop_path_rate
        return self.recipe.drop_path_rate if given is None else given

    @property
    def used_mixup_alpha(self) -> float:
        given = self.options.mixup_alpha
        return self.recipe.mixup_alpha if given is None else given

    @property
    def augmentation(self) -> dict:
        return self.train_source.augmentation(self.options.crop_scale, self.options.flip)

    def build(self) -> keras.Model:
        pretrained, image_size = self.options.pretrained, self.options.image_size
        if image_size is None and not pretrained:
            image_size = self.config.image_size
        network = _build_model(
            self.config,
            pretrained,
            image_size,
            self.train_source.num_classes,
            self.options.dropout,
            self.used_drop_path_rate,
        )
        _, mean, std, _ = self._preprocessing(network)
        return DeviceInput(network, mean, std, self.train_source.num_classes)

    def compile(
        self, network: keras.Model, total_steps: int, jit_compile: bool, steps_per_execution: int
    ) -> None:
        options = self.options
        self.schedule, optimizer = self.recipe.run_optimizer(total_steps, options, options.ema_momentum)
        # The `DeviceInput` that `fit` trains and the ViT in it, which is evaluated and returned compiled
        # as before: one optimizer (their variables are the same), a loss and metric each.
        models = [network] if unwrapped(network) is network else [network, unwrapped(network)]
        for model in models:
            model.compile(
                optimizer=optimizer,
                loss=optimization.loss(options.label_smoothing),
                metrics=[optimization.LabelAccuracy()],
                jit_compile=jit_compile,
                steps_per_execution=steps_per_execution,
            )

    def _preprocessing(self, network: keras.Model) -> tuple[tuple[int, int], tuple, tuple, str]:
        """The network's size, mean, std and interpolation: the catalog's answer (`preprocessing_for`)."""
        spec = preprocessing_for(unwrapped(network))
        return spec.image_size, spec.mean, spec.std, spec.interpolation

    def train_data(self, network: keras.Model, start_epoch: int, steps_per_epoch: int):
        """tf.data batches on TensorFlow, a `keras.utils.PyDataset` elsewhere: the same plan, uint8
        pixels (normalised and mixed on the device by `DeviceInput`)."""
        image_size, mean, std, interpolation = self._preprocessing(network)
        return input_module().train_pipeline(
            self.train_source,
            image_size=image_size,
            batch_size=self.options.batch_size,
            mean=mean,
            std=std,
            seed=self.options.seed,
            start_epoch=start_epoch,
            steps_per_epoch=steps_per_epoch,
            **self.augmentation,
            interpolation=interpolation,
            mixup_alpha=self.used_mixup_alpha,
            pixels="uint8",
        )

    def finish(self, network: keras.Model, history: dict[str, list[float]]) -> dict:
        # The paper evaluates on the plain resized image, resized here as train_pipeline resizes. The
        # batches are uint8, normalised on the device by the `DeviceInput` that was trained.
        image_size, mean, std, interpolation = self._preprocessing(network)
        inputs = input_module()
        eval_spec = inputs.Preprocessing(image_size, mean, std, None, interpolation, resampler="tensorflow")
        if keras.backend.backend() == "tensorflow":
            test_data = inputs.eval_pipeline(
                self.test_source, eval_spec, batch_size=self.options.batch_size, pixels="uint8"
            )
            test_loss, test_accuracy = network.evaluate(test_data, verbose=0)
        else:
            test_loss, test_accuracy = self._held_out_metrics(network, eval_spec)
        return {
            "accuracy": float(test_accuracy),
            "loss": float(test_loss),
            "test_examples": self.test_source.num_examples,
            "ema": self.options.ema_momentum is not None,
        }

    def _held_out_metrics(self, network: keras.Model, eval_spec) -> tuple[float, float]:
        """The held-out loss and accuracy off TensorFlow: predictions of full batches (the last one
        padded, so that every batch splits between data-parallel devices), the padding dropped,
        then the compiled loss and top-1 accuracy over the real examples (files skipped when read
        left out)."""
        from keras_vit.data import pyinput
        from keras_vit.training.runs.keras_distribution import predictions_in_every_process

        source = self.test_source
        batches = pyinput.eval_pipeline(
            source, eval_spec, batch_size=self.options.batch_size, pad=True, pixels="uint8"
        )
        with predictions_in_every_process(network):  # each process feeds its rows of every batch
            logits = network.predict(batches, verbose=0)[: source.num_examples].astype("float32")
        read = np.ones(source.num_examples, bool)
        read[sorted(source.bad_images.indices if source.bad_images else ())] = False
        logits, labels = logits[read], source.labels[read]
        loss = keras.ops.convert_to_numpy(network.loss(labels, logits))
        return float(loss), float((logits.argmax(axis=-1) == labels).mean())

    def saved_model(self, network: keras.Model) -> keras.Model:
        return unwrapped(network)

    def describe(self, network: keras.Model) -> dict:
        """What the run used (`runs.fit_task` puts it in the report): recipe, checkpoint, data, values."""
        options = self.options
        image_size, mean, std, interpolation = self._preprocessing(network)
        from_checkpoint = options.pretrained is not False and options.pretrained is not None
        start = "from a checkpoint" if from_checkpoint else "from scratch"
        tfds_name = not isinstance(self.dataset, tuple) and not input_module().is_folder_name(self.dataset)
        tfds_name = tfds_name and os.fspath(self.dataset) != defaults.DATASET
        return {
            "recipe": self.recipe.name,
            "recipe_description": f"{self.recipe.description}; {start}",
            "checkpoint": checkpoint_record(options.pretrained, unwrapped(network)),
            "data": {
                "dataset": runs.describe(self.dataset),
                "train_examples": self.train_source.num_examples,
                "test_examples": self.test_source.num_examples,
                "num_classes": self.train_source.num_classes,
                "images_per_class": self.train_source.images_per_class(),
                **bad_images_record(train=self.train_source, test=self.test_source),
                **(
                    {"train_split": options.train_split, "test_split": options.test_split}
                    if tfds_name
                    else {}
                ),
            },
            "class_names": list(self.train_source.class_names) if self.train_source.class_names else None,
            "hyperparameters": {
                **self.schedule,
                "weight_decay": self.schedule.get("weight_decay", 0.0),
                "label_smoothing": options.label_smoothing,
                "ema_momentum": options.ema_momentum,
                "dropout": options.dropout,
                "drop_path_rate": self.used_drop_path_rate,
                "mixup_alpha": self.used_mixup_alpha,
                "image_size": list(image_size),
                "mean": list(mean),
                "std": list(std),
                "interpolation": interpolation,
                **{
                    key: list(value) if isinstance(value, tuple) else value
                    for key, value in self.augmentation.items()
                },
            },
        }


@takes_options(ClassifierOptions, FINE_TUNING, "model.keras", pretrained=True)
def finetune(
    model: str | ViTConfig = defaults.FINETUNE_MODEL,
    dataset: str | os.PathLike | tuple[data.Source, data.Source] = defaults.DATASET,
    *,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    options: ClassifierOptions,
) -> TrainingResult:
    """`train` with the paper's fine-tuning recipe (`recipes.FINE_TUNING`) from `pretrained`."""
    if not options.pretrained:
        raise ValueError("finetune starts from a checkpoint: pass pretrained=<tag, file or hub id>, or True.")
    return train(model, dataset, recipe=FINE_TUNING, callbacks=callbacks, **options.arguments())

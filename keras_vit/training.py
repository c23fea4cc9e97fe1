"""The training driver behind `keras-vit train` / `keras-vit finetune`: `model.fit` under tf.distribute.

`train(...)` builds the model, optimizer and metrics inside `strategy.scope()`, compiles with
a recipe of `keras_vit.recipes` (pre-training: AdamW + warm-up + cosine; fine-tuning: SGD
momentum + warm-up + cosine, from a pretrained checkpoint with a new zero-initialised head),
fits with a progress bar and TensorBoard logs, evaluates on the held-out split, saves
`model.keras` and writes `report.json` in `output_dir`. `finetune(...)` is `train` with the
fine-tuning recipe.

Exact resume. Training runs in short epochs of `steps_per_epoch` batches. After each epoch
`EpochBackup` writes the complete training state (model and optimizer variables, EMA
averages, dropout seed states, the loss history) to `output_dir/backup`, atomically: a kill
at any moment leaves the previous complete backup. A run started again with the same
arguments restores it and rebuilds the input stream at that epoch
(`keras_vit.data.train_pipeline(start_epoch=k)`, whose epoch `k` is a pure function of the
seed and `k`), so a run killed with SIGKILL and restarted ends with the same weights, bit for
bit, as an uninterrupted one: no step lost, none repeated. (Keras's own `BackupAndRestore`
restores only epoch boundaries, not the data position, and writes its file in place.)

The main job: `train()` with no arguments trains `vit_digits` (a ViT small enough for a CPU)
from scratch on scikit-learn's handwritten digits (`keras_vit.data.load_digits`) and reports
the held-out accuracy.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import keras
import tensorflow as tf

from keras_vit import data, defaults, recipes, runs
from keras_vit import validation as check
from keras_vit.catalog import model_entry
from keras_vit.defaults import BAD_IMAGE_ACTIONS, RECIPES, SCRATCH_DROP_PATH, TRAIN_EPOCHS
from keras_vit.models import build_vit, create_model
from keras_vit.pretrained import checkpoint_record
from keras_vit.variants import VARIANTS, ViTConfig, model_config

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


def load_dataset(
    dataset: str | os.PathLike,
    *,
    train_split: str = "train",
    test_split: str = "test",
    data_dir: str | os.PathLike | None = None,
    on_bad_image: str = BAD_IMAGE_ACTIONS[0],
) -> tuple[data.Source, data.Source]:
    """`(train, held-out)` sources for `dataset`: `"digits"`, an image folder, or a tfds name.

    An image folder must hold `train/` and `test/` (or `val/`, `validation/`) sub-folders,
    each with one sub-folder per class. A tensorflow-datasets name (with a config or version
    if needed: `imagenette/320px`, `mnist:3.0.1`) reads `train_split` and `test_split` from
    `data_dir`; it must be prepared already (nothing is downloaded). A string is a folder if
    it exists or starts with `.`, `/` or `~` (`keras_vit.data.is_folder_name`). A folder's
    unreadable image files stop the run with their names, or are skipped with
    `on_bad_image="skip"` (`keras_vit.data.from_directory`).
    """
    if isinstance(dataset, str) and dataset == "digits":
        return data.load_digits()
    path = os.path.expanduser(os.fspath(dataset))
    if not data.is_folder_name(dataset):
        return (
            data.from_tfds(path, train_split, data_dir=data_dir),
            data.from_tfds(path, test_split, data_dir=data_dir),
        )
    if os.path.isdir(path):
        held_out = next(
            (name for name in ("test", "val", "validation") if os.path.isdir(os.path.join(path, name))), None
        )
        if not os.path.isdir(os.path.join(path, "train")) or held_out is None:
            raise ValueError(
                f"Image folder {path!r} needs a train/ and a test/ (or val/) sub-folder, each with one "
                "folder per class, e.g. train/cat/1.jpg and test/cat/7.jpg."
            )
        train_source = data.from_directory(os.path.join(path, "train"), on_bad_image=on_bad_image)
        test_source = data.from_directory(os.path.join(path, held_out), on_bad_image=on_bad_image)
        if train_source.class_names != test_source.class_names:
            raise ValueError(
                f"{path}: train/ and {held_out}/ have different class folders "
                f"({train_source.class_names} vs {test_source.class_names})."
            )
        return train_source, test_source
    if os.path.exists(path):
        raise ValueError(f"Dataset {path!r} is a file: pass an image folder, 'digits' or a tfds name.")
    raise FileNotFoundError(f"Dataset folder {path!r} does not exist.")


def _build_model(
    config: ViTConfig,
    pretrained: bool | str | os.PathLike | keras.Model,
    image_size: int,
    num_classes: int,
    dropout: float,
    drop_path_rate: float,
) -> keras.Model:
    # Logits: the recipes' loss (`recipes.loss`) is a softmax cross-entropy from logits.
    regularisation = dict(dropout=dropout, drop_path_rate=drop_path_rate, classifier_activation=None)
    if isinstance(pretrained, keras.Model) or (
        isinstance(pretrained, (str, os.PathLike)) and os.fspath(pretrained).endswith(".keras")
    ):  # a keras_vit model, e.g. the backbone `keras-vit pretrain` writes
        from keras_vit.masked_patch import to_classifier

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


def train(
    model: str | ViTConfig = defaults.TRAIN_MODEL,
    dataset: str | os.PathLike | tuple[data.Source, data.Source] = defaults.DATASET,
    *,
    output_dir: str | os.PathLike = defaults.TRAIN_OUTPUT_DIR,
    recipe: str = "pretrain",
    pretrained: bool | str | os.PathLike | keras.Model = False,
    image_size: int | None = None,
    batch_size: int = defaults.BATCH_SIZE,
    steps: int | None = None,
    epochs: float | None = None,
    steps_per_epoch: int | None = None,
    learning_rate: float | None = None,
    warmup_steps: int | None = None,
    weight_decay: float = defaults.WEIGHT_DECAY,
    label_smoothing: float = defaults.LABEL_SMOOTHING,
    ema_momentum: float | None = None,
    dropout: float = defaults.DROPOUT,
    drop_path_rate: float | None = None,
    crop_scale: Sequence[float] | None = None,
    flip: bool | None = None,
    mixup_alpha: float | None = None,
    strategy: str | tf.distribute.Strategy = defaults.STRATEGIES[0],
    precision: str = defaults.PRECISIONS[0],
    jit_compile: bool | str = defaults.JIT_CHOICES[0],
    steps_per_execution: int | str = defaults.STEPS_PER_EXECUTION,
    seed: int = defaults.SEED,
    train_split: str = defaults.TRAIN_SPLIT,
    test_split: str = defaults.TEST_SPLIT,
    data_dir: str | os.PathLike | None = None,
    on_bad_image: str = BAD_IMAGE_ACTIONS[0],
    callbacks: Sequence[keras.callbacks.Callback] = (),
    verbose: int | str = "auto",
) -> TrainingResult:
    """Train (or fine-tune) a ViT with `model.fit` under a tf.distribute strategy; resumable exactly.

    Args:
        model: a variant (`"vit_b16"`), a small registry model (`"vit_digits"`) or a `ViTConfig`.
        dataset: `"digits"`, an image folder with `train/` and `test/`, a prepared
            tensorflow-datasets name, or `(train, test)` `keras_vit.data.Source`s.
        output_dir: receives `model.keras`, `report.json`, TensorBoard `logs/` and, while
            the run is unfinished, `backup/`. Running again with the same arguments resumes.
        recipe: `"pretrain"` (AdamW, weight decay, warm-up + cosine decay; default LR 3e-3,
            the paper's ImageNet-1k value)
            or `"finetune"` (SGD momentum 0.9, warm-up + cosine; default LR 0.01).
        pretrained: checkpoint to start from (tag, file or hub id, as `create_model`): its
            position embeddings are resized to `image_size` and a new zero head is made. Or a
            keras_vit model or `.keras` file, e.g. the backbone `keras-vit pretrain` writes
            (`keras_vit.pretrain.to_classifier`; `model` is then ignored, and `image_size`
            must be the model's).
        image_size: training and evaluation resolution; default the model's (32 for
            `vit_digits`, 224 for variants) or the checkpoint's.
        batch_size: global batch, split across replicas.
        steps, epochs: training length, as steps or as passes over the training data
            (default `defaults.TRAIN_EPOCHS` passes, the main job's).
        steps_per_epoch: steps between backups (and log lines); default one pass, at most
            1000 steps.
        learning_rate, warmup_steps: peak LR and linear warm-up; default warm-up 10% of the
            steps, at most the recipe's (10k pre-training, 500 fine-tuning).
        weight_decay: decoupled weight decay of the pre-training recipe (kernels only).
        label_smoothing, ema_momentum: recipe options; EMA (Polyak averaging, e.g. 0.9999)
            weights are the ones evaluated and saved.
        dropout, drop_path_rate: regularisation of the model; stochastic depth defaults to
            `SCRATCH_DROP_PATH` (0.1) with the pre-training recipe, 0 with fine-tuning.
        crop_scale, flip: inception-crop area range and horizontal flips; defaults (0.7, 1)
            without flips for digits, (0.08, 1) with flips otherwise.
        mixup_alpha: mixup of each training batch with itself reversed, weight ~ Beta(alpha,
            alpha) (`keras_vit.data.train_pipeline`); 0 turns it off. Default `SCRATCH_MIXUP`
            (0.2) with the pre-training recipe, 0 with fine-tuning.
        strategy: a `keras_vit.distribute.get_strategy` name or a strategy.
        precision: `"float32"`, `"mixed_bfloat16"` or `"mixed_float16"` (loss-scaled).
        jit_compile: XLA-compile the train and evaluation steps; `"auto"`: on a single
            replica (where it makes `vit_digits` steps ~1.6x faster on a CPU), not across
            replicas (XLA fails under MirroredStrategy on logical CPU devices).
        steps_per_execution: train steps per call into TensorFlow; `"auto"`: the largest
            divisor of `steps_per_epoch` up to 32 (`keras_vit.runs.execution_steps`). Same
            results for any value; fewer calls make small models' epochs ~2x faster.
        seed: initialisation, data order and augmentation.
        train_split, test_split, data_dir: tensorflow-datasets splits and location.
        on_bad_image: `"stop"` (default) or `"skip"`: what an image folder's unreadable files
            do (`keras_vit.data.from_directory`); either way they are named.
        callbacks: extra Keras callbacks for `fit`.
        verbose: `fit` verbosity; `"auto"`: progress bar on a terminal, a line per epoch otherwise.

    Returns:
        `TrainingResult(model, report)`; the report (also `report.json`) has the held-out
        accuracy and loss, steps, seconds, images/s, per-epoch history, the values the run
        used (model config, recipe, checkpoint and its sha256, hyper-parameters, data sizes,
        strategy, versions, machine; see `keras_vit.runs`) and the arguments as given. The
        class names, when the data has them, are also written to `output_dir/labels.txt`.
        The model outputs logits (`classifier_activation=None`), as the recipes' loss expects.

    Every argument is checked before anything runs (`keras_vit.validation`): a value out of
    range raises `ValueError` naming it (0 is never read as "the default"). A fit whose loss
    becomes NaN or infinite stops at once with `keras_vit.runs.NonFiniteLossError`: no `model.keras` is
    written, and `report.json` records the failure. Fewer than two classes with examples in
    the training data are refused.
    """
    arguments = {key: runs.describe(value) for key, value in dict(locals()).items() if key != "callbacks"}
    check.one_of("recipe", recipe, RECIPES)
    runs.check_run_arguments(
        image_size=image_size,
        learning_rate=learning_rate,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        dropout=dropout,
        crop_scale=crop_scale,
        on_bad_image=on_bad_image,
    )
    check.fraction("label_smoothing", label_smoothing)
    check.optional(
        check.number,
        "ema_momentum",
        ema_momentum,
        minimum=0,
        maximum=1,
        exclusive_minimum=True,
        exclusive_maximum=True,
    )
    check.optional(check.fraction, "drop_path_rate", drop_path_rate)
    check.optional(check.number, "mixup_alpha", mixup_alpha, minimum=0)
    task = ClassificationTask(
        model_config(model),
        dataset,
        recipe=recipe,
        pretrained=pretrained,
        image_size=image_size,
        batch_size=batch_size,
        learning_rate=learning_rate,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        label_smoothing=label_smoothing,
        ema_momentum=ema_momentum,
        dropout=dropout,
        drop_path_rate=drop_path_rate,
        crop_scale=crop_scale,
        flip=flip,
        mixup_alpha=mixup_alpha,
        seed=seed,
        train_split=train_split,
        test_split=test_split,
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
    return TrainingResult(result.model, result.report)


@dataclass
class ClassificationTask:
    """Supervised classification (`runs.Task`): a ViT classifier, the paper's recipes, held-out accuracy.

    Arguments as `train`; `prepare` reads the data, `build` makes the model (a variant, a
    checkpoint with a new head, or a keras_vit backbone via `ViT.with_head`).
    """

    config: ViTConfig
    dataset: str | os.PathLike | tuple[data.Source, data.Source]
    recipe: str
    pretrained: bool | str | os.PathLike | keras.Model
    image_size: int | None
    batch_size: int
    learning_rate: float | None
    warmup_steps: int | None
    weight_decay: float
    label_smoothing: float
    ema_momentum: float | None
    dropout: float
    drop_path_rate: float | None
    crop_scale: Sequence[float] | None
    flip: bool | None
    mixup_alpha: float | None
    seed: int
    train_split: str
    test_split: str
    data_dir: str | os.PathLike | None
    on_bad_image: str = BAD_IMAGE_ACTIONS[0]
    default_epochs: float = TRAIN_EPOCHS
    saved_file: str = "model.keras"

    def prepare(self, batch_size: int) -> int:
        if isinstance(self.dataset, tuple):
            self.train_source, self.test_source = self.dataset
        else:
            self.train_source, self.test_source = load_dataset(
                self.dataset,
                train_split=self.train_split,
                test_split=self.test_split,
                data_dir=self.data_dir,
                on_bad_image=self.on_bad_image,
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
        return data.epoch_steps(self.train_source, batch_size)

    def sources(self) -> list[data.Source]:
        """The sources read so far (for naming undecodable files)."""
        return [getattr(self, name) for name in ("train_source", "test_source") if hasattr(self, name)]

    def _recipe_default(self, value: float | None, from_scratch: float) -> float:
        """`value` as given; if None, `from_scratch` with the pre-training recipe and 0 when fine-tuning."""
        if value is not None:
            return value
        return from_scratch if self.recipe == "pretrain" else 0.0

    @property
    def used_drop_path_rate(self) -> float:
        return self._recipe_default(self.drop_path_rate, SCRATCH_DROP_PATH)

    @property
    def used_mixup_alpha(self) -> float:
        return self._recipe_default(self.mixup_alpha, defaults.SCRATCH_MIXUP)

    def build(self) -> keras.Model:
        return _build_model(
            self.config,
            self.pretrained,
            self.image_size
            if self.image_size is not None
            else (None if self.pretrained else self.config.image_size),
            self.train_source.num_classes,
            self.dropout,
            self.used_drop_path_rate,
        )

    def compile(
        self, network: keras.Model, total_steps: int, jit_compile: bool, steps_per_execution: int
    ) -> None:
        if self.recipe == "pretrain":
            self.schedule = dict(
                learning_rate=(
                    defaults.SCRATCH_LEARNING_RATE if self.learning_rate is None else self.learning_rate
                ),
                warmup_steps=runs.warmup_steps(self.warmup_steps, total_steps, defaults.SCRATCH_WARMUP_CAP),
            )
            optimizer = recipes.pretraining_optimizer(
                total_steps,
                weight_decay=self.weight_decay,
                decay="cosine",
                ema_momentum=self.ema_momentum,
                **self.schedule,
            )
        else:
            self.schedule = dict(
                learning_rate=(
                    defaults.FINETUNE_LEARNING_RATE if self.learning_rate is None else self.learning_rate
                ),
                warmup_steps=runs.warmup_steps(self.warmup_steps, total_steps, defaults.FINETUNE_WARMUP_CAP),
            )
            optimizer = recipes.finetuning_optimizer(
                total_steps, ema_momentum=self.ema_momentum, **self.schedule
            )
        network.compile(
            optimizer=optimizer,
            loss=recipes.loss(self.label_smoothing),
            metrics=[recipes.LabelAccuracy()],
            jit_compile=jit_compile,
            steps_per_execution=steps_per_execution,
        )

    def _preprocessing(self, network: keras.Model) -> tuple[tuple[int, int], tuple, tuple, str]:
        entry = model_entry(network)
        mean, std = data.normalisation_for(network)
        interpolation = (entry.interpolation if entry is not None else None) or "bilinear"
        return tuple(network.input_shape[1:3]), mean, std, interpolation

    def train_data(self, network: keras.Model, start_epoch: int, steps_per_epoch: int) -> tf.data.Dataset:
        image_size, mean, std, interpolation = self._preprocessing(network)
        is_digits = not isinstance(self.dataset, tuple) and os.fspath(self.dataset) == defaults.DATASET
        return data.train_pipeline(
            self.train_source,
            image_size=image_size,
            batch_size=self.batch_size,
            mean=mean,
            std=std,
            seed=self.seed,
            start_epoch=start_epoch,
            steps_per_epoch=steps_per_epoch,
            **runs.augmentation(is_digits, self.crop_scale, self.flip),
            interpolation=interpolation,
            mixup_alpha=self.used_mixup_alpha,
        )

    def finish(self, network: keras.Model, history: dict[str, list[float]]) -> dict:
        # The paper evaluates on the plain resized image, resized here as train_pipeline resizes.
        image_size, mean, std, interpolation = self._preprocessing(network)
        eval_spec = data.Preprocessing(image_size, mean, std, None, interpolation, resampler="tensorflow")
        test_data = data.eval_pipeline(self.test_source, eval_spec, batch_size=self.batch_size)
        test_loss, test_accuracy = network.evaluate(test_data, verbose=0)
        return {
            "accuracy": float(test_accuracy),
            "loss": float(test_loss),
            "test_examples": self.test_source.num_examples,
            "ema": self.ema_momentum is not None,
        }

    def saved_model(self, network: keras.Model) -> keras.Model:
        return network

    def describe(self, network: keras.Model) -> dict:
        """What the run used (`runs.fit_task` puts it in the report): recipe, checkpoint, data, values."""
        image_size, mean, std, interpolation = self._preprocessing(network)
        is_digits = not isinstance(self.dataset, tuple) and os.fspath(self.dataset) == defaults.DATASET
        augment = runs.augmentation(is_digits, self.crop_scale, self.flip)
        from_checkpoint = self.pretrained is not False and self.pretrained is not None
        optimizer = (
            "AdamW (weight decay on kernels), warm-up + cosine decay: the paper's pre-training recipe"
            if self.recipe == "pretrain"
            else "SGD momentum 0.9, warm-up + cosine decay, no weight decay: the paper's fine-tuning recipe"
        )
        start = "from a checkpoint" if from_checkpoint else "from scratch"
        tfds_name = not isinstance(self.dataset, tuple) and not is_digits
        tfds_name = tfds_name and not data.is_folder_name(self.dataset)
        return {
            "recipe": self.recipe,
            "recipe_description": f"{optimizer}; {start}",
            "checkpoint": checkpoint_record(self.pretrained, network),
            "data": {
                "dataset": runs.describe(self.dataset),
                "train_examples": self.train_source.num_examples,
                "test_examples": self.test_source.num_examples,
                "num_classes": self.train_source.num_classes,
                **({"train_split": self.train_split, "test_split": self.test_split} if tfds_name else {}),
            },
            "class_names": list(self.train_source.class_names) if self.train_source.class_names else None,
            "hyperparameters": {
                **self.schedule,
                "decay": "cosine",
                "weight_decay": self.weight_decay if self.recipe == "pretrain" else 0.0,
                "label_smoothing": self.label_smoothing,
                "ema_momentum": self.ema_momentum,
                "dropout": self.dropout,
                "drop_path_rate": self.used_drop_path_rate,
                "mixup_alpha": self.used_mixup_alpha,
                "image_size": list(image_size),
                "mean": list(mean),
                "std": list(std),
                "interpolation": interpolation,
                **{key: list(value) if isinstance(value, tuple) else value for key, value in augment.items()},
            },
        }


def finetune(
    model: str | ViTConfig = defaults.FINETUNE_MODEL,
    dataset: str | os.PathLike | tuple[data.Source, data.Source] = defaults.DATASET,
    *,
    pretrained: bool | str | os.PathLike | keras.Model = True,
    **kwargs,
) -> TrainingResult:
    """`train` with the paper's fine-tuning recipe (SGD momentum, no weight decay) from `pretrained`."""
    if not pretrained:
        raise ValueError("finetune starts from a checkpoint: pass pretrained=<tag, file or hub id>, or True.")
    return train(model, dataset, recipe="finetune", pretrained=pretrained, **kwargs)

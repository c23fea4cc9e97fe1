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

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from keras_vit import data, defaults, recipes
from keras_vit.defaults import PRECISIONS, RECIPES, SCRATCH_DROP_PATH, TRAIN_EPOCHS
from keras_vit.distribute import fix_distributed_clipping, fix_multi_worker_fit, get_strategy, is_chief
from keras_vit.models import build_vit, create_model
from keras_vit.pretrained import model_entry
from keras_vit.variants import VARIANTS, ViTConfig, list_models

__all__ = [
    "EpochBackup",
    "TrainingResult",
    "finetune",
    "load_dataset",
    "model_config",
    "train",
]

MAX_STEPS_PER_EPOCH = 1000  # at most this many steps are lost to a kill (they are redone)


@dataclass
class TrainingResult:
    """What `train` returns: the final model (EMA weights if enabled) and the report it wrote."""

    model: keras.Model
    report: dict


def model_config(model: str | ViTConfig, **overrides) -> ViTConfig:
    """The architecture `model` (a registry name such as `"vit_digits"`, or a config) with fields replaced.

    `overrides` are `ViTConfig` fields (`patch_size`, `hidden_size`, `depth`, `num_heads`,
    `mlp_dim`, `image_size`); `None` values are ignored. Changing any gives a custom model
    named `<model>_custom`.
    """
    config = model if isinstance(model, ViTConfig) else None
    if config is None:
        if model not in VARIANTS:
            raise ValueError(f"Unknown model {model!r}: use one of {list_models()} (see `keras-vit models`).")
        config = VARIANTS[model]
    overrides = {key: value for key, value in overrides.items() if value is not None}
    if overrides and any(getattr(config, key) != value for key, value in overrides.items()):
        config = config.replace(name=f"{config.name}_custom", **overrides)
    return config


def load_dataset(
    dataset: str | os.PathLike,
    *,
    train_split: str = "train",
    test_split: str = "test",
    data_dir: str | os.PathLike | None = None,
) -> tuple[data.Source, data.Source]:
    """`(train, held-out)` sources for `dataset`: `"digits"`, an image folder, or a tfds name.

    An image folder must hold `train/` and `test/` (or `val/`, `validation/`) sub-folders,
    each with one sub-folder per class. A tensorflow-datasets name reads `train_split` and
    `test_split` from `data_dir`; it must be prepared already (nothing is downloaded).
    """
    if os.fspath(dataset) == "digits":
        return data.load_digits()
    path = os.fspath(dataset)
    if os.path.isdir(path):
        held_out = next(
            (name for name in ("test", "val", "validation") if os.path.isdir(os.path.join(path, name))), None
        )
        if not os.path.isdir(os.path.join(path, "train")) or held_out is None:
            raise ValueError(
                f"Image folder {path!r} needs a train/ and a test/ (or val/) sub-folder, each with one "
                "folder per class, e.g. train/cat/1.jpg and test/cat/7.jpg."
            )
        train_source = data.from_directory(os.path.join(path, "train"))
        test_source = data.from_directory(os.path.join(path, held_out))
        if train_source.class_names != test_source.class_names:
            raise ValueError(
                f"{path}: train/ and {held_out}/ have different class folders "
                f"({train_source.class_names} vs {test_source.class_names})."
            )
        return train_source, test_source
    if os.sep in path or path.startswith("."):
        raise FileNotFoundError(f"Dataset folder {path!r} does not exist.")
    return (
        data.from_tfds(path, train_split, data_dir=data_dir),
        data.from_tfds(path, test_split, data_dir=data_dir),
    )


def _plan_steps(
    steps_per_pass: int, steps: int | None, epochs: float | None, steps_per_epoch: int | None
) -> tuple[int, int]:
    """`(steps_per_epoch, epochs)` of `fit` for `steps` total or `epochs` passes over the data."""
    if steps is not None and epochs is not None:
        raise ValueError("Give the training length as steps or as epochs, not both.")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}.")
    if epochs is not None and epochs <= 0:
        raise ValueError(f"epochs must be positive, got {epochs!r}.")
    if steps_per_epoch is not None and steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be a positive int, got {steps_per_epoch!r}.")
    if steps is None:
        per_epoch = steps_per_epoch or min(steps_per_pass, MAX_STEPS_PER_EPOCH)
        return per_epoch, max(1, math.ceil(epochs * steps_per_pass / per_epoch))
    if steps_per_epoch is None:
        # The longest epoch up to one pass that divides `steps`, if not much shorter.
        cap = min(steps_per_pass, MAX_STEPS_PER_EPOCH, steps)
        steps_per_epoch = next((n for n in range(cap, cap // 2, -1) if steps % n == 0), cap)
    if steps % steps_per_epoch:
        low = steps // steps_per_epoch * steps_per_epoch
        raise ValueError(
            f"steps {steps} is not a multiple of steps_per_epoch {steps_per_epoch} (backups are taken "
            f"between epochs): use steps={max(low, steps_per_epoch)} or {low + steps_per_epoch}, or "
            "another steps_per_epoch."
        )
    return steps_per_epoch, steps // steps_per_epoch


class EpochBackup(keras.callbacks.Callback):
    """Saves the whole training state after every epoch, atomically, and restores it.

    `backup_dir/state.json` names the epoch and its weights file (`model.save_weights`
    format: model and optimizer variables, EMA averages included) and holds the seed-generator
    states (dropout, stochastic depth: not in the weights file) and the per-epoch logs. Each
    file is written under a temporary name and renamed, and the state file last: a kill at any
    point leaves the previous complete backup. The training driver reads `epoch` before `fit`
    (to start the input stream there and pass `initial_epoch`); `on_train_begin` restores.
    """

    STATE = "state.json"

    def __init__(self, backup_dir: str | os.PathLike, run: dict | None = None):
        """`run`: JSON-able description of the run (its arguments); a backup of another run is refused."""
        super().__init__()
        self.backup_dir = os.fspath(backup_dir)
        self.run = run or {}
        self.state = self._read_state()
        if self.state and self.state.get("run", {}) != json.loads(json.dumps(self.run)):
            changed = sorted(
                key
                for key in set(self.run) | set(self.state.get("run", {}))
                if self.run.get(key) != self.state.get("run", {}).get(key)
            )
            raise ValueError(
                f"{self.backup_dir} holds the backup of a run with other arguments ({', '.join(changed)}): "
                "resume with the same arguments, or use another output directory."
            )
        self.history: dict[str, list[float]] = dict(self.state.get("history", {}))

    @property
    def epoch(self) -> int:
        """Epochs completed by the backed-up run (0: none)."""
        return int(self.state.get("epoch", 0))

    def _read_state(self) -> dict:
        path = os.path.join(self.backup_dir, self.STATE)
        if not os.path.exists(path):
            return {}
        with open(path, encoding="utf-8") as file:
            return json.load(file)

    def _seed_variables(self) -> dict[str, keras.Variable]:
        weights = {id(variable) for variable in self.model.weights}
        return {variable.path: variable for variable in self.model.variables if id(variable) not in weights}

    def on_train_begin(self, logs=None):
        if not self.state:
            return
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        self.model.load_weights(os.path.join(self.backup_dir, self.state["weights"]))
        variables = self._seed_variables()
        for path, value in self.state.get("seed_states", {}).items():
            if path not in variables:
                raise ValueError(
                    f"The backup in {self.backup_dir} has seed state {path!r}, which this model lacks: it "
                    "was written by a different configuration; use another output directory."
                )
            variables[path].assign(np.asarray(value, dtype=variables[path].dtype))

    def on_epoch_end(self, epoch, logs=None):
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(float(value))
        os.makedirs(self.backup_dir, exist_ok=True)
        name = f"epoch-{epoch + 1:06d}.weights.h5"
        temporary = os.path.join(self.backup_dir, f"partial-{name}")
        self.model.save_weights(temporary, overwrite=True)
        _fsync(temporary)
        os.replace(temporary, os.path.join(self.backup_dir, name))
        self.state = {
            "epoch": epoch + 1,
            "weights": name,
            "steps": int(self.model.optimizer.iterations.numpy()),
            "seed_states": {
                path: keras.ops.convert_to_numpy(variable).tolist()
                for path, variable in self._seed_variables().items()
            },
            "history": self.history,
            "run": self.run,
        }
        _write_json(os.path.join(self.backup_dir, self.STATE), self.state)
        for entry in os.listdir(self.backup_dir):
            if entry.endswith(".weights.h5") and entry != name:
                os.remove(os.path.join(self.backup_dir, entry))


def _fsync(path: str) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def _write_json(path: str, content: dict) -> None:
    """Write `content` to `path` atomically (temporary file, fsync, rename)."""
    temporary = f"{path}.partial"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(content, file, indent=2)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def _describe(value):
    """A JSON-able value naming an argument the same way in every process (backups compare them)."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, (tuple, list)):
        return [_describe(item) for item in value]
    if isinstance(value, np.ndarray):
        digest = hashlib.sha1(np.ascontiguousarray(value).tobytes()).hexdigest()[:16]
        return f"array{value.shape} {value.dtype} sha1 {digest}"
    if isinstance(value, data.Source):  # its repr names functions by their (per-process) address
        return f"Source({value.num_examples} examples, {value.num_classes} classes)"
    if isinstance(value, keras.Model):
        return f"Model({value.name}, {value.count_params()} parameters)"
    return repr(value)


def _start_run(
    strategy: str | tf.distribute.Strategy, precision: str, batch_size: int, seed: int
) -> tf.distribute.Strategy:
    """Check the run's precision and batch, make the strategy (with the Keras fixes), seed everything."""
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}: use one of {PRECISIONS}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
    # A multi-worker strategy must exist before TensorFlow runs any op (data sources do).
    if not isinstance(strategy, tf.distribute.Strategy):
        strategy = get_strategy(strategy)
    fix_distributed_clipping()
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        fix_multi_worker_fit()
    if batch_size % strategy.num_replicas_in_sync:
        raise ValueError(
            f"batch_size {batch_size} must be divisible by the {strategy.num_replicas_in_sync} replicas."
        )
    keras.utils.set_random_seed(seed)
    return strategy


def _worker_dir(root: str, strategy: tf.distribute.Strategy) -> str:
    """`root` for the chief; a per-worker sub-folder for the other workers of a cluster."""
    if is_chief(strategy):
        return root
    return os.path.join(root, f"worker-{strategy.cluster_resolver.task_id}")


def _build_model(
    config: ViTConfig,
    pretrained: bool | str | os.PathLike | keras.Model,
    image_size: int,
    num_classes: int,
    dropout: float,
    drop_path_rate: float,
) -> keras.Model:
    regularisation = dict(dropout=dropout, drop_path_rate=drop_path_rate)
    if isinstance(pretrained, keras.Model) or (
        isinstance(pretrained, (str, os.PathLike)) and os.fspath(pretrained).endswith(".keras")
    ):  # a keras_vit model, e.g. the backbone `keras-vit pretrain` writes
        from keras_vit.pretrain import to_classifier

        classifier = to_classifier(pretrained, num_classes, **regularisation)
        if image_size is not None and tuple(classifier.input_shape[1:3]) != data._size_pair(image_size):
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


def _tensorboard(log_dir: str) -> list[keras.callbacks.Callback]:
    """The TensorBoard callback, or none (with a notice) when the `tensorboard` package is missing."""
    try:
        import tensorboard  # noqa: F401  (tf.summary needs it to write scalars)
    except ImportError:
        print(
            "keras_vit: no TensorBoard logs (the tensorboard package is not installed: "
            'pip install "keras-vit-zoo[train]").',
            file=sys.stderr,
        )
        return []
    return [keras.callbacks.TensorBoard(log_dir, write_graph=False)]


def _verbosity(verbose: int | str) -> int:
    if verbose == "auto":
        return 1 if sys.stdout.isatty() else 2
    return int(verbose)


def train(
    model: str | ViTConfig = defaults.TRAIN_MODEL,
    dataset: str | os.PathLike | tuple[data.Source, data.Source] = "digits",
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
    dropout: float = 0.0,
    drop_path_rate: float | None = None,
    crop_scale: Sequence[float] | None = None,
    flip: bool | None = None,
    strategy: str | tf.distribute.Strategy = "auto",
    precision: str = "float32",
    jit_compile: bool | str = "auto",
    seed: int = 0,
    train_split: str = "train",
    test_split: str = "test",
    data_dir: str | os.PathLike | None = None,
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
        strategy: a `keras_vit.distribute.get_strategy` name or a strategy.
        precision: `"float32"`, `"mixed_bfloat16"` or `"mixed_float16"` (loss-scaled).
        jit_compile: XLA-compile the train and evaluation steps; `"auto"`: on a single
            replica (where it makes `vit_digits` steps ~1.6x faster on a CPU), not across
            replicas (XLA fails under MirroredStrategy on logical CPU devices).
        seed: initialisation, data order and augmentation.
        train_split, test_split, data_dir: tensorflow-datasets splits and location.
        callbacks: extra Keras callbacks for `fit`.
        verbose: `fit` verbosity; `"auto"`: progress bar on a terminal, a line per epoch otherwise.

    Returns:
        `TrainingResult(model, report)`; the report (also `report.json`) has the held-out
        accuracy and loss, steps, seconds, images/s, per-epoch history and the arguments.
    """
    arguments = {key: _describe(value) for key, value in dict(locals()).items() if key != "callbacks"}
    if recipe not in RECIPES:
        raise ValueError(f"Unknown recipe {recipe!r}: use one of {RECIPES}.")
    if jit_compile not in (True, False, "auto"):
        raise ValueError(f"jit_compile must be True, False or 'auto', got {jit_compile!r}.")
    strategy = _start_run(strategy, precision, batch_size, seed)
    if jit_compile == "auto":
        jit_compile = strategy.num_replicas_in_sync == 1
    is_digits = not isinstance(dataset, tuple) and os.fspath(dataset) == "digits"
    if isinstance(dataset, tuple):
        train_source, test_source = dataset
    else:
        train_source, test_source = load_dataset(
            dataset, train_split=train_split, test_split=test_split, data_dir=data_dir
        )
    config = model_config(model)
    if steps is None and epochs is None:
        epochs = TRAIN_EPOCHS
    if drop_path_rate is None:
        drop_path_rate = SCRATCH_DROP_PATH if recipe == "pretrain" else 0.0
    steps_per_epoch, fit_epochs = _plan_steps(
        data.epoch_steps(train_source, batch_size), steps, epochs, steps_per_epoch
    )
    total_steps = steps_per_epoch * fit_epochs
    output_dir = os.fspath(output_dir)
    chief = is_chief(strategy)
    run = {key: value for key, value in arguments.items() if key not in ("strategy", "verbose")}
    backup = EpochBackup(_worker_dir(os.path.join(output_dir, "backup"), strategy), run)
    start_epoch = min(backup.epoch, fit_epochs)

    previous_policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        with strategy.scope():
            network = _build_model(
                config,
                pretrained,
                image_size or (None if pretrained else config.image_size),
                train_source.num_classes,
                dropout,
                drop_path_rate,
            )
            if recipe == "pretrain":
                optimizer = recipes.pretraining_optimizer(
                    total_steps,
                    learning_rate=learning_rate or 3e-3,
                    weight_decay=weight_decay,
                    warmup_steps=min(10_000, total_steps // 10) if warmup_steps is None else warmup_steps,
                    decay="cosine",
                    ema_momentum=ema_momentum,
                )
            else:
                optimizer = recipes.finetuning_optimizer(
                    total_steps,
                    learning_rate=learning_rate or 0.01,
                    warmup_steps=min(500, total_steps // 10) if warmup_steps is None else warmup_steps,
                    ema_momentum=ema_momentum,
                )
            network.compile(
                optimizer=optimizer,
                loss=recipes.loss(label_smoothing),
                metrics=["accuracy"],
                jit_compile=jit_compile,
            )
            # Eagerly: inside fit's first trace, each optimizer variable costs ~0.1 s to create.
            network.optimizer.build(network.trainable_variables)
    finally:
        keras.config.set_dtype_policy(previous_policy)

    height, width = network.input_shape[1:3]
    entry = model_entry(network)
    mean, std = data.normalisation_for(network)
    interpolation = (entry.interpolation if entry is not None else None) or "bilinear"
    train_data = data.train_pipeline(
        train_source,
        image_size=(height, width),
        batch_size=batch_size,
        mean=mean,
        std=std,
        seed=seed,
        start_epoch=start_epoch,
        steps_per_epoch=steps_per_epoch,
        **_augmentation(is_digits, crop_scale, flip),
        interpolation=interpolation,
    )
    # The paper evaluates on the plain resized image, resized here as train_pipeline resizes.
    eval_spec = data.Preprocessing((height, width), mean, std, None, interpolation, resampler="tensorflow")
    test_data = data.eval_pipeline(test_source, eval_spec, batch_size=batch_size)
    fit_callbacks = [backup, *callbacks]
    if chief:
        fit_callbacks.extend(_tensorboard(os.path.join(output_dir, "logs")))

    started = time.perf_counter()
    network.fit(
        train_data,
        epochs=fit_epochs,
        steps_per_epoch=steps_per_epoch,
        initial_epoch=start_epoch,
        callbacks=fit_callbacks,
        shuffle=False,  # the pipeline shuffles (reproducibly, per epoch)
        verbose=_verbosity(verbose),
    )
    fit_seconds = time.perf_counter() - started
    # fit() ends by copying the EMA averages (if enabled) into the model: they are evaluated and saved.
    test_loss, test_accuracy = network.evaluate(test_data, verbose=0)
    steps_this_run = (fit_epochs - start_epoch) * steps_per_epoch
    report = {
        "accuracy": float(test_accuracy),
        "loss": float(test_loss),
        "test_examples": test_source.num_examples,
        "steps": int(network.optimizer.iterations.numpy()),
        "planned_steps": total_steps,
        "steps_per_epoch": steps_per_epoch,
        "epochs": fit_epochs,
        "resumed_from_epoch": start_epoch,
        "steps_this_run": steps_this_run,
        "seconds": round(time.perf_counter() - started, 3),
        "fit_seconds": round(fit_seconds, 3),
        "images_per_second": round(steps_this_run * batch_size / fit_seconds, 1) if steps_this_run else None,
        "history": backup.history,
        "model": network.name,
        "parameters": int(network.count_params()),
        "image_size": [int(height), int(width)],
        "strategy": type(strategy).__name__,
        "replicas": int(strategy.num_replicas_in_sync),
        "ema": ema_momentum is not None,
        "versions": {"keras": keras.__version__, "tensorflow": tf.__version__},
        "arguments": arguments,
    }
    if chief:
        os.makedirs(output_dir, exist_ok=True)
        network.save(os.path.join(output_dir, "model.keras"))
        _write_json(os.path.join(output_dir, "report.json"), report)
    _remove_backup(backup.backup_dir)
    return TrainingResult(network, report)


def _augmentation(is_digits: bool, crop_scale: Sequence[float] | None, flip: bool | None) -> dict:
    """`train_pipeline`'s crop range and flips: gentle crops and no flips for the digits."""
    return dict(
        crop_scale=tuple(crop_scale or ((0.7, 1.0) if is_digits else (0.08, 1.0))),
        flip=(not is_digits) if flip is None else flip,
    )


def _remove_backup(backup_dir: str) -> None:
    """Delete a finished run's backup files (only those `EpochBackup` writes)."""
    if not os.path.isdir(backup_dir):
        return
    for entry in os.listdir(backup_dir):
        if entry.endswith((".weights.h5", ".json", ".partial")):
            os.remove(os.path.join(backup_dir, entry))
    if not os.listdir(backup_dir):
        os.rmdir(backup_dir)


def finetune(
    model: str | ViTConfig = defaults.FINETUNE_MODEL,
    dataset: str | os.PathLike | tuple[data.Source, data.Source] = "digits",
    *,
    pretrained: bool | str | os.PathLike | keras.Model = True,
    **kwargs,
) -> TrainingResult:
    """`train` with the paper's fine-tuning recipe (SGD momentum, no weight decay) from `pretrained`."""
    if not pretrained:
        raise ValueError("finetune starts from a checkpoint: pass pretrained=<tag, file or hub id>, or True.")
    return train(model, dataset, recipe="finetune", pretrained=pretrained, **kwargs)

"""Choices and defaults shared by the library functions and the `keras-vit` command line.

Declared once here, in a module that imports nothing heavy, so that the command line's help
shows the library's own values without importing TensorFlow or Keras. The training runs'
options and their defaults are declared in `keras_vit.options`, the recipes' values in
`keras_vit.recipes`.
"""

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
STRATEGIES = ("auto", "default", "one_device", "mirrored", "multi_worker", "tpu")  # first: the default
JIT_CHOICES = ("auto", True, False)
MPP_TARGETS = ("mean_color", "grid_4x4", "regression")
HEAD_FUSIONS = ("mean", "max", "min")

# The training commands' data and models (keras_vit.training, keras_vit.pretrain).
DATASET = "digits"  # scikit-learn's handwritten digits: offline, the main job's data
TRAIN_MODEL = "vit_digits"  # train and pretrain: a ViT small enough for a CPU
FINETUNE_MODEL = "vit_b16"
# The most train steps per call into the backend that steps_per_execution="auto" picks: per-call
# work (callbacks, logs to the host) costs about as much as a small model's step.
STEPS_PER_EXECUTION_CAP = 32
# The class names of a trained classifier, one per line in head order, written next to model.keras
# (and read by `keras-vit export --model RUN/model.keras`).
LABELS_FILE = "labels.txt"
METADATA_FILE = "keras_vit.json"  # what keras_vit.save_pretrained writes beside the weights

# Masked patch prediction's task (paper App. B.1.2; keras_vit.masked_patch, keras-vit pretrain).
MPP_BITS = 3
MPP_CORRUPT_RATE = 0.5
MPP_MASK_RATE = 0.8
MPP_RANDOM_RATE = 0.1

# The most pixels one image may have to be decoded (load_image, `keras-vit predict`, image folders,
# the exported SavedModel's bytes signature): Pillow's own default, Image.MAX_IMAGE_PIXELS
# (~9459 x 9459 pixels). A larger file is refused before it is decoded.
MAX_PIXELS = 89_478_485
# What a dataset folder's unreadable image files do (keras_vit.data.from_directory, --on-bad-image):
# stop with their names (the default, first), or be left out with one warning.
BAD_IMAGE_ACTIONS = ("stop", "skip")

# Names of earlier versions, each now declared once with the recipe it belongs to (`keras_vit.recipes`)
# or as a run option's default (`keras_vit.options`): old name -> (module, attribute path).
_MOVED = {
    "RECIPES": ("recipes", "RECIPES"),
    "WARMUP_FRACTION": ("recipes", "WARMUP_FRACTION"),
    "SCRATCH_LEARNING_RATE": ("recipes", "FROM_SCRATCH.learning_rate"),
    "SCRATCH_WARMUP_CAP": ("recipes", "FROM_SCRATCH.warmup_cap"),
    "SCRATCH_DROP_PATH": ("recipes", "FROM_SCRATCH.drop_path_rate"),
    "SCRATCH_MIXUP": ("recipes", "FROM_SCRATCH.mixup_alpha"),
    "WEIGHT_DECAY": ("recipes", "FROM_SCRATCH.weight_decay"),
    "TRAIN_EPOCHS": ("recipes", "FROM_SCRATCH.epochs"),
    "FINETUNE_LEARNING_RATE": ("recipes", "FINE_TUNING.learning_rate"),
    "FINETUNE_WARMUP_CAP": ("recipes", "FINE_TUNING.warmup_cap"),
    "PRETRAIN_LEARNING_RATE": ("recipes", "MASKED_PATCH_PREDICTION.learning_rate"),
    "PRETRAIN_WEIGHT_DECAY": ("recipes", "MASKED_PATCH_PREDICTION.weight_decay"),
    "PRETRAIN_EPOCHS": ("recipes", "MASKED_PATCH_PREDICTION.epochs"),
    "TRAIN_SPLIT": ("options", "RunOptions.train_split"),
    "TEST_SPLIT": ("options", "ClassifierOptions.test_split"),
    "SEED": ("options", "RunOptions.seed"),
    "DROPOUT": ("options", "RunOptions.dropout"),
    "BATCH_SIZE": ("options", "RunOptions.batch_size"),
    "STEPS_PER_EXECUTION": ("options", "RunOptions.steps_per_execution"),
    "LABEL_SMOOTHING": ("options", "ClassifierOptions.label_smoothing"),
    "TRAIN_OUTPUT_DIR": ("options", "ClassifierOptions.output_dir"),
    "PRETRAIN_OUTPUT_DIR": ("options", "MaskedPatchOptions.output_dir"),
}


def __getattr__(name: str):
    """An earlier version's name: its value where it lives now, with a `DeprecationWarning` naming that place.

    Resolved when asked for, through `importlib` (the modules it names import this one).
    """
    if name not in _MOVED:
        raise AttributeError(f"module 'keras_vit.defaults' has no attribute {name!r}")
    import dataclasses
    import importlib
    import warnings

    module, path = _MOVED[name]
    warnings.warn(
        f"keras_vit.defaults.{name} is now keras_vit.{module}.{path}.", DeprecationWarning, stacklevel=2
    )
    owner, _, attribute = path.rpartition(".")
    value = importlib.import_module(f"keras_vit.{module}")
    if owner:
        value = getattr(value, owner)
    if dataclasses.is_dataclass(value) and isinstance(value, type):  # an options class: the field's default
        return {field.name: field.default for field in dataclasses.fields(value)}[attribute]
    return getattr(value, attribute)

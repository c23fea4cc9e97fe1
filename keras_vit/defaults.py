"""Choices and defaults shared by the library functions and the `keras-vit` command line.

Declared once here, in a module that imports nothing heavy, so that the command line's help
shows the library's own values without importing TensorFlow or Keras.
"""

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
STRATEGIES = ("auto", "default", "one_device", "mirrored", "multi_worker", "tpu")  # first: the default
JIT_CHOICES = ("auto", True, False)
RECIPES = ("pretrain", "finetune")
MPP_TARGETS = ("mean_color", "grid_4x4", "regression")
HEAD_FUSIONS = ("mean", "max", "min")

# Every training command (keras_vit.runs.fit_task).
DATASET = "digits"  # scikit-learn's handwritten digits: offline, the main job's data
TRAIN_SPLIT = "train"
TEST_SPLIT = "test"
SEED = 0
DROPOUT = 0.0
WARMUP_FRACTION = 0.1  # linear warm-up over this share of the steps, capped by the recipe's
# Train steps per call into TensorFlow ("auto": the largest divisor of the epoch up to the cap).
# Per-call work (callbacks, logs to the host) costs as much as a small model's step.
STEPS_PER_EXECUTION = "auto"
STEPS_PER_EXECUTION_CAP = 32

# keras_vit.training.train / `keras-vit train` (the main job) and `finetune`.
TRAIN_MODEL = "vit_digits"
# Peak learning rate and warm-up cap of the recipes: AdamW from scratch (the paper's
# ImageNet-1k value) and SGD momentum fine-tuning (code default 500 warm-up steps).
SCRATCH_LEARNING_RATE = 3e-3
SCRATCH_WARMUP_CAP = 10_000
FINETUNE_LEARNING_RATE = 0.01
FINETUNE_WARMUP_CAP = 500
FINETUNE_MODEL = "vit_b16"
TRAIN_EPOCHS = 100  # passes over the data when neither steps nor epochs is given (the main job)
# Stochastic depth when training from scratch (DeiT's and AugReg's small-data regularisation;
# the main job measured 98.05% held-out with it, 97.49% without); none when fine-tuning (the paper).
SCRATCH_DROP_PATH = 0.1
# Mixup's Beta(alpha, alpha) when training from scratch (DeiT's small-data regularisation, lighter):
# the main job, seeds 0-4, mean 97.99% held-out with 0.2, 97.88% without (within the seed-to-seed
# spread; 0.5: 97.77% over seeds 0-2); none when fine-tuning (the paper).
SCRATCH_MIXUP = 0.2
BATCH_SIZE = 64
WEIGHT_DECAY = 0.05
LABEL_SMOOTHING = 0.1
TRAIN_OUTPUT_DIR = "vit_run"
# The class names of a trained classifier, one per line in head order, written next to model.keras
# (and read by `keras-vit export --model RUN/model.keras`).
LABELS_FILE = "labels.txt"

# keras_vit.pretrain.pretrain / `keras-vit pretrain` (masked patch prediction, paper App. B.1.2).
PRETRAIN_EPOCHS = 50
PRETRAIN_LEARNING_RATE = 2e-4
PRETRAIN_WEIGHT_DECAY = 0.0
PRETRAIN_OUTPUT_DIR = "vit_mpp"
MPP_BITS = 3
MPP_CORRUPT_RATE = 0.5
MPP_MASK_RATE = 0.8
MPP_RANDOM_RATE = 0.1

# The most pixels one image may have to be decoded (load_image, `keras-vit predict`, image folders,
# the exported SavedModel's bytes signature): Pillow's own default, Image.MAX_IMAGE_PIXELS
# (~9459 x 9459, 0.27 GB as uint8 RGB). A larger file is refused before it is decoded.
MAX_PIXELS = 89_478_485
# What a dataset folder's unreadable image files do (keras_vit.data.from_directory, --on-bad-image):
# stop with their names (the default, first), or be left out with one warning.
BAD_IMAGE_ACTIONS = ("stop", "skip")

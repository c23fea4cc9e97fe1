"""Choices and defaults shared by the library functions and the `keras-vit` command line.

Declared once here, in a module that imports nothing heavy, so that the command line's help
shows the library's own values without importing TensorFlow or Keras. The training runs'
options and their defaults are declared in `keras_vit.training.options`, the recipes' values in
`keras_vit.training.recipes`.
"""

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
STRATEGIES = ("auto", "default", "one_device", "mirrored", "multi_worker", "tpu")  # first: the default
JIT_CHOICES = ("auto", True, False)
MPP_TARGETS = ("mean_color", "grid_4x4", "regression")
HEAD_FUSIONS = ("mean", "max", "min")

# The training commands' data and models (keras_vit.training.classification, keras_vit.training.pretrain).
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

# Masked patch prediction's task (paper App. B.1.2; keras_vit.training.masked_patch, keras-vit pretrain).
MPP_BITS = 3
MPP_CORRUPT_RATE = 0.5
MPP_MASK_RATE = 0.8
MPP_RANDOM_RATE = 0.1

# The most pixels one image may have to be decoded (load_image, `keras-vit predict`, image folders,
# the exported SavedModel's bytes signature): Pillow's own default, Image.MAX_IMAGE_PIXELS
# (~9459 x 9459 pixels). A larger file is refused before it is decoded.
MAX_PIXELS = 89_478_485
# What a dataset folder's unreadable image files do (keras_vit.data.tfdata.from_directory, --on-bad-image):
# stop with their names (the default, first), or be left out with one warning.
BAD_IMAGE_ACTIONS = ("stop", "skip")

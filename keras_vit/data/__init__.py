"""Data: what an image becomes before the model sees it. `preprocessing` (Pillow) and
`tf_preprocessing` (TensorFlow) implement the catalog's `Preprocessing` spec; `datasets` says what a
dataset argument means (digits, an image folder, a tensorflow-datasets name); `tfdata` is the tf.data
input of the TensorFlow backend and `pyinput` the `keras.utils.PyDataset` input of JAX and PyTorch,
both deterministic in (seed, epoch, index). Modules load on first use."""

from keras_vit.utils.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__, {}, submodules=("datasets", "preprocessing", "pyinput", "tf_preprocessing", "tfdata")
)

"""What a training run's dataset argument means: the digits, an image folder, or a tfds name.

`load_dataset` gives classification its `(train, held-out)` sources, `load_unlabeled` gives
masked patch pre-training its training images. Both read the same names the same way: `"digits"`
(scikit-learn's, offline), a folder (a string that exists or starts with `.`, `/` or `~`:
`keras_vit.data.tfdata.is_folder_name`), else a prepared tensorflow-datasets name (with a config or
version if needed: `imagenette/320px`, `mnist:3.0.1`; nothing is downloaded). Each source
carries the augmentation that suits it (`keras_vit.data.tfdata.Source.augmentation`).

Both read the digits and folders through tf.data (`keras_vit.data.tfdata`) on TensorFlow and through
NumPy and Pillow (`keras_vit.data.pyinput`) on JAX and PyTorch, where a tensorflow-datasets name is
refused with what to do instead.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

import keras
import numpy as np

from keras_vit.data import pyinput
from keras_vit.utils.defaults import BAD_IMAGE_ACTIONS, DATASET

__all__ = ["InputModule", "bad_images_record", "input_module", "load_dataset", "load_unlabeled"]


def _folder(dataset: str | os.PathLike) -> str | None:
    """The folder `dataset` names (`None`: a tfds name); an existing file or a missing folder is refused."""
    path = os.path.expanduser(os.fspath(dataset))
    if not pyinput.is_folder_name(dataset):
        return None
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"Dataset {path!r} is a file: pass an image folder, '{DATASET}' or a tfds name.")
    raise FileNotFoundError(f"Dataset folder {path!r} does not exist.")


# The data options that apply to one kind of dataset only: (name, default, the kind it applies to).
_TFDS_OPTIONS = (
    ("train_split", "train", "tensorflow-datasets names"),
    ("test_split", "test", "tensorflow-datasets names"),
    ("data_dir", None, "tensorflow-datasets names"),
)
_FOLDER_OPTIONS = (("on_bad_image", BAD_IMAGE_ACTIONS[0], "image folders"),)


def _refuse_unused(dataset, kind: str, options: dict, applies: tuple) -> None:
    """A data option this kind of dataset cannot honour, set to other than its default, is an
    error that says so (it would be silently ignored)."""
    unused = [
        f"{name}={options[name]!r} (--{name.replace('_', '-')}) applies to {where} only"
        for name, default, where in applies
        if options.get(name, default) != default
    ]
    if unused:
        raise ValueError(f"{'; '.join(unused)}: dataset {os.fspath(dataset)!r} is {kind}; leave them out.")


class InputModule(Protocol):
    """The input contract both readers implement (`keras_vit.data.tfdata`: tf.data;
    `keras_vit.data.pyinput`: NumPy, Pillow, a `keras.utils.PyDataset`), so tasks never ask which
    backend runs. Sources: `Source` (a `pyinput.SourceInfo`: size, classes, augmentation,
    `bad_images`, the folder policy applied when files are read), `from_arrays`, `from_directory`
    (`on_bad_image`), `load_digits`; the training stream: `epoch_steps`, `train_pipeline` (batches
    a pure function of `(seed, epoch, index)`), `images_only`; evaluation: `Preprocessing`,
    `eval_pipeline`; `is_folder_name`."""

    Source: type
    Preprocessing: type

    def from_arrays(self, images, labels, *, num_classes: int | None = None, class_names=None) -> Any: ...

    def from_directory(self, path, *, on_bad_image: str = ..., max_pixels: int | None = ...) -> Any: ...

    def load_digits(self, test_fraction: float = 0.2, seed: int = 0) -> tuple: ...

    def epoch_steps(self, source, batch_size: int, steps_per_epoch: int | None = None) -> int: ...

    def train_pipeline(
        self, source, *, image_size: int | Sequence[int], batch_size: int, seed: int, **options
    ) -> Any: ...

    def images_only(self, batches) -> Any: ...

    def eval_pipeline(self, source, spec, *, batch_size: int, **options) -> Any: ...

    def is_folder_name(self, dataset) -> bool: ...


def input_module() -> InputModule:
    """The input pipelines of this backend (`InputModule`): `keras_vit.data.tfdata` (tf.data) on
    TensorFlow, else `keras_vit.data.pyinput` (NumPy, Pillow, a `keras.utils.PyDataset`)."""
    if keras.backend.backend() == "tensorflow":
        from keras_vit.data import tfdata as data

        return data
    return pyinput


def bad_images_record(**sources) -> dict:
    """The report's `{"bad_images": {split: ...}}` for the image-folder sources among `sources`
    (what `on_bad_image` met when the files were read: `BadImages.summary`), or `{}`."""
    record = {name: source.bad_images.summary() for name, source in sources.items() if source.bad_images}
    return {"bad_images": record} if record else {}


def _tfds(name: str, split: str, data_dir):
    """A tensorflow-datasets split's source; off TensorFlow one clear error (tfds reads through it)."""
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ValueError(
            f"Dataset {name!r} is a tensorflow-datasets name, which needs the TensorFlow backend (tf.data), "
            f"but Keras runs on {backend!r}: run with KERAS_BACKEND=tensorflow, or on {backend} train on "
            f"an image folder (train/ and test/ with a folder per class) or {DATASET!r}."
        )
    from keras_vit.data import tfdata as data

    return data.from_tfds(name, split, data_dir=data_dir)


def load_dataset(
    dataset: str | os.PathLike,
    *,
    train_split: str = "train",
    test_split: str = "test",
    data_dir: str | os.PathLike | None = None,
    on_bad_image: str = BAD_IMAGE_ACTIONS[0],
) -> tuple:
    """`(train, held-out)` sources for `dataset`: `"digits"`, an image folder, or a tfds name.

    An image folder must hold `train/` and `test/` (or `val/`, `validation/`) sub-folders,
    each with one sub-folder per class. A tensorflow-datasets name reads `train_split` and
    `test_split` from `data_dir`. A folder's unreadable image files stop the run with their
    names, or are skipped with `on_bad_image="skip"` (`keras_vit.data.tfdata.from_directory`).
    """
    options = dict(
        train_split=train_split, test_split=test_split, data_dir=data_dir, on_bad_image=on_bad_image
    )
    if isinstance(dataset, str) and dataset == DATASET:
        _refuse_unused(dataset, "scikit-learn's digits", options, _TFDS_OPTIONS + _FOLDER_OPTIONS)
        return input_module().load_digits()
    path = _folder(dataset)
    if path is None:
        _refuse_unused(dataset, "a tensorflow-datasets name", options, _FOLDER_OPTIONS)
        name = os.fspath(dataset)
        return _tfds(name, train_split, data_dir), _tfds(name, test_split, data_dir)
    _refuse_unused(dataset, "an image folder", options, _TFDS_OPTIONS)
    held_out = next(
        (name for name in ("test", "val", "validation") if os.path.isdir(os.path.join(path, name))), None
    )
    if not os.path.isdir(os.path.join(path, "train")) or held_out is None:
        raise ValueError(
            f"Image folder {path!r} needs a train/ and a test/ (or val/) sub-folder, each with one "
            "folder per class, e.g. train/cat/1.jpg and test/cat/7.jpg."
        )
    inputs = input_module()
    train_source = inputs.from_directory(os.path.join(path, "train"), on_bad_image=on_bad_image)
    test_source = inputs.from_directory(os.path.join(path, held_out), on_bad_image=on_bad_image)
    if train_source.class_names != test_source.class_names:
        raise ValueError(
            f"{path}: train/ and {held_out}/ have different class folders "
            f"({train_source.class_names} vs {test_source.class_names})."
        )
    return train_source, test_source


def load_unlabeled(
    dataset,
    train_split: str = "train",
    data_dir: str | os.PathLike | None = None,
    on_bad_image: str = BAD_IMAGE_ACTIONS[0],
) -> pyinput.SourceInfo:
    """The training images of `dataset` (their labels unused): the digits' train split, an image
    folder (its `train/` if present; any sub-folders), the `train_split` of a tfds name
    (TensorFlow only), a source of this backend's reader (`input_module().Source`: tf.data's
    `keras_vit.data.tfdata.Source` on TensorFlow, `keras_vit.data.pyinput.Source` elsewhere), or uint8-range
    images `(N, H, W[, C])`."""
    inputs = input_module()
    options = dict(train_split=train_split, data_dir=data_dir, on_bad_image=on_bad_image)
    if isinstance(dataset, (pyinput.SourceInfo, np.ndarray)) or dataset == DATASET:
        kind = "scikit-learn's digits" if isinstance(dataset, str) else f"a {type(dataset).__name__}"
        _refuse_unused(
            dataset if isinstance(dataset, str) else kind, kind, options, _TFDS_OPTIONS + _FOLDER_OPTIONS
        )
    if isinstance(dataset, pyinput.SourceInfo):
        if not isinstance(dataset, inputs.Source):
            raise ValueError(
                f"The source given is {type(dataset).__module__}'s, but Keras runs on "
                f"{keras.backend.backend()!r}, whose input is {inputs.__name__}'s: make it with "
                f"{inputs.__name__}.from_arrays or from_directory, or pass the images or their folder."
            )
        return dataset
    if isinstance(dataset, np.ndarray):
        return inputs.from_arrays(dataset, np.zeros(len(dataset), "int32"), num_classes=1)
    if isinstance(dataset, str) and dataset == DATASET:
        return inputs.load_digits()[0]  # the train split only: the test split stays unseen
    path = _folder(dataset)
    if path is None:
        _refuse_unused(dataset, "a tensorflow-datasets name", options, _FOLDER_OPTIONS)
        return _tfds(os.fspath(dataset), train_split, data_dir)
    _refuse_unused(dataset, "an image folder", options, _TFDS_OPTIONS)
    if os.path.isdir(os.path.join(path, "train")):
        path = os.path.join(path, "train")
    try:
        return inputs.from_directory(path, on_bad_image=on_bad_image)
    except ValueError as error:
        raise ValueError(
            f"{error} For unlabeled images any grouping will do: e.g. put them all in {path}/images/."
        ) from None

"""What keeps a `ViT` safe to call: input checks that say what to do, and on JAX a model that stays
usable when `fit`, `evaluate` or `predict` fails. The `ViT` methods call these before and around
Keras's own; they live beside the class so the model reads as its architecture."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras
import numpy as np

__all__ = ["check_batch", "check_dtype", "check_images", "state_kept_on_failure"]


@contextlib.contextmanager
def state_kept_on_failure(model: keras.Model, training: bool = False) -> Iterator[None]:
    """On JAX, put the weights back into the model when `fit`, `evaluate` or `predict` fails.

    Keras's JAX loops take the variables' values out of the model while they run (the
    optimizer's too in `fit`) and put them back only when the loop ends normally, or in
    `fit` only if a step has finished: a failure (a bad batch, labels of the wrong shape, an
    interrupt) would leave variables empty and the model broken for good (`'NoneType'
    object is not callable`). The state after the last good step is put back, and any
    variable still empty gets its value from before the call (references, intact when the
    step failed before it ran). For `training`, the optimizer is built first (as `fit`
    would) so that its variables have a value from before the call too.
    """
    if keras.backend.backend() != "jax":
        yield
        return
    optimizer = getattr(model, "optimizer", None)
    if training and optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)
    optimizer_variables = optimizer.variables if optimizer is not None else []
    variables = (*model.variables, *model.metrics_variables, *optimizer_variables)
    before = [(variable, variable.value) for variable in variables]
    model._jax_state = None  # a finished call's state (train_on_batch keeps it) is not this one's
    try:
        yield
    except BaseException:
        if getattr(model, "_jax_state", None):
            model.jax_state_sync()
        model._jax_state = None
        for variable, value in before:
            if variable._value is None:  # taken out by Keras and not put back
                variable.assign(value)
        raise


def check_batch(model: keras.Model, images) -> None:
    """Refuse an empty batch and NaN or infinite pixels of an array given to `predict`.

    An empty batch must not reach Keras's predict loop: on JAX the loop takes the weights
    out of the model for the first step, finds no data, and never puts them back, so every
    later call fails (`'NoneType' object is not callable`).
    """
    shape = getattr(images, "shape", None)
    if shape is not None and len(shape) > 0 and shape[0] == 0:
        raise ValueError(
            f"{model.name}.predict got an empty batch (shape {tuple(shape)}): no images to predict."
        )
    if isinstance(images, np.ndarray) and images.dtype.kind == "f" and not np.isfinite(images).all():
        raise ValueError(
            f"{model.name}.predict got NaN or infinite pixel values: they are no image (check the "
            "loading and keras_vit.preprocess_input)."
        )


def check_images(model: keras.Model, images) -> None:
    """Refuse images whose known shape cannot be this model's input, saying what to do.

    Keras's own input check lets some wrong shapes through to the patch reshape or the
    hybrid stem (deep TensorFlow errors), and on JAX a failed `predict` leaves the model's
    predict function broken; this check runs first, on the static shape of an array,
    tensor or `tf.data.Dataset` element (unknown dimensions pass).
    """
    if hasattr(images, "element_spec"):  # a tf.data.Dataset of images or (images, ...) tuples
        spec = images.element_spec
        images = spec[0] if isinstance(spec, tuple) else spec
    check_dtype(model, images)
    try:
        shape = tuple(None if size is None else int(size) for size in images.shape)
    except (AttributeError, TypeError, ValueError):  # no shape, or of unknown rank: nothing to check
        return
    height, width, channels = model.image_shape
    if channels == 1 and len(shape) == 3:
        shape = (*shape, 1)  # Keras adds the channel axis of a grayscale batch
    expected = (None, height, width, channels)
    if len(shape) == 4 and all(
        got in (None, want) or want is None for got, want in zip(shape, expected, strict=True)
    ):
        return
    if len(shape) != 4:
        advice = "a single image needs a batch axis (images[None]), grayscale a channel axis"
    elif shape[3] not in (None, channels):
        advice = (
            f"convert the images (grayscale to RGB: np.repeat(images, 3, axis=-1)), or build the "
            f"model with channels={shape[3]} (pretrained patch kernels are adapted to it)"
        )
    else:
        advice = (
            f"resize them to {height}x{width} (keras_vit.load_image(path, model) does it), or build "
            f"the model for that size: create_model(..., image_size=({shape[1]}, {shape[2]})) "
            "resizes the position embedding"
        )
    raise ValueError(
        f"{model.name} takes images of shape (batch, {height}, {width}, {channels}), got shape "
        f"{shape}: {advice}."
    )


def check_dtype(model: keras.Model, images) -> None:
    """Pixels of the dtype this model takes, or an error saying what to do.

    A float model takes normalised floats: integer or bool pixels are refused with a pointer to
    `preprocess_input` (raw pixels would be classified without a word, and wrongly). A model
    built with the uint8 input option (`image_dtype="uint8"`) normalises uint8 pixels itself
    and refuses anything else (Keras would cast floats to uint8 silently).
    """
    dtype = getattr(images, "dtype", None)
    if dtype is None:
        return
    try:
        dtype = keras.backend.standardize_dtype(dtype)
    except ValueError:  # a dtype Keras does not know (strings, objects): Keras refuses it
        return
    if model.image_dtype == "uint8":
        if dtype != "uint8":
            raise ValueError(
                f"{model.name} takes uint8 pixels in [0, 255] (image_dtype='uint8') and normalises them "
                f"itself, got {dtype} images: pass the uint8 images before normalising, or use a model "
                "built with image_dtype='float32' for normalised images."
            )
        return
    if dtype.startswith(("int", "uint", "bool")):
        raise TypeError(
            f"{model.name} takes normalised float images, got {dtype} pixels: pass them through "
            "keras_vit.preprocess_input(images, model) first (raw pixels would be classified without "
            "a word, and wrongly), or build the model with image_dtype='uint8'."
        )

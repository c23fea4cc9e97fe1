"""The TensorFlow implementation of a `keras_vit.registry.catalog.Preprocessing` spec.

`ImagePreprocessing` is a spec with its in-graph implementation: `resize` (resize + centre
crop of a uint8 batch), `normalize`, and calling it does both. `keras_vit.data.tfdata.eval_pipeline`
maps it over a tf.data source and `keras_vit.deploy.export.export_serving` puts it in the
SavedModel: both run this one implementation. `decode_image` decodes encoded files as
Pillow does. The NumPy/Pillow implementation of the same spec is
`keras_vit.data.preprocessing.load_image` + `normalize`; for the same image and spec the two give
identical uint8 pixels after the resize and identical float32 after normalising.

Pillow's resize (`resampler="pillow"`, the default), reproduced bit for bit: Pillow resizes in
two separable passes (width then height, or height first when the height shrinks by more than
twice as many pixels as the width: Pillow 13's rule, which `load_image` makes explicit). Each
pass is a convolution whose coefficients Pillow computes per output pixel in float64 (centre
`(i + 0.5) * scale`, support `filter_support * max(scale, 1)`, normalised to sum 1), rounds to
22-bit fixed point, and applies in integer arithmetic, rounding the sum to uint8. Here the
coefficients come from the same float64 operations in the same order (so the same integers),
each pass is a sparse `(out, in)` matrix product in float64 (exact: the sums are integers far
below 2^53), rounded as Pillow rounds. TensorFlow's own antialiased `tf.image.resize` has the
same kernels in floating point: one pass of it differs from Pillow by up to 8 grey levels,
two rounded passes by 1. `resampler="tensorflow"` is that one-pass resize (rounded once), what
`keras_vit.data.tfdata.train_pipeline` uses and `keras-vit train` evaluates with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from keras_vit.registry.catalog import Preprocessing, normalize
from keras_vit.utils.environment import import_tensorflow

tf = import_tensorflow("keras_vit.data.tf_preprocessing")

__all__ = ["LIBJPEG_WARNINGS", "ImagePreprocessing", "caught_stderr", "decode_image", "jpeg_damage"]

_PRECISION_BITS = 22  # Pillow's fixed point for 8-bit images: 32 - 8 - 2 bits
_SUPPORT = {"bilinear": 1.0, "bicubic": 2.0}  # Pillow's filter supports


def decode_image(data: tf.Tensor, channels: int = 3) -> tf.Tensor:
    """Decode one encoded image to uint8 `(height, width, channels)` as Pillow does.

    JPEG goes through libjpeg-turbo's accurate integer IDCT, Pillow's choice: the pixels are
    then identical to `PIL.Image.open(...).convert("RGB")` (TensorFlow's default fast IDCT is
    off by about 1 grey level on average, up to 18). PNG, GIF (first frame), BMP and WebP use
    `tf.io.decode_image`. A string that is no image raises `InvalidArgumentError`.
    """
    return tf.cond(
        tf.io.is_jpeg(data),
        lambda: tf.io.decode_jpeg(data, channels=channels, dct_method="INTEGER_ACCURATE"),
        lambda: tf.io.decode_image(data, channels=channels, expand_animations=False),
    )


# libjpeg's warnings: it "recovers" from a damaged JPEG (grey blocks for the lost data) and says
# so only with one of these lines on standard error, naming no file.
LIBJPEG_WARNINGS = re.compile(
    r"^(Corrupt JPEG data|Premature end of JPEG file|Invalid SOS|Inconsistent progression).*$", re.M
)


@contextlib.contextmanager
def caught_stderr() -> Iterator[Callable[[], str]]:
    """Standard error (file descriptor 2, where libjpeg writes) caught in a temporary file.

    Yields a function that returns what was written since its last call. Anything caught
    that is not a libjpeg warning is written back to standard error at the end.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    kept = []
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)

        def since_last_call() -> str:
            caught.seek(0)
            text = caught.read().decode(errors="replace")
            caught.seek(0)
            caught.truncate()
            kept.append(LIBJPEG_WARNINGS.sub("", text).strip())
            return text

        try:
            yield since_last_call
        finally:
            since_last_call()
            os.dup2(saved, 2)
            os.close(saved)
    other = "\n".join(text for text in kept if text)
    if other:
        sys.stderr.write(other + "\n")


def jpeg_damage(data: bytes) -> str | None:
    """libjpeg's complaint about a JPEG's bytes that it decodes only by "recovering" (grey or
    smeared blocks where data was lost, e.g. bytes damaged mid-file with the header and end
    marker intact), or None for an intact one. Pillow, which drops libjpeg's warnings, decodes
    such a file without a word; this decodes it once as `decode_image` does, its warning caught."""
    with caught_stderr() as caught:
        decode_image(tf.constant(data))
        warning = LIBJPEG_WARNINGS.search(caught())
    return warning.group(0).strip() if warning else None


def _kernel(interpolation: str, x: tf.Tensor) -> tf.Tensor:
    """Pillow's `bilinear_filter` / `bicubic_filter` (a = -0.5), the same float64 operations."""
    x = tf.abs(x)
    zero = tf.zeros_like(x)
    if interpolation == "bilinear":
        return tf.where(x < 1.0, 1.0 - x, zero)
    a = -0.5
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return tf.where(x < 1.0, near, tf.where(x < 2.0, far, zero))


def _pillow_coefficients(in_size: tf.Tensor, out_size: tf.Tensor, interpolation: str) -> tf.SparseTensor:
    """Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc`: its integer coefficients `(out, in)`."""
    scale = tf.cast(in_size, tf.float64) / tf.cast(out_size, tf.float64)
    filterscale = tf.maximum(scale, 1.0)
    support = _SUPPORT[interpolation] * filterscale
    ksize = tf.cast(tf.math.ceil(support), tf.int32) * 2 + 1
    center = (tf.cast(tf.range(out_size), tf.float64) + 0.5) * scale
    # C's (int) truncates; below zero it is clamped to 0 either way.
    xmin = tf.maximum(tf.cast(center - support + 0.5, tf.int32), 0)
    xmax = tf.minimum(tf.cast(center + support + 0.5, tf.int32), in_size) - xmin
    taps = tf.range(ksize)
    valid = taps[None, :] < xmax[:, None]
    columns = taps[None, :] + xmin[:, None]
    weights = _kernel(
        interpolation, (tf.cast(columns, tf.float64) - center[:, None] + 0.5) * (1.0 / filterscale)
    )
    weights = tf.where(valid, weights, tf.zeros_like(weights))
    # The normalising sum, accumulated tap after tap as Pillow does (the same float64 rounding).
    total = tf.foldl(
        lambda acc, tap: acc + tap, tf.transpose(weights), initializer=tf.zeros([out_size], tf.float64)
    )[:, None]
    weights = tf.where(total != 0.0, weights / tf.where(total != 0.0, total, 1.0), weights)
    scaled = weights * float(1 << _PRECISION_BITS)
    fixed = tf.where(weights < 0.0, tf.math.ceil(-0.5 + scaled), tf.floor(0.5 + scaled))  # C's (int)
    rows = tf.broadcast_to(tf.range(out_size)[:, None], tf.shape(valid))
    indices = tf.stack([tf.boolean_mask(rows, valid), tf.boolean_mask(columns, valid)], axis=1)
    return tf.SparseTensor(
        tf.cast(indices, tf.int64),
        tf.boolean_mask(fixed, valid),
        dense_shape=tf.cast(tf.stack([out_size, in_size]), tf.int64),
    )


def _pillow_pass(pixels: tf.Tensor, axis: int, out_size: tf.Tensor, interpolation: str) -> tf.Tensor:
    """One Pillow pass along `axis` (1: height, 2: width) of a float64 batch of uint8 values."""
    order = [axis] + [dim for dim in range(4) if dim != axis]
    moved = tf.transpose(pixels, order)
    shape = tf.shape(moved)
    coefficients = _pillow_coefficients(shape[0], out_size, interpolation)
    summed = tf.sparse.sparse_dense_matmul(coefficients, tf.reshape(moved, [shape[0], -1]))
    # Pillow: (2^21 + sum) >> 22, clipped to [0, 255].
    rounded = tf.floor((summed + float(1 << (_PRECISION_BITS - 1))) / float(1 << _PRECISION_BITS))
    rounded = tf.reshape(tf.clip_by_value(rounded, 0.0, 255.0), tf.concat([[out_size], shape[1:]], axis=0))
    return tf.transpose(rounded, np.argsort(order))


def _pillow_resize(images: tf.Tensor, new_height: tf.Tensor, new_width: tf.Tensor, interpolation: str):
    """`Image.resize` of a uint8 batch: two passes in Pillow 13's order (`preprocessing._pillow_resize`)."""
    pixels = tf.cast(images, tf.float64)
    shape = tf.shape(images)
    shrink = shape[1] - new_height
    return tf.cond(
        tf.logical_and(shrink > 0, shrink > 2 * (shape[2] - new_width)),
        lambda: _pillow_pass(_pillow_pass(pixels, 1, new_height, interpolation), 2, new_width, interpolation),
        lambda: _pillow_pass(_pillow_pass(pixels, 2, new_width, interpolation), 1, new_height, interpolation),
    )


@dataclass(frozen=True)
class ImagePreprocessing(Preprocessing):
    """A `Preprocessing` spec with its TensorFlow implementation (the fields and checks are the spec's).

    Calling it maps a uint8 batch `(batch, height, width, channels)` of any size to the
    model's float32 input `(batch, H, W, channels)`; it runs eagerly and in graphs (tf.data,
    `tf.function`, SavedModels). `ImagePreprocessing.from_spec(spec)` wraps a spec.
    """

    @classmethod
    def from_spec(cls, spec: Preprocessing) -> ImagePreprocessing:
        if type(spec) is cls:
            return spec
        return cls(**{field.name: getattr(spec, field.name) for field in dataclasses.fields(Preprocessing)})

    def _resized_size(self, in_height: tf.Tensor, in_width: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """`preprocessing.resized_size` in the graph: float64, in its order, round half to even."""
        height, width = self.image_size
        if self.crop_pct is None:
            return tf.constant(height), tf.constant(width)
        scale = tf.constant(max(height, width) / self.crop_pct, tf.float64) / tf.cast(
            tf.minimum(in_height, in_width), tf.float64
        )
        new_height = tf.maximum(height, tf.cast(tf.round(tf.cast(in_height, tf.float64) * scale), tf.int32))
        new_width = tf.maximum(width, tf.cast(tf.round(tf.cast(in_width, tf.float64) * scale), tf.int32))
        return new_height, new_width

    def resize(self, images: tf.Tensor) -> tf.Tensor:
        """Resize (shorter side to `size / crop_pct`) and centre-crop a uint8 batch, as `load_image` does."""
        height, width = self.image_size
        images = tf.convert_to_tensor(images)
        shape = tf.shape(images)
        tf.debugging.assert_positive(
            tf.minimum(shape[1], shape[2]), message="images must have a positive height and width"
        )
        new_height, new_width = self._resized_size(shape[1], shape[2])
        if self.resampler == "pillow":
            pixels = _pillow_resize(images, new_height, new_width, self.interpolation)
        else:
            pixels = tf.image.resize(
                images, (new_height, new_width), method=self.interpolation, antialias=True
            )
            pixels = tf.clip_by_value(tf.round(pixels), 0.0, 255.0)
        top, left = (new_height - height) // 2, (new_width - width) // 2
        cropped = pixels[:, top : top + height, left : left + width, :]
        cropped = tf.ensure_shape(cropped, (None, height, width, images.shape[-1]))
        return tf.cast(cropped, tf.uint8)

    def normalize(self, images: tf.Tensor) -> tf.Tensor:
        """`(x / 255 - mean) / std` in float32: `keras_vit.data.preprocessing.normalize`'s values, exactly.

        For uint8 images (what `resize` returns) it is a lookup in a `(256, channels)` table
        computed by `normalize` itself, so no graph rewrite can change the last bit (Grappler
        turns a division by a constant into a multiplication by its reciprocal, which is 1 ulp
        off for a third of the values). Other dtypes get the arithmetic.
        """
        images = tf.convert_to_tensor(images)
        channels = images.shape[-1]
        if images.dtype == tf.uint8:
            levels = np.repeat(np.arange(256, dtype="uint8")[:, None], channels, axis=1)
            table = tf.constant(normalize(levels, self.mean, self.std).reshape(-1))
            return tf.gather(table, tf.cast(images, tf.int32) * channels + tf.range(channels))
        mean = tf.constant(np.resize(np.asarray(self.mean, "float32"), channels))
        std = tf.constant(np.resize(np.asarray(self.std, "float32"), channels))
        return (tf.cast(images, tf.float32) / 255.0 - mean) / std

    def __call__(self, images: tf.Tensor) -> tf.Tensor:
        return self.normalize(self.resize(images))

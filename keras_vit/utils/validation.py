"""Checks of user input at the package's edges: one small set of validators for arguments and flags.

Each validator takes the argument's name and value, returns the value normalised (an `int`, a
`float`, a pair) and raises `ValueError` whose message names the argument, the value given and
what to pass instead. Zero is a value like any other: it is accepted where it means zero (no
weight decay, no warm-up) and refused where it does not (a learning rate, an image size), never
replaced by a default. Non-finite numbers (NaN, infinity) and booleans are never numbers here.
`cli_type` turns a validator into an argparse `type=`, so a bad flag fails while parsing, with
argparse's usage line.

Image checks: `as_uint8_pixels` states how arrays become 8-bit pixels (the rule `load_image`
follows) and `check_pixel_count` bounds the pixels decoded from one image
(`ImageTooLargeError`). This module imports nothing heavy (NumPy only inside `as_uint8_pixels`),
so the command line can use it while parsing.
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from keras_vit.utils.defaults import MAX_PIXELS

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "MAX_PIXELS",
    "ImageTooLargeError",
    "as_uint8_pixels",
    "check_pixel_count",
    "cli_type",
    "crop_scale",
    "existing_file",
    "fraction",
    "image_size",
    "integer",
    "non_negative_int",
    "number",
    "one_of",
    "optional",
    "positive_int",
    "positive_number",
]


class ImageTooLargeError(ValueError):
    """An image has more pixels than the configured limit (checked before it is decoded)."""


def integer(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an `int` in `[minimum, maximum]`; floats (even `3.0`), booleans and text are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = _bounds(minimum, maximum, False, False)
        raise ValueError(f"{name} must be an integer {bounds}, got {value}.")
    return value


def positive_int(name: str, value) -> int:
    """An integer >= 1 (a size, a count, a number of steps)."""
    return integer(name, value, minimum=1)


def non_negative_int(name: str, value) -> int:
    """An integer >= 0 (0 means none: no warm-up steps, seed 0)."""
    return integer(name, value, minimum=0)


def _bounds(minimum, maximum, exclusive_minimum: bool, exclusive_maximum: bool) -> str:
    low = None if minimum is None else f"{'>' if exclusive_minimum else '>='} {minimum:g}"
    high = None if maximum is None else f"{'<' if exclusive_maximum else '<='} {maximum:g}"
    if low and high:
        left, right = "(" if exclusive_minimum else "[", ")" if exclusive_maximum else "]"
        return f"in {left}{minimum:g}, {maximum:g}{right}"
    return low or high or "finite"


def number(
    name: str,
    value,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
) -> float:
    """A finite real number within the bounds, as a `float` (NaN, infinity and booleans refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
    value = float(value)
    bounds = _bounds(minimum, maximum, exclusive_minimum, exclusive_maximum)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number {bounds}, got {value}.")
    too_low = minimum is not None and (value <= minimum if exclusive_minimum else value < minimum)
    too_high = maximum is not None and (value >= maximum if exclusive_maximum else value > maximum)
    if too_low or too_high:
        raise ValueError(f"{name} must be {bounds}, got {value:g}.")
    return value


def positive_number(name: str, value) -> float:
    """A finite number > 0 (a learning rate: 0 would train nothing)."""
    return number(name, value, minimum=0.0, exclusive_minimum=True)


def fraction(name: str, value, *, allow_one: bool = False) -> float:
    """A rate in [0, 1) (dropout, label smoothing), or [0, 1] with `allow_one`."""
    return number(name, value, minimum=0.0, maximum=1.0, exclusive_maximum=not allow_one)


def optional(validator: Callable, name: str, value, **kwargs):
    """`None` (the documented default) kept as is; anything else checked by `validator`."""
    return None if value is None else validator(name, value, **kwargs)


def one_of(name: str, value, choices: Sequence):
    """`value` if it is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}.")
    return value


def existing_file(name: str, path: str | os.PathLike) -> str:
    """The path of an existing regular file (`FileNotFoundError` / `IsADirectoryError` otherwise)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{name} {path!r} is a folder, not a file.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{name} {path!r} does not exist.")
    return path


def _writable_place(name: str, path: str, folder: str) -> None:
    """The nearest existing folder at or above `folder` (where `path` goes) is a writable folder."""
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise NotADirectoryError(f"{name} {path!r} cannot be made: {existing!r} is a file, not a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"{name} {path!r} cannot be written: {existing!r} is not writable.")


def output_folder(name: str, path: str | os.PathLike) -> str:
    """A folder path that can be written: an existing folder, or a new one inside a writable one.

    Checked before a run or a writer starts, so that a file in the way or a read-only place is
    an error naming the path the user gave (not a staging file's name, or TensorBoard's
    failure later).
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"{name} must be a folder path, got {path!r}.")
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{name} {path!r} is a file, not a folder: give a folder path.")
    _writable_place(name, path, os.path.abspath(path))
    return path


def output_file(name: str, path: str | os.PathLike) -> str:
    """A file path that can be written: not a folder, in a folder `output_folder` would accept."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{name} {path!r} is a folder: give a file path.")
    _writable_place(name, path, os.path.dirname(os.path.abspath(path)))
    return path


def image_size(name: str, value) -> tuple[int, int]:
    """An int or a `(height, width)` pair of ints, each >= 1, as a pair: the one image-size check."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        side = positive_int(name, value)
        return side, side
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or len(value) != 2:
        raise ValueError(f"{name} must be an int or a (height, width) pair of ints, got {value!r}.")
    return positive_int(f"{name} height", value[0]), positive_int(f"{name} width", value[1])


def crop_scale(name: str, value) -> tuple[float, float]:
    """An area range `(low, high)` with `0 < low <= high <= 1` (an inception crop's scale)."""
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2:
        raise ValueError(f"{name} must be a pair (low, high) with 0 < low <= high <= 1, got {value!r}.")
    low = number(f"{name} low", value[0], minimum=0.0, maximum=1.0, exclusive_minimum=True)
    high = number(f"{name} high", value[1], minimum=low, maximum=1.0)
    return low, high


def check_pixel_count(name: str, height: int, width: int, max_pixels: int | None) -> None:
    """Refuse an image of `height * width` pixels above `max_pixels` (`None`: no limit)."""
    if max_pixels is not None and int(height) * int(width) > max_pixels:
        raise ImageTooLargeError(
            f"{name} is {int(width)}x{int(height)} = {int(height) * int(width):,} pixels, more than the "
            f"limit of {max_pixels:,} (a decompression bomb, or a very large photo): shrink it first, or "
            "raise the limit (max_pixels=..., keras-vit --max-pixels N) if you trust the file."
        )


def as_uint8_pixels(name: str, array) -> np.ndarray:
    """An image array as uint8 pixels `(H, W)` or `(H, W, C)`, by one stated rule (else `ValueError`).

    - uint8: as is.
    - uint16: 16-bit pixels, reduced to 8 bits by keeping the high byte (`v >> 8`), as
      TensorFlow's and Pillow's decoders read 16-bit PNGs.
    - other integers: 8-bit values; anything outside [0, 255] is refused.
    - floats: values in [0, 255], rounded; NaN, infinity or values outside [0, 255] are refused,
      and so are non-zero floats that all lie within [0, 1] (scaled images: multiply by 255).
    - booleans and non-numbers are refused.
    """
    import numpy as np

    array = np.asarray(array)
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (1, 3, 4)):
        raise ValueError(
            f"{name} must be an image array (H, W) or (H, W, C) with C = 1, 3 or 4, got shape {array.shape}."
        )
    if array.dtype == np.uint8:
        return array
    if array.dtype == np.uint16:
        return (array >> 8).astype(np.uint8)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.number) or np.iscomplexobj(array):
        raise ValueError(f"{name} must hold real pixel values, got dtype {array.dtype}.")
    if array.size == 0:
        raise ValueError(f"{name} is empty (shape {array.shape}).")
    if np.issubdtype(array.dtype, np.floating) and not np.all(np.isfinite(array)):
        raise ValueError(f"{name} holds NaN or infinite values: it is not an image.")
    low, high = float(array.min()), float(array.max())
    if low < 0 or high > 255:
        hint = (
            " For 16-bit pixels pass a uint16 array (or divide by 256)."
            if np.issubdtype(array.dtype, np.integer)
            else " Images already normalised (e.g. to [-1, 1]) go to the model as they are."
        )
        raise ValueError(f"{name} must hold pixel values in [0, 255], got [{low:g}, {high:g}].{hint}")
    if np.issubdtype(array.dtype, np.floating):
        if 0 < high <= 1:
            raise ValueError(
                f"{name} is a float array within [{low:g}, {high:g}], which looks like [0, 1] scaling; "
                "pixel values are taken in [0, 255]: multiply by 255 first (or, for an image that "
                "really is that dark in [0, 255], cast it to uint8)."
            )
        return np.round(array).astype(np.uint8)
    return array.astype(np.uint8)


def cli_type(validator: Callable, parse: Callable[[str], object] = int, **kwargs) -> Callable[[str], object]:
    """An argparse `type=`: parse the text with `parse`, then check it with `validator`.

    `argparse` puts the flag in front of the message (`argument --lr: ...`), so the value is
    named `value` here.
    """

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError:
            kind = {int: "an integer", float: "a number"}.get(parse, "a valid value")
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        try:
            return validator("value", value, **kwargs)
        except (ValueError, OSError) as error:
            raise argparse.ArgumentTypeError(str(error).removeprefix("value ")) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert

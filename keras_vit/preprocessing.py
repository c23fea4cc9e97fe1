"""Input scaling: the models take images already normalised as their weights expect."""

from __future__ import annotations

import numpy as np

GOOGLE_MEAN = (0.5, 0.5, 0.5)
GOOGLE_STD = (0.5, 0.5, 0.5)


def normalize(images, mean=GOOGLE_MEAN, std=GOOGLE_STD) -> np.ndarray:
    """Map pixel values in [0, 255] to `(x / 255 - mean) / std` (float32, channels last)."""
    images = np.asarray(images, dtype="float32") / 255.0
    channels = images.shape[-1]
    mean = np.resize(np.asarray(mean, dtype="float32"), channels)
    std = np.resize(np.asarray(std, dtype="float32"), channels)
    return (images - mean) / std


def preprocess_input(images, tag_or_model=None) -> np.ndarray:
    """Scale uint8-range images `(..., H, W, C)` to what the weights expect: [-1, 1] for
    every Google-trained checkpoint (mean = std = 0.5)."""
    return normalize(images)

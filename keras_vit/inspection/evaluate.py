"""Few-shot linear evaluation of frozen representations (paper §4.1, "Metrics").

The paper measures representations without fine-tuning by "solving a regularized
least-squares regression problem that maps the (frozen) representation of a subset of
training images to {-1, 1}^K target vectors", a closed form. `few_shot` does what
big_vision's `fewshot_lsr` evaluator does:

* the representation is the pre-head feature: `pre_logits` when the model has one, else
  the pooled token (`pool`), else the [class] token after `encoder_norm`;
* for each seed, the training examples of each class are permuted with
  `numpy.random.default_rng(seed)` and the first `shots` of each class kept (so the 5-shot
  set contains the 1-shot set);
* features are whitened with the mean/std of those examples, a constant column of 100 is
  appended (a bias that the penalty barely touches), and
  `W = argmin ||X W - Y||^2 + l2_reg ||W||^2` is solved in closed form, `Y` = 2 onehot - 1;
* the accuracy of `argmax(X_test W)` on the whole test set is averaged over `repeats` seeds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import keras
import numpy as np

from keras_vit.data.preprocessing import GOOGLE_MEAN, GOOGLE_STD
from keras_vit.data.tfdata import Source, eval_pipeline
from keras_vit.registry.variants import config_of

__all__ = ["feature_model", "few_shot", "least_squares_accuracy", "ridge_weights"]

BIAS_CONSTANT = 100.0


def feature_model(model: keras.Model) -> keras.Model:
    """The sub-model of a ViT that returns its pooled pre-head representation `(B, D)` (`ViT.feature_model`).

    The output of `pre_logits` if present, else of `pool`, else token 0 after the final
    LayerNorm (a model built with `pooling=None`). Any other model raises `ValueError`: pass a
    feature function to `few_shot` instead.
    """
    try:
        config_of(model)
    except ValueError as error:
        raise ValueError(
            f"{error} Or pass few_shot a function mapping image batches to (batch, features)."
        ) from None
    return model.feature_model()


def ridge_weights(features: np.ndarray, targets: np.ndarray, l2_reg: float) -> np.ndarray:
    """Closed-form `argmin_W ||features @ W - targets||^2 + l2_reg * ||W||^2` (float64).

    Solves the primal `(X^T X + l2 I)^-1 X^T Y` when there are at least as many rows as
    features, else the equivalent dual `X^T (X X^T + l2 I)^-1 Y` (smaller system).
    """
    x = np.asarray(features, dtype="float64")
    y = np.asarray(targets, dtype="float64")
    if l2_reg <= 0:
        raise ValueError(f"l2_reg must be positive, got {l2_reg!r}.")
    num_points, dim = x.shape
    if num_points >= dim:
        return np.linalg.solve(x.T @ x + l2_reg * np.eye(dim), x.T @ y)
    return x.T @ np.linalg.solve(x @ x.T + l2_reg * np.eye(num_points), y)


def least_squares_accuracy(
    train_features: np.ndarray,
    train_labels: np.ndarray,
    test_features: np.ndarray,
    test_labels: np.ndarray,
    num_classes: int,
    l2_reg: float,
) -> float:
    """Test accuracy of the regularised least-squares classifier fitted on the training features.

    Whitening, bias column and {-1, 1} targets as described in the module docstring.
    """
    train_features = np.asarray(train_features, dtype="float64")
    mean = train_features.mean(axis=0, keepdims=True)
    std = train_features.std(axis=0, keepdims=True) + 1e-5

    def design(features):
        whitened = (np.asarray(features, dtype="float64") - mean) / std
        return np.pad(whitened, ((0, 0), (0, 1)), constant_values=BIAS_CONSTANT)

    targets = 2.0 * np.eye(num_classes)[np.asarray(train_labels)] - 1.0
    weights = ridge_weights(design(train_features), targets, l2_reg)
    predictions = np.argmax(design(test_features) @ weights, axis=1)
    return float(np.mean(predictions == np.asarray(test_labels)))


def _representations(
    feature_fn: Callable, source: Source, batch_size: int, **pipeline
) -> tuple[np.ndarray, np.ndarray]:
    features, labels = [], []
    for images, batch_labels in eval_pipeline(source, batch_size=batch_size, **pipeline):
        output = keras.ops.convert_to_numpy(feature_fn(images))
        if output.ndim != 2 or len(output) != len(batch_labels):
            raise ValueError(
                f"The feature function returned shape {output.shape} for {len(batch_labels)} images; "
                "it must return (batch, features)."
            )
        features.append(output)
        labels.append(batch_labels.numpy())
    return np.concatenate(features), np.concatenate(labels)


def few_shot(
    model_or_feature_fn: keras.Model | Callable,
    train_source: Source,
    test_source: Source,
    *,
    shots: Sequence[int] = (1, 5, 10, 25),
    l2_reg: float = 2.0**10,
    seed: int = 0,
    repeats: int = 3,
    image_size: int | Sequence[int] | None = None,
    mean: Sequence[float] = GOOGLE_MEAN,
    std: Sequence[float] = GOOGLE_STD,
    crop_pct: float | None = None,
    interpolation: str = "bilinear",
    batch_size: int = 256,
) -> dict[int, float]:
    """Few-shot linear accuracy `{shots: accuracy}` of a frozen representation (see module docstring).

    `model_or_feature_fn`: a ViT (its representation is taken with `feature_model`) or a
    function mapping a float32 batch `(B, H, W, 3)`, normalised with `mean`/`std`, to
    features `(B, D)`. Images go through `keras_vit.data.tfdata.eval_pipeline` (default: a plain
    resize to `image_size`, as big_vision's few-shot preprocessing); `image_size` defaults
    to the model's input size. Features of both sources are computed once; each of the
    `repeats` seeds (`seed`, `seed + 1`, ...) draws new training subsets. Defaults follow
    big_vision (l2_reg 2^10, shots 1/5/10/25, 3 seeds). Every class of `train_source` needs
    at least `max(shots)` examples.
    """
    if isinstance(model_or_feature_fn, keras.Model):
        extractor = feature_model(model_or_feature_fn)
        feature_fn = extractor.predict_on_batch
        if image_size is None:
            image_size = tuple(model_or_feature_fn.input_shape[1:3])
    elif callable(model_or_feature_fn):
        feature_fn = model_or_feature_fn
        if image_size is None:
            raise ValueError("image_size is required with a feature function (it has no input shape).")
    else:
        raise TypeError(f"Expected a keras.Model or a callable, got {type(model_or_feature_fn).__name__}.")
    shots = sorted({int(n) for n in shots})
    if not shots or shots[0] < 1:
        raise ValueError(f"shots must be positive ints, got {shots!r}.")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats!r}.")
    if train_source.num_classes != test_source.num_classes:
        raise ValueError(
            f"train_source has {train_source.num_classes} classes but test_source "
            f"{test_source.num_classes}: they must share the label set."
        )
    num_classes = train_source.num_classes
    pipeline = dict(image_size=image_size, mean=mean, std=std, crop_pct=crop_pct, interpolation=interpolation)
    train_x, train_y = _representations(feature_fn, train_source, batch_size, **pipeline)
    test_x, test_y = _representations(feature_fn, test_source, batch_size, **pipeline)

    counts = np.bincount(train_y, minlength=num_classes)
    if counts.min() < shots[-1]:
        raise ValueError(
            f"Class {int(counts.argmin())} has {int(counts.min())} training examples, fewer than "
            f"{shots[-1]} shots: use fewer shots or a larger train_source."
        )
    results = {n: 0.0 for n in shots}
    for repeat in range(repeats):
        rng = np.random.default_rng(seed + repeat)
        class_indices = [rng.permutation(np.flatnonzero(train_y == label)) for label in range(num_classes)]
        for n in shots:
            chosen = np.concatenate([indices[:n] for indices in class_indices])
            accuracy = least_squares_accuracy(
                train_x[chosen], train_y[chosen], test_x, test_y, num_classes, l2_reg
            )
            results[n] += accuracy / repeats
    return results

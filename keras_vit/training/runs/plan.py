"""The length plan of a run: steps per epoch (backups fall between epochs), epochs, steps per call.

Pure Python: the same plan on every backend.
"""

from __future__ import annotations

import math

from keras_vit.utils.defaults import STEPS_PER_EXECUTION_CAP

__all__ = ["MAX_STEPS_PER_EPOCH", "execution_steps", "plan_steps"]

MAX_STEPS_PER_EPOCH = 1000  # at most this many steps are lost to a kill (they are redone)


def plan_steps(
    steps_per_pass: int, steps: int | None, epochs: float | None, steps_per_epoch: int | None
) -> tuple[int, int]:
    """`(steps_per_epoch, epochs)` of `fit` for `steps` total or `epochs` passes over the data."""
    if steps is not None and epochs is not None:
        raise ValueError("Give the training length as steps or as epochs, not both.")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}.")
    if epochs is not None and epochs <= 0:
        raise ValueError(f"epochs must be positive, got {epochs!r}.")
    if steps_per_epoch is not None and steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be a positive int, got {steps_per_epoch!r}.")
    if steps is None:
        per_epoch = steps_per_epoch or min(steps_per_pass, MAX_STEPS_PER_EPOCH)
        return per_epoch, max(1, math.ceil(epochs * steps_per_pass / per_epoch))
    if steps_per_epoch is None:
        # The longest epoch up to one pass that divides `steps`, if not much shorter.
        cap = min(steps_per_pass, MAX_STEPS_PER_EPOCH, steps)
        steps_per_epoch = next((n for n in range(cap, cap // 2, -1) if steps % n == 0), cap)
    if steps % steps_per_epoch:
        low = steps // steps_per_epoch * steps_per_epoch
        raise ValueError(
            f"steps {steps} is not a multiple of steps_per_epoch {steps_per_epoch} (backups are taken "
            f"between epochs): use steps={max(low, steps_per_epoch)} or {low + steps_per_epoch}, or "
            "another steps_per_epoch."
        )
    return steps_per_epoch, steps // steps_per_epoch


def execution_steps(steps_per_epoch: int, requested: int | str = "auto", replicas: int = 1) -> int:
    """Train steps per call into TensorFlow: `requested`, or for `"auto"` the largest divisor of
    `steps_per_epoch` up to `STEPS_PER_EXECUTION_CAP` (epochs, hence backups, end on a call).

    `"auto"` with several replicas is 1: Keras 3.15's multi-step loop fails under
    MirroredStrategy ("You must feed a value for placeholder tensor 'while/cond/Placeholder'").
    """
    if requested == "auto" and replicas > 1:
        return 1
    if requested == "auto":
        return max(
            n for n in range(1, min(steps_per_epoch, STEPS_PER_EXECUTION_CAP) + 1) if steps_per_epoch % n == 0
        )
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"steps_per_execution must be a positive int or 'auto', got {requested!r}.")
    if steps_per_epoch % requested:
        raise ValueError(
            f"steps_per_execution {requested} does not divide steps_per_epoch {steps_per_epoch}: backups "
            "are taken between epochs; use a divisor, or 'auto'."
        )
    return requested

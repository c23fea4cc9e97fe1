"""Whether a computation that rounds differently is as accurate as the one it replaces.

keras_vit's PyTorch path (`keras_vit/models/eager_torch.py`) adds each bias inside its matrix product
(one `addmm`, rounded once), where Keras's layers add it after (`matmul`, then `add`: rounded twice), so
their values differ by float rounding, not bit for bit. Both are compared with the same computation in
float64: per array, the mean error relative to the array's largest exact value. The new path's is not
systematically larger: on average over the arrays at most 2x the old path's, and in no array more than
4x (measured over 6 seeds on an AMD EPYC: 0.7-1.4x on average and at most 2.6x per array, float32 and
bfloat16 alike: each bound within 2x of what was measured. A mistake in the arithmetic is off by orders
of magnitude: the query bias without the attention scale, 1e6x). The gradients of key projections' biases
(named `.../key/bias`: the blocks' attention and the MAP head's) are left out: they are zero (softmax
ignores a shift of its logits), so both paths give only rounding noise there.

Where one rounding upstream sets every array's error (half precision, a MAP head: the errors of all
arrays move together), one random draw is one sample of a wide ratio (0.2-4.8x over 24 seeds for the
MAP case in mixed bfloat16). Such tests pass several independent draws (random weights and inputs);
each array's error is averaged over them (0.6-1.5x for 4 draws over the same seeds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

MEAN_RATIO, ARRAY_RATIO = 2.0, 4.0


Results = Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]]  # one draw's arrays, or several


def relative_errors(new: Results, old: Results, exact: Results) -> dict[str, tuple[float, float]]:
    """Per array name: the mean error of `new` and of `old` against `exact`, relative to its largest
    value, averaged over the draws."""
    draws = [_draws(results) for results in (new, old, exact)]
    assert len({len(results) for results in draws}) == 1, "as many draws of each"
    per_draw = [_draw_errors(*draw) for draw in zip(*draws, strict=True)]
    return {
        name: tuple(float(np.mean([errors[name][i] for errors in per_draw])) for i in (0, 1))
        for name in per_draw[0]
    }


def _draws(results: Results) -> list[Mapping[str, np.ndarray]]:
    return [results] if isinstance(results, Mapping) else list(results)


def _draw_errors(new: Mapping, old: Mapping, exact: Mapping) -> dict[str, tuple[float, float]]:
    assert new.keys() == old.keys() == exact.keys(), "the same arrays, by name"
    return {
        name: tuple(float(np.abs(path[name] - value).mean() / np.abs(value).max()) for path in (new, old))
        for name, value in exact.items()
        if not name.split(" ")[0].endswith("key/bias")
    }


def mean_errors(errors: dict[str, tuple[float, float]]) -> tuple[float, float]:
    """`relative_errors`' two paths, each averaged over the arrays."""
    return tuple(float(np.mean([error[i] for error in errors.values()])) for i in (0, 1))


def accuracy_failures(new: Results, old: Results, exact: Results) -> list[str]:
    """Where `new` is less accurate than `old` beyond rounding noise (the module's criterion), or []."""
    errors = relative_errors(new, old, exact)
    mean_new, mean_old = mean_errors(errors)
    failures = []
    if mean_new > MEAN_RATIO * mean_old:
        failures.append(f"mean relative error {mean_new:.3g} against {mean_old:.3g}")
    for name, (error_new, error_old) in errors.items():
        if error_new > ARRAY_RATIO * error_old + 1e-7:
            failures.append(f"{name}: relative error {error_new:.3g} against {error_old:.3g}")
    return failures

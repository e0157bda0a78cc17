"""Bootstrap intervals for the ratios the benches report (one place, so every bench computes them alike).

A bench compares two systems on the same requests: per request one number each (a median over
repeats), and the claim is about the median of the per-request ratios. Resampling the requests with
replacement and taking that median each time gives a percentile interval: how much the claim depends
on which requests were in the set. It says nothing about a machine that drifts during the run;
interleave the systems per request for that.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def bootstrap_ratio_interval(numer: Sequence[float | None], denom: Sequence[float | None], *, level: float = 0.90,
                             n_boot: int = 2000, seed: int = 0) -> tuple[float | None, float | None, float | None]:
    """(median of numer[i] / denom[i], low, high): the point estimate and its `level` percentile
    bootstrap interval over the pairs. Pairs with a missing or non-positive value are dropped; with
    no pair left every value is None, with one the interval is the point itself."""
    pairs = [(a, b) for a, b in zip(numer, denom, strict=True) if a is not None and b is not None and a > 0 and b > 0]
    if not pairs:
        return None, None, None
    ratios = np.array([a / b for a, b in pairs], dtype=float)
    point = float(np.median(ratios))
    if len(ratios) == 1:
        return point, point, point
    rng = np.random.default_rng(seed)
    medians = np.median(ratios[rng.integers(0, len(ratios), size=(n_boot, len(ratios)))], axis=1)
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return point, float(low), float(high)


__all__ = ["bootstrap_ratio_interval"]

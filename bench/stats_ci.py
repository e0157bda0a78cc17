"""Confidence intervals for speed ratios: the geometric mean of per-prompt ratios, bootstrapped.

A bench compares a system with plain decoding prompt by prompt (the ratio of the two medians over
repeats) and summarises a class of prompts by the geometric mean of those ratios: a 2x win and a
0.5x loss cancel, as they do for a user running both prompts. Its uncertainty comes from which
prompts happen to be in the class, so the interval resamples prompts (with replacement, within
their class: the overall figure keeps each class's share), never runs. Percentile bootstrap on
the log scale, seeded, so the same runs always give the same interval.

    from edgespec.bench.stats_ci import geomean_interval, verdict
    ci = geomean_interval({"code": [1.02, 0.98, 1.10], "chat": [0.97, 1.01]})   # overall
    verdict(ci)  # "holds" (lower bound >= 1), "loses" (upper bound < 1) or "cannot tell"

Used by the race (bench/race.py, `edgespec bench`); any bench that compares systems prompt by prompt can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

LEVEL = 0.90
RESAMPLES = 4000
SEED = 0


@dataclass(frozen=True)
class Interval:
    value: float    # the geometric mean of the ratios themselves
    low: float
    high: float
    level: float
    n: int          # ratios behind it

    def to_dict(self) -> dict:
        return {"value": round(self.value, 4), "low": round(self.low, 4), "high": round(self.high, 4),
                "level": self.level, "n": self.n}

    def __str__(self) -> str:
        return f"{self.value:.3f} ({self.level:.0%} interval {self.low:.3f}-{self.high:.3f}, {self.n} prompts)"


def geomean(ratios: Sequence[float]) -> float:
    xs = np.asarray(ratios, dtype=np.float64)
    if not len(xs) or (xs <= 0).any():
        raise ValueError(f"a geometric mean needs positive ratios, got {list(ratios)}")
    return float(np.exp(np.log(xs).mean()))


def geomean_interval(ratios: Sequence[float] | Mapping[str, Sequence[float]], *, level: float = LEVEL,
                     resamples: int = RESAMPLES, seed: int = SEED) -> Interval:
    """The geometric mean of `ratios` and its bootstrap interval. `ratios` grouped by class (a mapping)
    are resampled within each class; a plain sequence is one class."""
    groups = [np.log(np.asarray(g, dtype=np.float64)) for g in
              (ratios.values() if isinstance(ratios, Mapping) else [ratios]) if len(g)]
    if not groups:
        raise ValueError("no ratios")
    if any((~np.isfinite(g)).any() for g in groups):
        raise ValueError("ratios must be positive and finite")
    rng = np.random.default_rng(seed)
    total = sum(len(g) for g in groups)
    sums = np.zeros(resamples)
    for g in groups:  # each resample draws len(g) prompts of each class from that class
        sums += g[rng.integers(0, len(g), size=(resamples, len(g)))].sum(axis=1)
    means = sums / total
    tail = (1.0 - level) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    value = float(np.concatenate(groups).mean())
    return Interval(float(np.exp(value)), float(np.exp(low)), float(np.exp(high)), level, total)


def verdict(interval: Interval, threshold: float = 1.0) -> str:
    """What an interval lets one claim about "ratio >= threshold": it holds only if the whole interval
    is at or above it, it fails only if the whole interval is below; otherwise the data cannot tell.
    One prompt says nothing of its class: its interval is a point, and the verdict "cannot tell"."""
    if interval.n < 2:
        return "cannot tell"
    if interval.low >= threshold:
        return "holds"
    if interval.high < threshold:
        return "loses"
    return "cannot tell"

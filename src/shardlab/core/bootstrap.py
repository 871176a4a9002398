"""The percentile bootstrap: the one resampling behind every interval the tables print (timed steps,
evaluated rows)."""

from __future__ import annotations

import numpy as np


def bootstrap_interval(stat, sizes: tuple[int, ...], replicates: int = 1000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of `stat(*indices)`, one index array resampled (with replacement)
    per independent sample of `sizes`: one sample for a metric or a paired difference (the same rows
    for model and baseline), two for a difference of independent samples. Replicates whose statistic
    is undefined (NaN: e.g. no valid molecule drawn) are left out."""
    if min(sizes) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    values = np.array([stat(*(rng.integers(0, n, n) for n in sizes)) for _ in range(replicates)], float)
    values = values[np.isfinite(values)]
    if not len(values):
        return float("nan"), float("nan")
    low, high = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)

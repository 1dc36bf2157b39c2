"""Scores over seeds the way rliable reports them (Agarwal et al., 2021): the interquartile mean
(the mean of the middle 50%, robust to one lucky or unlucky seed yet using more than the median)
with a percentile-bootstrap 95% interval that resamples seeds, then episodes within them."""
from __future__ import annotations

import numpy as np
from scipy import stats

BOOTSTRAP = 2000


def iqm(values: np.ndarray) -> float:
    return float(stats.trim_mean(np.asarray(values, np.float64), 0.25))


def iqm_interval(groups: list[np.ndarray], seed: int = 0) -> tuple[float, float, float]:
    """IQM of all values pooled and a 95% percentile interval: resample the groups (seeds), then
    the values within each resampled group (a group of one value: a plain bootstrap over seeds)."""
    rng = np.random.default_rng(seed)
    groups = [np.asarray(g, np.float64) for g in groups if len(g)]
    point = iqm(np.concatenate(groups))
    draws = np.empty(BOOTSTRAP)
    for b in range(BOOTSTRAP):
        picked = [groups[i] for i in rng.integers(0, len(groups), len(groups))]
        draws[b] = iqm(np.concatenate([g[rng.integers(0, len(g), len(g))] for g in picked]))
    low, high = np.percentile(draws, [2.5, 97.5])
    return point, float(low), float(high)

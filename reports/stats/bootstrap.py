"""The seeded bootstrap of a mean (resampling the independent units: questions, not samples).

``reports.stats`` re-exports ``bootstrap_means``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["bootstrap_means"]


def bootstrap_means(values: Sequence[float], n_boot: int = 10_000, seed: int = 0, chunk: int = 1000) -> np.ndarray:
    """Means of ``n_boot`` resamples (with replacement) of ``values``; seeded, deterministic."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap needs at least one value")
    rng = np.random.default_rng(seed)
    out = np.empty(n_boot, dtype=np.float64)
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = rng.integers(0, x.size, size=(stop - start, x.size))
        out[start:stop] = x[idx].mean(axis=1)
    return out

"""Significance of paired comparisons: the exact McNemar and paired t p-values, the Pearson correlation of
per-question scores, and Holm's step-down correction across the comparisons of one report.

``reports.stats`` re-exports every name here.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from kvbench.reports.stats.distributions import binom_cdf, t_cdf

__all__ = ["mcnemar_exact", "paired_t_pvalue", "pearson", "holm"]


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value from the discordant counts b (base right, cand wrong) and c."""
    if b < 0 or c < 0:
        raise ValueError("discordant counts must be >= 0")
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2.0 * binom_cdf(min(b, c), n, 0.5))


def paired_t_pvalue(diffs: Sequence[float]) -> float:
    """Two-sided one-sample t-test p-value of mean(diffs) == 0."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.size < 2:
        return 1.0
    sd = float(d.std(ddof=1))
    m = float(d.mean())
    if sd == 0.0:
        return 1.0 if m == 0.0 else 0.0
    t = m / (sd / math.sqrt(d.size))
    return min(1.0, 2.0 * t_cdf(-abs(t), d.size - 1))


def pearson(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    """Pearson correlation (the phi coefficient for 0/1 data); None when either side is constant."""
    a = np.asarray(x, dtype=np.float64)
    b = np.asarray(y, dtype=np.float64)
    if a.size != b.size:
        raise ValueError("pearson needs equal lengths")
    if a.size < 2:
        return None
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    if den == 0.0:
        return None
    return float((a * b).sum()) / den


def holm(pvalues: Sequence[Optional[float]]) -> list[Optional[float]]:
    """Holm step-down adjusted p-values (None entries are skipped and stay None)."""
    idx = [i for i, p in enumerate(pvalues) if p is not None]
    for i in idx:
        if not 0.0 <= pvalues[i] <= 1.0 or math.isnan(pvalues[i]):
            raise ValueError(f"p-value out of [0, 1]: {pvalues[i]}")
    order = sorted(idx, key=lambda i: pvalues[i])
    m = len(order)
    out: list[Optional[float]] = [None] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out

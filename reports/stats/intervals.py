"""Confidence intervals (docs/design.md §10): one cell's accuracy and the difference of two paired proportions.

* one cell: a Wilson interval when every question was asked once (K=1, 0/1 scores), a Student-t interval
  over per-question means otherwise (K>1, or fractional scores) — ``estimate``; a one-sided upper bound of
  a weighted mean (``weighted_mean_upper``, the fidelity KL gate);
* paired 0/1 scores: Newcombe's hybrid score interval (``newcombe_paired_interval``) with the corrected
  correlation (``newcombe_phi``).

``reports.stats`` re-exports every name here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Optional, Sequence

import numpy as np

from kvbench.reports.stats.distributions import normal_ppf, t_ppf

__all__ = [
    "Estimate",
    "wilson_interval",
    "check_confidence",
    "t_interval",
    "weighted_mean_upper",
    "group_by_question",
    "estimate",
    "newcombe_from_means",
    "newcombe_phi",
    "newcombe_paired_interval",
]


# --------------------------------------------------------------------------- one cell


@dataclass(frozen=True)
class Estimate:
    """A mean with a two-sided confidence interval."""

    mean: float
    lo: float
    hi: float
    n: int  # questions
    k: int  # repeats per question (max)
    method: str  # "wilson" | "t" | "none"
    confidence: float = 0.95


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion."""
    if n <= 0:
        raise ValueError("wilson_interval needs n > 0")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be within [0, n], got {successes} of {n}")
    z = normal_ppf(0.5 + confidence / 2.0)
    phat = successes / n
    denom = 1.0 + z * z / n
    centre = (phat + z * z / (2 * n)) / denom
    half = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def check_confidence(confidence) -> float:
    """The one accepted range of a confidence level: a number strictly between 0.5 and 1 (a one-sided bound
    at 0.5 is the point estimate).  Raises ValueError otherwise; returns it as a float."""
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or math.isnan(confidence) \
            or not 0.5 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0.5, 1), got {confidence!r}")
    return float(confidence)


def t_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, lo, hi): Student-t interval for the mean of ``values``."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("t_interval needs at least one value")
    m = float(x.mean())
    if x.size == 1:
        return m, -math.inf, math.inf
    se = float(x.std(ddof=1)) / math.sqrt(x.size)
    q = t_ppf(0.5 + confidence / 2.0, x.size - 1)
    return m, m - q * se, m + q * se


def weighted_mean_upper(values: Sequence[float], weights: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """(weighted mean, one-sided upper confidence bound) of per-unit ``values`` with ``weights`` (e.g. a
    per-text mean KL weighted by its token count: the weighted mean is then the mean over every token).

    The bound is mean + t_{conf, n−1}·SE with the ratio-estimator standard error over the n units,
    SE = sqrt(n/(n−1)·Σ w_i²(x_i − mean)²)/Σ w_i (s/√n for equal weights); +inf with fewer than 2 units."""
    x = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if x.size == 0 or x.size != w.size:
        raise ValueError("weighted_mean_upper needs as many weights as values, and at least one")
    if np.any(w <= 0) or not np.all(np.isfinite(w)):
        raise ValueError("weights must be finite and > 0")
    check_confidence(confidence)
    tw = float(w.sum())
    mean = float((w * x).sum() / tw)
    if x.size < 2:
        return mean, math.inf
    se = math.sqrt(x.size / (x.size - 1) * float(((w * (x - mean)) ** 2).sum())) / tw
    return mean, mean + t_ppf(confidence, x.size - 1) * se


def group_by_question(scores: Mapping[tuple[Hashable, int], float]) -> dict[Hashable, list[float]]:
    """{(item, repeat): score} -> {item: [scores in repeat order]}."""
    out: dict[Hashable, list[tuple[int, float]]] = {}
    for (item, rep), v in scores.items():
        out.setdefault(item, []).append((rep, float(v)))
    return {item: [v for _, v in sorted(vals, key=lambda t: t[0])] for item, vals in out.items()}


def _is_binary(values) -> bool:
    return all(v in (0.0, 1.0) for v in values)


def estimate(scores: Mapping[tuple[Hashable, int], float], confidence: float = 0.95) -> Estimate:
    """Accuracy with an interval from {(item, repeat): score}.

    Wilson when every question has one repeat and scores are 0/1; otherwise a t-interval over
    per-question means (the questions are the independent units, not the samples)."""
    if not scores:
        raise ValueError("estimate needs at least one score")
    per_q = group_by_question(scores)
    k = max(len(v) for v in per_q.values())
    flat = [v for vals in per_q.values() for v in vals]
    if any(math.isnan(v) for v in flat):
        raise ValueError("scores contain NaN")
    if k == 1 and _is_binary(flat):
        s = int(round(sum(flat)))
        lo, hi = wilson_interval(s, len(flat), confidence)
        return Estimate(s / len(flat), lo, hi, len(flat), 1, "wilson", confidence)
    means = [sum(v) / len(v) for v in per_q.values()]
    m, lo, hi = t_interval(means, confidence)
    return Estimate(m, lo, hi, len(means), k, "t", confidence)


# --------------------------------------------------------------------------- paired comparisons


def newcombe_from_means(p1: float, p2: float, n: float, phi: Optional[float], confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided interval for p1 − p2 from two paired proportions over ``n`` units (Newcombe 1998, method 10).

    Wilson score intervals (l1, u1), (l2, u2) for each marginal proportion are combined with the
    correlation ``phi`` of the pairs (0 when undefined, i.e. None):

        L = D − sqrt((p1 − l1)² − 2·phi·(p1 − l1)·(u2 − p2) + (u2 − p2)²)
        U = D + sqrt((u1 − p1)² − 2·phi·(u1 − p1)·(p2 − l2) + (p2 − l2)²),   D = p1 − p2.

    """
    if n <= 0:
        raise ValueError("newcombe_from_means needs n > 0")
    for p in (p1, p2):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"proportions must be within [0, 1], got {p}")
    phi = 0.0 if phi is None or math.isnan(phi) else max(-1.0, min(1.0, float(phi)))
    z = normal_ppf(0.5 + confidence / 2.0)

    def wilson(p: float) -> tuple[float, float]:
        denom = 1.0 + z * z / n
        centre = (p + z * z / (2 * n)) / denom
        half = z * math.sqrt(max(p * (1 - p), 0.0) / n + z * z / (4 * n * n)) / denom
        return max(0.0, centre - half), min(1.0, centre + half)

    (l1, u1), (l2, u2) = wilson(p1), wilson(p2)
    d = p1 - p2
    lo_sq = (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
    hi_sq = (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2
    return max(-1.0, d - math.sqrt(max(lo_sq, 0.0))), min(1.0, d + math.sqrt(max(hi_sq, 0.0)))


def newcombe_phi(a: float, b: float, c: float, d: float, corrected: bool = True) -> float:
    """The correlation of the pairs of a paired 2×2 table as Newcombe's interval uses it.

    Plain: phi = (ad − bc)/sqrt((a+b)(c+d)(a+c)(b+d)), 0 when a margin is empty.  ``corrected`` (the
    default) shrinks a positive correlation by n/2 in the numerator, phi = max(ad − bc − n/2, 0)/sqrt(...)
    (negative ones are kept), as in Newcombe (1998) and Fagerland, Lydersen & Laake (2014,
    "Recommended tests and confidence intervals for paired binomial proportions"): without it a table with
    no discordant pairs has phi = 1, and the interval shrinks to |asymmetry of the Wilson interval|, which is
    0 at p = 1/2 (a = d = 3 gives a zero-width interval: the defect this interval is here to avoid)."""
    n = a + b + c + d
    den = (a + b) * (c + d) * (a + c) * (b + d)
    if den <= 0:
        return 0.0
    num = a * d - b * c
    if corrected:
        num = num - n / 2.0 if num > n / 2.0 else (0.0 if num >= 0 else num)
    return num / math.sqrt(den)


def newcombe_paired_interval(a: int, b: int, c: int, d: int, confidence: float = 0.95,
                             corrected_phi: bool = True) -> tuple[float, float]:
    """Newcombe's hybrid score interval (1998, method 10: Wilson intervals without continuity correction,
    square-and-add with the correlation) for the difference p1 − p2 of paired proportions, two-sided at
    ``confidence``.

    The 2×2 table counts pairs: ``a`` both 1, ``b`` first 1 and second 0, ``c`` first 0 and second 1,
    ``d`` both 0; p1 = (a + b)/n, p2 = (a + c)/n.  The correlation is ``newcombe_phi`` (``corrected_phi``
    False: the plain phi coefficient).  With the corrected phi the interval keeps a width of order 1/n when
    there are no discordant pairs (b = c = 0) instead of collapsing onto 0."""
    for v in (a, b, c, d):
        if v < 0:
            raise ValueError("counts must be >= 0")
    n = a + b + c + d
    if n == 0:
        raise ValueError("newcombe_paired_interval needs at least one pair")
    phi = newcombe_phi(a, b, c, d, corrected=corrected_phi)
    return newcombe_from_means((a + b) / n, (a + c) / n, n, phi, confidence)

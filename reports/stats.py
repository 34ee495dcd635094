"""Statistics for accuracy comparisons (DESIGN §10).

* one cell's accuracy: a Wilson interval when every question was asked once (K=1, 0/1 scores), a
  Student-t interval over per-question means otherwise (K>1, or fractional scores);
* two cells on the same (item, repeat) keys: mean paired difference, a seeded paired bootstrap CI that
  resamples questions (the repeats of one question stay together), an exact McNemar p-value (K=1,
  binary) or a paired t-test p-value (K>1), the correlation of per-question scores, and a one-sided
  lower confidence bound for non-inferiority;
* Holm's step-down correction across the comparisons of one report.

Pure Python + numpy: the distribution functions (Student t, binomial) are implemented in
``reports.distributions`` so the package does not depend on scipy at run time; tests check them against
scipy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Optional, Sequence

import numpy as np

from kvbench.reports.distributions import betainc, binom_cdf, normal_ppf, t_cdf, t_ppf

__all__ = [
    "Estimate",
    "PairedDelta",
    "normal_ppf",
    "betainc",
    "t_cdf",
    "t_ppf",
    "binom_cdf",
    "wilson_interval",
    "t_interval",
    "estimate",
    "mcnemar_exact",
    "paired_t_pvalue",
    "pearson",
    "holm",
    "bootstrap_means",
    "paired_delta",
    "group_by_question",
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


@dataclass(frozen=True)
class PairedDelta:
    """Candidate − baseline on shared (item, repeat) keys."""

    n_pairs: int
    n_questions: int
    k: int
    base_mean: float
    cand_mean: float
    delta: float
    ci_lo: float  # two-sided paired-bootstrap CI at ``confidence``
    ci_hi: float
    lower_bound: float  # one-sided lower confidence bound at ``confidence``
    p_value: float
    p_method: str  # "mcnemar" | "t"
    correlation: Optional[float]
    base_only: int  # K=1 binary: base right, candidate wrong (McNemar b); else -1
    cand_only: int  # McNemar c; else -1
    confidence: float = 0.95
    bound_method: str = "bootstrap"


def paired_delta(
    base: Mapping[tuple[Hashable, int], float],
    cand: Mapping[tuple[Hashable, int], float],
    confidence: float = 0.95,
    n_boot: int = 10_000,
    seed: int = 0,
    bound_method: str = "bootstrap",
) -> PairedDelta:
    """Paired comparison over the keys present in both mappings (raises when there are none)."""
    if bound_method not in ("bootstrap", "t"):
        raise ValueError(f"bound_method must be 'bootstrap' or 't', got {bound_method!r}")
    if not 0.5 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0.5, 1), got {confidence}")
    keys = sorted(set(base) & set(cand), key=lambda t: (str(t[0]), t[1]))
    if not keys:
        raise ValueError("no shared (item, repeat) keys between the two cells")
    b_vals = {key: float(base[key]) for key in keys}
    c_vals = {key: float(cand[key]) for key in keys}
    if any(math.isnan(v) for v in (*b_vals.values(), *c_vals.values())):
        raise ValueError("scores contain NaN")
    bq = group_by_question(b_vals)
    cq = group_by_question(c_vals)
    items = sorted(bq, key=str)
    k = max(len(v) for v in bq.values())
    b_means = np.array([np.mean(bq[i]) for i in items])
    c_means = np.array([np.mean(cq[i]) for i in items])
    diffs = c_means - b_means
    delta = float(diffs.mean())
    alpha = 1.0 - confidence

    boots = bootstrap_means(diffs, n_boot=n_boot, seed=seed)
    ci_lo, ci_hi = (float(v) for v in np.quantile(boots, [alpha / 2, 1 - alpha / 2]))
    if bound_method == "bootstrap":
        lower = float(np.quantile(boots, alpha))
    else:
        if diffs.size < 2:
            lower = -math.inf
        else:
            se = float(diffs.std(ddof=1)) / math.sqrt(diffs.size)
            lower = delta - t_ppf(confidence, diffs.size - 1) * se

    binary = k == 1 and _is_binary(b_vals.values()) and _is_binary(c_vals.values())
    if binary:
        b_only = sum(1 for key in keys if b_vals[key] == 1.0 and c_vals[key] == 0.0)
        c_only = sum(1 for key in keys if b_vals[key] == 0.0 and c_vals[key] == 1.0)
        p, p_method = mcnemar_exact(b_only, c_only), "mcnemar"
    else:
        b_only = c_only = -1
        p, p_method = paired_t_pvalue(diffs), "t"
    return PairedDelta(
        n_pairs=len(keys),
        n_questions=len(items),
        k=k,
        base_mean=float(b_means.mean()),
        cand_mean=float(c_means.mean()),
        delta=delta,
        ci_lo=ci_lo,
        ci_hi=ci_hi,
        lower_bound=lower,
        p_value=p,
        p_method=p_method,
        correlation=pearson(b_means, c_means),
        base_only=b_only,
        cand_only=c_only,
        confidence=confidence,
        bound_method=bound_method,
    )

"""Statistics for accuracy comparisons (DESIGN §10).

* one cell's accuracy: a Wilson interval when every question was asked once (K=1, 0/1 scores), a
  Student-t interval over per-question means otherwise (K>1, or fractional scores);
* two cells on the same (item, repeat) keys: mean paired difference, a seeded paired bootstrap CI that
  resamples questions (the repeats of one question stay together), an exact McNemar p-value (K=1,
  binary) or a paired t-test p-value (K>1), the correlation of per-question scores, and a one-sided
  lower confidence bound for non-inferiority: Newcombe's hybrid score interval for paired proportions
  when every score is 0/1 (``newcombe_paired_interval``), otherwise the paired bootstrap or t bound,
  which is unknown (−inf) when it cannot be estimated (fewer than 2 questions, or differences without
  spread: a zero-width interval is not evidence);
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
    "newcombe_paired_interval",
    "newcombe_from_means",
    "newcombe_phi",
    "check_confidence",
    "key_mismatch",
    "weighted_mean_upper",
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


def key_mismatch(base: Mapping, cand: Mapping) -> tuple[int, int]:
    """(keys only in ``base``, keys only in ``cand``)."""
    b, c = set(base), set(cand)
    return len(b - c), len(c - b)


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
    ci_lo: float  # two-sided CI at ``confidence``: Newcombe's when bound_method is "newcombe", else paired bootstrap
    ci_hi: float
    lower_bound: float  # one-sided lower confidence bound at ``confidence``
    p_value: float
    p_method: str  # "mcnemar" | "t"
    correlation: Optional[float]
    base_only: int  # K=1 binary: base right, candidate wrong (McNemar b); else -1
    cand_only: int  # McNemar c; else -1
    confidence: float = 0.95
    bound_method: str = "bootstrap"  # "newcombe" (0/1 scores) | "bootstrap" | "t"
    base_unpaired: int = 0  # keys only in the baseline (left out of the comparison)
    cand_unpaired: int = 0  # keys only in the candidate
    upper_bound: float = math.inf  # one-sided upper confidence bound at ``confidence`` (same method as lower_bound)

    @property
    def mismatched(self) -> bool:
        return bool(self.base_unpaired or self.cand_unpaired)


def paired_delta(
    base: Mapping[tuple[Hashable, int], float],
    cand: Mapping[tuple[Hashable, int], float],
    confidence: float = 0.95,
    n_boot: int = 10_000,
    seed: int = 0,
    bound_method: str = "bootstrap",
    strict: bool = False,
) -> PairedDelta:
    """Paired comparison over the keys present in both mappings (raises when there are none).

    Keys present in only one mapping are left out and counted (``base_unpaired``/``cand_unpaired``);
    with ``strict`` a mismatch raises ValueError instead.

    ``lower_bound`` (one-sided at ``confidence``):

    * K=1 and every score 0/1: Newcombe's hybrid score interval for paired proportions
      (``newcombe_paired_interval`` of the 2×2 table, corrected phi; the lower limit of the two-sided
      interval at 1 − 2α); the result's ``bound_method`` is "newcombe" whatever the argument says;
    * otherwise the paired bootstrap or t bound (``bound_method``) over per-question differences;
    * those cannot be estimated with fewer than 2 questions or differences without spread (a zero-width
      interval from identical differences is not evidence about the next items): then 0/1 scores (K>1)
      fall back to the Newcombe interval of the 2×2 table over (item, repeat) pairs, and other scores get
      −inf (unknown; a gate reports it as inconclusive).  The fallback treats the repeats as separate
      pairs; when no pair is discordant that is not optimistic: for a given mean discordance rate, the
      chance of seeing none at all is largest when the rate is the same for every question.

    ``ci_lo``/``ci_hi`` (what the report shows): Newcombe's two-sided interval at ``confidence`` where the
    lower bound is Newcombe's, else the two-sided paired-bootstrap CI."""
    if bound_method not in ("bootstrap", "t"):
        raise ValueError(f"bound_method must be 'bootstrap' or 't', got {bound_method!r}")
    check_confidence(confidence)
    only_b, only_c = key_mismatch(base, cand)
    if strict and (only_b or only_c):
        raise ValueError(f"item sets differ: {only_b} (item, repeat) key(s) only in the baseline, "
                         f"{only_c} only in the candidate")
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
    correlation = pearson(b_means, c_means)

    boots = bootstrap_means(diffs, n_boot=n_boot, seed=seed)
    ci_lo, ci_hi = (float(v) for v in np.quantile(boots, [alpha / 2, 1 - alpha / 2]))
    all_binary = _is_binary(b_vals.values()) and _is_binary(c_vals.values())
    degenerate = diffs.size < 2 or float(diffs.std(ddof=1)) == 0.0
    if all_binary and (k == 1 or degenerate):
        # one-sided at `confidence` = the lower limit of the two-sided interval at 1 − 2α; first = candidate
        n11 = sum(1 for key in keys if c_vals[key] == 1.0 and b_vals[key] == 1.0)
        n10 = sum(1 for key in keys if c_vals[key] == 1.0 and b_vals[key] == 0.0)
        n01 = sum(1 for key in keys if c_vals[key] == 0.0 and b_vals[key] == 1.0)
        n00 = len(keys) - n11 - n10 - n01
        lower, upper = newcombe_paired_interval(n11, n10, n01, n00, 1.0 - 2.0 * alpha)
        used = "newcombe"
        # the two-sided interval the report shows: the same construction (a bootstrap over 0/1 pairs that all
        # agree has zero width)
        ci_lo, ci_hi = newcombe_paired_interval(n11, n10, n01, n00, confidence)
    elif degenerate:
        lower, upper, used = -math.inf, math.inf, bound_method
    elif bound_method == "bootstrap":
        lower, upper, used = float(np.quantile(boots, alpha)), float(np.quantile(boots, 1.0 - alpha)), "bootstrap"
    else:
        se = float(diffs.std(ddof=1)) / math.sqrt(diffs.size)
        half = t_ppf(confidence, diffs.size - 1) * se
        lower, upper, used = delta - half, delta + half, "t"

    binary = k == 1 and all_binary
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
        correlation=correlation,
        base_only=b_only,
        cand_only=c_only,
        confidence=confidence,
        bound_method=used,
        base_unpaired=only_b,
        cand_unpaired=only_c,
        upper_bound=upper,
    )

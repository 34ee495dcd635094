"""Statistics for accuracy comparisons (docs/design.md §10).

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

The interval constructions live in ``reports.intervals``, the p-values, correlation and Holm's correction
in ``reports.significance``, the bootstrap in ``reports.bootstrap``; this module combines them into the
paired comparison (``paired_delta``) and re-exports every public name, so ``stats.X`` keeps working.

Pure Python + numpy: the distribution functions (Student t, binomial) are implemented in
``reports.distributions`` so the package does not depend on scipy at run time; tests check them against
scipy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Optional

import numpy as np

from kvbench.reports.stats.bootstrap import bootstrap_means
from kvbench.reports.stats.distributions import betainc, binom_cdf, normal_ppf, t_cdf, t_ppf
from kvbench.reports.stats.intervals import (
    Estimate,
    _is_binary,
    check_confidence,
    estimate,
    group_by_question,
    newcombe_from_means,
    newcombe_paired_interval,
    newcombe_phi,
    t_interval,
    weighted_mean_upper,
    wilson_interval,
)
from kvbench.reports.stats.significance import holm, mcnemar_exact, paired_t_pvalue, pearson

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


# --------------------------------------------------------------------------- paired comparisons


def key_mismatch(base: Mapping, cand: Mapping) -> tuple[int, int]:
    """(keys only in ``base``, keys only in ``cand``)."""
    b, c = set(base), set(cand)
    return len(b - c), len(c - b)


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
    keys, b_vals, c_vals, only_b, only_c = _shared_scores(base, cand, strict)
    bq = group_by_question(b_vals)
    cq = group_by_question(c_vals)
    items = sorted(bq, key=str)
    k = max(len(v) for v in bq.values())
    b_means = np.array([np.mean(bq[i]) for i in items])
    c_means = np.array([np.mean(cq[i]) for i in items])
    diffs = c_means - b_means
    delta = float(diffs.mean())
    correlation = pearson(b_means, c_means)
    all_binary = _is_binary(b_vals.values()) and _is_binary(c_vals.values())
    lower, upper, used, ci_lo, ci_hi = _bounds(keys, b_vals, c_vals, diffs, k, all_binary, confidence, n_boot, seed,
                                               bound_method)
    b_only, c_only, p, p_method = _significance(keys, b_vals, c_vals, diffs, k == 1 and all_binary)
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


def _shared_scores(base: Mapping, cand: Mapping, strict: bool):
    """``(keys, base scores, candidate scores, base-only count, candidate-only count)`` over the keys present
    in both (sorted); raises on a mismatch under ``strict``, on no shared key, and on NaN scores."""
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
    return keys, b_vals, c_vals, only_b, only_c


def _bounds(keys, b_vals, c_vals, diffs, k: int, all_binary: bool, confidence: float, n_boot: int, seed: int,
            bound_method: str):
    """``(lower, upper, method, ci_lo, ci_hi)``: the one-sided bounds at ``confidence`` and the two-sided
    interval the report shows (``paired_delta``'s docstring says which construction applies when)."""
    delta = float(diffs.mean())
    alpha = 1.0 - confidence
    boots = bootstrap_means(diffs, n_boot=n_boot, seed=seed)
    ci_lo, ci_hi = (float(v) for v in np.quantile(boots, [alpha / 2, 1 - alpha / 2]))
    degenerate = diffs.size < 2 or float(diffs.std(ddof=1)) == 0.0
    if all_binary and (k == 1 or degenerate):
        # one-sided at `confidence` = the lower limit of the two-sided interval at 1 − 2α; first = candidate
        n11 = sum(1 for key in keys if c_vals[key] == 1.0 and b_vals[key] == 1.0)
        n10 = sum(1 for key in keys if c_vals[key] == 1.0 and b_vals[key] == 0.0)
        n01 = sum(1 for key in keys if c_vals[key] == 0.0 and b_vals[key] == 1.0)
        n00 = len(keys) - n11 - n10 - n01
        lower, upper = newcombe_paired_interval(n11, n10, n01, n00, 1.0 - 2.0 * alpha)
        # the two-sided interval the report shows: the same construction (a bootstrap over 0/1 pairs that all
        # agree has zero width)
        ci_lo, ci_hi = newcombe_paired_interval(n11, n10, n01, n00, confidence)
        return lower, upper, "newcombe", ci_lo, ci_hi
    if degenerate:
        return -math.inf, math.inf, bound_method, ci_lo, ci_hi
    if bound_method == "bootstrap":
        return float(np.quantile(boots, alpha)), float(np.quantile(boots, 1.0 - alpha)), "bootstrap", ci_lo, ci_hi
    se = float(diffs.std(ddof=1)) / math.sqrt(diffs.size)
    half = t_ppf(confidence, diffs.size - 1) * se
    return delta - half, delta + half, "t", ci_lo, ci_hi


def _significance(keys, b_vals, c_vals, diffs, binary: bool):
    """``(base_only, cand_only, p, p_method)``: McNemar's exact test on the discordant pairs (K=1, 0/1
    scores; the counts), else the paired t-test over per-question differences (counts -1)."""
    if binary:
        b_only = sum(1 for key in keys if b_vals[key] == 1.0 and c_vals[key] == 0.0)
        c_only = sum(1 for key in keys if b_vals[key] == 0.0 and c_vals[key] == 1.0)
        return b_only, c_only, mcnemar_exact(b_only, c_only), "mcnemar"
    return -1, -1, paired_t_pvalue(diffs), "t"

"""Statistics of the area under the accuracy-vs-context-length curve (``reports/long_context.py`` builds
the report rows on them; it re-exports every name here).

Area under the curve (AUC).  With requested lengths L_1 < … < L_m and per-length mean scores s_i (mean
over questions of the per-question mean score), x_i = log2 L_i and

    AUC = Σ_{i<m} (x_{i+1} − x_i)·(s_i + s_{i+1})/2 / (x_m − x_1),

the trapezoid over log2 length normalised by the log2 span: a mean score in [0, 1] that weighs every
doubling of the context equally.  With one length it is that length's score.  AUC is linear in the s_i
(``auc_weights``), so resampling the questions of each length resamples the AUC.

Intervals (seeded, deterministic):

* one cell's AUC: a percentile bootstrap that resamples questions within each length (the repeats of one
  question stay together, as in ``stats``);
* a candidate against the baseline on shared (item, repeat) keys: a paired bootstrap that draws the same
  questions for both cells within each length and recomputes both per-length means and both AUCs.  It
  gives the two-sided intervals of the per-length and AUC ratios (candidate / baseline: the "recovery";
  undefined when the baseline's mean is 0, and a resample whose baseline mean is 0 counts as +inf when
  the candidate's is > 0 and as 1 when both are 0) and of the AUC delta, and the one-sided lower bound of
  the AUC delta that the gate uses.  A length whose pairs all agree adds no width to that bootstrap however
  few its questions, so for 0/1 scores with such a length the bound and the interval are the more conservative of the
  bootstrap's and the Bonferroni combination Σ w_i·bound_i of Newcombe's per-length intervals at
  confidence 1 − α/m (valid at 1 − α by the union bound); other scores without spread in any length get
  an unknown bound (−inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from kvbench.reports.stats import paired as stats

__all__ = ["auc_weights", "auc", "AucEstimate", "auc_estimate", "PairedAuc", "paired_auc"]

_BIG = 1e300  # stands in for +inf inside quantiles (linear interpolation with inf gives nan)

Key = tuple[str, int]


def auc_weights(lengths) -> np.ndarray:
    """w with AUC = Σ w_i·s_i (trapezoid over log2 length over the log2 span); w ≥ 0, Σ w = 1."""
    ls = [int(n) for n in lengths]
    if not ls or any(n <= 0 for n in ls) or ls != sorted(set(ls)):
        raise ValueError(f"lengths must be distinct, positive and increasing, got {ls}")
    if len(ls) == 1:
        return np.ones(1)
    x = np.log2(np.asarray(ls, dtype=np.float64))
    dx = np.diff(x)
    w = np.zeros(len(ls))
    w[:-1] += dx / 2
    w[1:] += dx / 2
    return w / (x[-1] - x[0])


def auc(means: Mapping[int, float]) -> float:
    """AUC of {length: mean score}."""
    ls = sorted(means)
    return float(auc_weights(ls) @ np.array([float(means[n]) for n in ls]))


def _question_means(scores: Mapping[Key, float]) -> tuple[list, np.ndarray]:
    per_q = stats.group_by_question(scores)
    items = sorted(per_q, key=str)
    return items, np.array([float(np.mean(per_q[i])) for i in items])


def _boot_means(rng: np.random.Generator, cols: list[np.ndarray], n_boot: int, chunk: int = 2000) -> list[np.ndarray]:
    """For each column set (arrays sharing one question axis), ``n_boot`` resampled means, drawing the
    same question indices for every array of a set."""
    n = cols[0].size
    outs = [np.empty(n_boot) for _ in cols]
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))
        for o, a in zip(outs, cols):
            o[start:stop] = a[idx].mean(axis=1)
    return outs


def _quantiles(x: np.ndarray, qs) -> list[float]:
    v = np.quantile(np.where(np.isposinf(x), _BIG, x), qs)
    return [math.inf if q >= _BIG / 10 else float(q) for q in v]


def _ratio(c: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        r = c / b
    return np.where(b > 0, r, np.where(c > 0, math.inf, 1.0))


@dataclass(frozen=True)
class AucEstimate:
    value: float
    lo: float
    hi: float
    lengths: tuple[int, ...]
    confidence: float


def auc_estimate(by_length: Mapping[int, Mapping[Key, float]], confidence: float = 0.95, n_boot: int = 10_000,
                 seed: int = 0) -> AucEstimate:
    """One cell's AUC with a percentile bootstrap interval over questions within each length."""
    stats.check_confidence(confidence)
    ls = sorted(n for n, s in by_length.items() if s)
    if not ls:
        raise ValueError("auc_estimate needs scores at one length at least")
    w = auc_weights(ls)
    rng = np.random.default_rng(seed)
    point, boots = 0.0, np.zeros(n_boot)
    for wi, n in zip(w, ls):
        _, m = _question_means(by_length[n])
        point += wi * float(m.mean())
        boots += wi * _boot_means(rng, [m], n_boot)[0]
    a = 1.0 - confidence
    lo, hi = _quantiles(boots, [a / 2, 1 - a / 2])
    return AucEstimate(point, lo, hi, tuple(ls), confidence)


@dataclass(frozen=True)
class PairedAuc:
    """Candidate against baseline over shared keys, per length and for the AUC (see the module docstring)."""

    lengths: tuple[int, ...]
    base_means: tuple[float, ...]  # per length
    cand_means: tuple[float, ...]
    ratio_ci: tuple[tuple[float, float], ...]  # per length, two-sided bootstrap interval of cand/base
    base_auc: float
    cand_auc: float
    delta: float  # cand_auc − base_auc
    ci_lo: float  # two-sided interval of the delta
    ci_hi: float
    lower_bound: float  # one-sided lower bound of the delta at ``confidence``
    bound_method: str  # "bootstrap" | "newcombe-bonferroni" | "none" (unknown: −inf)
    auc_ratio_ci: tuple[float, float]
    n_pairs: int
    n_questions: int
    confidence: float
    base_unpaired: int = 0
    cand_unpaired: int = 0
    upper_bound: float = math.inf  # one-sided upper bound of the delta at ``confidence`` (as lower_bound)

    @property
    def auc_ratio(self) -> Optional[float]:
        """cand_auc / base_auc; None when the baseline's AUC is 0 (undefined)."""
        return self.cand_auc / self.base_auc if self.base_auc > 0 else None

    def ratio(self, i: int) -> Optional[float]:
        b = self.base_means[i]
        return self.cand_means[i] / b if b > 0 else None

    @property
    def mismatched(self) -> bool:
        return bool(self.base_unpaired or self.cand_unpaired)


def paired_auc(base: Mapping[int, Mapping[Key, float]], cand: Mapping[int, Mapping[Key, float]], confidence: float = 0.95,
               n_boot: int = 10_000, seed: int = 0, strict: bool = False) -> PairedAuc:
    """Paired per-length and AUC comparison of {length: {(item_id, repeat): score}} maps.

    Lengths and keys present on one side only are left out and counted; ``strict`` raises ValueError
    instead.  Raises ValueError when no key is shared."""
    stats.check_confidence(confidence)
    only_b = sum(len(set(base.get(n, {})) - set(cand.get(n, {}))) for n in set(base) | set(cand))
    only_c = sum(len(set(cand.get(n, {})) - set(base.get(n, {}))) for n in set(base) | set(cand))
    if strict and (only_b or only_c):
        raise ValueError(f"item sets differ: {only_b} (item, repeat) key(s) only in the baseline, "
                         f"{only_c} only in the candidate")
    shared = {n: sorted(set(base[n]) & set(cand[n]), key=lambda k: (k[0], k[1])) for n in sorted(set(base) & set(cand))}
    shared = {n: ks for n, ks in shared.items() if ks}
    if not shared:
        raise ValueError("no shared (item, repeat) keys between the two cells")
    ls = sorted(shared)
    w = auc_weights(ls)
    rng = np.random.default_rng(seed)
    b_means, c_means, b_boot, c_boot, degenerate, n_q = [], [], [], [], [], 0
    binary = True
    for n in ls:
        bk = {k: float(base[n][k]) for k in shared[n]}
        ck = {k: float(cand[n][k]) for k in shared[n]}
        vals = [*bk.values(), *ck.values()]
        if any(math.isnan(v) for v in vals):
            raise ValueError("scores contain NaN")
        binary = binary and all(v in (0.0, 1.0) for v in vals)
        _, bm = _question_means(bk)
        _, cm = _question_means(ck)
        n_q += bm.size
        d = cm - bm
        degenerate.append(d.size < 2 or float(d.std(ddof=1)) == 0.0)
        b_means.append(float(bm.mean()))
        c_means.append(float(cm.mean()))
        bb, cb = _boot_means(rng, [bm, cm], n_boot)
        b_boot.append(bb)
        c_boot.append(cb)
    a = 1.0 - confidence
    qs = [a / 2, 1 - a / 2]
    ratio_ci = tuple(tuple(_quantiles(_ratio(cb, bb), qs)) for bb, cb in zip(b_boot, c_boot))
    b_auc_boot = sum(wi * bb for wi, bb in zip(w, b_boot))
    c_auc_boot = sum(wi * cb for wi, cb in zip(w, c_boot))
    deltas = c_auc_boot - b_auc_boot
    base_auc, cand_auc = float(w @ np.array(b_means)), float(w @ np.array(c_means))
    ci_lo, ci_hi = _quantiles(deltas, qs)
    lower, method = (_quantiles(deltas, [a])[0], "bootstrap") if not all(degenerate) else (-math.inf, "none")
    upper = _quantiles(deltas, [1 - a])[0] if not all(degenerate) else math.inf
    if binary and any(degenerate):
        # A length whose pairs all agree adds no width to the bootstrap, however few its questions.  For 0/1
        # scores the Bonferroni-combined Newcombe interval (Σ w_i·bound_i, each at 1 − α/m) is always valid:
        # the reported bound and interval are the more conservative of the two.
        conf_i = 1.0 - a / len(ls)
        one = [stats.paired_delta({k: base[n][k] for k in shared[n]}, {k: cand[n][k] for k in shared[n]},
                                  confidence=conf_i, n_boot=200, seed=seed) for n in ls]
        nc_lower = float(w @ np.array([d.lower_bound for d in one]))
        nc_upper = float(w @ np.array([d.upper_bound for d in one]))
        if not math.isnan(nc_lower) and (method == "none" or nc_lower < lower):
            lower, method = nc_lower, "newcombe-bonferroni"
        if not math.isnan(nc_upper) and (math.isinf(upper) or nc_upper > upper):
            upper = nc_upper
        nc_lo, nc_hi = float(w @ np.array([d.ci_lo for d in one])), float(w @ np.array([d.ci_hi for d in one]))
        if not (math.isnan(nc_lo) or math.isnan(nc_hi)):
            ci_lo, ci_hi = min(ci_lo, nc_lo), max(ci_hi, nc_hi)
    return PairedAuc(
        lengths=tuple(ls), base_means=tuple(b_means), cand_means=tuple(c_means), ratio_ci=ratio_ci,
        base_auc=base_auc, cand_auc=cand_auc, delta=cand_auc - base_auc, ci_lo=ci_lo, ci_hi=ci_hi,
        lower_bound=lower, bound_method=method, auc_ratio_ci=tuple(_quantiles(_ratio(c_auc_boot, b_auc_boot), qs)),
        n_pairs=sum(len(v) for v in shared.values()), n_questions=n_q, confidence=confidence,
        base_unpaired=only_b, cand_unpaired=only_c, upper_bound=upper,
    )

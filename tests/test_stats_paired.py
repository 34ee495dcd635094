"""Paired deltas, bootstrap and per-cell estimates (reports/stats/paired.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from kvbench.reports.stats import paired as stats


def _binary(n, p, seed):
    rng = np.random.default_rng(seed)
    return {(f"q{i}", 0): float(v) for i, v in enumerate(rng.random(n) < p)}


def test_estimate_k1_is_wilson():
    s = _binary(200, 0.4, 0)
    est = stats.estimate(s)
    k = int(sum(s.values()))
    ref = sps.binomtest(k, 200).proportion_ci(method="wilson")
    assert est.method == "wilson" and est.n == 200 and est.k == 1
    assert (est.lo, est.hi) == pytest.approx((ref.low, ref.high))
    assert est.mean == pytest.approx(k / 200)


def test_estimate_k_gt_1_is_t_over_question_means():
    rng = np.random.default_rng(1)
    scores = {(f"q{i}", r): float(rng.random() < 0.3 + 0.02 * i) for i in range(30) for r in range(4)}
    est = stats.estimate(scores)
    means = np.array([np.mean([scores[(f"q{i}", r)] for r in range(4)]) for i in range(30)])
    ref = sps.t.interval(0.95, 29, loc=means.mean(), scale=sps.sem(means))
    assert est.method == "t" and est.n == 30 and est.k == 4
    assert (est.lo, est.hi) == pytest.approx(ref)


def test_estimate_rejects_nan_and_empty():
    with pytest.raises(ValueError):
        stats.estimate({})
    with pytest.raises(ValueError):
        stats.estimate({("a", 0): math.nan, ("b", 0): 1.0})


def test_paired_delta_counts_and_mcnemar():
    base = {(f"q{i}", 0): 1.0 for i in range(20)}
    cand = dict(base)
    for i in range(6):  # 6 regressions, 1 improvement (base wrong on q19)
        cand[(f"q{i}", 0)] = 0.0
    base[("q19", 0)] = 0.0
    d = stats.paired_delta(base, cand, seed=0, n_boot=2000)
    assert (d.base_only, d.cand_only) == (6, 1)
    assert d.p_method == "mcnemar"
    assert d.p_value == pytest.approx(sps.binomtest(1, 7, 0.5).pvalue)
    assert d.delta == pytest.approx((14 - 19) / 20)
    assert d.ci_lo <= d.delta <= d.ci_hi
    assert d.lower_bound <= d.delta
    assert d.n_pairs == 20 and d.n_questions == 20


def test_paired_delta_uses_only_shared_keys_and_rejects_disjoint():
    base = {("a", 0): 1.0, ("b", 0): 0.0, ("c", 0): 1.0}
    cand = {("a", 0): 1.0, ("b", 0): 1.0, ("z", 0): 0.0}
    d = stats.paired_delta(base, cand, n_boot=500)
    assert d.n_pairs == 2 and d.delta == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no shared"):
        stats.paired_delta({("a", 0): 1.0}, {("b", 0): 1.0})


def test_identical_cells_give_zero_delta_and_p_one():
    s = _binary(50, 0.5, 4)
    d = stats.paired_delta(s, dict(s), n_boot=1000)
    ones = int(sum(s.values()))
    # neither the reported interval nor the non-inferiority bound collapses onto 0 without discordant pairs
    # (Newcombe, not the bootstrap)
    assert d.delta == 0.0 and (d.ci_lo, d.ci_hi) == pytest.approx(stats.newcombe_paired_interval(ones, 0, 0, 50 - ones, 0.95))
    assert d.ci_lo < -0.01 and d.ci_hi > 0.01
    assert d.bound_method == "newcombe"
    assert d.lower_bound == pytest.approx(stats.newcombe_paired_interval(ones, 0, 0, 50 - ones, 0.9)[0])
    assert -0.1 < d.lower_bound < -0.01
    assert d.p_value == 1.0
    assert d.correlation == pytest.approx(1.0)


def test_bootstrap_is_seeded_and_matches_normal_approximation():
    rng = np.random.default_rng(5)
    x = rng.normal(0.0, 1.0, size=400)
    a = stats.bootstrap_means(x, n_boot=4000, seed=7)
    b = stats.bootstrap_means(x, n_boot=4000, seed=7)
    c = stats.bootstrap_means(x, n_boot=4000, seed=8)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    # the bootstrap SE of a mean is close to s/sqrt(n)
    assert a.std() == pytest.approx(x.std(ddof=1) / math.sqrt(x.size), rel=0.08)


def test_bootstrap_ci_coverage_near_nominal():
    """Paired bootstrap 90% intervals cover the true difference about 90% of the time."""
    rng = np.random.default_rng(11)
    n, trials, hits = 150, 120, 0
    for t in range(trials):
        base = {(f"q{i}", 0): float(v) for i, v in enumerate(rng.random(n) < 0.6)}
        cand = {k: (v if rng.random() > 0.15 else 1.0 - v) for k, v in base.items()}
        # true delta: flips turn 0.6 into 0.6*0.85 + 0.4*0.15 = 0.57
        d = stats.paired_delta(base, cand, confidence=0.9, n_boot=1000, seed=t)
        hits += d.ci_lo <= -0.03 <= d.ci_hi
    assert 0.80 <= hits / trials <= 0.97


def test_repeats_stay_together_and_t_pvalue_for_k_gt_1():
    rng = np.random.default_rng(6)
    base = {(f"q{i}", r): float(rng.random() < 0.5) for i in range(40) for r in range(3)}
    cand = {k: (0.0 if k[0] in {f"q{i}" for i in range(10)} else v) for k, v in base.items()}
    d = stats.paired_delta(base, cand, n_boot=2000)
    diffs = []
    for i in range(40):
        diffs.append(np.mean([cand[(f"q{i}", r)] - base[(f"q{i}", r)] for r in range(3)]))
    assert d.k == 3 and d.n_questions == 40 and d.n_pairs == 120
    assert d.p_method == "t"
    assert d.p_value == pytest.approx(sps.ttest_1samp(diffs, 0.0).pvalue, rel=1e-8)
    assert d.delta == pytest.approx(np.mean(diffs))


def test_t_lower_bound_matches_scipy():
    rng = np.random.default_rng(9)
    base = {(f"q{i}", 0): float(rng.random()) for i in range(30)}
    cand = {k: v - 0.05 + 0.1 * rng.random() for k, v in base.items()}
    d = stats.paired_delta(base, cand, bound_method="t")
    diffs = np.array([cand[k] - base[k] for k in sorted(base, key=lambda t: t[0])])
    ref = diffs.mean() - sps.t.ppf(0.95, 29) * sps.sem(diffs)
    assert d.lower_bound == pytest.approx(ref, rel=1e-9)

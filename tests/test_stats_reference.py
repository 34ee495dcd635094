"""reports/stats/paired.py against scipy and published reference values."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from kvbench.reports.stats import paired as stats


@pytest.mark.parametrize("df", [1, 2, 3, 7, 29, 120, 1000])
@pytest.mark.parametrize("p", [0.001, 0.025, 0.05, 0.3, 0.5, 0.9, 0.975, 0.9995])
def test_t_ppf_and_cdf_match_scipy(df, p):
    q = stats.t_ppf(p, df)
    assert q == pytest.approx(sps.t.ppf(p, df), rel=1e-9, abs=1e-9)
    assert stats.t_cdf(q, df) == pytest.approx(p, rel=1e-9)


@pytest.mark.parametrize("a,b,x", [(0.5, 0.5, 0.3), (2, 3, 0.7), (10, 0.5, 0.99), (50, 40, 0.55), (1, 1, 0.2)])
def test_betainc_matches_scipy(a, b, x):
    from scipy.special import betainc

    assert stats.betainc(a, b, x) == pytest.approx(betainc(a, b, x), rel=1e-10)


@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (10, 10), (37, 50), (1, 1), (500, 1319)])
@pytest.mark.parametrize("conf", [0.9, 0.95, 0.99])
def test_wilson_matches_scipy(k, n, conf):
    ref = sps.binomtest(k, n).proportion_ci(confidence_level=conf, method="wilson")
    lo, hi = stats.wilson_interval(k, n, conf)
    assert lo == pytest.approx(ref.low, abs=1e-12)
    assert hi == pytest.approx(ref.high, abs=1e-12)


def test_wilson_known_value():
    # 81 successes of 263: a textbook example (Wilson 95% CI 0.2553 to 0.3662)
    lo, hi = stats.wilson_interval(81, 263)
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)


def test_wilson_rejects_bad_input():
    with pytest.raises(ValueError):
        stats.wilson_interval(5, 0)
    with pytest.raises(ValueError):
        stats.wilson_interval(11, 10)


def test_t_interval_matches_scipy():
    rng = np.random.default_rng(1)
    x = rng.random(17)
    m, lo, hi = stats.t_interval(x, 0.95)
    ref = sps.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=sps.sem(x))
    assert (lo, hi) == pytest.approx(ref, rel=1e-9)
    assert m == pytest.approx(x.mean())


@pytest.mark.parametrize("b,c", [(0, 0), (0, 5), (3, 9), (10, 10), (1, 20), (40, 61)])
def test_mcnemar_exact_matches_binomtest(b, c):
    ref = 1.0 if b + c == 0 else sps.binomtest(b, b + c, 0.5).pvalue
    assert stats.mcnemar_exact(b, c) == pytest.approx(ref, rel=1e-10)


def test_mcnemar_known_value():
    # b=1, c=9: exact two-sided p = 2 * (1 + 10) / 1024
    assert stats.mcnemar_exact(1, 9) == pytest.approx(22 / 1024)


def test_paired_t_pvalue_matches_scipy():
    rng = np.random.default_rng(2)
    d = rng.normal(0.1, 0.3, size=25)
    assert stats.paired_t_pvalue(d) == pytest.approx(sps.ttest_1samp(d, 0.0).pvalue, rel=1e-8)


def test_holm_reference_values():
    # R: p.adjust(c(0.01, 0.02, 0.03, 0.04, 0.05), "holm") -> 0.05 0.08 0.09 0.09 0.09
    assert stats.holm([0.01, 0.02, 0.03, 0.04, 0.05]) == pytest.approx([0.05, 0.08, 0.09, 0.09, 0.09])
    # order is preserved, None passes through, values cap at 1
    assert stats.holm([0.04, None, 0.01, 0.6]) == pytest.approx([0.08, None, 0.03, 0.6])
    assert stats.holm([0.5, 0.6]) == [1.0, 1.0]


def test_pearson_matches_numpy_and_constant_is_none():
    rng = np.random.default_rng(3)
    x, y = rng.random(30), rng.random(30)
    assert stats.pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert stats.pearson([1, 1, 1], [0, 1, 0]) is None


def test_binom_cdf_matches_scipy():
    for k, n in [(0, 5), (3, 20), (100, 250)]:
        assert stats.binom_cdf(k, n) == pytest.approx(sps.binom.cdf(k, n, 0.5), rel=1e-10)

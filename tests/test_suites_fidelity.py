"""Fidelity metrics and the fidelity suite, against a deterministic fake model with known perturbations."""

from __future__ import annotations

import numpy as np
import pytest

from kvbench.core.records import ITEM_FIELDS
from kvbench.suites.base import SuiteOptions
from kvbench.suites.fake import VOCAB, FakeClient
from kvbench.suites.fidelity.suite import FidelitySuite, Reference
from kvbench.suites.fidelity.metrics import first_divergence, kl_full, kl_topk_overlap, kl_topk_tail, pooled_summary
from kvbench.suites.fidelity.ref import Text, topk_from_full

SCORE_KEYS = {"kl_mean", "kl_p99", "kl_max", "top1_agree", "nll_ref", "nll_cand", "ppl_ref", "ppl_cand", "first_divergence", "n_tokens"}


def _logsoftmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _kl_float64_reference(p_lp, q_lp):
    """Straight from the definition, one row at a time."""
    out = []
    for a, b in zip(p_lp, q_lp):
        out.append(sum(np.exp(x) * (x - y) for x, y in zip(a.tolist(), b.tolist())))
    return np.array(out)


def test_kl_full_against_definition():
    rng = np.random.default_rng(123)
    p, q = _logsoftmax(rng.standard_normal((5, 40)) * 3), _logsoftmax(rng.standard_normal((5, 40)) * 3)
    got = kl_full(p, q)
    ref = _kl_float64_reference(p, q)
    assert np.all(np.isfinite(got))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-12
    assert np.allclose(kl_full(p, p), 0.0)


@pytest.mark.parametrize("k", [8, 32, 64])
def test_topk_tail_is_close_lower_bound_of_exact(k):
    """Peaked rows like a language model's: the top-k + tail KL never exceeds the exact KL and is close."""
    rng = np.random.default_rng(k)
    V = 500
    base = rng.standard_normal((64, V)) * 4.0
    p = _logsoftmax(base)
    q = _logsoftmax(base + rng.standard_normal((64, V)) * 0.3)
    exact = kl_full(p, q)
    ids, top = topk_from_full(p, k)
    approx = kl_topk_tail(top, np.take_along_axis(q, ids, axis=-1))
    assert np.all(approx <= exact + 1e-12)
    rel = abs(approx.mean() - exact.mean()) / exact.mean()
    assert rel < {8: 0.5, 32: 0.2, 64: 0.1}[k], rel
    # and the overlap bound (candidate reports only its own top-k) is a lower bound too
    cids, ctop = topk_from_full(q, k)
    overlap = kl_topk_overlap(ids, top, cids, ctop)
    assert np.all(overlap <= exact + 1e-12)
    assert overlap.mean() > 0.3 * exact.mean()


def test_topk_tail_detects_large_shift():
    p = _logsoftmax(np.array([[5.0, 1.0, 0.0, -1.0]]))
    q = _logsoftmax(np.array([[0.0, 5.0, 1.0, -1.0]]))
    ids, top = topk_from_full(p, 2)
    approx = kl_topk_tail(top, np.take_along_axis(q, ids, axis=-1))
    assert approx[0] > 1.0 and approx[0] <= kl_full(p, q)[0] + 1e-12


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 4], 8) == 2
    assert first_divergence([1, 2, 3], [1, 2, 3], 8) == 8  # no divergence inside the window
    assert first_divergence([1, 2], [1, 2, 3], 8) == 2
    assert first_divergence([], [5], 8) == 0


def _texts(opts):
    rng = np.random.default_rng(7)
    words = ["apples", "cost", "3 dollars", "each;", "so", "7 cost", "21.", "#### 21"]
    out = []
    for i in range(4):
        cont = " " + " ".join(rng.choice(words, size=12))
        out.append(Text(f"t{i}", f"Question: item {i} asks something?\nAnswer:", cont))
    return out[: opts.limit or 4]


def _suite(tmp_path, exact=False, k=64, cache=True):
    ref_clients = []

    def make():
        c = FakeClient(seed=0)
        ref_clients.append(c)
        return c

    s = FidelitySuite(Reference("fake-ref", make), tmp_path / "cache" if cache else None, top_k=k, greedy_tokens=16, exact=exact, texts=_texts)
    return s, ref_clients


def test_identical_candidate_scores_perfectly(tmp_path):
    suite, _ = _suite(tmp_path)
    res = suite.run(FakeClient(seed=0), SuiteOptions(progress=False, concurrency=2))
    assert len(res.records) == 4
    for r in res.records:
        assert set(r) == set(ITEM_FIELDS) | {"by_position"}  # per-bucket sums (fidelity by position)
        assert SCORE_KEYS <= set(r["scores"])
        assert r["correct"] is None and r["suite"] == "fidelity"
        assert r["scores"]["kl_max"] < 1e-6 and r["scores"]["top1_agree"] == 1.0
        assert r["scores"]["first_divergence"] == 16.0
        assert r["scores"]["nll_ref"] == pytest.approx(r["scores"]["nll_cand"], abs=1e-6)
    assert res.summary["kl_mean"] < 1e-6 and res.summary["n"] == 4


def test_perturbed_candidate_and_cache(tmp_path):
    suite, refs = _suite(tmp_path)
    small = suite.run(FakeClient(seed=0, noise=0.05), SuiteOptions(progress=False))
    assert len(refs) == 1 and refs[0].closed  # reference computed once and closed
    big = suite.run(FakeClient(seed=0, noise=1.0), SuiteOptions(progress=False))
    assert len(refs) == 1  # second run: reference from the cache, no new reference client
    assert 0 < small.summary["kl_mean"] < big.summary["kl_mean"]
    assert small.summary["top1_agree"] >= big.summary["top1_agree"]
    assert big.summary["top1_agree"] < 1.0
    assert big.summary["kl_p99"] >= big.summary["kl_mean"] and big.summary["kl_max"] >= big.summary["kl_p99"]
    assert abs(big.summary["ppl_cand"] - big.summary["ppl_ref"]) > 0
    assert big.summary["first_divergence"] < 16
    assert all("kl=top64+tail" in r["protocol"] for r in big.records)


def test_exact_mode_matches_approximation(tmp_path):
    """Full-vocabulary KL (both clients in-process) against the cached top-k + tail approximation."""
    cand = FakeClient(seed=0, noise=0.3)
    exact_suite, _ = _suite(tmp_path / "a", exact=True, k=32)
    ex = exact_suite.run(cand, SuiteOptions(progress=False))
    approx_suite, _ = _suite(tmp_path / "b", exact=False, k=32)
    ap = approx_suite.run(cand, SuiteOptions(progress=False))
    for re_, ra in zip(ex.records, ap.records):
        assert "kl=full" in re_["protocol"]
        e, a = re_["scores"]["kl_mean"], ra["scores"]["kl_mean"]
        assert a <= e + 1e-9 and abs(a - e) / e < 0.15
        assert re_["scores"]["kl_mean_topk"] == pytest.approx(a, rel=1e-9)
        assert re_["scores"]["top1_agree"] == ra["scores"]["top1_agree"]
    assert ap.summary["kl_mean"] == pytest.approx(ex.summary["kl_mean_topk"], rel=1e-9)  # both token-weighted
    # exact KL equals an independent computation for the first text
    t = _texts(SuiteOptions())[0]
    from kvbench.core.client import ScoreRequest

    r = FakeClient(seed=0).score(ScoreRequest(t.context, t.continuation, full_distribution=True))
    c = cand.score(ScoreRequest(t.context, t.continuation, full_distribution=True))
    want = _kl_float64_reference(r.full_logprobs.astype(np.float64), c.full_logprobs.astype(np.float64)).mean()
    assert ex.records[0]["scores"]["kl_mean"] == pytest.approx(want, rel=1e-5)


def test_topk_only_candidate_uses_overlap(tmp_path):
    suite, _ = _suite(tmp_path, k=VOCAB)
    res = suite.run(FakeClient(seed=0, noise=0.3, full_distribution=False), SuiteOptions(progress=False))
    full = _suite(tmp_path / "f", k=VOCAB)[0].run(FakeClient(seed=0, noise=0.3), SuiteOptions(progress=False))
    assert all("kl=topk-overlap" in r["protocol"] for r in res.records)
    # the candidate reports only its top-20 (the API limit): a lower bound of the full-row figure, and close
    assert all(r["scores"]["kl_mean"] <= f["scores"]["kl_mean"] + 1e-9 for r, f in zip(res.records, full.records))
    assert res.summary["kl_mean"] > 0.7 * full.summary["kl_mean"]


def test_pooled_summary_is_token_weighted():
    s = pooled_summary([np.array([1.0]), np.array([0.0, 0.0, 0.0])], [np.ones(1), np.zeros(3)], [np.zeros(1), np.zeros(3)], [np.zeros(1), np.zeros(3)], [2, 4])
    assert s["kl_mean"] == pytest.approx(0.25) and s["top1_agree"] == pytest.approx(0.25)
    assert s["first_divergence"] == 3.0 and s["n_tokens"] == 4.0

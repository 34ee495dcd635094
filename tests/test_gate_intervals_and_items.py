"""Gate defects: silently shrunk item sets, zero-width intervals, three KL means, threshold ranges."""

from __future__ import annotations

import json
import math
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps
from typer.testing import CliRunner

from kvbench.harness.cell_work import DefaultWork
from kvbench.harness.cli import app
from kvbench.harness.runner import run_sweep
from kvbench.core.store import RunStore
from kvbench.core.io import read_jsonl
from kvbench.harness.sweep.config import parse_config
from kvbench.harness.targets import TargetSession
from kvbench.reports.stats import paired as stats
from kvbench.reports.analysis import _fidelity, analyze
from kvbench.reports.gate.check import GateError, GateThresholds, gate_one, run_gate
from kvbench.reports.load import CellData, load_run
from kvbench.suites.fidelity import metrics as fm
from kvbench.suites.fake import FakeClient

sys.path.insert(0, str(Path(__file__).parent))
from test_reports_load import make_run  # noqa: E402


def gate(*args):  # with the workflow-command lines these tests read (off GitHub Actions too)
    r = CliRunner().invoke(app, ["gate", "--annotations", *map(str, args)])
    return r.exit_code, r.stdout + r.stderr


def _cell(key, correct, invalid=None, truncated=None, scores=None):
    items = []
    for i, ok in enumerate(correct):
        rec = {"suite": "gsm8k", "item_id": str(i), "repeat": 0, "correct": ok,
               "invalid": bool(invalid[i]) if invalid else False,
               "finish_reason": "length" if truncated and truncated[i] else "stop"}
        if scores is not None:
            rec["scores"] = {"f1": scores[i]}
        items.append(rec)
    return CellData(key=key, label=key, config={"kv_dtype": key}, status="done", items=items, short=key)


# ------------------------------------------------------------------------------ 1. item sets


@pytest.fixture(scope="module")
def mismatched_run(tmp_path_factory):
    root = make_run(tmp_path_factory.mktemp("mis") / "run", drops={"bf16": 0.0, "fp8_e4m3": 0.0},
                    concurrency=(1,), aa=False, n_gsm8k=40, n_aime=5)
    store = RunStore(root)
    for ref in store.cells():
        if ref.config["kv_dtype"] == "fp8_e4m3":
            recs = read_jsonl(ref.path / "items.jsonl")
            gsm = [r for r in recs if r["suite"] == "gsm8k"]
            drop = {r["item_id"] for r in gsm[:3]}
            extra = dict(gsm[5], item_id="not-in-baseline")
            store.write_items(ref.key, [r for r in recs if r.get("item_id") not in drop] + [extra])
    return root


def test_gate_refuses_mismatched_item_sets(mismatched_run):
    code, out = gate(mismatched_run, "--candidate", "kv_dtype=fp8_e4m3", "--max-drop", "0.5")
    assert code == 2, out
    err = [l for l in out.splitlines() if l.startswith("::error")]
    assert len(err) == 1 and "missing data" in err[0]
    assert "3 only in the baseline, 1 only in the candidate" in err[0]


def test_rate_check_is_not_dropped_on_mismatch():
    from kvbench.reports.gate.check import _rate_check

    base = _cell("bf16", [True] * 10)
    cand = _cell("fp8", [True] * 10)
    for r in cand.items[:4]:
        r.pop("invalid")  # candidate records no invalid flag for 4 items
    with pytest.raises(GateError, match="4 only in the baseline, 0 only in the candidate"):
        _rate_check(base, cand, "gsm8k", "invalid", "invalid rate", 0.05, GateThresholds())
    for r in base.items + cand.items:
        r.pop("invalid", None)
    assert _rate_check(base, cand, "gsm8k", "invalid", "invalid rate", 0.05, GateThresholds()) is None  # neither records it


def test_paired_delta_counts_unpaired_keys_and_strict_raises():
    base = {("a", 0): 1.0, ("b", 0): 0.0, ("c", 0): 1.0}
    cand = {("a", 0): 1.0, ("b", 0): 1.0, ("z", 0): 0.0}
    d = stats.paired_delta(base, cand, n_boot=200)
    assert (d.base_unpaired, d.cand_unpaired, d.n_pairs) == (1, 1, 2) and d.mismatched
    with pytest.raises(ValueError, match="1 .* only in the baseline, 1 only in the candidate"):
        stats.paired_delta(base, cand, n_boot=200, strict=True)


def test_report_warns_about_mismatched_items(mismatched_run, caplog):
    data = load_run(mismatched_run)
    base = [c for c in data.cells if c.config["kv_dtype"] == "bf16" and c.items][0]
    with caplog.at_level("WARNING", logger="kvbench.report"):
        a = analyze(data.cells, lambda c: base, baseline=base, n_boot=200)
    gsm = [r for r in a.deltas if r.suite == "gsm8k"][0]
    assert (gsm.d.base_unpaired, gsm.d.cand_unpaired) == (3, 1)
    assert any("3 (item, repeat) key(s) only in the baseline and 1 only in the cell" in w for w in a.warnings)
    assert any("item sets differ" in m for m in caplog.messages)
    r = CliRunner().invoke(app, ["report", str(mismatched_run), "--out", str(mismatched_run / "rep"), "--bootstrap", "200"])
    assert r.exit_code == 0, r.stdout
    md = (mismatched_run / "rep" / "report.md").read_text()  # the warning is in the report itself, before the numbers
    assert md.index("## Warnings") < md.index("## Summary") and "only in the baseline" in md
    assert "<h2>Warnings</h2>" in (mismatched_run / "rep" / "report.html").read_text()


# ------------------------------------------------------------------------------ 2. zero-width intervals


@pytest.mark.parametrize("right", [0, 3, 6])
def test_all_concordant_small_binary_does_not_pass(right):
    base = _cell("bf16", [True] * right + [False] * (6 - right))
    cand = _cell("fp8", [True] * right + [False] * (6 - right))
    t = GateThresholds(default_max_drop=0.10, n_boot=500)
    for method in ("bootstrap", "t"):
        checks = gate_one(base, cand, GateThresholds(default_max_drop=0.10, n_boot=500, method=method))
        acc = [c for c in checks if c.kind == "accuracy"][0]
        assert acc.delta == 0.0 and acc.bound < -0.10 and acc.passed is False and acc.inconclusive
        rates = [c for c in checks if c.kind in ("invalid rate", "truncation rate")]
        assert rates and all(c.passed is False and c.inconclusive and c.bound > 0.05 for c in rates)
    assert t.validate()


def test_all_concordant_large_binary_passes():
    rng = np.random.default_rng(3)
    ok = list(rng.random(2000) < 0.5)
    checks = gate_one(_cell("bf16", ok), _cell("fp8", ok), GateThresholds(n_boot=500))
    assert all(c.passed for c in checks if c.gated)
    acc = [c for c in checks if c.kind == "accuracy"][0]
    assert -0.005 < acc.bound < 0.0


def test_degenerate_non_binary_differences_are_inconclusive():
    scores = [0.25, 0.5, 0.75, 0.5, 0.25, 1.0]
    base = _cell("bf16", [True] * 6, scores=scores)
    cand = _cell("fp8", [True] * 6, scores=scores)
    for method in ("bootstrap", "t"):
        d = stats.paired_delta(dict(((str(i), 0), v) for i, v in enumerate(scores)),
                               dict(((str(i), 0), v) for i, v in enumerate(scores)), n_boot=200, bound_method=method)
        assert d.lower_bound == -math.inf and d.bound_method == method
        t = GateThresholds(metrics=["gsm8k:f1"], n_boot=200, method=method)
        acc = [c for c in gate_one(base, cand, t) if c.kind == "accuracy"][0]
        assert acc.passed is False and acc.inconclusive
    # a constant non-zero shift is no evidence either
    d = stats.paired_delta({(str(i), 0): v for i, v in enumerate(scores)},
                           {(str(i), 0): v - 0.01 for i, v in enumerate(scores)}, n_boot=200)
    assert d.lower_bound == -math.inf
    # one question: unknown
    assert stats.paired_delta({("a", 0): 0.3}, {("a", 0): 0.4}, n_boot=100).lower_bound == -math.inf


def test_k_gt_1_binary_without_spread_uses_newcombe_over_pairs():
    base = {(f"q{i}", r): float(i % 2) for i in range(30) for r in range(4)}
    d = stats.paired_delta(base, dict(base), n_boot=200)
    assert d.k == 4 and d.bound_method == "newcombe"
    assert d.lower_bound == pytest.approx(stats.newcombe_paired_interval(60, 0, 0, 60, 0.9)[0])
    # with spread, K>1 keeps the bootstrap / t bound over per-question means
    cand = {k: (0.0 if k[0] in ("q1", "q3") and k[1] == 0 else v) for k, v in base.items()}
    assert stats.paired_delta(base, cand, n_boot=200).bound_method == "bootstrap"
    assert stats.paired_delta(base, cand, bound_method="t").bound_method == "t"


# ------------------------------------------------------------------------------ Newcombe's interval


def _newcombe_reference(a, b, c, d, conf, corrected):
    """Independent evaluation: scipy's Wilson intervals, numpy's correlation, the square-and-add formula."""
    n = a + b + c + d
    p1, p2 = (a + b) / n, (a + c) / n
    w1 = sps.binomtest(a + b, n).proportion_ci(conf, method="wilson")
    w2 = sps.binomtest(a + c, n).proportion_ci(conf, method="wilson")
    x = np.array([1] * a + [1] * b + [0] * c + [0] * d, dtype=float)  # first member of each pair
    y = np.array([1] * a + [0] * b + [1] * c + [0] * d, dtype=float)  # second member
    if x.std() == 0 or y.std() == 0:
        phi = 0.0
    else:
        phi = float(np.corrcoef(x, y)[0, 1])
        if corrected:
            ad_bc = a * d - b * c
            scale = phi / ad_bc if ad_bc else 1 / math.sqrt((a + b) * (c + d) * (a + c) * (b + d))
            phi = (ad_bc - n / 2) * scale if ad_bc > n / 2 else (0.0 if ad_bc >= 0 else phi)
    lo = p1 - p2 - math.sqrt((p1 - w1.low) ** 2 - 2 * phi * (p1 - w1.low) * (w2.high - p2) + (w2.high - p2) ** 2)
    hi = p1 - p2 + math.sqrt((w1.high - p1) ** 2 - 2 * phi * (w1.high - p1) * (p2 - w2.low) + (p2 - w2.low) ** 2)
    return lo, hi


def test_newcombe_worked_example_by_hand():
    # a=12, b=9, c=2, d=21 (n=44): p1 = 21/44, p2 = 14/44, D = 7/44; plain phi = 234/sqrt(21*23*14*30)
    lo, hi = stats.newcombe_paired_interval(12, 9, 2, 21, 0.95, corrected_phi=False)
    assert (lo, hi) == pytest.approx((0.01821, 0.28916), abs=5e-5)
    assert (lo, hi) == pytest.approx(_newcombe_reference(12, 9, 2, 21, 0.95, False), rel=1e-9)
    # the default (n/2-corrected phi = 212/sqrt(...)) is a little wider
    lo_c, hi_c = stats.newcombe_paired_interval(12, 9, 2, 21)
    assert (lo_c, hi_c) == pytest.approx(_newcombe_reference(12, 9, 2, 21, 0.95, True), rel=1e-9)
    assert lo_c < lo and hi_c > hi and (lo_c, hi_c) == pytest.approx((0.01124, 0.29537), abs=5e-5)


@pytest.mark.parametrize("table", [(12, 9, 2, 21), (1, 1, 7, 12), (59, 6, 16, 80), (0, 3, 1, 0), (5, 0, 0, 1),
                                   (40, 2, 0, 3), (0, 0, 0, 9), (10, 0, 0, 0)])
@pytest.mark.parametrize("conf", [0.9, 0.95, 0.99])
@pytest.mark.parametrize("corrected", [True, False])
def test_newcombe_matches_independent_evaluation(table, conf, corrected):
    got = stats.newcombe_paired_interval(*table, conf, corrected_phi=corrected)
    assert got == pytest.approx(_newcombe_reference(*table, conf, corrected), rel=1e-9, abs=1e-12)
    n = sum(table)
    d = (table[1] - table[2]) / n
    assert -1 <= got[0] <= d <= got[1] <= 1


def test_newcombe_without_discordant_pairs_keeps_a_width():
    z = sps.norm.ppf(0.975)
    # b = c = 0 with an empty margin: phi = 0, the limits are ± the Wilson upper limit of 0/n = z²/(n + z²)
    for n in (6, 20):
        lo, hi = stats.newcombe_paired_interval(0, 0, 0, n)
        assert hi == pytest.approx(z * z / (n + z * z), rel=1e-9) and lo == pytest.approx(-hi, rel=1e-9)
    # a = d = 3: the plain phi is 1 and the plain interval collapses onto 0; the corrected phi (ad − n/2)/ad = 2/3
    plain = stats.newcombe_paired_interval(3, 0, 0, 3, corrected_phi=False)
    assert abs(plain[0]) < 1e-6 and abs(plain[1]) < 1e-6
    w = sps.binomtest(3, 6).proportion_ci(0.95, method="wilson")
    half = (0.5 - w.low) * math.sqrt(2 - 2 * (2 / 3))
    assert stats.newcombe_paired_interval(3, 0, 0, 3) == pytest.approx((-half, half), rel=1e-9)
    assert half > 0.2


def test_newcombe_coverage_near_nominal():
    """One-sided 95% lower bounds of paired_delta hold the true difference about 95% of the time."""
    rng = np.random.default_rng(1)
    n, trials, hits = 80, 400, 0
    for _ in range(trials):
        base = rng.random(n) < 0.7
        flip = rng.random(n) < 0.1  # 10% of the answers change, 30/70 in the two directions
        cand = np.where(flip, ~base, base)
        true_delta = 0.1 * (0.3 - 0.7)
        d = stats.paired_delta({(str(i), 0): float(v) for i, v in enumerate(base)},
                               {(str(i), 0): float(v) for i, v in enumerate(cand)}, n_boot=100)
        hits += d.lower_bound <= true_delta
    assert 0.92 <= hits / trials <= 0.995


# ------------------------------------------------------------------------------ 3. one KL definition


def _fid_cell(key, texts, with_summary=True):
    rng = np.random.default_rng(0)
    items, kls, top1s, refs, cands = [], [], [], [], []
    for i, n_tok in enumerate(texts):
        kl = rng.gamma(0.5, 0.02 * (i + 1), size=n_tok)
        top1 = (rng.random(n_tok) < 0.9).astype(float)
        ref = -rng.random(n_tok)
        cand = ref - 0.01 * rng.random(n_tok)
        items.append({"suite": "fidelity", "item_id": f"t{i}", "repeat": 0, "correct": None, "invalid": False,
                      "finish_reason": "stop", "scores": fm.item_scores(kl, top1, ref, cand, 5)})
        kls.append(kl), top1s.append(top1), refs.append(ref), cands.append(cand)
    pooled = fm.pooled_summary(kls, top1s, refs, cands, [5] * len(texts))
    summary = {"suites": {"fidelity": pooled}} if with_summary else {"suites": {}}
    return CellData(key=key, label=key, config={"kv_dtype": key}, status="done", items=items, summary=summary,
                    short=key), pooled, np.concatenate(kls)


def test_kl_mean_means_one_thing():
    cell, pooled, every_token = _fid_cell("fp8", [10, 200, 35, 90])
    row = _fidelity(cell)
    per_text = [r["scores"]["kl_mean"] for r in cell.items]
    assert pooled["kl_mean"] == pytest.approx(every_token.mean(), rel=1e-12)
    assert row.kl_mean == pytest.approx(pooled["kl_mean"], rel=1e-12)
    assert abs(np.mean(per_text) - pooled["kl_mean"]) > 1e-3  # the unweighted mean is a different number
    base = _cell("bf16", [True] * 4)
    cand = _cell("fp8", [True] * 4)
    cand.items += cell.items
    kl = [c for c in gate_one(base, cand, GateThresholds(max_kl_mean=1.0, n_boot=200)) if c.kind == "fidelity KL"][0]
    assert kl.cand_value == pytest.approx(pooled["kl_mean"], rel=1e-12)
    assert kl.bound > kl.cand_value


def test_kl_p99_means_one_thing():
    cell, pooled, every_token = _fid_cell("fp8", [10, 200, 35, 90])
    row = _fidelity(cell)
    assert row.kl_p99 == pytest.approx(np.percentile(every_token, 99), rel=1e-12) == pooled["kl_p99"]
    assert row.kl_p99_text_mean == pytest.approx(np.mean([r["scores"]["kl_p99"] for r in cell.items]))
    bare, _, _ = _fid_cell("fp8", [10, 200], with_summary=False)
    assert math.isnan(_fidelity(bare).kl_p99)  # no pooled value: no "KL p99" rather than another quantity


def test_weighted_mean_upper():
    x = [0.1, 0.3, 0.2, 0.5]
    m, ub = stats.weighted_mean_upper(x, [1, 1, 1, 1], 0.95)
    assert m == pytest.approx(np.mean(x))
    assert ub == pytest.approx(np.mean(x) + sps.t.ppf(0.95, 3) * sps.sem(x), rel=1e-9)
    m, ub = stats.weighted_mean_upper(x, [1, 2, 3, 4], 0.9)
    assert m == pytest.approx(np.average(x, weights=[1, 2, 3, 4])) and ub > m
    assert stats.weighted_mean_upper([0.2], [7])[1] == math.inf


class _FidelityWork(DefaultWork):
    """The real fidelity suite (through ``DefaultWork``) on the fake bigram model; a fake load."""

    def load(self, base_url, model_id, cell):
        return {"duration_s": 1.0}, []


@contextmanager
def _fake_opener(spec, cell_config, engine_kwargs, log_path, **_):
    noise = {"bf16": 0.0, "fp8_e4m3": 0.4}[cell_config["kv_dtype"]]  # the "quantized" cache perturbs the logits
    client = FakeClient(seed=0, noise=noise, responder=lambda req: "#### 7")  # same answers in both cells
    yield TargetSession(client, "fake-bigram", url="http://fake",
                        capacity=lambda: None, flush=lambda: None, log_path=None)


def test_sweep_written_kl_numbers_agree(tmp_path):
    """KL mean / p99 as the sweep writes them to summary.json, the report's fidelity row and the gate's JSON
    are one number each (a run written by the real runner and fidelity suite on a fake model)."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    rows = [{"question": f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?",
             "answer": f"He has {i} + {i + 3} = {2 * i + 3} apples.\n#### {2 * i + 3}"} for i in range(5)]
    (data_dir / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sweep = parse_config({
        "name": "kl", "axes": {"kv": [{"dtype": "bf16", "scales": "unit"}, {"dtype": "fp8_e4m3", "scales": "unit"}],
                               "concurrency": [1]},
        "suites": [{"name": "gsm8k_chat", "limit": 5}, {"name": "fidelity", "limit": 5, "params": {"top_k": 16, "greedy_tokens": 4}}],
        "load": {"num_prompts": 1}, "baseline": {"kv_dtype": "bf16"}, "aa_control": False,
        "data_dir": str(data_dir),
    })
    run = tmp_path / "run"
    outcome = run_sweep(sweep, run, work=_FidelityWork(sweep), progress=False, opener=_fake_opener)
    assert outcome.ok, outcome

    data = load_run(run)
    cand = [c for c in data.cells if c.config["kv_dtype"] == "fp8_e4m3" and c.items][0]
    summary = json.loads((run / "cells" / cand.key / "summary.json").read_text())["suites"]["fidelity"]
    recs = [r for r in read_jsonl(run / "cells" / cand.key / "items.jsonl") if r["suite"] == "fidelity"]
    assert len(recs) == 5 and summary["n"] == 5
    # the pooled (token-weighted) mean differs from the plain mean over texts: the check can tell them apart
    per_text = np.mean([r["scores"]["kl_mean"] for r in recs])
    assert summary["kl_mean"] > 0.01 and abs(per_text - summary["kl_mean"]) > 1e-6 * summary["kl_mean"]
    n_tok = np.array([r["scores"]["n_tokens"] for r in recs])
    weighted = float(np.sum(n_tok * [r["scores"]["kl_mean"] for r in recs]) / n_tok.sum())
    assert summary["kl_mean"] == pytest.approx(weighted, rel=1e-9)

    row = _fidelity(cand)
    assert row.kl_mean == pytest.approx(summary["kl_mean"], rel=1e-9)
    assert row.kl_p99 == pytest.approx(summary["kl_p99"], rel=1e-12)
    assert summary["kl_p99"] > summary["kl_mean"]

    js = tmp_path / "gate.json"
    for max_kl, passed in ((10.0, True), (summary["kl_mean"] / 2, False)):  # a maximum below the mean fails
        code, out = gate(run, "--candidate", "kv_dtype=fp8_e4m3", "--max-kl", max_kl, "--json", js)
        assert code != 2, out  # the accuracy checks of 5 items decide nothing; the KL check below does
        kl = [c for c in json.loads(js.read_text())["checks"] if c["kind"] == "fidelity KL"]
        assert len(kl) == 1 and kl[0]["passed"] is passed, kl
        assert kl[0]["candidate_value"] == pytest.approx(summary["kl_mean"], rel=1e-9)


# ------------------------------------------------------------------------------ 4. thresholds


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("thr") / "run", drops={"bf16": 0.0, "fp8_e4m3": 0.0}, concurrency=(1,),
                    aa=False, n_gsm8k=40, n_aime=5)


@pytest.mark.parametrize("args,needle", [
    (["--max-truncation-increase", "2"], "--max-truncation-increase) must be a fraction in [0, 1]"),
    (["--max-invalid-increase", "1.5"], "--max-invalid-increase) must be a fraction in [0, 1]"),
    (["--max-invalid-increase", "-0.1"], "must be a number >= 0"),
    (["--confidence", "0.5"], "confidence must be in (0.5, 1), got 0.5"),
    (["--confidence", "1"], "confidence must be in (0.5, 1)"),
])
def test_threshold_ranges_exit_2(small_run, args, needle):
    code, out = gate(small_run, "--candidate", "kv_dtype=fp8_e4m3", *args)
    assert code == 2, out
    err = [l for l in out.splitlines() if l.startswith("::error")]
    assert len(err) == 1 and needle in err[0]


def test_threshold_ranges_agree_with_stats():
    for conf in (0.5, 1.0, 0.3, math.nan):
        with pytest.raises(GateError) as g:
            GateThresholds(confidence=conf).validate()
        with pytest.raises(ValueError) as s:
            stats.paired_delta({("a", 0): 1.0}, {("a", 0): 1.0}, confidence=conf)
        assert str(g.value) == str(s.value)
    for conf in (0.51, 0.8, 0.999):
        GateThresholds(confidence=conf).validate()
        stats.paired_delta({("a", 0): 1.0, ("b", 0): 0.0}, {("a", 0): 1.0, ("b", 0): 0.0}, confidence=conf, n_boot=100)
    GateThresholds(max_invalid_rate_increase=1.0, max_truncation_rate_increase=0.0).validate()
    with pytest.raises(GateError, match="max_truncation_rate_increase"):
        GateThresholds(max_truncation_rate_increase=2.0).validate()

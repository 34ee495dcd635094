"""Long-context reports: accuracy by context length, AUC, recovery against the baseline, the length × depth
heatmap, and fidelity by position, on constructed runs whose ruler records follow the agreed schema
(/work/notes/interfaces.md: suite "ruler", scores.ruler, context_length, depth, ...)."""

from __future__ import annotations

import base64
import math
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.core.store import RunStore
from kvbench.core.io import canonical_key
from kvbench.reports.stats import paired as stats
from kvbench.reports.compare import report_analysis
from kvbench.reports.load import load_run
from kvbench.reports.item_records import accuracy_suites, item_scores, suite_metrics
from kvbench.reports.long_context import auc, auc_estimate, auc_weights, heatmap, paired_auc
from kvbench.reports.long_context_tables import NA_BASELINE_ZERO, recovery_table
from kvbench.suites.fidelity.metrics import bucket_edges, by_position_sums, pooled_by_position

sys.path.insert(0, str(Path(__file__).parent))
from test_reports_files import _check_png  # noqa: E402

LENGTHS = (1024, 2048, 4096)
DEPTHS = (0.0, 50.0, 100.0)
TASKS = ("niah_single", "niah_multivalue", "cwe")
KVS = ("bf16", "fp8_e4m3", "nvfp4")


def ruler_record(task, length, di, n, repeat, score, n_answers, depth):
    answers = [f"{task[:4]}-{length}-{di}-{n}-{j}" for j in range(n_answers)]
    found = answers[: round(score * n_answers)]
    return {
        "suite": "ruler", "item_id": f"{task}-L{length}-d{di}-{n}", "repeat": repeat, "seed": 1000 * n + repeat,
        "prompt_hash": f"{hash((task, length, di, n)) & 0xffffffffffff:016x}", "raw_output": ", ".join(found),
        "extracted": ", ".join(found), "target": ", ".join(answers), "correct": score == 1.0, "invalid": False,
        "finish_reason": "stop", "prompt_tokens": length + 12, "output_tokens": 20, "latency_s": 0.2,
        "scores": {"ruler": score}, "protocol": "kvbench:ruler:v1:test", "task": task, "context_length": length,
        "context_tokens": length - 3, "depth": depth, "answers": answers,
    }


def ruler_items(kv, drop, per_cell=4, repeats=1, base_p=None, seed=0, lengths=LENGTHS):
    """Baseline outcomes from a stream shared by every cell; the candidate loses each expected string with
    chance ``drop`` × (length / 1024) (errors grow with context)."""
    base_p = base_p or {1024: 0.95, 2048: 0.85, 4096: 0.7}
    rng_base, rng = random.Random(seed), random.Random(f"{seed}-{kv}")
    recs = []
    for length in lengths:
        for task in TASKS:
            n_ans = 4 if task == "niah_multivalue" else (10 if task == "cwe" else 1)
            for di, depth in enumerate(DEPTHS if task != "cwe" else (None,)):
                for n in range(per_cell):
                    for r in range(repeats):
                        hits = sum(1 for _ in range(n_ans) if rng_base.random() < base_p[length])
                        lost = sum(1 for _ in range(hits) if rng.random() < drop * length / 1024)
                        recs.append(ruler_record(task, length, di, n, r, (hits - lost) / n_ans, n_ans, depth))
    return recs


def fidelity_items(kv, seed=0):
    """Fidelity records with per-record ``by_position`` sums and the pooled summary from token arrays."""
    rng = np.random.default_rng(seed)
    scale = {"bf16": 0.0, "fp8_e4m3": 0.002, "nvfp4": 0.02}[kv]
    recs, kls, t1s, offs = [], [], [], []
    for i in range(3):
        n, off = 2500 + 100 * i, 30
        kl = scale * rng.exponential(1.0, n) * (1 + np.arange(n) / 1000)  # error grows with position
        top1 = (rng.random(n) > 5 * scale * (1 + np.arange(n) / 1000)).astype(float)
        edges = bucket_edges(off + n)
        recs.append({"suite": "fidelity", "item_id": f"long-{i}", "repeat": 0, "seed": None, "prompt_hash": f"f{i}",
                     "raw_output": "", "extracted": None, "target": "", "correct": None, "invalid": False,
                     "finish_reason": "length", "prompt_tokens": off, "output_tokens": 8, "latency_s": 1.0,
                     "scores": {"kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
                                "kl_max": float(kl.max()), "top1_agree": float(top1.mean()), "nll_ref": 1.0,
                                "nll_cand": 1.0 + float(kl.mean()), "ppl_ref": math.e, "ppl_cand": math.exp(1 + kl.mean()),
                                "first_divergence": 8.0, "n_tokens": float(n)},
                     "protocol": "kvbench:fidelity:v1:texts=gsm8k-concat-2500", "by_position": by_position_sums(kl, top1, off, edges)})
        kls.append(kl)
        t1s.append(top1)
        offs.append(off)
    allkl = np.concatenate(kls)
    summary = {"n": 3, "kl_mean": float(allkl.mean()), "kl_p99": float(np.percentile(allkl, 99)),
               "n_tokens": float(allkl.size),
               "by_position": pooled_by_position(kls, t1s, offs, bucket_edges(max(o + k.size for o, k in zip(offs, kls))))}
    return recs, summary, (kls, t1s, offs)


def make_ruler_run(root: Path, drops=None, gate=None, per_cell=4, repeats=1, fidelity=True, items_for=None, **kw) -> Path:
    drops = drops or {"bf16": 0.0, "fp8_e4m3": 0.01, "nvfp4": 0.12}
    store = RunStore(root)
    config = {"baseline": "kv_dtype=bf16", "name": "ruler-test"}
    if gate is not None:
        config["gate"] = gate
    store.write_manifest({"config": config, "git_sha": "0" * 40, "device": "cpu (synthetic)", "date": "2026-01-01"})
    for kv, drop in drops.items():
        cfg = {"model": "smollm2-135m", "target": "embedded", "prefill_backend": "torch", "decode_backend": "torch",
               "kv_dtype": kv, "kv_scales": "unit", "concurrency": 1}
        key = canonical_key(cfg)
        store.init_cell(key, cfg, label=kv)
        items = items_for(kv) if items_for else ruler_items(kv, drop, per_cell, repeats, **kw)
        suites = {}
        if fidelity:
            fid, fsum, _ = fidelity_items(kv)
            items += fid
            suites["fidelity"] = fsum
        store.write_items(key, items)
        store.write_json(key, "summary", {"suites": suites, "load": {}, "capacity": {}, "error": None})
        store.set_status(key, "done")
    return root


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_ruler_run(tmp_path_factory.mktemp("lc") / "run")


def cli(*args):
    r = CliRunner().invoke(app, [*map(str, args)])
    return r.exit_code, r.stdout + (r.stderr or "")


# ------------------------------------------------------------------------------ definitions


def test_auc_definition():
    assert auc({4096: 0.4}) == pytest.approx(0.4)  # one length: its score
    assert auc({1024: 1.0, 4096: 0.5}) == pytest.approx(0.75)  # two lengths: the mean
    # 1k, 2k, 8k: log2 span 3; trapezoids (1·(0.9+0.7)/2 + 2·(0.7+0.1)/2) / 3
    assert auc({1024: 0.9, 2048: 0.7, 8192: 0.1}) == pytest.approx((0.8 + 0.8) / 3)
    w = auc_weights([1024, 2048, 8192])
    assert w.sum() == pytest.approx(1.0) and np.all(w > 0)
    for bad in ([], [2048, 1024], [0, 1024], [1024, 1024]):
        with pytest.raises(ValueError):
            auc_weights(bad)


def test_primary_metric_of_ruler_is_the_score(run):
    cell = load_run(run).cells[0]
    assert accuracy_suites(cell) == ["ruler"]
    assert suite_metrics(cell, "ruler")[:2] == ["ruler", "correct"]
    primary, correct = item_scores(cell, "ruler"), item_scores(cell, "ruler", "correct")
    assert set(primary) == set(correct)
    assert any(0 < v < 1 for v in primary.values())  # fractional scores of multi-value tasks
    assert all(correct[k] == (primary[k] == 1.0) for k in primary)


def test_length_rows_auc_and_intervals_match_direct_computation(run):
    a = report_analysis(load_run(run), n_boot=2000)
    assert [r.cell.config["kv_dtype"] for r in a.lengths] == list(KVS)
    for row in a.lengths:
        recs = [r for r in row.cell.items if r["suite"] == "ruler"]
        means = {}
        for n in LENGTHS:
            sc = {(r["item_id"], r["repeat"]): r["scores"]["ruler"] for r in recs if r["context_length"] == n}
            e = stats.estimate(sc)
            assert row.by_length[n] == e and e.method == "t"  # fractional scores: t over questions
            means[n] = float(np.mean(list(sc.values())))
        assert row.auc.value == pytest.approx(auc(means))
        assert row.auc.lo < row.auc.value < row.auc.hi
    by_kv = {r.cell.config["kv_dtype"]: r.auc.value for r in a.lengths}
    assert by_kv["bf16"] > by_kv["fp8_e4m3"] > by_kv["nvfp4"]
    # seeded: the same interval twice
    b = report_analysis(load_run(run), n_boot=2000)
    assert [(r.auc.lo, r.auc.hi) for r in b.lengths] == [(r.auc.lo, r.auc.hi) for r in a.lengths]


def test_auc_interval_width_matches_the_analytic_standard_error():
    rng = np.random.default_rng(3)
    by_len = {n: {(f"q{n}-{i}", 0): float(rng.random() < p) for i in range(400)}
              for n, p in ((1024, 0.9), (2048, 0.7), (8192, 0.4))}
    est = auc_estimate(by_len, confidence=0.9, n_boot=4000, seed=1)
    w = auc_weights(sorted(by_len))
    se = math.sqrt(sum(wi ** 2 * np.var(list(s.values()), ddof=1) / len(s) for wi, s in zip(w, by_len.values())))
    assert (est.hi - est.lo) / (2 * 1.6449 * se) == pytest.approx(1.0, abs=0.08)


def test_paired_auc_bound_is_seeded_and_matches_the_analytic_bound():
    rng = np.random.default_rng(5)
    base, cand = {}, {}
    for n, p, drop in ((1024, 0.9, 0.02), (4096, 0.7, 0.1)):
        b = {(f"q{n}-{i}", 0): float(rng.random() < p) for i in range(500)}
        base[n] = b
        cand[n] = {k: (0.0 if v and rng.random() < drop else v) for k, v in b.items()}
    p1 = paired_auc(base, cand, confidence=0.95, n_boot=4000, seed=7)
    p2 = paired_auc(base, cand, confidence=0.95, n_boot=4000, seed=7)
    assert p1 == p2 and p1.bound_method == "bootstrap"
    d = [np.array([cand[n][k] - base[n][k] for k in base[n]]) for n in sorted(base)]
    w = auc_weights(sorted(base))
    delta = float(sum(wi * di.mean() for wi, di in zip(w, d)))
    se = math.sqrt(sum(wi ** 2 * di.var(ddof=1) / di.size for wi, di in zip(w, d)))
    assert p1.delta == pytest.approx(delta)
    assert p1.lower_bound == pytest.approx(delta - 1.6449 * se, abs=0.25 * se)
    assert p1.ratio(0) == pytest.approx(np.mean(list(cand[1024].values())) / np.mean(list(base[1024].values())))


def test_identical_cells_get_a_newcombe_bound_not_a_zero_width_one():
    base = {n: {(f"q{n}-{i}", 0): float(i % 3 != 0) for i in range(60)} for n in (1024, 2048)}
    p = paired_auc(base, base, n_boot=1000)
    assert p.delta == 0.0 and p.bound_method == "newcombe-bonferroni"
    assert -0.1 < p.lower_bound < 0.0
    frac = {n: {k: v * 0.5 for k, v in s.items()} for n, s in base.items()}
    assert paired_auc(frac, frac, n_boot=1000).lower_bound == -math.inf  # unknown: not 0/1 scores


def test_recovery_ratio_and_na_when_baseline_scores_zero(tmp_path):
    def items(kv):
        p = {1024: 0.9, 2048: 0.6, 4096: 1e-9}  # the baseline finds nothing at 4k
        recs = ruler_items("bf16", 0.0, per_cell=3, base_p=p)
        if kv == "nvfp4":  # the candidate finds a string at 4k where the baseline found none
            for r in recs:
                if r["context_length"] == 4096 and r["item_id"].startswith("niah_single") and r["item_id"].endswith("-0"):
                    r["scores"]["ruler"], r["correct"] = 1.0, True
        return recs

    root = make_ruler_run(tmp_path / "run", drops={"bf16": 0.0, "nvfp4": 0.0}, items_for=items, fidelity=False)
    a = report_analysis(load_run(root), n_boot=500)
    (rec,) = a.recovery
    p = rec.paired
    assert p.base_means[2] == 0.0 and p.cand_means[2] > 0 and p.ratio(2) is None
    assert p.ratio(0) == pytest.approx(1.0) and p.auc_ratio == pytest.approx(p.cand_auc / p.base_auc)
    t = recovery_table(a)
    row = t.rows[0]
    assert row[t.columns.index("4k")] == NA_BASELINE_ZERO
    assert row[t.columns.index("1k")].startswith("1.000×")
    assert not re.search(r"\binf\b|nan", " ".join(row))


def test_heatmap_values_are_the_mean_scores(run):
    cell = load_run(run).cells[2]
    hm = heatmap(cell, "ruler")
    assert hm.lengths == list(LENGTHS) and hm.depths == list(DEPTHS)
    for i, d in enumerate(DEPTHS):
        for j, n in enumerate(LENGTHS):
            vals = [r["scores"]["ruler"] for r in cell.items
                    if r["suite"] == "ruler" and r["depth"] == d and r["context_length"] == n]
            assert hm.count[i, j] == len(vals) and hm.mean[i, j] == pytest.approx(np.mean(vals))


# ------------------------------------------------------------------------------ the rendered report


def test_report_renders_long_context_and_position_sections(run, tmp_path):
    out = tmp_path / "rep"
    code, text = cli("report", run, "--out", out, "--bootstrap", "500")
    assert code == 0, text
    md = (out / "report.md").read_text()
    for title in ("## Long-context accuracy", "### Long-context accuracy by context length",
                  "### Long-context recovery against the baseline (cell / baseline)",
                  "### Long-context paired deltas by context length", "### Fidelity by position"):
        assert title in md
    plots = ["long_context_length", "ruler_heatmap_1", "ruler_heatmap_2", "ruler_heatmap_3", "fidelity_position"]
    for name in plots:
        assert f"]({name}.png)" in md
        _check_png(out / f"{name}.png")
    assert "| ruler | nvfp4 | bf16 |" in md  # a recovery row of the candidate against the baseline
    assert "nvfp4 vs bf16, ruler AUC:" in md  # the summary line
    # fidelity by position: columns are buckets; the entries are the pooled figures of the token arrays
    _, fsum, (kls, t1s, offs) = fidelity_items("nvfp4")
    row = next(line for line in md.splitlines() if line.startswith("| nvfp4 |") and "/" in line)
    b = fsum["by_position"][-1]
    assert f"{b['kl_mean']:.3g} / {b['kl_p99']:.3g} / {100 * b['top1_agree']:.2f}%" in row
    assert "| cell | tokens | 0–512 | 512–1k | 1k–2k | 2k–4k |" in md
    page = (out / "report.html").read_text()
    refs = re.findall(r"""src=['"]([^'"]*)['"]""", page)
    inlined = {base64.b64decode(r.split(",", 1)[1]) for r in refs}
    for name in plots:
        assert (out / f"{name}.png").read_bytes() in inlined
    assert "Long-context recovery against the baseline" in page and "Fidelity by position" in page


def test_repeats_of_an_item_stay_together(tmp_path):
    root = make_ruler_run(tmp_path / "run", per_cell=2, repeats=3, fidelity=False)
    a = report_analysis(load_run(root), n_boot=500)
    assert all(e.k == 3 and e.n == 14 for r in a.lengths for e in r.by_length.values())  # 14 questions per length
    for rec in a.recovery:
        assert rec.paired.n_pairs == 3 * rec.paired.n_questions == 3 * 14 * len(LENGTHS)
    assert all(r.pass_at_k is None for r in a.accuracy if r.metric == "ruler")  # fractional scores: no pass@K
    assert any(r.pass_at_k is not None for r in a.accuracy if r.metric == "correct")


def test_paired_auc_keeps_width_when_a_short_length_agrees_everywhere():
    # six questions per length; every pair agrees at 2048, the candidate loses two at 1024: the bootstrap
    # alone would give the 2048 length no width, so the bound and interval fall back to Newcombe's
    base = {1024: {(f"a{i}", 0): 1.0 for i in range(6)}, 2048: {(f"b{i}", 0): 1.0 for i in range(6)}}
    cand = {1024: {(f"a{i}", 0): float(i >= 2) for i in range(6)}, 2048: dict(base[2048])}
    p = paired_auc(base, cand, confidence=0.95, n_boot=2000, seed=0)
    assert p.bound_method == "newcombe-bonferroni"
    boot_only = min(0.5 * (c - 1.0) for c in (4 / 6, 1.0))  # what resampling 1024 alone could reach
    assert p.lower_bound < boot_only - 0.05
    assert p.ci_hi > 0.0 and p.ci_lo <= p.lower_bound
    same = paired_auc(base, {n: dict(v) for n, v in base.items()}, confidence=0.95, n_boot=2000, seed=0)
    assert same.delta == 0.0 and same.ci_lo < -0.1 and same.ci_hi > 0.1

"""The gate's words at the edges (issue 40): NOT DISCRIMINATIVE only where no candidate result could fail;
a drop from a 100% baseline is an ordinary comparison (INCONCLUSIVE with a plan, then FAIL with more items);
the same rules for the AUC, per-length and rate checks; floors explained from the baseline's records; each
candidate's own A/A control as a noise floor; the fidelity limits (KL, perplexity ratio, top-1 agreement)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

import pytest

from kvbench.core.store import RunStore
from kvbench.core.io import canonical_key
from kvbench.reports.gate.check import GateError, GateThresholds, run_gate
from kvbench.reports.gate.plan import plan_result
from kvbench.reports.load import load_run

sys.path.insert(0, str(Path(__file__).parent))
from test_verdict_paths import B400, CFG, _records, build, flip  # noqa: E402

RULER_DROP = 0.10  # the ruler margin of configs/default.yaml, where the ceiling case was seen


def _acc(result, metric: Optional[str] = None):
    return next(c for c in result.checks if c.kind == "accuracy" and (metric is None or c.metric == metric))


def _gate(root: Path, base, cand, drop=0.05, aa=None, **kw):
    run = load_run(build(root, base, {"fp8_e4m3": cand}, aa))
    return run_gate(run, "kv_dtype=bf16", None, GateThresholds(default_max_drop=drop, **kw))


# ------------------------------------------------------------------------------ the ceiling
@pytest.mark.parametrize("n,lost,word", [(6, 2, "INCONCLUSIVE"), (12, 4, "INCONCLUSIVE"), (30, 10, "FAIL")])
def test_drop_from_a_full_baseline_is_a_comparison(tmp_path, n, lost, word):
    """Baseline 100%, the candidate losing a third: not 'too easy to show a loss' — it showed one."""
    r = _gate(tmp_path / "r", [True] * n, flip([True] * n, lost), drop=RULER_DROP)
    acc = _acc(r)
    assert r.word == word and acc.status == word.lower(), acc.reason
    assert "ceiling" not in acc.reason
    plans = [p for p in plan_result(r) if p.check is acc]
    if word == "INCONCLUSIVE":
        # the plan sizes it: questions to confirm the loss, and more than now
        (p,) = plans
        assert p.n_expected is not None and p.n_expected > n and "confirm the loss" in p.note
        assert "do not help" not in p.note
        assert "past the margin" in acc.reason and "not proven" in acc.reason
    else:
        assert plans and plans[0].n_expected is None and "loses more than the margin" in plans[0].note


def test_plan_for_a_ceiling_drop_is_right(tmp_path):
    """At the planned size the same loss rate is a proven FAIL; at half of it, still INCONCLUSIVE."""
    r = _gate(tmp_path / "r", [True] * 6, flip([True] * 6, 2), drop=RULER_DROP)
    (p,) = plan_result(r)
    for n, word in ((p.n_expected + 3, "FAIL"), (max(p.n_expected // 2, 7), "INCONCLUSIVE")):
        lost = round(n / 3)
        assert _gate(tmp_path / f"n{n}", [True] * n, flip([True] * n, lost), drop=RULER_DROP).word == word, n


@pytest.mark.parametrize("n", [1, 6, 400])
def test_both_at_the_ceiling_is_not_discriminative(tmp_path, n):
    r = _gate(tmp_path / "r", [True] * n, [True] * n)
    assert r.word == "NOT DISCRIMINATIVE" and "both at the ceiling" in _acc(r).reason


@pytest.mark.parametrize("n,word", [(6, "INCONCLUSIVE"), (400, "PASS")])
def test_one_item_below_a_full_baseline(tmp_path, n, word):
    r = _gate(tmp_path / "r", [True] * n, flip([True] * n, 1))
    assert _acc(r).status == word.lower(), _acc(r).reason


def test_one_item_below_the_ceiling_in_the_baseline_discriminates(tmp_path):
    base = flip([True] * 400, 1)
    r = _gate(tmp_path / "r", base, [True] * 400)
    assert _acc(r).status == "pass"


# ------------------------------------------------------------------------------ the floor
@pytest.mark.parametrize("base_right,cand_right,n,status", [
    (0, 0, 6, "not discriminative"),  # 0/n both
    (0, 1, 6, "not discriminative"),  # the candidate cannot lose what the baseline never had
    (1, 0, 10, "not discriminative"),  # baseline 10% = the margin: a drop of exactly δ is not past it
    (1, 0, 6, "inconclusive"),  # baseline 16.7% > δ: a drop past the margin is possible
    (2, 0, 10, "inconclusive"),  # one item above the margin
])
def test_floor_boundaries(tmp_path, base_right, cand_right, n, status):
    base = [i < base_right for i in range(n)]
    cand = [i < cand_right for i in range(n)]
    r = _gate(tmp_path / "r", base, cand, drop=RULER_DROP)
    assert _acc(r).status == status, _acc(r).reason
    if status == "not discriminative":
        assert "floor" in _acc(r).reason and not plan_result(r)[0].n_expected


# ------------------------------------------------------------------------------ ruler: AUC and per-length
def _ruler_records(outcomes: dict[int, list[bool]]) -> list[dict]:
    out = []
    for length, oks in outcomes.items():
        for i, ok in enumerate(oks):
            out.append({"suite": "ruler", "item_id": f"niah_single-L{length}-d0-{i}", "repeat": 0, "seed": None,
                        "prompt_hash": f"{length:08x}{i:08x}", "raw_output": "x", "extracted": "x", "target": "x",
                        "correct": ok, "invalid": False, "finish_reason": "stop", "prompt_tokens": length,
                        "output_tokens": 5, "latency_s": 0.1, "scores": {"ruler": float(ok)}, "protocol": "ruler",
                        "task": "niah_single", "context_length": length, "context_tokens": length, "depth": 50.0,
                        "answers": ["x"], "answer_tokens": 4})
    return out


def _ruler_run(root: Path, base: dict, cand: dict) -> Path:
    store = RunStore(root)
    store.write_manifest({"config": {"baseline": "kv_dtype=bf16", "gate": {"max_drop": RULER_DROP}}, "git_sha": "0" * 40,
                          "device": "cpu (synthetic)", "date": "2026-11-28"})
    for kv, outcomes in (("bf16", base), ("nvfp4", cand)):
        cfg = {**CFG, "kv_dtype": kv}
        key = canonical_key(cfg)
        store.init_cell(key, cfg, label=kv)
        store.write_items(key, _ruler_records(outcomes))
        store.write_json(key, "summary", {"suites": {}, "load": None, "capacity": None, "error": None})
        store.set_status(key, "done")
    return root


@pytest.mark.parametrize("metric", ["auc", "L2048", None])
def test_ruler_metrics_follow_the_same_rules(tmp_path, metric):
    full = {1024: [True] * 12, 2048: [True] * 12}
    metrics = [f"ruler:{metric}"] if metric else None
    lost = {1024: [True] * 12, 2048: flip([True] * 12, 12)}  # every long item lost: a proven drop
    r = run_gate(load_run(_ruler_run(tmp_path / "a", full, lost)), "kv_dtype=bf16", None,
                 GateThresholds(default_max_drop=RULER_DROP, metrics=metrics))
    assert _acc(r).status == "fail", _acc(r).reason
    r = run_gate(load_run(_ruler_run(tmp_path / "b", full, full)), "kv_dtype=bf16", None,
                 GateThresholds(default_max_drop=RULER_DROP, metrics=metrics))
    assert _acc(r).status == "not discriminative" and "both at the ceiling" in _acc(r).reason
    some = {1024: [True] * 12, 2048: flip([True] * 12, 2)}
    r = run_gate(load_run(_ruler_run(tmp_path / "c", full, some)), "kv_dtype=bf16", None,
                 GateThresholds(default_max_drop=RULER_DROP, metrics=metrics))
    assert _acc(r).status in ("inconclusive", "pass") and "ceiling" not in _acc(r).reason


# ------------------------------------------------------------------------------ rates
def _with_finish(root: Path, cut: dict[str, int]) -> Path:
    """Mark the first ``cut[kv]`` records of each cell as cut off at max_tokens (wrong, finish_reason length)."""
    store = RunStore(root)
    for ref in store.cells():
        recs = [json.loads(x) for x in (ref.path / "items.jsonl").read_text().splitlines()]
        for r in recs[:cut.get(ref.config["kv_dtype"], 0)]:
            r.update(finish_reason="length", correct=False, request_options={"max_tokens": 128}, output_tokens=128)
        store.write_items(ref.key, recs)
    return root


def test_rate_at_its_ceiling_cannot_fail(tmp_path):
    """Every baseline answer cut off: no candidate can raise the truncation rate, and the floor is explained."""
    root = _with_finish(build(tmp_path / "r", [False] * 20, {"fp8_e4m3": [False] * 20}), {"bf16": 20, "fp8_e4m3": 20})
    r = run_gate(load_run(root), "kv_dtype=bf16", None, GateThresholds())
    trunc = next(c for c in r.checks if c.kind == "truncation rate")
    assert trunc.status == "not discriminative" and "cannot fail" in trunc.reason
    acc = _acc(r)
    assert acc.status == "not discriminative" and "cut off at max_tokens=128" in acc.reason
    assert "none finished within 128 tokens" in acc.reason and "--max-tokens 512" in acc.reason
    # one record short of the rate's ceiling: the check can fail, so it is an ordinary check again
    root = _with_finish(build(tmp_path / "s", [False] * 10, {"fp8_e4m3": [False] * 10}), {"bf16": 9, "fp8_e4m3": 10})
    trunc = next(c for c in run_gate(load_run(root), "kv_dtype=bf16", None, GateThresholds()).checks
                 if c.kind == "truncation rate")
    assert trunc.status != "not discriminative"


def test_floor_cause_names_the_budget_that_fits(tmp_path):
    """Answers of known length (ruler's answer_tokens) say the budget that would have fitted them; finished
    free-form answers say how long they were."""
    root = build(tmp_path / "r", [False] * 10, {"fp8_e4m3": [False] * 10})
    store = RunStore(root)
    for ref in store.cells():
        recs = [json.loads(x) for x in (ref.path / "items.jsonl").read_text().splitlines()]
        for i, r in enumerate(recs):
            r["answer_tokens"] = 30 + i
            if i < 8:
                r.update(finish_reason="length", request_options={"max_tokens": 32}, output_tokens=32)
        store.write_items(ref.key, recs)
    acc = _acc(run_gate(load_run(root), "kv_dtype=bf16", None, GateThresholds(default_max_drop=0.1)))
    assert "8 of 10 baseline answers were cut off at max_tokens=32" in acc.reason
    assert "max_tokens 39 would have fitted them" in acc.reason


def test_invalid_answers_explain_a_floor(tmp_path):
    root = build(tmp_path / "r", [False] * 10, {"fp8_e4m3": [False] * 10})
    store = RunStore(root)
    for ref in store.cells():
        recs = [json.loads(x) for x in (ref.path / "items.jsonl").read_text().splitlines()]
        for r in recs:
            r.update(invalid=True, extracted=None)
        store.write_items(ref.key, recs)
    acc = _acc(run_gate(load_run(root), "kv_dtype=bf16", None, GateThresholds()))
    assert acc.status == "not discriminative" and "without an answer the suite could extract" in acc.reason


# ------------------------------------------------------------------------------ each candidate's own A/A control
def _with_candidate_control(root: Path, outcomes: list[bool]) -> Path:
    store = RunStore(root)
    cfg = {**CFG, "kv_dtype": "fp8_e4m3", "aa_control": True, "concurrency": 4}
    key = canonical_key(cfg)
    store.init_cell(key, cfg, label="fp8_e4m3 A/A")
    store.write_items(key, _records(outcomes))
    store.write_json(key, "summary", {"suites": {}, "load": None, "capacity": None, "error": None})
    store.set_status(key, "done")
    return root


def test_candidate_control_is_a_noise_floor(tmp_path):
    """The baseline is deterministic (its control identical), the candidate is not (its own control differs by
    15 pp): a proven 12 pp drop past a 5 pp margin is within the candidate's own noise."""
    cand = flip(B400, 48)
    root = build(tmp_path / "r", B400, {"fp8_e4m3": cand}, aa=list(B400))
    r = run_gate(load_run(root), "kv_dtype=bf16", None, GateThresholds())
    assert _acc(r).status == "fail" and [n.subject for n in _acc(r).noises] == ["the baseline"]
    _with_candidate_control(root, flip(cand, 60, start=0))
    r = run_gate(load_run(root), "kv_dtype=bf16", None, GateThresholds())
    acc = _acc(r)
    assert [n.subject for n in acc.noises] == ["the baseline", "the candidate"]
    assert acc.noise.subject == "the candidate" and acc.noise.delta == pytest.approx(-60 / 400)
    assert acc.status == "not discriminative" and "the candidate" in acc.reason
    assert r.cand_aa and list(r.cand_aa.values())[0].aa_control
    # the candidate's control is not a candidate itself
    assert [c.config.get("aa_control") for c in r.candidates] == [None]


# ------------------------------------------------------------------------------ fidelity limits
def _fidelity_run(root: Path, kl: float, dnll: float, top1: float, n_texts: int = 8) -> Path:
    build(root, [True, False] * 50, {"fp8_e4m3": [True, False] * 50})
    store = RunStore(root)
    for ref in store.cells():
        recs = [json.loads(x) for x in (ref.path / "items.jsonl").read_text().splitlines()]
        mine = ref.config["kv_dtype"] != "bf16"
        for i in range(n_texts):
            jitter = 1.0 + 0.05 * ((i % 3) - 1)
            recs.append({"suite": "fidelity", "item_id": f"fid-{i}", "repeat": 0, "correct": None, "invalid": False,
                         "finish_reason": "stop", "scores": {
                             "kl_mean": kl * jitter if mine else 0.0, "top1_agree": 1 - (1 - top1) * jitter if mine else 1.0,
                             "nll_ref": 1.5, "nll_cand": 1.5 + (dnll * jitter if mine else 0.0), "n_tokens": 100}})
        store.write_items(ref.key, recs)
    return root


@pytest.mark.parametrize("kl,ppl,top1,word", [
    (0.011, 1.009, 0.957, "PASS"),  # the default model's fp8_e4m3 (docs/verdict.md)
    (0.040, 1.056, 0.915, "FAIL"),  # fp8_e5m2: +5.6% perplexity
    (0.119, 1.147, 0.858, "FAIL"),  # nvfp4
])
def test_default_fidelity_limits(tmp_path, kl, ppl, top1, word):
    root = _fidelity_run(tmp_path / "r", kl, math.log(ppl), top1)
    r = run_gate(load_run(root), "kv_dtype=bf16", None, GateThresholds(metrics=["gsm8k"]))
    fid = {c.kind: c for c in r.checks if c.suite == "fidelity"}
    assert set(fid) == {"fidelity KL", "perplexity ratio", "top-1 agreement"}
    assert fid["perplexity ratio"].cand_value == pytest.approx(ppl, rel=1e-3)
    assert fid["top-1 agreement"].status == "info"  # reported, not gated by default
    words = {fid["fidelity KL"].word, fid["perplexity ratio"].word}
    assert words == {word}, {k: (c.status, c.reason) for k, c in fid.items()}


def test_top1_limit_can_be_gated(tmp_path):
    root = _fidelity_run(tmp_path / "r", 0.011, math.log(1.009), 0.957)
    r = run_gate(load_run(root), "kv_dtype=bf16", None, GateThresholds(metrics=["gsm8k"], min_top1_agreement=0.97))
    top1 = next(c for c in r.checks if c.kind == "top-1 agreement")
    assert top1.status == "fail" and "below the minimum 97.0%" in top1.reason
    r = run_gate(load_run(root), "kv_dtype=bf16", None, GateThresholds(metrics=["gsm8k"], min_top1_agreement=0.9))
    assert next(c for c in r.checks if c.kind == "top-1 agreement").status == "pass"


def test_explicit_fidelity_limit_needs_records(tmp_path):
    root = build(tmp_path / "r", [True, False] * 10, {"fp8_e4m3": [True, False] * 10})
    run = load_run(root)
    assert not [c for c in run_gate(run, "kv_dtype=bf16", None, GateThresholds()).checks if c.suite == "fidelity"]
    with pytest.raises(GateError, match="no fidelity records"):
        run_gate(run, "kv_dtype=bf16", None, GateThresholds(max_ppl_ratio=1.05, fidelity_required=True))


def test_full_marks_certify_where_the_run_shows_the_items_can_lose(tmp_path):
    """Both at 100% is not discriminative on its own; when another candidate of the same run provably lost on
    the same items, they can show a loss, and the candidate at 100% is judged on its interval (PASS at n = 36
    against a 10 pp margin)."""
    full = [True] * 36
    alone = run_gate(load_run(build(tmp_path / "a", full, {"fp8_e4m3": list(full)})), "kv_dtype=bf16", None,
                     GateThresholds(default_max_drop=RULER_DROP))
    assert _acc(alone).status == "not discriminative"
    both = load_run(build(tmp_path / "b", full, {"fp8_e4m3": list(full), "nvfp4": flip(full, 6)}))
    r = run_gate(both, "kv_dtype=bf16", None, GateThresholds(default_max_drop=RULER_DROP))
    acc = {c.candidate.config["kv_dtype"]: c for c in r.checks if c.kind == "accuracy"}
    assert acc["nvfp4"].far_bound < 0  # a proven loss on these items
    assert acc["fp8_e4m3"].status == "pass" and "nvfp4" in acc["fp8_e4m3"].reason, acc["fp8_e4m3"].reason
    # a drop that is not proven (its upper bound above 0) shows nothing
    weak = load_run(build(tmp_path / "c", full, {"fp8_e4m3": list(full), "nvfp4": flip(full, 1)}))
    r = run_gate(weak, "kv_dtype=bf16", None, GateThresholds(default_max_drop=RULER_DROP))
    e4 = next(c for c in r.checks if c.kind == "accuracy" and c.candidate.config["kv_dtype"] == "fp8_e4m3")
    assert e4.status == "not discriminative"

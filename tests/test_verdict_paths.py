"""Every verdict path on constructed runs (pass, fail, inconclusive, not discriminative at the floor, at the
ceiling and by the A/A noise, error-rate fail), and the report's word equal to `kvbench gate`'s exit status
on the same store: overall (`kvbench gate RUN`) and per card (`kvbench gate RUN --candidate SELECTOR`)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional

import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.core.store import RunStore
from kvbench.core.io import canonical_key
from kvbench.reports.gate.check import WORD_EXIT, GateThresholds, run_gate
from kvbench.reports.gate.plan import plan_result
from kvbench.reports.load import load_run

CFG = {"model": "m", "target": "embedded", "prefill_backend": "torch", "decode_backend": "torch", "kv_scales": "unit",
       "concurrency": 8}


def _records(outcomes: list[Optional[bool]]) -> list[dict]:
    out = []
    for i, ok in enumerate(outcomes):
        err = ok is None
        out.append({"suite": "gsm8k", "item_id": f"q{i}", "repeat": 0, "seed": None, "prompt_hash": f"{i:016x}",
                    "raw_output": "" if err else f"#### {int(bool(ok))}", "extracted": None if err else str(int(bool(ok))),
                    "target": "1", "correct": None if err else bool(ok), "invalid": None if err else False,
                    "finish_reason": "error" if err else "stop", "prompt_tokens": 10, "output_tokens": 0 if err else 5,
                    "latency_s": 0.1, "scores": {}, "protocol": "t",
                    "error": "ReadTimeout: timed out" if err else None, "error_kind": "timeout" if err else None})
    return out


def build(root: Path, base: list[bool], cands: dict[str, list[Optional[bool]]], aa: Optional[list[bool]] = None,
          gate: Optional[dict] = None) -> Path:
    store = RunStore(root)
    config = {"baseline": "kv_dtype=bf16", "gate": gate or {"max_drop": 0.05}}
    store.write_manifest({"config": config, "git_sha": "0" * 40, "device": "cpu (synthetic)", "date": "2026-11-24"})
    cells = [("bf16", base, False)] + [(kv, o, False) for kv, o in cands.items()] + ([("bf16", aa, True)] if aa else [])
    for kv, outcomes, is_aa in cells:
        cfg = {**CFG, "kv_dtype": kv, **({"aa_control": True, "concurrency": 4} if is_aa else {})}
        key = canonical_key(cfg)
        store.init_cell(key, cfg, label=kv + (" A/A" if is_aa else ""))
        store.write_items(key, _records(outcomes))
        store.write_json(key, "summary", {"suites": {}, "load": None, "capacity": None, "error": None})
        store.set_status(key, "done")
    return root


def flip(outcomes: list[bool], n: int, to: bool = False, start: int = 0) -> list[Optional[bool]]:
    """``n`` outcomes that are ``not to`` turned into ``to``, from index ``start``."""
    out: list[Optional[bool]] = list(outcomes)
    for i in range(start, len(out)):
        if n and out[i] is (not to):
            out[i], n = to, n - 1
    return out


def base_60(n: int, seed: int = 0) -> list[bool]:
    rng = random.Random(seed)
    return [rng.random() < 0.6 for _ in range(n)]


def cli(*args):
    r = CliRunner().invoke(app, [*map(str, args)])
    return r.exit_code, r.output


B400 = base_60(400)
SCENARIOS = {
    # name: (base, candidates, A/A, expected word of the candidate "fp8_e4m3")
    "pass": (B400, {"fp8_e4m3": flip(B400, 2)}, flip(flip(B400, 2, start=100), 2, to=True, start=100), "PASS"),
    "fail": (B400, {"fp8_e4m3": flip(B400, 60)}, flip(B400, 2, start=200), "FAIL"),
    "inconclusive": (base_60(20), {"fp8_e4m3": base_60(20)}, None, "INCONCLUSIVE"),
    # Δ −10 pp beyond a 5 pp margin, but 40 questions leave the interval holding −δ: not a proven loss
    "losing_inconclusive": (base_60(40), {"fp8_e4m3": flip(base_60(40), 4)}, None, "INCONCLUSIVE"),
    "floor": ([False] * 400, {"fp8_e4m3": [False] * 400}, None, "NOT DISCRIMINATIVE"),
    "ceiling": ([True] * 400, {"fp8_e4m3": [True] * 400}, None, "NOT DISCRIMINATIVE"),
    "noise": (B400, {"fp8_e4m3": flip(B400, 4)}, flip(B400, 32, start=50), "NOT DISCRIMINATIVE"),
    "errors": (B400, {"fp8_e4m3": [None if i % 20 == 0 else ok for i, ok in enumerate(B400)]}, None, "FAIL"),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_report_word_equals_gate_exit(tmp_path, name):
    base, cands, aa, expected = SCENARIOS[name]
    run = build(tmp_path / "run", base, cands, aa)
    out = tmp_path / "report"
    code, text = cli("report", run, "--out", out, "--bootstrap", "500")
    assert code == 0, text
    doc = json.loads((out / "report.json").read_text())
    cards = doc["tables"]["verdicts"]["rows"] if isinstance(doc["tables"]["verdicts"], dict) else doc["tables"]["verdicts"]
    assert len(cards) == 1
    card = cards[0]
    assert card["word"] == expected and card["overall_word"] == expected
    md = (out / "report.md").read_text()
    assert f"Overall: {expected}" in md and f"**{expected}**" in md
    assert md.index("\n## Verdict\n") < md.index("\n## Accuracy\n")  # the verdict comes first
    html = (out / "report.html").read_text()
    assert "id='verdict'" in html and expected in html
    # the gate agrees: overall, and for the card's own selector
    code, gate_out = cli("gate", run)
    assert code == WORD_EXIT[expected], gate_out
    code, _ = cli("gate", run, "--candidate", card["selector"])
    assert code == WORD_EXIT[expected]
    assert f"kvbench gate {run}" in card["command"] and card["selector"] == "kv_dtype=fp8_e4m3"


def _result(tmp_path, name, **kw):
    base, cands, aa, _ = SCENARIOS[name]
    run = load_run(build(tmp_path / name, base, cands, aa))
    return run_gate(run, "kv_dtype=bf16", None, GateThresholds(max_drop={"gsm8k": 0.05}, **kw))


def test_reasons_name_the_cause(tmp_path):
    acc = lambda r: next(c for c in r.checks if c.kind == "accuracy")  # noqa: E731
    assert "floor" in acc(_result(tmp_path, "floor")).reason
    assert "ceiling" in acc(_result(tmp_path, "ceiling")).reason
    noise = acc(_result(tmp_path, "noise"))
    assert "A/A" in noise.reason and noise.noise is not None and noise.noise.delta == pytest.approx(-32 / 400)
    # without the control the same candidate passes: the noise rule is what refused
    assert acc(_result(tmp_path, "noise", use_aa=False)).status == "pass"
    err = _result(tmp_path, "errors")
    rate = [c for c in err.checks if c.kind == "error rate" and c.subject == "candidate"][0]
    assert rate.status == "fail" and rate.cand_value == pytest.approx(20 / 400) and "error rate" in rate.reason
    a = acc(err)
    assert a.n_error_pairs == 20 and a.n == 380 and a.status == "pass"  # errors are not wrong answers
    # a looser error limit lets the same run pass
    assert _result(tmp_path, "errors", max_error_rate=0.1).word == "PASS"


def test_conclusive_fail_at_ceiling_stays_fail(tmp_path):
    run = load_run(build(tmp_path / "run", [True] * 200, {"fp8_e4m3": flip([True] * 200, 40)}))
    r = run_gate(run, "kv_dtype=bf16", None, GateThresholds())
    assert r.word == "FAIL"


def test_drop_within_noise_is_not_a_failure(tmp_path):
    """A candidate whose conclusive drop is no larger than the A/A control's difference is not discriminated."""
    run = load_run(build(tmp_path / "run", B400, {"fp8_e4m3": flip(B400, 40)}, aa=flip(B400, 48, start=10)))
    r = run_gate(run, "kv_dtype=bf16", None, GateThresholds(max_drop={"gsm8k": 0.2}, default_max_drop=0.2))
    acc = next(c for c in r.checks if c.kind == "accuracy")
    assert acc.status == "pass"  # −10 pp within a 20 pp margin, A/A −12 pp below it
    r = run_gate(run, "kv_dtype=bf16", None, GateThresholds(max_drop={"gsm8k": 0.05}))
    acc = next(c for c in r.checks if c.kind == "accuracy")
    assert acc.status == "not discriminative" and "no larger than the A/A" in acc.reason


def test_plan_says_how_many_items(tmp_path):
    r = _result(tmp_path, "inconclusive")
    plans = plan_result(r)
    assert len(plans) == 1
    p = plans[0]
    assert p.n_now == 20 and p.n_expected is not None and p.n_expected > 20 and p.n_power >= p.n_expected
    # the plan is right: the same agreement at the planned size certifies
    share = sum(SCENARIOS["inconclusive"][0]) / 20

    def exact(n: int) -> list[bool]:  # the observed share of right answers at size n
        k = round(share * n)
        return [True] * k + [False] * (n - k)

    for n, status in ((p.n_expected + 5, "pass"), (p.n_expected // 2, "inconclusive")):
        outcomes = exact(n)
        run = load_run(build(tmp_path / f"n{n}", outcomes, {"fp8_e4m3": list(outcomes)}))
        r = run_gate(run, "kv_dtype=bf16", None, GateThresholds())
        assert next(c for c in r.checks if c.kind == "accuracy").status == status, n
    # a failure is not planned into a pass, a non-discriminative metric is not helped by items
    (pf,) = plan_result(_result(tmp_path, "fail"))
    assert pf.n_expected is None and "loses more than the margin" in pf.note
    # a drop beyond the margin that is not proven: the plan says how many questions would confirm it
    (pl,) = [p for p in plan_result(_result(tmp_path, "losing_inconclusive")) if p.check.kind == "accuracy"]
    assert pl.check.status == "inconclusive" and pl.check.delta == pytest.approx(-0.1)
    assert pl.n_expected is not None and pl.n_expected > 40 and "confirm the loss" in pl.note
    base = base_60(pl.n_expected + 10, seed=2)
    k = round(0.1 * len(base))
    run = load_run(build(tmp_path / "confirm", base, {"fp8_e4m3": flip(base, k)}))
    r = run_gate(run, "kv_dtype=bf16", None, GateThresholds())
    assert next(c for c in r.checks if c.kind == "accuracy").status == "fail"
    (pn,) = plan_result(_result(tmp_path, "floor"))
    assert pn.n_expected is None and "do not help" in pn.note


def test_gate_plan_flag(tmp_path):
    base, cands, aa, _ = SCENARIOS["inconclusive"]
    run = build(tmp_path / "run", base, cands, aa)
    js = tmp_path / "g.json"
    code, out = cli("gate", run, "--plan", "--json", js)
    assert code == 3 and "sample-size plan" in out
    doc = json.loads(js.read_text())
    assert doc["word"] == "INCONCLUSIVE" and doc["plan"][0]["needed_expected"] > 20


def test_rate_increase_within_noise_is_not_discriminative(tmp_path):
    """A truncation increase no larger than the A/A control's is noise, not a failure; without the control
    it fails."""
    run_dir = build(tmp_path / "run", B400, {"fp8_e4m3": list(B400)}, aa=list(B400))
    store = RunStore(run_dir)
    for ref in store.cells():
        n_trunc = {"fp8_e4m3": 40, "bf16": 48 if ref.config.get("aa_control") else 0}[ref.config["kv_dtype"]]
        recs = [json.loads(x) for x in (ref.path / "items.jsonl").read_text().splitlines()]
        for r in recs[:n_trunc]:
            r["finish_reason"] = "length"
        store.write_items(ref.key, recs)
    run = load_run(run_dir)
    trunc = lambda r: next(c for c in r.checks if c.kind == "truncation rate")  # noqa: E731
    with_aa = run_gate(run, "kv_dtype=bf16", None, GateThresholds())
    assert trunc(with_aa).status == "not discriminative" and "A/A" in trunc(with_aa).reason
    assert trunc(run_gate(run, "kv_dtype=bf16", None, GateThresholds(use_aa=False))).status == "fail"


def test_report_tables_do_not_print_a_zero_delta_for_a_blind_metric(tmp_path):
    """GSM8K at 0% for every format: the delta table and the summary say the metric cannot tell, not "+0.0 pp"."""
    base, cands, aa, _ = SCENARIOS["floor"]
    out = tmp_path / "report"
    code, text = cli("report", build(tmp_path / "run", base, cands, aa), "--out", out, "--bootstrap", "200")
    assert code == 0, text
    md = (out / "report.md").read_text()
    summary = md[md.index("\n## Summary\n"):md.index("\n## Accuracy\n")]
    assert "not discriminative (baseline 0%)" in summary and "+0.0 pp" not in summary
    deltas = md[md.index("### Paired deltas"):md.index("### A/A control")]
    row = next(line for line in deltas.splitlines() if line.startswith("| gsm8k |"))
    assert "not discriminative (baseline 0%)" in row and "+0.0 pp" not in row.split("|")[7]

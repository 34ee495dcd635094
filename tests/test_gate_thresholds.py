"""Gate thresholds (merging config sections) and metric selection in reports/gate/check.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from kvbench.reports.gate.check import GateError, GateThresholds, merge_gate_config, run_gate
from kvbench.reports.load import load_run

sys.path.insert(0, str(Path(__file__).parent))
from test_reports_load import make_run  # noqa: E402


def test_merge_runner_gate_spec():
    spec = {"max_drop": {"gsm8k": 0.03}, "confidence": 0.9, "max_invalid_rate_increase": None,
            "max_truncation_rate_increase": 0.1, "max_kl_mean": 0.02}
    t = merge_gate_config(GateThresholds(), spec)
    assert t.drop_for("gsm8k") == 0.03 and t.drop_for("aime24") == 0.05
    assert t.confidence == 0.9 and t.max_truncation_rate_increase == 0.1 and t.max_kl_mean == 0.02
    assert t.max_invalid_rate_increase == 0.05  # None keeps the default
    t2 = merge_gate_config(t, {"max_drop": 0.2})
    assert t2.drop_for("gsm8k") == 0.2 and t.drop_for("gsm8k") == 0.03  # a number replaces every suite; t unchanged
    t3 = merge_gate_config(GateThresholds(), {"max_drop": {"default": 0.1, "aime24": 0.2}, "metrics": ["gsm8k"]})
    assert t3.drop_for("gsm8k") == 0.1 and t3.drop_for("aime24") == 0.2 and t3.metrics == ["gsm8k"]


@pytest.mark.parametrize("bad", [{"max_drop": "x"}, {"max_drop": {"gsm8k": -0.1}}, {"confidence": 1.2},
                                 {"max_kl_mean": math.nan}, [1, 2]])
def test_bad_gate_sections_are_rejected(bad):
    with pytest.raises((GateError, ValueError)):
        merge_gate_config(GateThresholds(), bad)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return load_run(make_run(tmp_path_factory.mktemp("thr") / "run", concurrency=(1,), n_gsm8k=200, n_aime=20,
                             drops={"bf16": 0.0, "nvfp4": 0.3}))


def test_metric_selection(run):
    r = run_gate(run, "kv_dtype=bf16", "kv_dtype=nvfp4", GateThresholds(metrics=["flexible-extract"], n_boot=500))
    acc = [(c.suite, c.metric) for c in r.checks if c.kind == "accuracy"]
    assert acc == [("gsm8k", "flexible-extract")]  # a score name selects every suite that has it
    r = run_gate(run, "kv_dtype=bf16", "kv_dtype=nvfp4", GateThresholds(metrics=["aime24", "gsm8k:strict-match"], n_boot=500))
    assert [(c.suite, c.metric) for c in r.checks if c.kind == "accuracy"] == [("aime24", "correct"), ("gsm8k", "strict-match")]
    with pytest.raises(GateError, match="no such suite"):
        run_gate(run, "kv_dtype=bf16", "kv_dtype=nvfp4", GateThresholds(metrics=["gsm8k_cot"]))


def test_t_and_bootstrap_bounds_agree_roughly(run):
    b = run_gate(run, "kv_dtype=bf16", "kv_dtype=nvfp4", GateThresholds(metrics=["gsm8k"], n_boot=4000))
    t = run_gate(run, "kv_dtype=bf16", "kv_dtype=nvfp4", GateThresholds(metrics=["gsm8k"], method="t"))
    lb_b = [c.bound for c in b.checks if c.kind == "accuracy"][0]
    lb_t = [c.bound for c in t.checks if c.kind == "accuracy"][0]
    assert lb_b == pytest.approx(lb_t, abs=0.015)
    assert not b.passed and not t.passed and b.exit_code == 1


def test_confidence_changes_the_bound(run):
    lo = run_gate(run, "kv_dtype=bf16", "kv_dtype=nvfp4", GateThresholds(metrics=["gsm8k"], method="t", confidence=0.99))
    hi = run_gate(run, "kv_dtype=bf16", "kv_dtype=nvfp4", GateThresholds(metrics=["gsm8k"], method="t", confidence=0.8))
    assert lo.checks[0].bound < hi.checks[0].bound


def _cell(key, correct):
    from kvbench.reports.load import CellData

    items = [{"suite": "gsm8k", "item_id": str(i), "repeat": 0, "correct": ok, "invalid": False, "finish_reason": "stop"}
             for i, ok in enumerate(correct)]
    return CellData(key=key, label=key, config={"kv_dtype": key}, status="done", items=items, short=key)


def test_inconclusive_versus_clear_failure():
    from kvbench.reports.gate.check import gate_one, summary_line, GateResult

    base = _cell("bf16", [True] * 10 + [False] * 10)
    same_mean = _cell("fp8", [False] + [True] * 9 + [True] + [False] * 9)  # one lost, one gained: Δ = 0
    worse = _cell("nvfp4", [False] * 8 + [True] * 2 + [False] * 10)  # eight lost
    t = GateThresholds(max_drop={"gsm8k": 0.01}, n_boot=2000)
    c1 = [c for c in gate_one(base, same_mean, t) if c.kind == "accuracy"][0]
    assert c1.delta == 0.0 and c1.passed is False and c1.inconclusive
    c2 = [c for c in gate_one(base, worse, t) if c.kind == "accuracy"][0]
    assert c2.delta == pytest.approx(-0.4) and c2.passed is False and not c2.inconclusive
    line = summary_line(GateResult(base, [same_mean], [c1], t))
    assert line.startswith("::warning title=kvbench gate::INCONCLUSIVE (exit 3)") and "inconclusive" in line


def test_rate_increase_limits_may_be_unset():
    """A config may leave a rate limit null: validation does not compare None with a number."""
    from kvbench.reports.gate.check import GateThresholds

    GateThresholds(max_invalid_rate_increase=None, max_truncation_rate_increase=None).validate()

"""`kvbench gate` on the long-context score: the ruler suite's primary metric (scores.ruler), one context
length (``ruler:L<length>``) and the area under the accuracy-vs-length curve (``ruler:auc``): pass, fail,
inconclusive, thresholds from flags / the run's gate section / a --config file, and exit 2 for missing data."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.harness.config_checks import SweepConfigError
from kvbench.core.store import RunStore
from kvbench.core.io import read_jsonl
from kvbench.harness.sweep.specs import SuiteSpec, _gate
from kvbench.reports.stats import paired as stats
from kvbench.reports.load import load_run, select
from kvbench.reports.item_records import item_scores
from kvbench.reports.long_context import paired_auc, scores_by_length

sys.path.insert(0, str(Path(__file__).parent))
from test_reports_long_context import make_ruler_run  # noqa: E402

DROPS = {"bf16": 0.0, "fp8_e4m3": 0.004, "nvfp4": 0.12}


def gate(*args):  # with the workflow-command lines these tests read (off GitHub Actions too)
    r = CliRunner().invoke(app, ["gate", "--annotations", *map(str, args)])
    return r.exit_code, r.stdout + (r.stderr or "")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_ruler_run(tmp_path_factory.mktemp("glc") / "run", drops=DROPS, per_cell=30, fidelity=False)


def _cells(root, kv):
    data = load_run(root)
    return (select(data.cells, "kv_dtype=bf16", need_items=True)[0], select(data.cells, f"kv_dtype={kv}", need_items=True)[0])


def test_auc_gate_fails_a_regression_and_passes_a_small_drop(run, tmp_path):
    js = tmp_path / "g.json"
    code, out = gate(run, "--baseline", "kv_dtype=bf16", "--candidate", "kv_dtype=nvfp4", "--metric", "ruler:auc",
                     "--max-drop", "0.1", "--json", js)
    assert code == 1, out
    assert "accuracy [AUC over context lengths]" in out and out.strip().splitlines()[-1].startswith("::error")
    doc = json.loads(js.read_text())
    (row,) = [c for c in doc["checks"] if c["metric"] == "auc"]
    base, cand = _cells(run, "nvfp4")
    p = paired_auc(scores_by_length(base, "ruler"), scores_by_length(cand, "ruler"), n_boot=10_000, seed=0)
    assert row["bound"] == pytest.approx(p.lower_bound) and row["delta"] == pytest.approx(p.delta)
    assert row["baseline"] == pytest.approx(p.base_auc) and row["threshold"] == pytest.approx(-0.1)
    assert row["passed"] is False and p.lower_bound <= -0.1 and not row["inconclusive"]
    code, out = gate(run, "--baseline", "kv_dtype=bf16", "--candidate", "kv_dtype=fp8_e4m3", "--metric", "ruler:auc",
                     "--max-drop", "0.1")
    assert code == 0, out
    assert "tightest: ruler LB" in out.strip().splitlines()[-1]
    # deterministic: the same table twice
    assert gate(run, "--candidate", "kv_dtype=fp8_e4m3", "--metric", "ruler:auc", "--max-drop", "0.1")[1] == out


def test_auc_gate_inconclusive_with_few_items(tmp_path):
    root = make_ruler_run(tmp_path / "small", drops={"bf16": 0.0, "nvfp4": 0.03}, per_cell=1, fidelity=False)
    js = tmp_path / "g.json"
    code, out = gate(root, "--candidate", "kv_dtype=nvfp4", "--metric", "ruler:auc", "--max-drop", "0.1", "--json", js)
    (row,) = json.loads(js.read_text())["checks"][:1]
    assert code == 3, out  # INCONCLUSIVE
    assert row["delta"] > -0.1 >= row["bound"] and row["inconclusive"] is True and row["status"] == "inconclusive"
    assert "INCONCLUSIVE" in out and "more items would decide" in out


def test_length_gate_and_default_primary_metric(run, tmp_path):
    base, cand = _cells(run, "nvfp4")
    js = tmp_path / "g.json"
    code, out = gate(run, "--candidate", "kv_dtype=nvfp4", "--metric", "ruler:L1024", "--metric", "ruler:L4096",
                     "--max-drop", "0.1", "--json", js)
    rows = {c["metric"]: c for c in json.loads(js.read_text())["checks"] if c["kind"] == "accuracy"}
    for n in (1024, 4096):
        d = stats.paired_delta(scores_by_length(base, "ruler")[n], scores_by_length(cand, "ruler")[n])
        assert rows[f"L{n}"]["bound"] == pytest.approx(d.lower_bound) and rows[f"L{n}"]["n"] == d.n_pairs
    assert rows["L4096"]["passed"] is False and code == 1  # the drop grows with length
    assert "[L4096 (4k tokens)]" in out
    assert gate(run, "--candidate", "kv_dtype=nvfp4", "--metric", "ruler:L1024", "--max-drop", "0.2")[0] == 0
    # no --metric: the ruler suite's primary metric, the per-item scores.ruler over every length
    code, out = gate(run, "--candidate", "kv_dtype=nvfp4", "--max-drop", "0.1", "--json", js)
    (row,) = [c for c in json.loads(js.read_text())["checks"] if c["kind"] == "accuracy"]
    d = stats.paired_delta(item_scores(base, "ruler"), item_scores(cand, "ruler"))
    assert row["metric"] == "ruler" and row["bound"] == pytest.approx(d.lower_bound) and code == 1
    assert any(v not in (0.0, 1.0) for v in item_scores(base, "ruler").values())  # scores, not `correct`
    # a per-metric margin on the command line
    assert gate(run, "--candidate", "kv_dtype=nvfp4", "--metric", "ruler:auc", "--max-drop", "ruler:auc=0.4")[0] == 0


def test_gate_section_of_the_run_and_of_a_config_file(tmp_path):
    section = {"metrics": ["ruler:auc"], "max_drop": {"ruler": 0.1}}
    root = make_ruler_run(tmp_path / "run", drops=DROPS, per_cell=30, fidelity=False, gate=section)
    code, out = gate(root, "--candidate", "kv_dtype=nvfp4")
    assert code == 1 and "AUC over context lengths" in out
    assert gate(root, "--candidate", "kv_dtype=fp8_e4m3")[0] == 0
    # the sweep config's gate section validates these names
    g = _gate(section, "gate", [SuiteSpec("ruler")])
    assert g.metrics == ["ruler:auc"] and g.max_drop == {"ruler": 0.1}
    assert _gate({"metrics": ["ruler:L4096"], "max_drop": {"ruler:auc": 0.2}}, "gate", [SuiteSpec("ruler")]).max_drop == {"ruler:auc": 0.2}
    for bad in ({"metrics": ["ruler:L4k"]}, {"metrics": ["ruler:L0"]}, {"max_drop": {"rular:auc": 0.1}}):
        with pytest.raises(SweepConfigError):
            _gate(bad, "gate", [SuiteSpec("ruler")])


def test_gate_config_file_with_the_ruler_suite(tmp_path):
    root = make_ruler_run(tmp_path / "run", drops=DROPS, per_cell=30, fidelity=False)
    cfg = tmp_path / "lc.yaml"
    cfg.write_text("suites: [ruler]\ngate:\n  metrics: [ruler:auc]\n  max_drop: {ruler: 0.1}\n")
    code, out = gate(root, "--candidate", "kv_dtype=nvfp4", "--config", cfg)
    assert code == 1 and "AUC over context lengths" in out, out
    assert gate(root, "--candidate", "kv_dtype=fp8_e4m3", "--config", cfg)[0] == 0


@pytest.mark.parametrize("metric", ["ruler:auc", "ruler:L1024", "ruler"])
def test_mismatched_items_exit_2(tmp_path, metric):
    root = make_ruler_run(tmp_path / "run", drops=DROPS, per_cell=3, fidelity=False)
    store = RunStore(root)
    for ref in store.cells():
        if ref.config["kv_dtype"] == "nvfp4":  # the candidate lost one item of every length
            recs = read_jsonl(ref.path / "items.jsonl")
            store.write_items(ref.key, [r for r in recs if not r["item_id"].startswith("niah_single") or not r["item_id"].endswith("-d0-0")])
    code, out = gate(root, "--candidate", "kv_dtype=nvfp4", "--metric", metric, "--max-drop", "0.5")
    assert code == 2, out
    assert "hold different items" in out and "::error title=kvbench gate::missing data" in out


@pytest.mark.parametrize("metric,needle", [("ruler:L999", "no ruler items of context length 999"),
                                           ("ruler:nope", "no records for ruler:nope")])
def test_bad_length_metrics_exit_2(run, metric, needle):
    code, out = gate(run, "--candidate", "kv_dtype=nvfp4", "--metric", metric)
    assert code == 2 and needle in out, out


def test_auc_needs_a_long_context_suite(tmp_path):
    from test_reports_load import make_run

    root = make_run(tmp_path / "run", concurrency=(1,), n_gsm8k=20, n_aime=2, k_aime=1)
    code, out = gate(root, "--candidate", "kv_dtype=nvfp4", "--metric", "gsm8k:auc")
    assert code == 2 and "carry no context_length" in out

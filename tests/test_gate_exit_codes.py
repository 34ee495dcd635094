"""`kvbench gate` on synthetic runs: a planted regression fails, an A/A control passes, missing data is 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.core.store import RunStore
from kvbench.core.io import read_jsonl
from kvbench.reports.stats import paired as stats
from kvbench.reports.load import load_run, select
from kvbench.reports.item_records import item_scores

sys.path.insert(0, str(Path(__file__).parent))
from test_reports_load import make_run  # noqa: E402

BIG = dict(n_gsm8k=300, n_aime=30, concurrency=(1,), aa_flip=0.01, kl_scale=0.005)  # KL well within the default limit
DROPS = {"bf16": 0.0, "fp8_e4m3": 0.005, "nvfp4": 0.2}


def gate(*args, env=None):  # with the workflow-command lines these tests read (off GitHub Actions too)
    r = CliRunner().invoke(app, ["gate", "--annotations", *map(str, args)], env=env)
    return r.exit_code, r.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("gate") / "run", drops=DROPS, **BIG)


def test_planted_regression_fails(run):
    code, out = gate(run, "--baseline", "kv_dtype=bf16", "--candidate", "kv_dtype=nvfp4")
    assert code == 1, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("::error title=kvbench gate::FAIL")
    assert "gsm8k accuracy" in last
    acc_rows = [l for l in out.splitlines() if " accuracy " in l and not l.startswith("::")]
    assert acc_rows and all(l.rstrip().endswith("FAIL") for l in acc_rows)


def test_aa_control_and_tiny_drop_pass(run):
    code, out = gate(run, "--baseline", "kv_dtype=bf16", "--candidate", "kv_dtype=bf16,aa_control=true")
    assert code == 0, out
    assert out.strip().splitlines()[-1].startswith("::notice title=kvbench gate::PASS")
    code, out = gate(run, "--candidate", "kv_dtype=fp8_e4m3")  # baseline from the run config
    assert code == 0, out


def test_decision_matches_stats_recomputed_from_items(run, tmp_path):
    js = tmp_path / "gate.json"
    code, _ = gate(run, "--candidate", "kv_dtype=nvfp4", "--json", js)
    doc = json.loads(js.read_text())
    assert code == 1 and doc["passed"] is False and doc["exit_code"] == 1
    data = load_run(run)
    base = select(data.cells, "kv_dtype=bf16", need_items=True)[0]
    cand = select(data.cells, "kv_dtype=nvfp4", need_items=True)[0]
    d = stats.paired_delta(item_scores(base, "gsm8k"), item_scores(cand, "gsm8k"))
    row = [c for c in doc["checks"] if c["kind"] == "accuracy" and c["suite"] == "gsm8k"][0]
    assert row["bound"] == pytest.approx(d.lower_bound)
    assert row["delta"] == pytest.approx(d.delta)
    assert row["threshold"] == pytest.approx(-0.05)
    assert row["passed"] is (d.lower_bound > -0.05)


def test_max_drop_flags_decide(run):
    assert gate(run, "--candidate", "kv_dtype=nvfp4", "--max-drop", "0.5")[0] == 0
    # a per-suite flag tightens one suite only
    code, out = gate(run, "--candidate", "kv_dtype=nvfp4", "--max-drop", "0.5", "--max-drop", "gsm8k=0.05")
    assert code == 1 and "gsm8k accuracy" in out.splitlines()[-1] and "aime24 accuracy" not in out.splitlines()[-1]
    # gating a single metric
    code, out = gate(run, "--candidate", "kv_dtype=nvfp4", "--max-drop", "0.5", "--metric", "gsm8k:flexible-extract")
    assert code == 0 and "[flexible-extract]" in out


def test_thresholds_from_manifest_and_config_file(tmp_path):
    root = make_run(tmp_path / "run", drops=DROPS, gate={"max_drop": {"gsm8k": 0.5, "aime24": 0.5}}, **BIG)
    assert gate(root, "--candidate", "kv_dtype=nvfp4")[0] == 0  # the run's own gate section
    assert gate(root, "--candidate", "kv_dtype=nvfp4", "--max-drop", "0.05")[0] == 1  # flags win
    cfg = tmp_path / "strict.yaml"
    cfg.write_text("suites: [gsm8k, aime24]\ngate:\n  max_drop: {gsm8k: 0.01, aime24: 0.01}\n")
    assert gate(root, "--candidate", "kv_dtype=nvfp4", "--config", cfg)[0] == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("gate:\n  max_dorp: 0.1\n")
    assert gate(root, "--candidate", "kv_dtype=nvfp4", "--config", bad)[0] == 2


def test_truncation_and_kl_are_gated(tmp_path):
    root = make_run(tmp_path / "run", drops={"bf16": 0.0, "fp8_e4m3": 0.0}, truncate_extra={"fp8_e4m3": 0.3}, **BIG)
    code, out = gate(root, "--candidate", "kv_dtype=fp8_e4m3")
    assert code == 1 and "truncation rate" in out.splitlines()[-1]
    assert gate(root, "--candidate", "kv_dtype=fp8_e4m3", "--max-truncation-increase", "0.9")[0] == 0
    code, out = gate(root, "--candidate", "kv_dtype=fp8_e4m3", "--max-truncation-increase", "0.9", "--max-kl", "0.001")
    assert code == 1 and "fidelity KL" in out.splitlines()[-1]
    assert gate(root, "--candidate", "kv_dtype=fp8_e4m3", "--max-truncation-increase", "0.9", "--max-kl", "1")[0] == 0


def test_github_step_summary_is_appended(run, tmp_path):
    summary = tmp_path / "summary.md"
    code, _ = gate(run, "--candidate", "kv_dtype=nvfp4", env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert code == 1
    text = summary.read_text()
    assert "kvbench gate: FAIL" in text and "| nvfp4 calibrate | accuracy | gsm8k |" in text


@pytest.mark.parametrize("args,needle", [
    (["--candidate", "kv_type=nvfp4"], "unknown selector key"),
    (["--candidate", "kv_dtype=fp4"], "no done cell"),
    (["--candidate", "nvfp4"], "key=value"),
    (["--baseline", "model=smollm2-135m", "--candidate", "kv_dtype=nvfp4"], "matches 3 cells"),
    (["--candidate", "kv_dtype=bf16"], "only the baseline"),
    (["--candidate", "kv_dtype=nvfp4", "--metric", "gpqa_diamond"], "no such suite or metric"),
    (["--candidate", "kv_dtype=nvfp4", "--max-drop", "lots"], "--max-drop"),
    (["--candidate", "kv_dtype=nvfp4", "--confidence", "1.5"], "confidence"),
    (["--candidate", "kv_dtype=nvfp4", "--method", "magic"], "method"),
])
def test_usage_errors_exit_2(run, args, needle):
    r = CliRunner().invoke(app, ["gate", str(run), "--annotations", *args])
    assert r.exit_code == 2, r.stdout
    assert needle in r.stdout + r.stderr
    assert "::error title=kvbench gate::" in r.stdout


def test_missing_data_exit_2(tmp_path):
    assert gate(tmp_path / "nope", "--candidate", "kv_dtype=nvfp4")[0] == 2
    root = make_run(tmp_path / "failed", drops=DROPS, failed=("nvfp4",), **BIG)
    code, out = gate(root, "--candidate", "kv_dtype=nvfp4")
    assert code == 2 and "no done cell" in out
    # a candidate without fidelity records while a KL maximum is required
    root = make_run(tmp_path / "nofid", drops=DROPS, **BIG)
    store = RunStore(root)
    for ref in store.cells():
        if ref.config["kv_dtype"] == "fp8_e4m3":
            store.write_items(ref.key, [r for r in read_jsonl(ref.path / "items.jsonl") if r["suite"] != "fidelity"])
    assert gate(root, "--candidate", "kv_dtype=fp8_e4m3")[0] == 0
    code, out = gate(root, "--candidate", "kv_dtype=fp8_e4m3", "--max-kl", "0.1")
    assert code == 2 and "no fidelity records" in out
    # a candidate whose suites differ from the baseline's
    for ref in store.cells():
        if ref.config["kv_dtype"] == "fp8_e4m3":
            store.write_items(ref.key, [r for r in read_jsonl(ref.path / "items.jsonl") if r["suite"] != "aime24"])
    code, out = gate(root, "--candidate", "kv_dtype=fp8_e4m3")
    assert code == 2 and "no records for aime24" in out
    # missing --candidate: click's usage error
    assert gate(root)[0] == 2

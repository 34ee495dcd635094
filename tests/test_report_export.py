"""Machine-readable report tables (reports/export.py): CSV and report.json values equal the analysis'
numbers, the JSON is strict and round-trips, extra tables, missing values, and the report commands."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.reports.analysis import AccuracyRow, DeltaRow
from kvbench.reports.compare import report_analysis
from kvbench.reports.export import SCHEMA_VERSION, SECTIONS, frames, load_tables, write_exports
from kvbench.reports.load import load_run

sys.path.insert(0, str(Path(__file__).parent))
from test_reports_load import make_run  # noqa: E402
from test_reports_long_context import make_ruler_run, ruler_items  # noqa: E402


def _strict(text: str) -> dict:
    def refuse(token):
        raise AssertionError(f"non-strict JSON token {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("exp") / "run", concurrency=(1, 4), n_gsm8k=40, n_aime=6, k_aime=3)


@pytest.fixture(scope="module")
def analysis(run):
    return report_analysis(load_run(run), n_boot=200)


@pytest.fixture(scope="module")
def exported(analysis, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    extra = {"verdicts": [{"suite": "gsm8k", "verdict": "PASS", "lower_bound": -0.01, "reasons": ["a", "b"]},
                          {"suite": "aime24", "verdict": "FAIL", "lower_bound": float("-inf"), "reasons": []}],
             "gate_checks": [{"check": "kl", "value": float("nan"), "limit": 0.05, "ok": True}]}
    written = write_exports(analysis, out, extra=extra, meta={"title": "t", "command": "kvbench report x"})
    return out, written


def _row(df: pd.DataFrame, **where) -> pd.Series:
    sel = df
    for k, v in where.items():
        sel = sel[sel[k] == v]
    assert len(sel) == 1, (where, len(sel))
    return sel.iloc[0]


def test_csv_values_equal_the_analysis_numbers(run, analysis, exported):
    out, written = exported
    acc = pd.read_csv(out / "tables" / "accuracy.csv")
    base = analysis.baseline
    # a known fraction computed from the records themselves, not through the statistics code
    items = [r for r in base.items if r["suite"] == "gsm8k"]
    known = sum(1 for r in items if r["correct"]) / len(items)
    row = _row(acc, cell_key=base.key, suite="gsm8k", metric="correct")
    assert row["accuracy"] == known and row["n_questions"] == len(items) and row["k"] == 1
    assert row["kv_dtype"] == "bf16" and row["concurrency"] == 1 and not row["aa_control"] and row["primary_metric"]
    assert row["cell"] == base.short and row["run"] == base.run and row["interval_method"] == "wilson"
    for r in analysis.accuracy:
        got = _row(acc, cell_key=r.cell.key, suite=r.suite, metric=r.metric)
        assert (got["accuracy"], got["ci_low"], got["ci_high"]) == (r.est.mean, r.est.lo, r.est.hi)
        assert got["invalid_rate"] == r.invalid_rate and got["truncation_rate"] == r.truncation_rate
    aime = _row(acc, cell_key=base.key, suite="aime24", metric="correct")
    assert aime["k"] == 3 and aime["interval_method"] == "t" and 0 <= aime["pass_at_k"] <= 1

    deltas = pd.read_csv(out / "tables" / "deltas.csv")
    assert len(deltas) == len(analysis.deltas) > 0
    for r in analysis.deltas:
        got = _row(deltas, cell_key=r.cell.key, suite=r.suite)
        d = r.d
        assert got["baseline_key"] == r.base.key and got["metric"] == r.metric
        assert (got["delta"], got["ci_low"], got["ci_high"], got["p_holm"]) == (d.delta, d.ci_lo, d.ci_hi, r.p_holm)
        assert (got["baseline_mean"], got["cell_mean"], got["n_pairs"]) == (d.base_mean, d.cand_mean, d.n_pairs)
        if d.base_only >= 0:
            assert (got["n_lost"], got["n_gained"]) == (d.base_only, d.cand_only)
        else:  # the -1 sentinel of K>1 is a missing value
            assert math.isnan(got["n_lost"]) and math.isnan(got["n_gained"])
    aa = pd.read_csv(out / "tables" / "aa.csv")
    assert len(aa) == len(analysis.aa) == 2
    assert list(aa["output_agreement"]) == [r.output_agreement for r in analysis.aa]

    serving = pd.read_csv(out / "tables" / "serving.csv")
    assert len(serving) == len(analysis.serving)
    for cell, s in analysis.serving:
        got = _row(serving, cell_key=cell.key)
        assert got["median_ttft_ms"] == s["median_ttft_ms"] and got["completed"] == s["completed"]
    cap = pd.read_csv(out / "tables" / "capacity.csv")
    nv = _row(cap, kv_dtype="nvfp4")
    assert nv["tokens_vs_baseline"] == pytest.approx(2.0 / 0.5625, rel=1e-3)  # bytes per element, bf16 / nvfp4
    assert nv["tokens"] == next(c for c, *_ in analysis.capacity if c.config["kv_dtype"] == "nvfp4").capacity["tokens"]
    fid = pd.read_csv(out / "tables" / "fidelity.csv")
    for f in analysis.fidelity:
        assert _row(fid, cell_key=f.cell.key)["kl_mean"] == f.kl_mean
    cells = pd.read_csv(out / "tables" / "cells.csv")
    assert len(cells) == len(analysis.cells) and int(cells["is_baseline"].sum()) == 1
    assert set(written) >= {"json", "accuracy.csv", "verdicts.csv", "gate_checks.csv"}


def test_json_is_strict_and_round_trips(analysis, exported):
    out, _ = exported
    doc = _strict((out / "report.json").read_text())
    assert doc["schema_version"] == SCHEMA_VERSION and doc["generated_by"] == "kvbench"
    assert doc["meta"]["title"] == "t" and doc["meta"]["confidence"] == 0.95
    assert doc["meta"]["baseline"]["cell_key"] == analysis.baseline.key
    assert list(doc["tables"]) == [*SECTIONS, "verdicts", "gate_checks"]
    assert doc["tables"]["lengths"] == {"columns": [], "rows": []}  # no long-context suite in this run
    loaded = load_tables(out / "report.json")
    built = frames(analysis, {"verdicts": [], "gate_checks": []})
    for name in SECTIONS:
        pd.testing.assert_frame_equal(loaded[name], built[name], check_dtype=True)
    assert load_tables(out)["accuracy"].equals(loaded["accuracy"])  # the directory works too
    # the documented pure-pandas one-liner gives the same numbers
    acc = pd.DataFrame(json.load(open(out / "report.json"))["tables"]["accuracy"]["rows"])
    assert list(acc.columns) == doc["tables"]["accuracy"]["columns"]
    assert list(acc["accuracy"]) == [r.est.mean for r in analysis.accuracy]


def test_missing_and_non_finite_values_are_null(analysis, exported):
    out, _ = exported
    doc = _strict((out / "report.json").read_text())
    # make_run's summaries hold no pooled KL p99: NaN in the analysis, null in JSON, empty in CSV
    assert all(math.isnan(f.kl_p99) for f in analysis.fidelity)
    assert all(r["kl_p99"] is None for r in doc["tables"]["fidelity"]["rows"])
    line = (out / "tables" / "fidelity.csv").read_text().splitlines()
    cols = line[0].split(",")
    assert all(row.split(",")[cols.index("kl_p99")] == "" for row in line[1:])
    v = doc["tables"]["verdicts"]["rows"]
    assert v[0] == {"suite": "gsm8k", "verdict": "PASS", "lower_bound": -0.01, "reasons": '["a", "b"]'}
    assert v[1]["lower_bound"] is None and v[1]["reasons"] == "[]"  # -inf: null
    assert doc["tables"]["gate_checks"]["rows"] == [{"check": "kl", "value": None, "limit": 0.05, "ok": True}]
    gc = pd.read_csv(out / "tables" / "gate_checks.csv")
    assert math.isnan(gc["value"][0]) and gc["limit"][0] == 0.05 and bool(gc["ok"][0])


def test_extra_tables_names_and_stale_csvs(analysis, tmp_path):
    with pytest.raises(ValueError):
        frames(analysis, {"accuracy": [{"x": 1}]})
    with pytest.raises(ValueError):
        frames(analysis, {"../evil": [{"x": 1}]})
    write_exports(analysis, tmp_path, extra={"verdicts": [{"a": 1}]})
    assert (tmp_path / "tables" / "verdicts.csv").read_text() == "a\n1\n"
    written = write_exports(analysis, tmp_path, extra={"verdicts": []})  # empty now: no CSV, an empty table
    assert not (tmp_path / "tables" / "verdicts.csv").exists() and "verdicts.csv" not in written
    doc = _strict((tmp_path / "report.json").read_text())
    assert doc["tables"]["verdicts"] == {"columns": [], "rows": []}
    assert not (tmp_path / "tables" / "lengths.csv").exists()  # empty sections get no CSV


def test_new_fields_become_columns_without_changes(analysis):
    @dataclasses.dataclass
    class AccuracyRowMore(AccuracyRow):  # fields the analysis may gain later
        n_later: int = 3
        later_rate: float = 0.075

    @dataclasses.dataclass
    class DeltaRowMore(DeltaRow):
        n_later_pairs: int = 2

    a = dataclasses.replace(analysis)
    a.accuracy = [AccuracyRowMore(**{f.name: getattr(r, f.name) for f in dataclasses.fields(r)}) for r in analysis.accuracy]
    a.deltas = [DeltaRowMore(**{f.name: getattr(r, f.name) for f in dataclasses.fields(r)}) for r in analysis.deltas]
    a.serving = [(c, {**s, "p999_ttft_ms": 1.5, "slo": {"ttft_ms": 200.0}}) for c, s in analysis.serving]
    f = frames(a)
    assert list(f["accuracy"]["n_later"]) == [3] * len(a.accuracy) and f["accuracy"]["later_rate"][0] == 0.075
    assert list(f["deltas"]["n_later_pairs"]) == [2] * len(a.deltas)
    # every field of the analysis' own rows is a column (whatever fields they have today)
    for section, rows in (("accuracy", analysis.accuracy), ("deltas", analysis.deltas)):
        simple = [x.name for x in dataclasses.fields(rows[0])
                  if isinstance(getattr(rows[0], x.name), (int, float, str)) and x.name not in ("cell", "base")]
        assert set(simple) <= set(f[section].columns), (section, set(simple) - set(f[section].columns))
    assert f["serving"]["p999_ttft_ms"][0] == 1.5 and f["serving"]["slo_ttft_ms"][0] == 200.0


def test_long_context_and_position_tables(tmp_path):
    def items(kv):
        p = {1024: 0.9, 2048: 0.6, 4096: 1e-9}  # the baseline finds nothing at 4k
        recs = ruler_items("bf16", 0.0, per_cell=3, base_p=p)
        if kv == "nvfp4":
            for r in recs:
                if r["context_length"] == 4096 and r["item_id"].startswith("niah_single") and r["item_id"].endswith("-0"):
                    r["scores"]["ruler"], r["correct"] = 1.0, True
        return recs

    root = make_ruler_run(tmp_path / "run", drops={"bf16": 0.0, "nvfp4": 0.0}, items_for=items)
    a = report_analysis(load_run(root), n_boot=200)
    write_exports(a, tmp_path / "out")
    t = load_tables(tmp_path / "out")
    lengths = t["lengths"]
    assert len(lengths) == sum(len(r.by_length) for r in a.lengths) == 6
    for r in a.lengths:
        for n, e in r.by_length.items():
            got = _row(lengths, cell_key=r.cell.key, context_length=n)
            assert (got["accuracy"], got["n_questions"], got["auc"]) == (e.mean, e.n, r.auc.value)
    (rec,) = a.recovery
    rows = t["recovery"].sort_values("context_length")
    assert list(rows["context_length"]) == list(rec.paired.lengths)
    assert rows["ratio"].iloc[0] == pytest.approx(1.0) and pd.isna(rows["ratio"].iloc[2])  # baseline 0: null
    assert rows["ratio_ci_high"].isna().iloc[2]  # an infinite bound is a missing value
    assert rows["delta"].iloc[1] == rec.deltas[2048].delta
    assert rows["auc_ratio"].iloc[0] == rec.paired.auc_ratio and rows["auc_delta"].iloc[0] == rec.paired.delta
    assert rows["baseline_auc"].iloc[0] == rec.paired.base_auc
    pos = t["fidelity_positions"]
    assert len(pos) == sum(len(r.buckets) for r in a.positions) > 0
    b = a.positions[-1].buckets[-1]
    got = _row(pos, cell_key=a.positions[-1].cell.key, position_lo=b.lo)
    assert (got["kl_mean"], got["n_tokens"], got["bucket"], got["position_hi"]) == (b.kl_mean, b.n_tokens, b.label, b.hi)
    doc = _strict((tmp_path / "out" / "report.json").read_text())
    assert any(r["ratio"] is None for r in doc["tables"]["recovery"]["rows"])


def test_report_and_compare_commands_write_the_exports(run, tmp_path):
    out = tmp_path / "rep"
    r = CliRunner().invoke(app, ["report", str(run), "--out", str(out), "--bootstrap", "100"])
    assert r.exit_code == 0, r.output
    doc = _strict((out / "report.json").read_text())
    assert doc["meta"]["command"].startswith("kvbench report") and (out / "tables" / "accuracy.csv").is_file()
    assert "report.json, tables/*.csv" in (out / "report.md").read_text()
    other = make_run(tmp_path / "run2", concurrency=(1, 4), n_gsm8k=40, n_aime=6, k_aime=3, seed=1)
    cmp_out = tmp_path / "cmp"
    r = CliRunner().invoke(app, ["compare", str(run), str(other), "--out", str(cmp_out), "--bootstrap", "100"])
    assert r.exit_code == 0, r.output
    t = load_tables(cmp_out)
    assert set(t["deltas"]["run"]) == {"run2"} and set(t["deltas"]["baseline_run"]) == {"run"}
    assert set(t["cells"]["run"]) == {"run", "run2"}

"""KV error diagnostics in the machine-readable report: ``tables/diagnostics.csv`` (one row per diagnosed cell
and layer) and ``report.json``'s ``diagnostics`` list (one summary per cell); a run without diagnostics gets
neither (no CSV, no ``tables.diagnostics``, no top-level ``diagnostics`` key)."""

from __future__ import annotations

import copy
import csv
import json
import logging
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.reports.diagnostics_export import DIAGNOSTICS_COLUMNS, diagnostics_entries, diagnostics_rows
from kvbench.reports.export import SECTIONS, load_tables

sys.path.insert(0, str(Path(__file__).parent))
from test_reports_load import make_run  # noqa: E402


def small_diag() -> dict:
    """Three layers × two kv heads.  Layer 0 is kept in bf16, layer 1 has a sliding window, layer 2 carries the
    most KL; the V rel errors of layer 2 are not dyadic (their mean is a rounded float)."""
    def part(rel, sat, flushed):
        return {"rel_err": rel, "saturated": sat, "flushed": flushed, "amax": [4.0, 5.0], "scale": [1.0, 1.0],
                "max_repr": [448.0, 448.0], "values": 512}

    layers = [
        {"layer": 0, "format": "bf16", "sliding_window": None,
         "k": part([0.0, 0.0], [0.0, 0.0], [0.0, 0.0]), "v": part([0.0, 0.0], [0.0, 0.0], [0.0, 0.0]),
         "attn_rel_err": [0.0, 0.0], "kl_loo": 0.04, "kl_contribution": 0.0},
        {"layer": 1, "format": "fp8_e4m3", "sliding_window": 512,
         "k": part([0.25, 0.5], [0.0, 0.125], [0.0, 0.0]), "v": part([0.125, 0.375], [0.0, None], [0.0625, 0.25]),
         "attn_rel_err": [0.5, 0.75], "kl_loo": 0.035, "kl_contribution": 0.005},
        {"layer": 2, "format": "fp8_e4m3", "sliding_window": None,
         "k": part([0.03125, 0.09375], [0.0078125, 0.00390625], [0.0, 0.0]),
         "v": part([0.1, 0.2], [0.0, 0.0], [0.0, 0.0]),
         "attn_rel_err": [0.1, 0.7], "kl_loo": 0.01, "kl_contribution": 0.03},
        {"layer": 3, "format": "fp8_e4m3", "sliding_window": None,
         "k": part([0.5, 0.5], [0.0, 0.0], [0.0, 0.0]), "v": part([0.5, 0.5], [0.0, 0.0], [0.0, 0.0]),
         "attn_rel_err": [0.5, 0.5], "kl_loo": None, "kl_contribution": None},
    ]
    return {"schema": "kvbench:diagnostics:v1", "model": "toy-4l", "kv_dtype": "fp8_e4m3", "kv_scales": "calibrate",
            "kv_dtype_skip_layers": "0", "layer_dtypes": [r["format"] for r in layers], "num_layers": 4,
            "num_kv_heads": 2, "head_dim": 64, "backend": "torch",
            "texts": {"n": 4, "tokens": 1024, "label": "synthetic"}, "layers": layers,
            "kl": {"full": 0.04, "top1_agree": 0.9921875, "method": "leave-one-out", "tokens": 1000},
            "suggestion": {"limit": 0.02, "skip_layers": "0,2", "kl": 0.0125, "met": True,
                           "steps": [{"skip_layers": "0", "n_skipped": 1, "kl": 0.04, "bytes_per_token": 1000.0}],
                           "capacity": {"context_len": 4096, "budget_bytes": 2**30, "rows": [
                               {"name": "bf16", "bytes_per_token": 2048.0, "tokens": 524288, "max_concurrency": 128},
                               {"name": "fp8_e4m3", "bytes_per_token": 1088.0, "tokens": 986895, "max_concurrency": 240},
                               {"name": "fp8_e4m3 skip 0,2", "bytes_per_token": 1568.0, "tokens": 684784,
                                "max_concurrency": 167}]}},
            "confirm": None}


def _fmean(vals):
    return statistics.fmean([v for v in vals if v is not None])


def _vmax(vals):
    return max(v for v in vals if v is not None)


def expected_rows(diag: dict, key: str, short: str, run: str) -> list[dict]:
    """The CSV rows computed straight from the JSON, independently of the exporter."""
    out = []
    for r in diag["layers"]:
        out.append({"cell_key": key, "cell": short, "run": run, "kv_dtype": diag["kv_dtype"], "layer": r["layer"],
                    "format": r["format"], "sliding_window": r["sliding_window"],
                    "k_rel_err_mean": _fmean(r["k"]["rel_err"]), "v_rel_err_mean": _fmean(r["v"]["rel_err"]),
                    "attn_rel_err_mean": _fmean(r["attn_rel_err"]),
                    "k_saturated_max": _vmax(r["k"]["saturated"]), "v_saturated_max": _vmax(r["v"]["saturated"]),
                    "k_flushed_max": _vmax(r["k"]["flushed"]), "v_flushed_max": _vmax(r["v"]["flushed"]),
                    "kl_loo": r["kl_loo"], "kl_contribution": r["kl_contribution"]})
    return out


def _parse(col: str, text: str):
    if text == "":
        return None
    if col in ("layer", "sliding_window"):
        return int(text)
    if col in ("cell_key", "cell", "run", "kv_dtype", "format"):
        return text
    return float(text)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = make_run(tmp_path_factory.mktemp("diagexp") / "run", drops={"bf16": 0.0, "fp8_e4m3": 0.05},
                    concurrency=(1,), aa=False, n_gsm8k=20, n_aime=4, k_aime=1)
    cells = [p for p in (root / "cells").iterdir()
             if json.loads((p / "cell.json").read_text()).get("config", {}).get("kv_dtype") == "fp8_e4m3"]
    assert len(cells) == 1
    return root, cells[0]


def _report(run_dir: Path, out: Path) -> dict:
    r = CliRunner().invoke(app, ["report", str(run_dir), "--out", str(out), "--bootstrap", "100"])
    assert r.exit_code == 0, r.output
    return json.loads((out / "report.json").read_text(), parse_constant=lambda t: pytest.fail(f"token {t}"))


def test_report_exports_diagnostics_then_drops_them(run, tmp_path):
    root, cell_dir = run
    diag = small_diag()
    (cell_dir / "diagnostics.json").write_text(json.dumps(diag))
    out = tmp_path / "rep"
    try:
        doc = _report(root, out)
    finally:
        (cell_dir / "diagnostics.json").unlink()
    key = cell_dir.name
    short = next(r["cell"] for r in doc["tables"]["cells"]["rows"] if r["cell_key"] == key)
    assert short.startswith("fp8_e4m3") and {r["run"] for r in doc["tables"]["cells"]["rows"]} == {"run"}
    want = expected_rows(diag, key, short, "run")
    # spot values, so that the expectation itself is checked
    assert want[1]["k_rel_err_mean"] == 0.375 and want[1]["v_saturated_max"] == 0.0 and want[1]["v_flushed_max"] == 0.25
    assert want[2]["k_saturated_max"] == 0.0078125 and want[3]["kl_contribution"] is None

    # tables/diagnostics.csv: one row per layer, exact numbers, the documented columns in order
    with open(out / "tables" / "diagnostics.csv", newline="") as f:
        lines = list(csv.reader(f))
    assert tuple(lines[0]) == DIAGNOSTICS_COLUMNS
    got = [{c: _parse(c, v) for c, v in zip(lines[0], line)} for line in lines[1:]]
    assert got == want
    # the same rows in report.json's table index, and through load_tables
    t = doc["tables"]["diagnostics"]
    assert tuple(t["columns"]) == DIAGNOSTICS_COLUMNS and t["rows"] == want
    assert [k for k in doc["tables"] if k not in SECTIONS][0] == "diagnostics"
    assert list(doc["tables"])[: len(SECTIONS)] == list(SECTIONS)  # the existing tables keep their place
    df = load_tables(out)["diagnostics"]
    assert list(df["layer"]) == [0, 1, 2, 3] and list(df["sliding_window"].isna()) == [True, False, True, True]
    assert df["v_rel_err_mean"][2] == _fmean([0.1, 0.2])

    # report.json's diagnostics list: one summary entry for the cell
    (entry,) = doc["diagnostics"]
    sug = diag["suggestion"]
    assert entry == {
        "cell_key": key, "cell": short, "run": "run", "kv_dtype": "fp8_e4m3", "kv_dtype_skip_layers": "0",
        "kl_full": 0.04, "top1_agree": 0.9921875, "tokens": 1000,
        "top_layers": [{"layer": 2, "kl_contribution": 0.03}, {"layer": 1, "kl_contribution": 0.005},
                       {"layer": 0, "kl_contribution": 0.0}],
        "suggestion": {"skip_layers": "0,2", "kl": 0.0125, "limit": 0.02, "met": True,
                       "capacity": {"context_len": 4096, "budget_bytes": 2**30, "rows": sug["capacity"]["rows"]}}}
    # the existing keys are unchanged
    assert set(doc) == {"schema_version", "generated_by", "meta", "tables", "diagnostics"}

    # the same run without diagnostics, into the same directory: the stale CSV and the key are gone
    doc2 = _report(root, out)
    assert not (out / "tables" / "diagnostics.csv").exists()
    assert "diagnostics" not in doc2 and "diagnostics" not in doc2["tables"]
    assert set(doc2) == {"schema_version", "generated_by", "meta", "tables"}
    assert (out / "tables" / "accuracy.csv").is_file()


def test_run_without_diagnostics_gets_neither(run, tmp_path):
    root, cell_dir = run
    assert not (cell_dir / "diagnostics.json").exists()
    out = tmp_path / "plain"
    doc = _report(root, out)
    assert "diagnostics" not in doc  # no key at all (not an empty list)
    assert "diagnostics" not in doc["tables"]
    assert not (out / "tables" / "diagnostics.csv").exists()
    assert "diagnostics" not in load_tables(out)


def _cell(key, diag, short="s", run="r", config=None):
    return SimpleNamespace(key=key, short=short, label=key, run=run, config=config or {}, diagnostics=diag)


def test_partial_and_malformed_files(caplog):
    d = small_diag()
    bare = copy.deepcopy(d)
    bare.update(kl=None, suggestion=None, kv_dtype=None)
    for r in bare["layers"]:
        r.update(kl_contribution=None, format=None)
        r["k"]["saturated"] = []
    bad = copy.deepcopy(d)
    bad["layers"] = "nope"
    cells = [_cell("a", bare, config={"kv_dtype": "nvfp4"}), _cell("b", bad), _cell("c", None)]
    with caplog.at_level(logging.WARNING, logger="kvbench.report"):
        rows = diagnostics_rows(cells)
        entries = diagnostics_entries(cells)
    assert "cell b" in caplog.text  # the malformed cell is left out with a warning
    assert [r["cell_key"] for r in rows] == ["a"] * 4 and [e["cell_key"] for e in entries] == ["a"]
    # no format on the layer: the file's layer_dtypes; no saturated values: None; the config's kv_dtype
    assert [r["format"] for r in rows] == ["bf16", "fp8_e4m3", "fp8_e4m3", "fp8_e4m3"]
    assert all(r["k_saturated_max"] is None and r["kl_contribution"] is None for r in rows)
    assert rows[0]["kv_dtype"] == "nvfp4"
    (e,) = entries
    assert e["suggestion"] is None and e["top_layers"] == [] and e["kl_full"] is None and e["top1_agree"] is None
    assert e["tokens"] == 1024  # no kl block: the texts' token count
    assert diagnostics_rows([_cell("x", None)]) == [] and diagnostics_entries([]) == []

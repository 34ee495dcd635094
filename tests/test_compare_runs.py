"""`kvbench compare RUN_A RUN_B`: cells matched by configuration, accuracy and serving deltas per matched
cell, the configuration diff as paths, and the cells with no partner."""

from __future__ import annotations

from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.core.store import RunStore
from kvbench.core.io import canonical_key
from kvbench.reports.compare import compare_analysis
from kvbench.reports.load import load_run
from kvbench.reports.run_diff import config_diff, diff_runs, format_diff, match_keys


def _requests(seconds_per_request: float, n: int = 10) -> list[dict]:
    """Sequential requests of 10 output tokens each: throughput 10 / seconds_per_request tok/s."""
    return [{"request_id": f"r{j}", "success": True, "error": None, "prompt_tokens": 8, "output_tokens": 10,
             "start_s": j * seconds_per_request, "ttft_s": 0.1, "latency_s": seconds_per_request,
             "itl_s": [0.01] * 9, "tpot_s": 0.01} for j in range(n)]


def make_run(root, model: str, budget: float, cells: dict) -> str:
    """``cells[(kv, conc)] = (n_correct_of_10 or None, seconds_per_request or None)``."""
    store = RunStore(root)
    store.write_manifest({"config": {"name": "t", "model": model, "engine": {"kv_budget_gb": budget},
                                     "axes": {"kv": sorted({kv for kv, _ in cells}), "concurrency": [1, 4]}}})
    for (kv, conc), (n_ok, spr) in cells.items():
        cfg = {"model": model, "target": "embedded", "prefill_backend": "torch", "decode_backend": "torch",
               "kv_dtype": kv, "kv_scales": "unit", "concurrency": conc}
        key = canonical_key(cfg)
        store.init_cell(key, cfg, label=f"{kv} c={conc}")
        if n_ok is not None:
            store.write_items(key, [{"suite": "gsm8k", "item_id": f"q{i}", "repeat": 0, "correct": i < n_ok,
                                     "invalid": False, "finish_reason": "stop", "scores": {}} for i in range(10)])
        if spr is not None:
            store.write_requests(key, _requests(spr))
        store.write_json(key, "summary", {"suites": {}, "load": {}, "capacity": None, "error": None})
        store.set_status(key, "done")
    return str(root)


def runs(tmp_path):
    a = make_run(tmp_path / "a", "/models/old", 1.0, {("bf16", 1): (8, 1.0), ("bf16", 4): (None, 0.5),
                                                       ("nvfp4", 1): (5, 0.8), ("fp8_e4m3", 1): (7, None)})
    b = make_run(tmp_path / "b", "/models/new", 2.0, {("bf16", 1): (9, 0.5), ("bf16", 4): (None, 0.5),
                                                       ("nvfp4", 1): (4, 0.4), ("nvfp4", 4): (None, 0.2)})
    return load_run(a), load_run(b)


def test_cells_match_by_configuration_not_by_run_constants(tmp_path):
    a, b = runs(tmp_path)
    assert match_keys([a, b]) == ["aa_control", "concurrency", "kv_dtype"]  # model differs but is per-run
    d = diff_runs(a, b)
    assert sorted((p.a.config["kv_dtype"], p.a.config["concurrency"], p.b.config["model"]) for p in d.pairs) == [
        ("bf16", 1, "/models/new"), ("bf16", 4, "/models/new"), ("nvfp4", 1, "/models/new")]
    assert [(c.config["kv_dtype"], c.config["concurrency"]) for c in d.only_a] == [("fp8_e4m3", 1)]
    assert [(c.config["kv_dtype"], c.config["concurrency"]) for c in d.only_b] == [("nvfp4", 4)]
    assert d.config == [("axes.kv", ["bf16", "fp8_e4m3", "nvfp4"], ["bf16", "nvfp4"]),
                        ("engine.kv_budget_gb", 1.0, 2.0), ("model", "/models/old", "/models/new")]


def test_config_diff_paths():
    assert config_diff({"a": {"b": 1, "c": [1, {"d": 2}]}, "x": 1}, {"a": {"b": 1, "c": [1, {"d": 3}]}, "y": 2}) == [
        ("a.c[1].d", 2, 3), ("x", 1, None), ("y", None, 2)]
    assert config_diff({"k": [1]}, {"k": [1, 2]}) == [("k", [1], [1, 2])]


def test_report_text_has_deltas_diff_and_unmatched(tmp_path):
    a, b = runs(tmp_path)
    md = format_diff(diff_runs(a, b))
    assert "| `engine.kv_budget_gb` | 1.0 | 2.0 |" in md and "| `model` | /models/old | /models/new |" in md
    assert "| bf16 c=1 | gsm8k | 80.0% (n=10) | 90.0% (n=10) | +10.0 pts | +10.0 pts (10) |" in md
    assert "| nvfp4 c=1 | gsm8k | 50.0% (n=10) | 40.0% (n=10) | -10.0 pts | -10.0 pts (10) |" in md
    # out tok/s: 10 requests x 10 tokens over 10 x seconds_per_request -> 10, 20 (bf16 c=1), 12.5, 25 (nvfp4)
    assert "| bf16 c=1 | 10 → 20 (×2.000) |" in md and "| nvfp4 c=1 | 12.5 → 25 (×2.000) |" in md
    assert "| bf16 c=4 | 20 → 20 (×1.000) |" in md
    assert "- only in a: fp8_e4m3 c=1 [" in md and "- only in b: nvfp4 c=4 [" in md
    assert "No data" not in md


def test_paired_report_pairs_across_a_changed_model(tmp_path):
    a, b = runs(tmp_path)
    an = compare_analysis([a, b], n_boot=200)
    got = {(r.cell.config["kv_dtype"], r.suite, round(r.d.delta, 6)) for r in an.deltas}
    assert got == {("bf16", "gsm8k", 0.1), ("nvfp4", "gsm8k", -0.1)}


def test_cli_prints_and_writes_the_comparison(tmp_path):
    a, b = runs(tmp_path)
    out = tmp_path / "cmp"
    r = CliRunner().invoke(app, ["compare", str(a.path), str(b.path), "--out", str(out), "--bootstrap", "200"])
    assert r.exit_code == 0, r.stdout + r.stderr
    text = (out / "compare.md").read_text()
    assert text.strip() in r.stdout
    for title in ("## Configuration differences", "## Accuracy (3 matched cells)", "## Serving", "## Cells with no partner"):
        assert title in text
    assert (out / "report.md").exists()

"""`kvbench report` and `kvbench compare` on synthetic runs: files produced, readable, self-contained."""

from __future__ import annotations

import base64
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.core.store import RunStore
from kvbench.reports.stats import paired as stats
from kvbench.reports.compare import compare_analysis, load_runs, report_analysis
from kvbench.reports.load import load_run
from kvbench.reports.item_records import item_scores

sys.path.insert(0, str(Path(__file__).parent))
from test_reports_load import make_run  # noqa: E402

PLOTS = {"accuracy", "deltas", "accuracy_throughput", "fidelity", "serving", "latency", "capacity"}


def cli(*args):
    r = CliRunner().invoke(app, [*map(str, args)])
    return r.exit_code, r.stdout + (r.stderr or "")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("rep") / "run", failed=("fp8_e5m2",),
                    drops={"bf16": 0.0, "fp8_e4m3": 0.02, "fp8_e5m2": 0.1, "nvfp4": 0.35})


def _check_png(path: Path):
    import matplotlib.image as mpimg

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 300
    assert float(img[..., :3].std()) > 0.01  # not a blank canvas


def test_report_writes_markdown_html_and_plots(run, tmp_path):
    out = tmp_path / "rep"
    code, text = cli("report", run, "--out", out, "--bootstrap", "2000")
    assert code == 0, text
    assert str((out / "report.html").resolve()) in text
    for name in PLOTS:
        _check_png(out / f"{name}.png")
    md = (out / "report.md").read_text()
    for title in ("## Accuracy", "### Paired deltas against the baseline", "### A/A control", "### Fidelity",
                  "### Serving: load and throughput", "### Serving: latency (ms)", "### KV capacity by format", "### Cells"):
        assert title in md
    for name in PLOTS:
        assert f"]({name}.png)" in md
    assert "RuntimeError: boom" in md  # the failed cell is listed with its error
    assert "kvbench report" in md and "--out" in md  # how to regenerate it


def test_html_is_self_contained(run, tmp_path):
    out = tmp_path / "rep"
    assert cli("report", run, "--out", out, "--bootstrap", "500")[0] == 0
    page = (out / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<style>" in page
    refs = re.findall(r"""(?:src|href)=['"]([^'"]*)['"]""", page)
    assert refs and all(r.startswith("data:image/png;base64,") for r in refs)
    assert not re.search(r"https?://", page)
    inlined = [base64.b64decode(r.split(",", 1)[1]) for r in refs]
    assert sorted(inlined) == sorted((out / f"{n}.png").read_bytes() for n in PLOTS)


def test_report_numbers_match_stats(run):
    data = load_run(run)
    a = report_analysis(data, n_boot=1000)
    assert a.baseline.config["kv_dtype"] == "bf16" and not a.baseline.aa_control
    # one delta row per (candidate cell with items, suite); the failed fp8_e5m2 cell is left out
    assert {(r.cell.config["kv_dtype"], r.suite) for r in a.deltas} == {
        (kv, s) for kv in ("fp8_e4m3", "nvfp4") for s in ("gsm8k", "aime24")}
    row = [r for r in a.deltas if r.cell.config["kv_dtype"] == "nvfp4" and r.suite == "gsm8k"][0]
    d = stats.paired_delta(item_scores(a.baseline, "gsm8k"), item_scores(row.cell, "gsm8k"), n_boot=1000)
    assert (row.d.delta, row.d.ci_lo, row.d.ci_hi, row.d.p_value) == pytest.approx((d.delta, d.ci_lo, d.ci_hi, d.p_value))
    assert [r.p_holm for r in a.deltas] == pytest.approx(stats.holm([r.d.p_value for r in a.deltas]))
    # A/A: agreement of raw outputs computed independently
    aa = [r for r in a.aa if r.suite == "gsm8k"][0]
    raw = lambda c: {r["item_id"]: r["raw_output"] for r in c.items if r["suite"] == "gsm8k"}  # noqa: E731
    rb, rc = raw(a.baseline), raw(aa.cell)
    assert aa.output_agreement == pytest.approx(sum(rb[k] == rc[k] for k in rb) / len(rb))
    assert aa.output_agreement < 1.0  # the synthetic A/A has planted flips
    # serving: one row per cell with requests; capacity: one row per format (not per concurrency)
    assert len(a.serving) == 3 * 3
    caps = {cell.config["kv_dtype"]: ratio for cell, _, ratio in a.capacity}
    assert caps["bf16"] == pytest.approx(1.0) and caps["nvfp4"] == pytest.approx(2 / 0.5625, rel=1e-3)


def test_runs_without_items_or_requests(tmp_path):
    root = make_run(tmp_path / "load_only", drops={"bf16": 0.0, "nvfp4": 0.0}, aa=False)
    store = RunStore(root)
    for ref in store.cells():
        (ref.path / "items.jsonl").unlink(missing_ok=True)
    code, text = cli("report", root, "--out", tmp_path / "r1")
    assert code == 0, text
    names = {p.stem for p in (tmp_path / "r1").glob("*.png")}
    assert names == {"serving", "latency", "capacity"}
    root = make_run(tmp_path / "acc_only", drops={"bf16": 0.0, "nvfp4": 0.3}, concurrency=(1,))
    for ref in RunStore(root).cells():
        (ref.path / "requests.jsonl").unlink(missing_ok=True)
    code, text = cli("report", root, "--out", tmp_path / "r2")
    assert code == 0, text
    assert "serving" not in {p.stem for p in (tmp_path / "r2").glob("*.png")}
    assert "_No data._" in (tmp_path / "r2" / "report.md").read_text()


def test_report_errors_exit_2(run, tmp_path):
    assert cli("report", tmp_path / "missing", "--out", tmp_path / "o")[0] == 2
    code, text = cli("report", run, "--out", tmp_path / "o", "--baseline", "model=smollm2-135m")
    assert code == 2 and "matches" in text
    assert cli("report", run, "--out", tmp_path / "o", "--confidence", "2")[0] == 2


def test_compare_pairs_cells_across_runs(tmp_path):
    a = make_run(tmp_path / "a" / "run", drops={"bf16": 0.0, "nvfp4": 0.3}, concurrency=(1, 4), aa=False)
    b = make_run(tmp_path / "b" / "run", drops={"bf16": 0.0, "nvfp4": 0.05}, concurrency=(1, 4), aa=False)
    runs = load_runs([a, b])
    assert [r.name for r in runs] == ["a/run", "b/run"]
    an = compare_analysis(runs, n_boot=500)
    pairs = {(r.cell.run, r.base.run, r.cell.config["kv_dtype"], r.base.config["kv_dtype"], r.suite) for r in an.deltas}
    assert pairs == {("b/run", "a/run", kv, kv, s) for kv in ("bf16", "nvfp4") for s in ("gsm8k", "aime24")}
    improved = [r for r in an.deltas if r.cell.config["kv_dtype"] == "nvfp4" and r.suite == "gsm8k"][0]
    assert improved.d.delta > 0.1  # run b's nvfp4 drops far less than run a's
    out = tmp_path / "cmp"
    code, text = cli("compare", a, b, "--out", out, "--bootstrap", "500")
    assert code == 0, text
    md = (out / "report.md").read_text()
    assert "a/run" in md and "b/run" in md
    assert (out / "report.html").exists() and (out / "serving.png").exists()
    assert cli("compare", a, "--out", out)[0] == 2

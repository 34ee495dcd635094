"""KV error diagnostics: figures, the report section (Markdown / HTML), the standalone report, and the section in
a sweep report for a cell holding diagnostics.json."""

from __future__ import annotations

import base64
import copy
import json
import re
import sys
from pathlib import Path

import pytest

from kvbench.reports.render import diagnostics_plots as dp
from kvbench.reports import diagnostics_report as dr

sys.path.insert(0, str(Path(__file__).parent))
from test_reports_load import make_run  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def make_diag(layers: int = 6, heads: int = 2, dominant: int = 3, kl=True, suggestion=True, saturate=True) -> dict:
    """A synthetic diagnostics.json: layer ``dominant`` carries most error and KL; V error above K; layer 0
    already in bf16 (``kv_dtype_skip_layers`` "0")."""
    rows = []
    for i in range(layers):
        bf16 = i == 0 and layers > 1
        scale = 0.0 if bf16 else (6.0 if i == dominant else 1.0 + 0.1 * i)
        part = lambda base, key: {
            "rel_err": [base * scale * (1 + 0.2 * h) for h in range(heads)],
            "saturated": [(0.003 if (key == "k" and i == dominant and h == heads - 1 and saturate) else 0.0)
                          for h in range(heads)],
            "flushed": [0.0] * heads, "amax": [10.0 + h for h in range(heads)], "scale": [1.0] * heads,
            "max_repr": [448.0] * heads, "values": 4096}
        contrib = None if not kl else (0.0 if bf16 else (0.03 if i == dominant else (-0.0005 if i == 5 else 0.002 * i)))
        rows.append({"layer": i, "format": "bf16" if bf16 else "fp8_e4m3", "sliding_window": None,
                     "k": part(0.01, "k"), "v": part(0.025, "v"), "attn_rel_err": [0.02 * scale] * heads,
                     "kl_loo": None if not kl else 0.05 - (contrib or 0.0), "kl_contribution": contrib})
    diag = {"schema": "kvbench:diagnostics:v1", "model": "toy-6l", "kv_dtype": "fp8_e4m3", "kv_scales": "calibrate",
            "kv_dtype_skip_layers": "0" if layers > 1 else None,
            "layer_dtypes": [r["format"] for r in rows], "num_layers": layers, "num_kv_heads": heads, "head_dim": 64,
            "backend": "torch", "texts": {"n": 8, "tokens": 2048, "label": "gsm8k reference solutions"},
            "layers": rows,
            "kl": {"full": 0.05, "top1_agree": 0.987, "method": "leave-one-out", "tokens": 2048} if kl else None,
            "suggestion": None, "confirm": None}
    if suggestion:
        diag["suggestion"] = {
            "limit": 0.02, "skip_layers": "3,4", "kl": 0.0125, "met": True,
            "steps": [{"skip_layers": None, "n_skipped": 0, "kl": 0.05, "bytes_per_token": 6400.0},
                      {"skip_layers": "3", "n_skipped": 1, "kl": 0.021, "bytes_per_token": 6912.0},
                      {"skip_layers": "3,4", "n_skipped": 2, "kl": 0.0125, "bytes_per_token": 7424.0}],
            "capacity": {"context_len": 4096, "budget_bytes": 8 * 2**30, "rows": [
                {"name": "bf16", "bytes_per_token": 12288.0, "tokens": 699050, "max_concurrency": 170},
                {"name": "fp8_e4m3", "bytes_per_token": 6400.0, "tokens": 1342177, "max_concurrency": 327},
                {"name": "fp8_e4m3 skip 3,4", "bytes_per_token": 7424.0, "tokens": 1157049, "max_concurrency": 282}]}}
        diag["confirm"] = {"config": "confirm.yaml", "command": "kvbench sweep confirm.yaml --out runs/confirm"}
    return diag


def _png_ok(path: Path) -> None:
    import matplotlib.image as mpimg

    assert path.is_file() and path.read_bytes()[:8] == PNG
    img = mpimg.imread(path)
    assert img.shape[0] > 150 and img.shape[1] > 250
    assert float(img[..., :3].std()) > 0.01  # not blank


def _inlined(page: str) -> list[bytes]:
    return [base64.b64decode(s) for s in re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)]


# ------------------------------------------------------------------------------ data helpers


def test_helpers_find_the_dominant_layer_and_skip_set():
    d = make_diag()
    assert [r["layer"] for r in dr.top_layers(d, 3)] == [3, 4, 2]
    assert dp.skip_layer_indices(d) == [3, 4]
    assert dp.skip_layer_indices(d, "sliding_window") == []  # no layer has a window
    d2 = make_diag()
    d2["layers"][1]["sliding_window"] = 512
    d2["suggestion"]["skip_layers"] = "5,sliding_window"
    assert dp.skip_layer_indices(d2) == [1, 5]
    m = dp.heads_matrix(d, "v", "rel_err")
    assert m.shape == (6, 2) and m[3, 1] == pytest.approx(0.025 * 6 * 1.2)
    assert dp.layer_mean(d["layers"][3], "k") == pytest.approx(0.01 * 6 * 1.1)


def test_summary_names_top_layers_shares_v_dominance_and_saturation():
    text = dr._md_runs(dr.summary_text(make_diag()))
    assert "0.05 nats/token" in text and "98.70%" in text
    # top 3 by contribution with their share of the full KL (0.03 / 0.05 = 60%)
    assert "layer 3 (0.03, 60% of the full KL); layer 4 (0.008, 16% of the full KL); layer 2 (0.004, 8% of the full KL)" in text
    assert "**V error dominates**" in text and "2.5×" in text
    assert "1 layer × head slot (layer 3)" in text and "K layer 3 head 1: 0.3%" in text
    assert "1 layer (5) contributes negatively" in text
    clean = dr._md_runs(dr.summary_text(make_diag(saturate=False)))
    assert "No value saturated or flushed to zero." in clean


# ------------------------------------------------------------------------------ standalone report


def test_write_report_files_numbers_and_inline_images(tmp_path):
    d = make_diag()
    out = dr.write_report(d, tmp_path / "diag")
    names = {"kl_contribution", "suggestion_steps", "kv_error", "attn_error", "saturation"}
    assert names <= set(out) and "flushed" not in out  # nothing flushed: no figure
    for n in names:
        _png_ok(out[n])
    md = out["markdown"].read_text()
    assert md.startswith("# Where the error comes from: toy-6l fp8_e4m3\n")
    for n in names:
        assert f"]({n}.png)" in md
    # top-layers table: layer 3 first, its numbers
    table = md.split("### Top 5 layers by KL contribution", 1)[1]
    first = [ln for ln in table.splitlines() if ln.startswith("| ")][1]
    assert first.startswith("| 3 | fp8_e4m3 | 0.066 | 0.165 | 0.12 | 0.15% / 0% | 0.03 | 60.0% |"), first
    # suggestion: skip set, KL before -> after vs limit, capacity cost
    assert "Keep layers `3,4` (2) in bf16: KL **0.05 → 0.0125** nats/token, within the limit 0.02." in md
    assert "It costs **13.8%** of the uniform fp8_e4m3 capacity (1,342,177 → 1,157,049 tokens, max concurrency 327 → 282)" in md
    assert "| fp8_e4m3 skip 3,4 | 7,424 | 1,157,049 | 282 | −13.8% |" in md
    assert "| bf16 | 12,288 | 699,050 | 170 | −47.9% |" in md
    assert "kvbench sweep confirm.yaml --out runs/confirm" in md
    page = out["html"].read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert not re.search(r"https?://", page)
    assert sorted(_inlined(page)) == sorted(out[n].read_bytes() for n in names)
    assert "<h1>Where the error comes from: toy-6l fp8_e4m3</h1>" in page
    assert "<b>0.05 → 0.0125</b>" in page and "<code>3,4</code>" in page


def test_degenerate_inputs_one_layer_no_kl_no_suggestion(tmp_path):
    d = make_diag(layers=1, heads=1, dominant=0, kl=False, suggestion=False, saturate=False)
    out = dr.write_report(d, tmp_path / "one")
    assert {"kv_error", "attn_error"} <= set(out)
    assert not {"kl_contribution", "suggestion_steps", "saturation"} & set(out)
    _png_ok(out["kv_error"])
    md = out["markdown"].read_text()
    assert "KL against the bf16 reference was not measured" in md
    assert "No skip-layer suggestion in this diagnostics file." in md
    assert "### Top layer by attention-output error (no KL contribution measured)" in md
    # kl present but every contribution missing; suggestion that keeps nothing
    d2 = make_diag()
    for r in d2["layers"]:
        r["kl_contribution"] = None
    d2["suggestion"].update(skip_layers=None, kl=0.05, limit=0.1, met=True, steps=[], capacity={})
    md2 = dr.render_markdown(d2, tmp_path / "p2")
    assert "No per-layer KL contribution was measured." in md2
    assert "No layer needs to stay in bf16: KL 0.05 is within the limit 0.1." in md2
    assert not (tmp_path / "p2" / "kl_contribution.png").exists()
    assert "![kv_error](kv_error.png)" in md2
    # a null kl block and a fully empty layer list do not break rendering
    d3 = copy.deepcopy(d2)
    d3.update(kl=None, layers=[])
    assert "Where the error comes from" in dr.render_html(d3)


def test_render_markdown_rel_and_prefix(tmp_path):
    md = dr.render_markdown(make_diag(), tmp_path / "figs", "figs", prefix="c1_")
    assert "![kv_error](figs/c1_kv_error.png)" in md
    assert (tmp_path / "figs" / "c1_kv_error.png").read_bytes()[:8] == PNG


def test_kl_bars_highlight_skip_layers(tmp_path):
    """The bars of the suggested skip layers are drawn in the highlight colour, others not (pixel check)."""
    import matplotlib.image as mpimg
    import numpy as np

    p = tmp_path / "kl.png"
    assert dp.kl_contribution_plot(make_diag(), p)
    img = mpimg.imread(p)[..., :3]
    red = np.all(np.abs(img - np.array([0xd6, 0x27, 0x28]) / 255) < 0.02, axis=-1)
    blue = np.all(np.abs(img - np.array([0x1f, 0x77, 0xb4]) / 255) < 0.02, axis=-1)
    assert red.sum() > 500 and blue.sum() > 100
    d = make_diag()
    d["suggestion"] = None
    assert dp.kl_contribution_plot(d, p)
    img = mpimg.imread(p)[..., :3]
    red = np.all(np.abs(img - np.array([0xd6, 0x27, 0x28]) / 255) < 0.02, axis=-1)
    assert red.sum() < 20


# ------------------------------------------------------------------------------ sweep report


def test_sweep_report_gets_the_section_of_a_cell_with_diagnostics(tmp_path):
    from typer.testing import CliRunner

    from kvbench.harness.cli import app

    run = make_run(tmp_path / "run", drops={"bf16": 0.0, "fp8_e4m3": 0.05}, concurrency=(1,), aa=False,
                   n_gsm8k=20, n_aime=4, k_aime=1)
    cells = sorted(p for p in (run / "cells").iterdir() if json.loads((p / "cell.json").read_text())
                   .get("config", {}).get("kv_dtype") == "fp8_e4m3") if (run / "cells").is_dir() else []
    assert len(cells) == 1
    (cells[0] / "diagnostics.json").write_text(json.dumps(make_diag()))
    out = tmp_path / "rep"
    r = CliRunner().invoke(app, ["report", str(run), "--out", str(out), "--bootstrap", "200"])
    assert r.exit_code == 0, r.output
    md = (out / "report.md").read_text()
    assert md.count("## Where the error comes from: toy-6l fp8_e4m3") == 1
    assert md.index("## Cells") < md.index("## Where the error comes from")  # after the existing content
    assert f"[{cells[0].name}]" in md
    assert "Keep layers `3,4` (2) in bf16" in md and "![kv_error](diag1_kv_error.png)" in md
    _png_ok(out / "diag1_kv_error.png")
    page = (out / "report.html").read_text()
    assert "Where the error comes from: toy-6l fp8_e4m3" in page
    assert (out / "diag1_kl_contribution.png").read_bytes() in _inlined(page)
    assert page.rstrip().endswith("</body></html>")

"""What a reader found contradictory in the demo report (issue 46), each fixed and held here: the sweep line
and the report name the same ruler figure; intervals say which they are; the planned concurrency is counted
for the requests the measured one counts; no literal backticks in the HTML; wide tables fit the page."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.harness.runner import _brief
from kvbench.reports.capacity import planned_at_request

sys.path.insert(0, str(Path(__file__).parent))
from test_verdict_paths import B400, build, flip  # noqa: E402


def test_sweep_line_prints_the_primary_metric():
    """The ruler summary holds both the share of items with every value found (accuracy) and the mean share of
    values found (the ruler score the report and the gate use): the sweep line prints the latter."""
    line = _brief({"suites": {"ruler": {"accuracy": 0.667, "ruler": 0.708, "errors": 0},
                              "gsm8k": {"accuracy": 0.5, "errors": 0}}})
    assert line == ": ruler 0.708, gsm8k 0.500"


def test_planned_concurrency_at_the_load_request_size():
    cap = {"tokens": 11648, "num_pages": 728, "page_size": 16, "context_len": 2304, "max_concurrency": 5}
    assert planned_at_request(cap, 80) == 728 // 5  # five 16-token pages per 80-token request
    assert planned_at_request(cap, 80, running_limit=16) == 16  # the server's running limit caps it
    assert planned_at_request({"tokens": 1000}, 100) == 10  # no pages known: whole requests of tokens
    assert planned_at_request(cap, 0) is None


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("consistency")
    run = build(root / "run", B400, {"fp8_e4m3": flip(B400, 4)}, aa=list(B400))
    out = root / "report"
    r = CliRunner().invoke(app, ["report", str(run), "--out", str(out), "--bootstrap", "300"])
    assert r.exit_code == 0, r.output
    return out


def test_intervals_are_labelled(report):
    md = (report / "report.md").read_text()
    card = md[md.index("## Verdict"):md.index("\n## Accuracy\n")]
    assert "Δ [two-sided 95% CI]" in card and "one-sided 95% bound vs −δ" in card
    assert "Two intervals at 95%, on purpose" in card


def test_no_literal_backticks_in_the_html(report):
    html = (report / "report.html").read_text()
    body = html[html.index("<body"):]
    assert "`" not in body
    assert "<code>kvbench gate" in body  # the command is marked up, not quoted


@pytest.mark.skipif(not (os.environ.get("KVBENCH_REQUIRE_CHROMIUM") or shutil.which("chromium")),
                    reason="needs Debian's chromium (CI installs it and sets KVBENCH_REQUIRE_CHROMIUM=1)")
def test_wide_tables_fit_the_page(tmp_path):
    """A table of long cells wraps inside the page instead of running past it (and out of a 1400-px shot)."""
    from kvbench.reports.render import screenshot as shot
    from kvbench.reports.render.html_style import CSS as _CSS
    from kvbench.reports.tables import Table

    row = ["1,259.6 / 1,260.2 / 1,615.4  (+3% / +3% / −1%)"] * 9
    page = tmp_path / "wide.html"
    page.write_text(f"<!DOCTYPE html><html><head><style>{_CSS}</style></head><body>"
                    + Table("wide", [f"column {i}" for i in range(9)], [row] * 3).to_html() + "</body></html>")
    m = shot.page_metrics(page, 1400)
    assert m["width"] <= m["client_width"] <= 1400, m

"""Ship-decision figures (reports/render/plots_ship.py): the Pareto front, accuracy against throughput, capacity per
format, latency percentiles; on constructed runs (tests/test_reports_load.py ``make_run``)."""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvbench.reports.analysis import Analysis
from kvbench.reports.compare import report_analysis
from kvbench.reports.load import load_run
from kvbench.reports.render.plots import fidelity_plot, series_key, serving_plot, write_plots
from kvbench.reports.render.plots_ship import (
    accuracy_throughput_plot,
    accuracy_throughput_points,
    capacity_plot,
    latency_plot,
    measured_concurrency,
    pareto_front,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_reports_files import _check_png  # noqa: E402
from test_reports_load import make_run  # noqa: E402

NAN = math.nan


# ------------------------------------------------------------------------------------------ Pareto front


@pytest.mark.parametrize("points, front", [
    ([], []),
    ([(1.0, 1.0)], [0]),
    ([(1, 5), (2, 4), (3, 3), (2, 2), (1, 1)], [0, 1, 2]),  # a staircase plus two dominated points
    ([(3, 3), (2, 4), (1, 5)], [2, 1, 0]),  # sorted by x whatever the input order
    ([(2, 3), (2, 3), (1, 1)], [0, 1]),  # equal points dominate neither: both kept
    ([(2, 3), (2, 4)], [1]),  # same x, higher y dominates
    ([(1, 3), (2, 3)], [1]),  # same y, higher x dominates
    ([(NAN, 9), (1, NAN), (1, 1)], [2]),  # NaN coordinates are never on the front
    ([(5, 5), (1, 1), (4, 4), (5, 4.9)], [0]),  # one point dominating all others
    ([(10, 0.5), (1, 0.9), (5, 0.7), (5, 0.6), (7, 0.7)], [1, 4, 0]),  # (5, .7) and (5, .6) lose to (7, .7)
])
def test_pareto_front(points, front):
    assert pareto_front(points) == front


def test_pareto_front_is_brute_force_non_dominated():
    import random

    rng = random.Random(3)
    for _ in range(50):
        pts = [(float(rng.randint(0, 6)), float(rng.randint(0, 6))) for _ in range(rng.randint(1, 9))]
        front = set(pareto_front(pts))
        for i, (x, y) in enumerate(pts):
            dominated = any(a >= x and b >= y and (a, b) != (x, y) for a, b in pts)
            assert (i in front) == (not dominated)


# ------------------------------------------------------------------------------------ constructed analysis


@pytest.fixture(scope="module")
def analysis(tmp_path_factory) -> Analysis:
    root = make_run(tmp_path_factory.mktemp("ship") / "run", drops={"bf16": 0.0, "fp8_e4m3": 0.02, "nvfp4": 0.35},
                    concurrency=(1, 4), n_gsm8k=30, n_aime=4, k_aime=2)
    return report_analysis(load_run(root), n_boot=200)


def _with_aa_serving(a: Analysis, **extra) -> Analysis:
    """A copy of ``a`` whose A/A control also has serving data: higher concurrency, absurd values."""
    aa = next(c for c in a.cells if c.aa_control)
    aa = replace(aa, config={**aa.config, "concurrency": 64})
    s = dict(a.serving[0][1], output_throughput=1e6, median_ttft_ms=1e6, **extra)
    b = copy.copy(a)
    b.serving = list(a.serving) + [(aa, s)]
    return b


def _serving_of(a: Analysis, kv: str, conc: int) -> dict:
    return next(s for c, s in a.serving if c.config["kv_dtype"] == kv and c.concurrency == conc and not c.aa_control)


def test_points_one_per_series_at_highest_concurrency(analysis):
    a = _with_aa_serving(analysis)
    assert any(r.cell.aa_control for r in a.accuracy)  # the A/A control has accuracy rows of its own
    points, missing = accuracy_throughput_points(a)
    assert set(points) == {"gsm8k", "aime24"} and missing == {"gsm8k": [], "aime24": []}
    for suite, pts in points.items():
        assert [p.label for p in pts] == ["bf16 unit", "fp8_e4m3 calibrate", "nvfp4 calibrate"]  # no A/A point
        for p in pts:
            kv = p.label.split()[0]
            assert p.concurrency == 4
            # the A/A control's serving entry (same series config, c=64, 1e6 tok/s) is not the series' throughput
            assert p.throughput == pytest.approx(_serving_of(a, kv, 4)["output_throughput"])
            row = next(r for r in a.accuracy if r.suite == suite and r.metric == "correct" and not r.cell.aa_control
                       and r.cell.config["kv_dtype"] == kv)
            assert p.est is row.est
            assert p.baseline == (kv == "bf16")


def test_series_without_serving_data_are_named_not_dropped(analysis, tmp_path):
    a = copy.copy(analysis)
    a.serving = [(c, s) for c, s in analysis.serving if c.config["kv_dtype"] != "fp8_e4m3"]
    points, missing = accuracy_throughput_points(a)
    assert missing == {"gsm8k": ["fp8_e4m3 calibrate"], "aime24": ["fp8_e4m3 calibrate"]}
    assert all(p.label != "fp8_e4m3 calibrate" for pts in points.values() for p in pts)
    assert accuracy_throughput_plot(a, tmp_path / "at.png")
    _check_png(tmp_path / "at.png")


def test_plots_written_with_data(analysis, tmp_path):
    for fn in (accuracy_throughput_plot, capacity_plot, latency_plot, serving_plot, fidelity_plot):
        p = tmp_path / f"{fn.__name__}.png"
        assert fn(analysis, p) is True
        _check_png(p)


def test_plots_skipped_without_data(analysis, tmp_path):
    empty = Analysis(cells=analysis.cells, baseline=analysis.baseline, confidence=0.95)
    for fn in (accuracy_throughput_plot, capacity_plot, latency_plot, serving_plot, fidelity_plot):
        p = tmp_path / f"{fn.__name__}.png"
        assert fn(empty, p) is False and not p.exists()
    # accuracy without any serving data: nothing to place on the throughput axis
    acc_only = copy.copy(analysis)
    acc_only.serving = []
    assert accuracy_throughput_plot(acc_only, tmp_path / "x.png") is False and not (tmp_path / "x.png").exists()
    # serving data of the A/A control alone is no series
    aa_only = copy.copy(empty)
    aa_only.serving = _with_aa_serving(analysis).serving[-1:]
    assert aa_only.serving[0][0].aa_control
    assert latency_plot(aa_only, tmp_path / "l.png") is False and serving_plot(aa_only, tmp_path / "s.png") is False


def test_measured_concurrency_and_capacity_second_panel(analysis, tmp_path):
    import matplotlib.image as mpimg

    assert measured_concurrency(analysis) == {}  # the synthetic run measured none
    assert capacity_plot(analysis, tmp_path / "one.png")
    a = _with_aa_serving(analysis, max_running_without_queueing=999)
    for c, s in a.serving[:-1]:
        a.serving[a.serving.index((c, s))] = (c, dict(s, max_running_without_queueing=None if c.concurrency == 4
                                                      else 3 if c.config["kv_dtype"] == "nvfp4" else 1))
    m = measured_concurrency(a)
    by_kv = {c.config["kv_dtype"]: m.get(series_key(c)) for c, _, _ in a.capacity}
    assert by_kv == {"bf16": 1.0, "fp8_e4m3": 1.0, "nvfp4": 3.0}  # the A/A control's 999 is not the baseline's
    assert capacity_plot(a, tmp_path / "two.png")
    _check_png(tmp_path / "two.png")
    # the measured panel sits next to the planned one: a wider figure
    assert mpimg.imread(tmp_path / "two.png").shape[1] > 1.4 * mpimg.imread(tmp_path / "one.png").shape[1]


def test_write_plots_names_and_report_sections(analysis, tmp_path):
    from kvbench.reports.render.html import ReportMeta, write_report

    out = write_plots(analysis, tmp_path / "p")
    assert {"accuracy_throughput", "latency", "capacity", "serving"} <= set(out)
    for name in ("accuracy_throughput", "latency", "capacity"):
        assert out[name] == tmp_path / "p" / f"{name}.png"
    written = write_report(analysis, tmp_path / "r", ReportMeta(title="t", command="kvbench report x"))
    md = written["markdown"].read_text()
    assert "## Accuracy vs throughput" in md and "![accuracy_throughput](accuracy_throughput.png)" in md
    assert md.index("![serving](serving.png)") < md.index("![latency](latency.png)") < md.index("## Capacity")

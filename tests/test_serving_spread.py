"""Serving ratios with their spread across load repeats, in the report and on the verdict card: repeats
recomputed and combined from the records, "0.91× (0.85–0.97)", the warning when the spread exceeds the
measured difference (and its absence when it does not), the single-repeat statement, the machine-load column
and warning, and the goodput wording when the baseline itself misses the SLO."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_verdict_paths import _records, cli  # noqa: E402

from kvbench.core.store import RunStore  # noqa: E402
from kvbench.core.io import canonical_key  # noqa: E402
from kvbench.reports.load import CellData  # noqa: E402
from kvbench.reports.serving import serving_summary  # noqa: E402
from kvbench.reports.serving_spread import (WarnedTable, fmt_ratio, goodput_text, machine_text,  # noqa: E402
                                            machine_warning, ratio_range, slo_unmet, spread_warning, within_noise)

CFG = {"model": "m", "target": "embedded", "prefill_backend": "torch", "decode_backend": "torch", "kv_scales": "unit",
       "concurrency": 4}
QUIET = {"cpu_count": 2, "loadavg_before": [0.5, 0.5, 0.5], "loadavg_after": [0.9, 0.6, 0.5], "wall_s": 1.0,
         "own_cpu_s": 1.0, "own_cpu_share": 0.5, "busy_share": 0.55, "others_cpu_share": 0.05}
BUSY = {**QUIET, "loadavg_before": [5.4, 4.0, 3.0], "others_cpu_share": 0.41}


def _repeat(i: int, duration: float, tpot: float = 0.1) -> list[dict]:
    """4 requests of 10 output tokens spanning ``duration`` s: 40 / duration output tokens per second."""
    ttft = duration - 9 * tpot
    return [{"request_id": f"r{j}", "success": True, "error": None, "prompt_tokens": 64, "output_tokens": 10,
             "start_s": 0.0, "ttft_s": ttft, "latency_s": duration, "itl_s": [tpot] * 9, "tpot_s": tpot, "repeat": i}
            for j in range(4)]


def _load(durations, slo=None, machine=QUIET, tpot=0.1) -> tuple[dict, list[dict]]:
    records = [r for i, d in enumerate(durations) for r in _repeat(i, d, tpot)]
    per = [{"duration_s": d, "machine_load": machine} for d in durations]
    load = {"duration_s": sorted(durations)[len(durations) // 2], "slo": slo or {"tpot_ms": 500.0},
            "max_concurrency": 4, "repeats": len(durations), "per_repeat": per}
    return load, records


def _cell(durations, kv="bf16", **kw) -> CellData:
    load, records = _load(durations, **kw)
    return CellData(key=kv, label=kv, config={**CFG, "kv_dtype": kv}, status="done", requests=records,
                    summary={"suites": {}, "load": load, "error": None}, short=f"{kv} c=4")


NOISY_BASE, NOISY_CAND = [1.0, 1.25, 0.8], [1.05, 1.3, 0.85]  # 40, 32, 50 tok/s vs 38.1, 30.8, 47.1
CLEAR_BASE, CLEAR_CAND = [1.0, 1.02, 0.98], [2.0, 2.02, 1.98]  # ~40 vs ~20 tok/s, each within ±2%


def test_repeats_recomputed_from_their_records():
    s = serving_summary(_cell(NOISY_BASE))
    assert s["repeats"] == 3 and s["completed"] == 12
    assert s["output_throughput"] == pytest.approx(40.0)  # median of 40, 32, 50
    assert s["spread"]["output_throughput"] == {"min": pytest.approx(32.0), "max": pytest.approx(50.0)}
    assert s["machine_load"]["others_cpu_share"] == 0.05 and s["machine_load"]["repeats"] == 3
    # an old store: records without "repeat", no per_repeat: one repeat over load.duration_s
    old = _cell([2.0])
    for r in old.requests:
        r.pop("repeat")
    old.summary["load"] = {"duration_s": 2.0}
    s = serving_summary(old)
    assert s["repeats"] == 1 and s["output_throughput"] == pytest.approx(20.0) and s["machine_load"] is None


def test_ratio_with_range_and_the_noise_warning():
    b, c = serving_summary(_cell(NOISY_BASE)), serving_summary(_cell(NOISY_CAND, "fp8_e4m3"))
    lo, hi = ratio_range(b, c, "output_throughput")
    assert lo == pytest.approx((40 / 1.3) / 50) and hi == pytest.approx((40 / 0.85) / 32)
    assert fmt_ratio(b, c, "output_throughput") == f"0.95× ({lo:.2f}–{hi:.2f})"
    assert within_noise(b, c, "output_throughput")
    w = spread_warning(4, b, c)
    assert w.startswith("serving: run-to-run spread (±") and "exceeds the measured difference at c=4" in w
    assert w.endswith("not a measured speed difference") and "out tok/s 0.95× (−5%)" in w


def test_no_warning_when_the_difference_exceeds_the_spread():
    b, c = serving_summary(_cell(CLEAR_BASE)), serving_summary(_cell(CLEAR_CAND, "fp8_e4m3"))
    assert fmt_ratio(b, c, "output_throughput").startswith("0.50× (0.4")
    assert not within_noise(b, c, "output_throughput") and spread_warning(4, b, c) is None


def test_own_spread_alone_triggers_the_warning():
    # the range stays below 1.0, but the baseline's own repeats vary by ±25% against a 10% difference
    # (baseline repeats 100, 100, 125; candidate 90, 90, 90)
    b = {"output_throughput": 100.0, "repeats": 3, "spread": {"output_throughput": {"min": 100.0, "max": 125.0}}}
    c = {"output_throughput": 90.0, "repeats": 3, "spread": {"output_throughput": {"min": 90.0, "max": 90.0}}}
    assert ratio_range(b, c, "output_throughput") == pytest.approx((0.72, 0.9))
    assert within_noise(b, c, "output_throughput")
    assert "(±25%)" in spread_warning(16, b, c)


def test_single_repeat_has_no_range():
    b, c = serving_summary(_cell([1.0])), serving_summary(_cell([2.0], "fp8_e4m3"))
    assert ratio_range(b, c, "output_throughput") is None and fmt_ratio(b, c, "output_throughput") == "0.50×"
    assert spread_warning(4, b, c) is None


def test_goodput_when_the_baseline_misses_the_slo():
    # TPOT 100 ms against a 50 ms target: no request of the baseline meets it
    b = serving_summary(_cell(CLEAR_BASE, slo={"tpot_ms": 50.0}))
    c = serving_summary(_cell(CLEAR_CAND, "fp8_e4m3", slo={"tpot_ms": 50.0}))
    assert slo_unmet(b) == "SLO not met by the baseline either (0 of 12 requests): TPOT target 50 ms vs baseline p50 100 ms"
    assert goodput_text(b, c) == "n/a: SLO not met by the baseline either"
    met_b, met_c = serving_summary(_cell(CLEAR_BASE)), serving_summary(_cell(CLEAR_CAND, "fp8_e4m3"))
    assert slo_unmet(met_b) is None and goodput_text(met_b, met_c).startswith("0.50×")


def test_machine_warning_only_when_loaded():
    quiet, busy = serving_summary(_cell([1.0])), serving_summary(_cell([1.0], machine=BUSY))
    assert machine_warning([("bf16 c=4", quiet)]) is None
    w = machine_warning([("bf16 c=4", busy), ("fp8 c=4", quiet), ("nvfp4 c=16", busy)])
    assert "loaded by other processes during the load tests of bf16 c=4, nvfp4 c=16 (" in w and "41% of the CPU" in w
    assert "load average up to 5.4 on 2 CPUs" in w and "fp8" not in w
    assert machine_text(busy) == "others 41% · load 5.4 on 2 CPUs"
    endpoint = _cell([1.0], machine=BUSY)
    endpoint.summary["target"] = {"type": "endpoint", "url": "http://127.0.0.1:8000"}
    s = serving_summary(endpoint)
    assert machine_warning([("x", s)]) is None  # its server's CPU is in "others"
    assert machine_text(s).startswith("others 41% (incl. the endpoint's server)")


def test_warned_table_renders_warnings_before_the_note():
    t = WarnedTable("T", ["a"], [["1"]], note="the note", warnings=["serving: careful"])
    md = t.to_markdown()
    assert "- ⚠ **serving: careful**" in md and md.index("careful") < md.index("the note")
    h = t.to_html()
    assert "<li>⚠ serving: careful</li>" in h and h.index("careful") < h.index("the note")
    assert "⚠" not in WarnedTable("T", ["a"], [["1"]], note="n").to_markdown()


# ------------------------------------------------------------------ end to end: kvbench report on a store


def build(root: Path, base_durations, cand_durations, machine=QUIET, slo: Optional[dict] = None) -> Path:
    store = RunStore(root)
    store.write_manifest({"config": {"baseline": "kv_dtype=bf16", "gate": {"max_drop": 0.05}}, "git_sha": "0" * 40,
                          "device": "cpu (synthetic)", "date": "2026-11-25"})
    outcomes = [i % 3 != 0 for i in range(60)]
    for kv, durations in (("bf16", base_durations), ("fp8_e4m3", cand_durations)):
        cfg = {**CFG, "kv_dtype": kv}
        key = canonical_key(cfg)
        store.init_cell(key, cfg, label=kv)
        store.write_items(key, _records(outcomes))
        load, records = _load(durations, slo=slo, machine=machine)
        store.write_requests(key, records)
        store.write_json(key, "summary", {"suites": {}, "load": load, "capacity": None, "error": None})
        store.set_status(key, "done")
    return root


def _report(tmp_path, *args, **kw) -> tuple[str, str, dict]:
    run = build(tmp_path / "run", *args, **kw)
    out = tmp_path / "report"
    code, text = cli("report", run, "--out", out, "--bootstrap", "200")
    assert code == 0, text
    return (out / "report.md").read_text(), (out / "report.html").read_text(), json.loads((out / "report.json").read_text())


def test_report_shows_spread_and_warning(tmp_path):
    md, html, doc = _report(tmp_path, NOISY_BASE, NOISY_CAND)
    assert "0.95× (0.62–1.47)" in md  # the card's out tok/s and the serving table's × base
    assert md.count("run-to-run spread (±") >= 2  # on the card and under the serving table
    assert "- ⚠ **serving: run-to-run spread" in md and "not a measured speed difference" in md
    assert "⚠ serving: run-to-run spread" in html and "not a measured speed difference" in html
    assert "no run-to-run spread was measured" not in md
    assert "others 5% · load 0.9 on 2 CPUs vs others 5% · load 0.9 on 2 CPUs" in md  # the card's machine column
    assert "loaded by other processes" not in md


def test_report_without_warning_when_the_difference_is_clear(tmp_path):
    md, html, _ = _report(tmp_path, CLEAR_BASE, CLEAR_CAND)
    assert "0.50× (0.49–0.52)" in md
    assert "run-to-run spread (±" not in md and "run-to-run spread (±" not in html


def test_report_single_repeat_and_loaded_machine(tmp_path):
    md, html, _ = _report(tmp_path, [1.0], [2.0], machine=BUSY, slo={"tpot_ms": 50.0})
    assert "no run-to-run spread was measured" in md and "no run-to-run spread was measured" in html
    assert ("loaded by other processes during the load tests of the baseline at c=4, the candidate at c=4 (they took "
            "up to 41% of the CPU; 1-minute load average up to 5.4 on 2 CPUs)") in md
    assert "loaded by other processes during the load tests of bf16, fp8_e4m3 (" in md  # the serving table's
    assert "SLO not met by the baseline either (0 of 4 requests): TPOT target 50 ms vs baseline p50 100 ms" in md
    assert "n/a: SLO not met by the baseline either" in md and "SLO not met by the baseline either" in html


def test_serving_plot_draws_the_repeat_spread(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from kvbench.reports.analysis import Analysis
    from kvbench.reports.render.plots import serving_plot

    drawn = []
    real = Axes.errorbar
    monkeypatch.setattr(Axes, "errorbar", lambda self, x, y, yerr=None, **kw: drawn.append((list(y), yerr))
                        or real(self, x, y, yerr=yerr, **kw))
    cells = [_cell(NOISY_BASE), _cell(NOISY_CAND, "fp8_e4m3")]
    a = Analysis(cells, cells[0], 0.95, serving=[(c, serving_summary(c)) for c in cells])
    assert serving_plot(a, tmp_path / "s.png")
    absolute = [e for y, e in drawn if y[0] > 2]
    assert absolute[0] == [[pytest.approx(8.0)], [pytest.approx(10.0)]]  # bf16: 40 tok/s, repeats 32..50
    relative = [e for y, e in drawn if y[0] < 2]
    assert relative[1][0][0] == pytest.approx(1 / 1.05 - (40 / 1.3) / 50)  # fp8: 0.95×, pairings down to 0.62
    one = [_cell([1.0]), _cell([2.0], "fp8_e4m3")]
    drawn.clear()
    assert serving_plot(Analysis(one, one[0], 0.95, serving=[(c, serving_summary(c)) for c in one]), tmp_path / "t.png")
    assert all(e is None for _, e in drawn)  # one repeat: no bars


def test_goodput_wording_when_only_the_baseline_misses():
    b = serving_summary(_cell(CLEAR_BASE, slo={"tpot_ms": 50.0}, tpot=0.1))
    c = serving_summary(_cell(CLEAR_CAND, "fp8_e4m3", slo={"tpot_ms": 50.0}, tpot=0.01))  # the candidate meets it
    assert slo_unmet(b, c).startswith("SLO not met by the baseline (0 of 12 requests): TPOT target 50 ms")
    assert goodput_text(b, c) == "n/a: SLO not met by the baseline"

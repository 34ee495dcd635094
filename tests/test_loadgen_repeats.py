"""Repeated load tests and the machine load around them: ``run_repeats`` (records tagged, summaries combined,
the prefix-cache flush between repeats), ``MachineProbe`` (load averages, own CPU, others' share from
/proc/stat), the sweep's ``load.repeats`` and ``DefaultWork.load`` end to end against the fake-engine server."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_fakes import FakeEngine, serve  # noqa: E402

from kvbench.core.serving_repeats import combine_machine, combine_summaries, group_by_repeat  # noqa: E402
from kvbench.harness.loadgen import machine as loadgen_machine  # noqa: E402
from kvbench.harness.cell_work import DefaultWork  # noqa: E402
from kvbench.harness.config_checks import SweepConfigError  # noqa: E402
from kvbench.harness.loadgen.run import LoadConfig  # noqa: E402
from kvbench.harness.loadgen.machine import MachineProbe, proc_stat_times  # noqa: E402
from kvbench.harness.loadgen.repeats import run_repeats, spread_lines  # noqa: E402
from kvbench.harness.sweep.specs import LoadSpec, _load  # noqa: E402
from kvbench.runtime.server import create_app  # noqa: E402


def _fake_run(durations, tpot_s=0.1, others=(0.05,)):
    """A ``run_load`` stand-in: repeat i lasts ``durations[i]`` s, 4 requests of 10 output tokens each."""
    from kvbench.core.serving_metrics import summarize

    calls = []

    def run(base_url, model, cfg):
        i = len(calls)
        calls.append(model)
        d = durations[i]
        recs = [{"request_id": f"r{j}", "success": True, "error": None, "prompt_tokens": 8, "output_tokens": 10,
                 "start_s": 0.0, "ttft_s": 0.1, "latency_s": 0.1 + 9 * tpot_s, "itl_s": [tpot_s] * 9, "tpot_s": tpot_s}
                for j in range(4)]
        s = summarize(recs, d, {"tpot_ms": 500.0})
        s.update({"model": "m", "base_url": base_url, "config": {"seed": cfg.seed}, "t0_monotonic": 100.0 + i,
                  "server_metrics": {"available": True, "max_running": 2 + i, "preemptions": i},
                  "client_lag_ms": {"mean": 1.0, "p99": 2.0 + i, "max": 3.0}, "first_errors": [],
                  "machine_load": {"cpu_count": 2, "loadavg_before": [1.0 + i, 1.0, 1.0], "loadavg_after": [1.5, 1.0, 1.0],
                                   "wall_s": d, "own_cpu_s": 0.5, "own_cpu_share": 0.2, "busy_share": 0.3,
                                   "others_cpu_share": others[i % len(others)]}})
        return s, recs

    return run, calls


def test_repeats_are_tagged_and_combined():
    run, calls = _fake_run([1.0, 2.0, 4.0], others=(0.05, 0.4, 0.1))
    flushed = []
    summary, records = run_repeats("http://x", None, LoadConfig(num_prompts=4), 3, between=flushed.append, run=run)
    assert flushed == [1, 2]  # before every repeat after the first
    assert calls == [None, "m", "m"]  # the model discovered once is reused
    assert [r["repeat"] for r in records] == [0] * 4 + [1] * 4 + [2] * 4
    assert summary["repeats"] == 3 and len(summary["per_repeat"]) == 3
    # 40 output tokens per repeat over 1, 2, 4 s: 40, 20, 10 tok/s -> median 20, spread 10..40
    assert summary["output_throughput"] == pytest.approx(20.0)
    assert summary["spread"]["output_throughput"] == {"min": pytest.approx(10.0), "max": pytest.approx(40.0)}
    assert summary["completed"] == 12 and summary["total_output_tokens"] == 120  # counts add up
    assert [p["output_throughput"] for p in summary["per_repeat"]] == pytest.approx([40.0, 20.0, 10.0])
    assert [p["t0_monotonic"] for p in summary["per_repeat"]] == [100.0, 101.0, 102.0]
    assert "t0_monotonic" not in summary and summary["model"] == "m"
    m = summary["machine_load"]
    assert m["others_cpu_share"] == 0.4 and m["loadavg_before_1m"] == 3.0 and m["repeats"] == 3
    assert m["own_cpu_s"] == pytest.approx(1.5)
    assert summary["server_metrics"]["max_running"] == 4 and summary["client_lag_ms"]["p99"] == 4.0
    lines = spread_lines(summary)
    assert lines[0].startswith("Across 3 repeats, median (min–max): output 20.0 (10.0–40.0) tok/s")
    assert "took 40% of the CPU" in lines[1]


def test_one_repeat_keeps_the_single_run_figures():
    run, _ = _fake_run([2.0])
    summary, records = run_repeats("http://x", "m", LoadConfig(num_prompts=4), 1, run=run)
    assert summary["repeats"] == 1 and summary["output_throughput"] == pytest.approx(20.0)
    assert summary["spread"]["output_throughput"] == {"min": pytest.approx(20.0), "max": pytest.approx(20.0)}
    assert {r["repeat"] for r in records} == {0}
    assert spread_lines(summary)[0].startswith("One repeat: no run-to-run spread measured")
    with pytest.raises(ValueError):
        run_repeats("http://x", "m", LoadConfig(num_prompts=4), 0, run=run)


def test_combine_helpers_on_old_and_partial_inputs():
    assert group_by_repeat([{"a": 1}, {"repeat": 1}, {"repeat": 0}]) == {0: [{"a": 1}, {"repeat": 0}], 1: [{"repeat": 1}]}
    assert combine_machine([None, {}]) is None
    c = combine_summaries([{"output_throughput": 1.0, "completed": 2}, {"output_throughput": 3.0, "completed": 3},
                           {"output_throughput": float("nan"), "completed": 1}])
    assert c["output_throughput"] == 2.0 and c["completed"] == 6  # NaN left out of the median
    assert c["spread"]["output_throughput"] == {"min": 1.0, "max": 3.0}


def _fake_proc(root: Path, busy: int, idle: int) -> Path:
    root.mkdir(exist_ok=True)
    # user nice system idle iowait irq softirq steal
    (root / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4\n")
    return root


def test_machine_probe_others_share(tmp_path, monkeypatch):
    proc = _fake_proc(tmp_path / "proc", 1000, 1000)
    own = iter([{1: 10.0}, {1: 10.5, 2: 0.3}])  # this process +0.5 s, a server started during the span 0.3 s
    monkeypatch.setattr(loadgen_machine, "own_cpu_seconds", lambda proc=None: next(own))
    monkeypatch.setattr(loadgen_machine.os, "cpu_count", lambda: 2)
    probe = MachineProbe.start(proc)
    tick = os.sysconf("SC_CLK_TCK")
    # over the span: 150 busy ticks and 50 idle ones -> 75% busy
    _fake_proc(proc, 1000 + 150, 1000 + 50)
    probe.t0 -= 1.0  # a one-second span: own 0.8 CPU s of 2 CPU s = 40%
    m = probe.stop()
    assert m["cpu_count"] == 2 and m["own_cpu_s"] == pytest.approx(0.8) and m["own_processes"] == 2
    assert m["own_cpu_share"] == pytest.approx(0.4, abs=0.01)
    assert m["busy_share"] == pytest.approx(0.75) and m["others_cpu_share"] == pytest.approx(0.35, abs=0.01)
    assert proc_stat_times(proc) == pytest.approx((1150 / tick, 2200 / tick))
    assert proc_stat_times(tmp_path / "nowhere") is None


def test_machine_probe_without_proc(tmp_path):
    m = MachineProbe.start(tmp_path / "no-proc").stop()
    assert m["busy_share"] is None and m["others_cpu_share"] is None and m["cpu_count"] >= 1


def test_load_spec_repeats():
    assert LoadSpec().repeats == 1 and _load({}, "load").repeats == 1
    assert _load({"repeats": 3}, "load").repeats == 3
    with pytest.raises(SweepConfigError, match="load.repeats"):
        _load({"repeats": 0}, "load")


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(step_s=0.002, max_running=4)
    with serve(create_app(engine)) as url:
        yield url
    engine.shutdown()


def test_default_work_runs_the_repeats(server):
    spec = LoadSpec(num_prompts=3, input_len=8, output_len=4, metrics_interval_s=0, repeats=2)

    def target(name):
        raise KeyError(name)

    work = DefaultWork(SimpleNamespace(load=spec, slo={"tpot_ms": 500.0}, target=target))
    cell = SimpleNamespace(concurrency=2, key="cellkey", config={"target": "embedded"})
    summary, records = work.load(server, "fake-model", cell)
    assert summary["repeats"] == 2 and len(summary["per_repeat"]) == 2 and summary["completed"] == 6
    assert [r["repeat"] for r in records] == [0, 0, 0, 1, 1, 1]
    # the same prompts in both repeats (the cell's salt): the same prompt lengths in the same order
    assert [r["prompt_tokens"] for r in records[:3]] == [r["prompt_tokens"] for r in records[3:]]
    for rep in summary["per_repeat"]:
        m = rep["machine_load"]
        assert m["cpu_count"] == os.cpu_count() and len(m["loadavg_before"]) == 3 and m["own_cpu_s"] >= 0
        assert m["others_cpu_share"] is None or 0.0 <= m["others_cpu_share"] <= 1.0
    assert summary["machine_load"]["repeats"] == 2


def test_flush_between_repeats_when_the_target_says_how(monkeypatch):
    from kvbench.harness import targets

    calls = []
    monkeypatch.setattr(targets, "flush_cache", lambda url, spec, key=None: calls.append((url, spec, key)))
    spec = SimpleNamespace(flush_cache="POST /flush_cache", api_key="k")
    work = DefaultWork(SimpleNamespace(target=lambda name: spec))
    fn = work._flush_between("http://h:1", SimpleNamespace(config={"target": "sglang"}))
    fn(1)
    assert calls == [("http://h:1", "POST /flush_cache", "k")]
    none = DefaultWork(SimpleNamespace(target=lambda name: SimpleNamespace(flush_cache=None, api_key=None)))
    assert none._flush_between("http://h:1", SimpleNamespace(config={"target": "embedded"})) is None


def test_kvbench_load_repeats(server, tmp_path):
    import json

    from typer.testing import CliRunner

    from kvbench.harness.cli import app

    out = tmp_path / "load"
    res = CliRunner().invoke(app, ["load", "--base-url", server, "--max-concurrency", "2", "--num-prompts", "3",
                                   "--input-len", "8", "--output-len", "3", "--repeats", "2", "--metrics-interval", "0",
                                   "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "Across 2 repeats, median (min–max): output " in res.output and "Machine: " in res.output
    recs = [json.loads(x) for x in (out / "c2" / "requests.jsonl").read_text().splitlines()]
    assert [r["repeat"] for r in recs] == [0, 0, 0, 1, 1, 1]
    s = json.loads((out / "c2" / "summary.json").read_text())
    assert s["repeats"] == 2 and s["completed"] == 6 and len(s["per_repeat"]) == 2

"""The report's serving section: ``reports.serving.serving_summary`` against hand-computed values, the two
serving tables, the /metrics sampler's three naming schemes (preemption counters included) and the load
settings a load summary records."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_reports_load import make_run  # noqa: E402

from kvbench.harness.loadgen.run import LoadConfig, jsonable, load_settings  # noqa: E402
from kvbench.harness.loadgen.server_metrics import MetricsSampler, counter_increase  # noqa: E402
from kvbench.core.store import RunStore  # noqa: E402
from kvbench.reports.analysis import Analysis  # noqa: E402
from kvbench.reports.compare import report_analysis  # noqa: E402
from kvbench.reports.load import CellData, load_run  # noqa: E402
from kvbench.reports.serving import serving_summary, serving_tables  # noqa: E402
from kvbench.runtime.server_protocol import prometheus_text  # noqa: E402

# ------------------------------------------------------------------ a cell with known records

# times are multiples of 1/16 s, exact in binary, so chunk buckets and sums are exact
RECORDS = [
    # start, ttft, itl, output tokens, latency, prompt tokens
    {"request_id": "r0", "success": True, "error": None, "prompt_tokens": 10, "output_tokens": 4, "start_s": 0.0,
     "ttft_s": 0.125, "itl_s": [0.25, 0.25, 0.25], "latency_s": 0.875, "tpot_s": 0.25},
    {"request_id": "r1", "success": True, "error": None, "prompt_tokens": 20, "output_tokens": 5, "start_s": 0.0,
     "ttft_s": 0.25, "itl_s": [0.25] * 4, "latency_s": 1.25, "tpot_s": 0.25},
    {"request_id": "r2", "success": True, "error": None, "prompt_tokens": 30, "output_tokens": 3, "start_s": 0.5,
     "ttft_s": 0.5, "itl_s": [0.5, 1.0], "latency_s": 2.0, "tpot_s": 0.75},
    {"request_id": "r3", "success": True, "error": None, "prompt_tokens": 40, "output_tokens": 1, "start_s": 0.75,
     "ttft_s": 0.375, "itl_s": [], "latency_s": 0.375, "tpot_s": None},
    {"request_id": "r4", "success": False, "error": "HTTP 500", "prompt_tokens": 50, "output_tokens": 0, "start_s": 1.5,
     "ttft_s": None, "itl_s": [], "latency_s": 0.0625, "tpot_s": None},
]

SERVER = {"available": True, "samples": 9, "interval_s": 0.5, "max_running": 6.0, "max_waiting": 2.0,
          "max_running_without_queueing": 5.0, "kv_usage_max": 0.42, "kv_usage_mean": 0.3, "preemptions": 3}

LOAD = {
    "duration_s": 2.5, "slo": {"ttft_ms": 400.0, "tpot_ms": 500.0},
    "request_rate": 4.0, "burstiness": 0.5, "max_concurrency": 8, "num_prompts": 5, "dataset": "random",
    "input_len": 32, "output_len": 4, "range_ratio": 0.0,
    # stale metric values: serving_summary recomputes these from the records
    "completed": 999, "mean_ttft_ms": 1.0, "request_throughput": 123.0,
    "server_metrics": SERVER,
}


def _cell(load, records=RECORDS, conc=8, key="k1") -> CellData:
    cfg = {"kv_dtype": "fp8_e4m3", "kv_scales": "calibrate", "concurrency": conc}
    return CellData(key=key, label=f"fp8 c={conc}", config=cfg, status="done", requests=list(records),
                    summary={"suites": {}, "load": load, "capacity": None, "error": None}, short=f"fp8_e4m3 c={conc}")


# by hand (ms; linear-interpolation percentiles of the sorted values):
# TTFT [125, 250, 375, 500]; TPOT [250, 250, 750] (r3 has one token); ITL [250 x7, 500, 1000];
# E2E [375, 875, 1250, 2000]
EXPECTED = {
    "request_rate": 4.0, "burstiness": 0.5, "max_concurrency": 8, "num_prompts": 5,
    "completed": 4, "failed": 1, "duration_s": 2.5,
    "request_throughput": 4 / 2.5, "input_throughput": 100 / 2.5, "output_throughput": 13 / 2.5,
    "total_token_throughput": 113 / 2.5,
    # chunks (one token each) in [0, 1): r0 4, r1 3 -> 7; [1, 2): r1 2, r2 2, r3 1 -> 5; [2, 3): r2 1
    "peak_output_throughput": 7.0,
    # SLO TTFT <= 400, TPOT <= 500: r0, r1, r3 (no TPOT, judged on TTFT) pass; r2 (TTFT 500) fails
    "good_requests": 3, "request_goodput": 3 / 2.5, "slo": {"ttft_ms": 400.0, "tpot_ms": 500.0},
    "mean_ttft_ms": 312.5, "median_ttft_ms": 312.5, "p90_ttft_ms": 375 + 0.7 * 125, "p95_ttft_ms": 375 + 0.85 * 125,
    "p99_ttft_ms": 375 + 0.97 * 125,
    "mean_tpot_ms": 1250 / 3, "median_tpot_ms": 250.0, "p90_tpot_ms": 250 + 0.8 * 500, "p95_tpot_ms": 250 + 0.9 * 500,
    "p99_tpot_ms": 250 + 0.98 * 500,
    "mean_itl_ms": 3250 / 9, "median_itl_ms": 250.0, "p90_itl_ms": 500 + 0.2 * 500, "p95_itl_ms": 500 + 0.6 * 500,
    "p99_itl_ms": 500 + 0.92 * 500,
    "mean_e2el_ms": 1125.0, "median_e2el_ms": 875 + 0.5 * 375, "p90_e2el_ms": 1250 + 0.7 * 750,
    "p95_e2el_ms": 1250 + 0.85 * 750, "p99_e2el_ms": 1250 + 0.97 * 750,
    # r0 [0, .875], r1 [0, 1.25], r2 [.5, 2.5], r3 [.75, 1.125] overlap at t = .75
    "peak_concurrency": 4,
    "max_running": 6.0, "max_running_without_queueing": 5.0, "kv_usage_max": 0.42, "preemptions": 3,
}


def test_serving_summary_matches_hand_computed_values():
    s = serving_summary(_cell(LOAD))
    assert set(EXPECTED) <= set(s)
    for key, want in EXPECTED.items():
        got = s[key]
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-12), key
        else:
            assert got == want, key
    assert s["dataset"] == "random" and s["input_len"] == 32 and s["output_len"] == 4
    # every key a plot reads today is kept
    for key in ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"):
        assert key in s


def test_goodput_follows_the_recorded_slo():
    tight = dict(LOAD, slo={"ttft_ms": 200.0})  # TTFT 125, 250, 500, 375: r0 alone
    s = serving_summary(_cell(tight))
    assert s["good_requests"] == 1 and s["request_goodput"] == pytest.approx(1 / 2.5)
    e2e = dict(LOAD, slo={"e2el_ms": 1000.0, "ttft_ms": None})  # r0 (875) and r3 (375)
    s = serving_summary(_cell(e2e))
    assert s["good_requests"] == 2 and s["slo"] == {"e2el_ms": 1000.0}
    s = serving_summary(_cell({k: v for k, v in LOAD.items() if k != "slo"}))
    assert s["slo"] is None and s["good_requests"] is None and s["request_goodput"] is None


def test_unlimited_rate_and_concurrency_survive_json():
    settings = json.loads(json.dumps(jsonable(load_settings(LoadConfig(num_prompts=7, burstiness=2.0)))))
    assert settings["request_rate"] == "inf" and settings["max_concurrency"] is None
    assert settings["num_prompts"] == 7 and settings["dataset"] == "random"
    s = serving_summary(_cell({"duration_s": 2.5, **settings}))
    assert s["request_rate"] == math.inf and s["max_concurrency"] == math.inf and s["burstiness"] == 2.0
    load_row, _ = serving_tables(Analysis([], None, 0.95, serving=[(_cell({}), s)]))
    assert load_row.rows[0][1:4] == ["∞", "∞", "2"]
    # stores written before the settings were top-level keys: read from the load's `config` copy
    old = {"duration_s": 2.5, "config": {"request_rate": "inf", "burstiness": 1.0, "max_concurrency": 16,
                                         "num_prompts": 16, "dataset": "random", "input_len": 64, "output_len": 16}}
    s = serving_summary(_cell(old))
    assert (s["request_rate"], s["burstiness"], s["max_concurrency"], s["num_prompts"]) == (math.inf, 1.0, 16, 16)


def test_sharegpt_settings_leave_unfixed_lengths_unknown():
    cfg = LoadConfig(dataset="sharegpt", dataset_path="x.json", request_rate=3.0)
    assert load_settings(cfg, tokenizer=object())["input_len"] is None
    assert load_settings(cfg, tokenizer=object())["output_len"] is None
    assert load_settings(cfg, tokenizer=None)["output_len"] == cfg.output_len
    assert load_settings(cfg)["request_rate"] == 3.0


# ------------------------------------------------------------------ tables


def test_serving_tables_rows_and_old_store_dashes():
    new, old = _cell(LOAD, key="new"), _cell({"duration_s": 2.5}, conc=4, key="old")
    old.short = "bf16 c=4"
    a = Analysis([new, old], None, 0.95, serving=[(c, serving_summary(c)) for c in (new, old)])
    load_t, lat_t = serving_tables(a)
    assert load_t.title == "Serving: load and throughput" and lat_t.title == "Serving: latency (ms)"
    rows = {r[0]: r for r in load_t.rows}
    # no baseline: no "× base" ratio; one repeat, no machine-load record
    assert rows["fp8_e4m3"] == ["fp8_e4m3", "8", "4", "0.5", "4/1", "1.60", "5.2", "—", "45.2", "1.20", "4", "5", "42.0%",
                                "3", "1", "—"]
    # an old store: no settings, no SLO, no /metrics summary -> dashes; the conc. column falls back to the cell's
    assert rows["bf16"] == ["bf16", "4", "—", "—", "4/1", "1.60", "5.2", "—", "45.2", "—", "4", "—", "—", "—", "1", "—"]
    assert "TPOT ≤ 500 ms, TTFT ≤ 400 ms" in load_t.note
    # latency: long form, one row per cell and metric, in the order TTFT, TPOT, ITL, E2E
    assert lat_t.columns == ["series", "conc.", "metric", "mean", "median", "p90", "p95", "p99"]
    assert len(lat_t.rows) == 8 and [r[2] for r in lat_t.rows[:4]] == ["TTFT", "TPOT", "ITL", "E2E"]
    fp8 = {r[2]: r for r in lat_t.rows if r[0] == "fp8_e4m3"}
    assert fp8["TTFT"][3:] == ["312.5", "312.5", "462.5", "481.2", "496.2"]
    assert fp8["ITL"][3:] == ["361.11", "250.00", "600.00", "800.00", "960.00"]
    assert fp8["E2E"][3:] == ["1,125.0", "1,062.5", "1,775.0", "1,887.5", "1,977.5"]
    md = load_t.to_markdown()
    assert "| bf16 | 4 | — | — |" in md


def test_report_analysis_uses_serving_summary(tmp_path):
    root = make_run(tmp_path / "run", drops={"bf16": 0.0, "nvfp4": 0.0}, concurrency=(1, 4), aa=False, n_gsm8k=6,
                    n_aime=2, k_aime=1)
    store = RunStore(root)
    key = next(ref.key for ref in store.cells() if ref.config["kv_dtype"] == "nvfp4" and ref.config["concurrency"] == 4)
    summary = json.loads((store.cell_dir(key) / "summary.json").read_text())
    summary["load"] = {**LOAD, "max_concurrency": 4}
    (store.cell_dir(key) / "summary.json").write_text(json.dumps(summary))
    (store.cell_dir(key) / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    a = report_analysis(load_run(root), n_boot=200)
    by_key = {c.key: s for c, s in a.serving}
    assert len(by_key) == 4
    s = by_key[key]
    assert s["preemptions"] == 3 and s["request_goodput"] == pytest.approx(1.2) and s["p90_itl_ms"] == pytest.approx(600)
    others = [v for k, v in by_key.items() if k != key]
    assert all(v["preemptions"] is None and v["request_rate"] is None and v["completed"] == 24 for v in others)


# ------------------------------------------------------------------ /metrics sampler


class _Pool:
    """Serves the given /metrics texts in turn (the last one again after that); ``on_get(i)`` runs at fetch i."""

    def __init__(self, texts, on_get=None):
        self.texts, self.on_get, self.i = texts, on_get, 0

    async def get_text(self, path):
        assert path == "/metrics"
        text = self.texts[min(self.i, len(self.texts) - 1)]
        if self.on_get:
            self.on_get(self.i)
        self.i += 1
        return 200, text


def _kvbench_text(running, waiting, kv, preempted):
    stats = SimpleNamespace(running=running, waiting=waiting, pages_used=int(kv * 100), pages_total=100, kv_usage=kv,
                            preemptions=preempted, prompt_tokens=0, generation_tokens=0, requests_finished=0,
                            requests_aborted=0)
    return prometheus_text(stats, "m")


def _vllm_text(running, waiting, kv, preempted):
    lab = '{engine="0",model_name="m"}'
    return (f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{lab} {running}\n"
            f"vllm:num_requests_waiting{lab} {waiting}\nvllm:kv_cache_usage_perc{lab} {kv}\n"
            f"# HELP vllm:num_preemptions_total Cumulative number of preemptions from the engine.\n"
            f"# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total{lab} {preempted}\n"
            f"vllm:num_preemptions_created{lab} 1.7e9\n")


def _sglang_text(running, waiting, kv, preempted):
    lab = '{model_name="m"}'
    return (f"sglang:num_running_reqs{lab} {running}\nsglang:num_queue_reqs{lab} {waiting}\n"
            f"sglang:token_usage{lab} {kv}\nsglang:num_retracted_reqs{lab} 99.0\n"  # a gauge, not the counter
            f"sglang:num_retracted_requests_total{lab} {preempted}\n")


# (running, waiting, kv usage, preemption counter)
SAMPLES = [(2, 0, 0.1, 5), (4, 1, 0.3, 6), (3, 0, 0.2, 9)]


@pytest.mark.parametrize("render", [_kvbench_text, _vllm_text, _sglang_text], ids=["kvbench", "vllm", "sglang"])
def test_sampler_reads_each_naming_scheme(render):
    texts = [render(*s) for s in SAMPLES]
    sampler = MetricsSampler(None, "/metrics", 0.001, 0.0)
    sampler.pool = _Pool(texts, on_get=lambda i: sampler.stop() if i == len(texts) - 2 else None)
    asyncio.run(sampler.run())
    # the periodic polls stop at the second text; the final poll after stop() reads the last one
    assert len(sampler.samples) == 3
    sm = sampler.summary()
    assert sm["available"] and sm["max_running"] == 4 and sm["max_waiting"] == 1
    assert sm["max_running_without_queueing"] == 3 and sm["kv_usage_max"] == pytest.approx(0.3)
    assert sm["preemptions"] == 4  # 9 at the last sample - 5 at the first
    assert [row[4] for row in sm["timeline"]] == [5, 6, 9]


def test_sampler_counts_kvbench_kernel_compiles_during_the_run():
    """kvbench's server on a GPU exports the kernels it compiled while serving (each a stall of every running
    request): the run's increase is in the summary and in the text report; servers without the counter (and
    kvbench on the CPU, which does not watch) give None and no row."""
    def text(compiles, secs):
        stats = SimpleNamespace(running=1, waiting=0, pages_used=1, pages_total=100, kv_usage=0.01, preemptions=0,
                                prompt_tokens=0, generation_tokens=0, requests_finished=0, requests_aborted=0,
                                kernel_compiles=compiles, kernel_compile_s=secs)
        return prometheus_text(stats, "m")

    assert "kvbench_kernel_compiles_total" not in _kvbench_text(*SAMPLES[0])
    texts = [text(2, 1.5), text(2, 1.5), text(3, 4.25)]
    sampler = MetricsSampler(None, "/metrics", 0.001, 0.0)
    sampler.pool = _Pool(texts, on_get=lambda i: sampler.stop() if i == len(texts) - 2 else None)
    asyncio.run(sampler.run())
    sm = sampler.summary()
    assert sm["kernel_compiles"] == 1 and sm["kernel_compile_s"] == pytest.approx(2.75)
    assert [row[5] for row in sm["timeline"]] == [2, 2, 3]
    for render in (_vllm_text, _kvbench_text):
        other = MetricsSampler(_Pool([render(*SAMPLES[0])] * 3), "/metrics", 0.001, 0.0)
        asyncio.run(other._poll())
        assert other.summary()["kernel_compiles"] is None


def test_sampler_without_a_preemption_counter():
    text = "vllm:num_requests_running 2\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.5\n"
    sampler = MetricsSampler(_Pool([text]), "/metrics", 0.001, 0.0)

    async def two_polls():
        await sampler._poll()
        await sampler._poll()

    asyncio.run(two_polls())
    sm = sampler.summary()
    assert sm["preemptions"] is None and sm["max_running"] == 2 and sm["kv_usage_max"] == 0.5


def test_counter_increase_handles_restarts_and_gaps():
    assert counter_increase([5, 6, None, 9]) == 4
    assert counter_increase([5, 6, 1, 3]) == 1 + 1 + 2  # dropped to 1: restarted, counted from zero
    assert counter_increase([7]) == 0 and counter_increase([None, None]) is None and counter_increase([]) is None


# ------------------------------------------------------------------ end to end against the kvbench server


def test_load_summary_records_settings_and_preemptions():
    from test_server_fakes import FakeEngine, serve

    from kvbench.harness.loadgen.run import run_load
    from kvbench.runtime.server import create_app

    engine = FakeEngine(step_s=0.002, max_running=2)
    try:
        with serve(create_app(engine)) as url:
            cfg = LoadConfig(num_prompts=6, max_concurrency=3, request_rate=200.0, burstiness=2.0, input_len=8,
                             output_len=4, metrics_interval_s=0.01, slo_ttft_ms=10_000.0, seed=1)
            summary, records = run_load(url, None, cfg)
    finally:
        engine.shutdown()
    load = json.loads(json.dumps(summary))
    assert (load["request_rate"], load["burstiness"], load["max_concurrency"], load["num_prompts"]) == (200.0, 2.0, 3, 6)
    assert (load["dataset"], load["input_len"], load["output_len"]) == ("random", 8, 4)
    assert load["server_metrics"]["available"] and load["server_metrics"]["preemptions"] == 0  # exported, none happened
    cell = CellData(key="k", label="x", config={"concurrency": 3}, status="done", requests=records,
                    summary={"load": load}, short="x")
    s = serving_summary(cell)
    assert s["request_rate"] == 200.0 and s["max_concurrency"] == 3 and s["completed"] == 6
    assert s["good_requests"] == 6 and s["slo"] == {"ttft_ms": 10_000.0} and s["preemptions"] == 0
    assert s["max_running"] <= 2 and s["peak_concurrency"] <= 3


def test_serving_only_run_two_engines_baseline_series_and_labels(tmp_path):
    """A sweep of two server targets with load only (no item records), as configs/vllm-vs-kvbench-8b.yaml: the
    configured baseline names a series, the × base column divides by it at each concurrency, and a label says a
    backend once when it serves both phases."""
    import random

    from test_reports_load import _requests

    from kvbench.core.io import canonical_key
    from kvbench.reports.load import resolve_baseline
    from kvbench.reports.serving import serving_tables

    store = RunStore(tmp_path / "run")
    store.write_manifest({"config": {"baseline": {"kv_dtype": "bf16", "target": "vllm"}}, "git_sha": "0" * 40})
    for target, backend in (("vllm", "FLASH_ATTN"), ("kvbench", "triton")):
        for kv in ("bf16", "fp8_e4m3"):
            for conc in (4, 16):
                cfg = {"model": "m", "target": target, "prefill_backend": backend, "decode_backend": backend,
                       "kv_dtype": kv, "kv_scales": "unit", "concurrency": conc}
                key = canonical_key(cfg)
                store.init_cell(key, cfg, label=f"{target} {kv} c={conc}")
                store.write_requests(key, _requests(kv, conc, random.Random(f"{target}{kv}{conc}")))
                store.write_json(key, "summary", {"suites": {}, "load": {"max_concurrency": conc}, "capacity": {}, "error": None})
                store.set_status(key, "done")
    run = load_run(store.root)
    base = resolve_baseline(run)
    assert base is not None and base.config["target"] == "vllm" and base.config["kv_dtype"] == "bf16"
    assert base.concurrency == 4 and not base.items
    a = report_analysis(run, n_boot=50)
    table = next(t for t in serving_tables(a) if "load and throughput" in t.title)
    col = table.columns.index("out tok/s × base")
    rows = {(r[0], r[1]): r[col] for r in table.rows}
    assert ("vllm FLASH_ATTN bf16", "4") in rows and ("kvbench triton fp8_e4m3", "16") in rows  # backend said once
    assert rows[("vllm FLASH_ATTN bf16", "4")] == "—"  # the baseline itself
    assert rows[("kvbench triton bf16", "16")].endswith("×") and rows[("vllm FLASH_ATTN fp8_e4m3", "4")].endswith("×")


def test_sampler_reports_where_the_engine_step_time_went(monkeypatch):
    """kvbench's step-time counters (prefill / mixed / decode): their increase between the first and the last
    scrape, per kind, and the loop's busy fraction of that window; a server without them gives None (vLLM)."""
    import kvbench.harness.loadgen.server_metrics as smod

    def text(n_pre, s_pre, n_dec, s_dec):
        stats = SimpleNamespace(running=1, waiting=0, pages_used=1, pages_total=100, kv_usage=0.01, preemptions=0,
                                prompt_tokens=0, generation_tokens=0, requests_finished=0, requests_aborted=0,
                                step_counts={"prefill": n_pre, "decode": n_dec},
                                step_seconds={"prefill": s_pre, "decode": s_dec},
                                step_tokens={"prefill": 100 * n_pre, "decode": 8 * n_dec})
        return prometheus_text(stats, "m")

    texts = [text(1, 0.5, 10, 0.25), text(2, 0.75, 20, 0.5), text(5, 1.5, 110, 1.25)]
    clock = [10.0, 11.0, 14.0]
    monkeypatch.setattr(smod.time, "perf_counter", lambda: clock.pop(0) if len(clock) > 1 else clock[0])
    sampler = MetricsSampler(None, "/metrics", 0.001, 0.0)
    sampler.pool = _Pool(texts, on_get=lambda i: sampler.stop() if i == len(texts) - 2 else None)
    asyncio.run(sampler.run())
    es = sampler.summary()["engine_steps"]
    assert es["prefill"] == {"steps": 4, "seconds": pytest.approx(1.0), "tokens": 400, "ms_per_step": pytest.approx(250)}
    assert es["decode"]["steps"] == 100 and es["decode"]["seconds"] == pytest.approx(1.0) and es["decode"]["tokens"] == 800
    assert "mixed" not in es and es["window_s"] == pytest.approx(4.0) and es["busy_fraction"] == pytest.approx(0.5)
    # a server restarted between two scrapes: its counters start again from zero and still add up
    from kvbench.harness.loadgen.server_metrics import engine_steps, parse_prometheus

    scrapes = [parse_prometheus(t) for t in (text(4, 1.0, 40, 0.5), text(6, 1.5, 60, 0.75), text(1, 0.25, 10, 0.25))]
    es = engine_steps(scrapes, 2.0)
    assert es["prefill"]["steps"] == 3 and es["prefill"]["seconds"] == pytest.approx(0.75)
    assert es["decode"]["steps"] == 30 and es["busy_fraction"] == pytest.approx((0.75 + 0.5) / 2.0)
    other = MetricsSampler(_Pool([_vllm_text(*SAMPLES[0])] * 3), "/metrics", 0.001, 0.0)
    asyncio.run(other._poll())
    asyncio.run(other._poll())
    assert other.summary()["engine_steps"] is None

"""The load generator end to end against the kvbench server (fake engine): records, usage-based token
counts, arrivals, concurrency cap, /metrics samples, failures, outputs and the ``kvbench load`` command."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
from typer.testing import CliRunner

sys.path.insert(0, os.path.dirname(__file__))
from test_server_fakes import FakeEngine, serve  # noqa: E402

from kvbench.harness.cli import app  # noqa: E402
from kvbench.harness.loadgen.run import LoadConfig, run_load, write_outputs  # noqa: E402
from kvbench.runtime.server import create_app  # noqa: E402

RECORD_KEYS = {"request_id", "success", "error", "prompt_tokens", "output_tokens", "start_s", "ttft_s", "latency_s", "itl_s", "tpot_s"}


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(step_s=0.004, max_running=3)
    with serve(create_app(engine)) as url:
        yield url, engine
    engine.shutdown()


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_run_load_records_and_summary(server, api, tmp_path):
    url, _ = server
    cfg = LoadConfig(num_prompts=24, max_concurrency=6, input_len=20, output_len=12, range_ratio=0.25, api=api,
                     metrics_interval_s=0.05, seed=5)
    summary, records = run_load(url, None, cfg)
    assert summary["model"] == "fake-model" and summary["completed"] == 24 and summary["failed"] == 0
    assert all(set(r) == RECORD_KEYS for r in records)
    assert summary["token_count_source"] == "usage"
    for r in records:
        assert r["success"] and 0 < r["ttft_s"] <= r["latency_s"]
        assert len(r["itl_s"]) == r["output_tokens"] - 1  # one token per chunk from this server
        assert r["tpot_s"] == pytest.approx((r["latency_s"] - r["ttft_s"]) / (r["output_tokens"] - 1))
    assert {r["output_tokens"] for r in records} <= set(range(9, 16)) and len({r["output_tokens"] for r in records}) > 1
    if api == "completions":  # token-id prompts: exact input lengths
        assert all(15 <= r["prompt_tokens"] <= 25 for r in records)
    assert summary["total_output_tokens"] == sum(r["output_tokens"] for r in records)
    assert summary["peak_concurrency"] <= 6
    sm = summary["server_metrics"]
    assert sm["available"] and sm["samples"] >= 2 and sm["max_running"] <= 3  # the engine's own cap
    assert sm["max_waiting"] >= 1  # 6 in flight, 3 running: the rest queue
    write_outputs(str(tmp_path), summary, records)
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == records
    assert json.loads((tmp_path / "summary.json").read_text())["completed"] == 24


def test_poisson_arrivals_follow_the_seed(server):
    url, _ = server
    rate = 40.0
    cfg = LoadConfig(num_prompts=12, request_rate=rate, input_len=8, output_len=2, seed=9, metrics_interval_s=0)
    _, records = run_load(url, None, cfg)
    rng = random.Random(9)
    expected, t = [0.0], 0.0
    for _ in range(11):
        t += rng.gammavariate(1.0, 1.0 / rate)
        expected.append(t)
    starts = [r["start_s"] for r in records]
    offset = starts[0]
    assert all(abs((s - offset) - e) < 0.02 for s, e in zip(starts, expected)), list(zip(starts, expected))


def test_failures_are_counted_not_hidden(server):
    url, _ = server
    cfg = LoadConfig(num_prompts=4, input_len=300, output_len=4, warmup=0, metrics_interval_s=0)  # context is 256
    summary, records = run_load(url, None, cfg)
    assert summary["completed"] == 0 and summary["failed"] == 4
    assert all(not r["success"] and "HTTP 400" in r["error"] for r in records)
    with pytest.raises(RuntimeError, match="warm-up"):
        run_load(url, None, LoadConfig(num_prompts=2, input_len=300, output_len=4, warmup=1))


def test_kvbench_load_command(server, tmp_path):
    url, _ = server
    out = tmp_path / "load"
    res = CliRunner().invoke(app, ["load", "--base-url", url, "--max-concurrency", "1,4", "--num-prompts", "8",
                                   "--input-len", "16", "--output-len", "4", "--out", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert res.output.count("Serving Benchmark Result") == 2
    for c in (1, 4):
        s = json.loads((out / f"c{c}" / "summary.json").read_text())
        assert s["completed"] == 8 and s["config"]["max_concurrency"] == c
        assert len((out / f"c{c}" / "requests.jsonl").read_text().splitlines()) == 8
    assert len(json.loads((out / "summary.json").read_text())["levels"]) == 2
    bad = CliRunner().invoke(app, ["load", "--base-url", url, "--max-concurrency", "0"])
    assert bad.exit_code == 2

"""``kvbench serve`` as a process (a tiny synthetic Llama-3 shape on CPU, loopback) driven by
``kvbench load`` as a process: the path the README and the GPU run use."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = "synthetic:llama-3-8b,layers=2,hidden=256,heads=4,kv_heads=2,head_dim=64,intermediate_size=512,vocab=512"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_then_load(tmp_path):
    port = _free_port()
    kvbench = [sys.executable, "-m", "kvbench.harness.cli"]
    server = subprocess.Popen(kvbench + ["serve", "--model", MODEL, "--device", "cpu", "--kv-dtype", "fp8_e4m3",
                                         "--kv-budget-gb", "0.01", "--max-model-len", "256", "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        out = tmp_path / "load"
        res = subprocess.run(kvbench + ["load", "--base-url", url, "--max-concurrency", "1,4", "--num-prompts", "8",
                                        "--input-len", "24", "--output-len", "6", "--out", str(out), "--no-progress"],
                             capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.count("Serving Benchmark Result") == 2
        for c in (1, 4):
            s = json.loads((out / f"c{c}" / "summary.json").read_text())
            assert s["completed"] == 8 and s["total_output_tokens"] == 8 * 6 and s["peak_concurrency"] <= c
        metrics = httpx.get(url + "/metrics").text
        assert "kvbench_generation_tokens_total" in metrics and "kvbench_kv_pages_used" in metrics
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
    log = server.stdout.read()
    assert "KV cache:" in log and "fp8_e4m3" in log
    from kvbench.harness.server_capacity import parse_startup_log

    cap = parse_startup_log(log)  # what a sweep's server target reads: the pool and the admission limit
    assert cap["kv_cache_dtype"] == "fp8_e4m3" and cap["max_running_requests"] == 64

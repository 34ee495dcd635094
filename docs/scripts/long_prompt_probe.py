"""Send one huge prompt to a fresh ``kvbench serve`` and watch the server while it answers.

    python docs/scripts/long_prompt_probe.py --mb 64 -- --max-model-len 8192 --kv-budget-gb 0.25

Starts ``kvbench serve`` (the arguments after ``--``; default model on CPU unless they say otherwise) on a
free loopback port, waits for ``/health``, starts one ordinary streaming completion, then POSTs a
completion whose prompt is ``--mb`` MiB of plain English text.  Meanwhile a thread GETs ``/health``
every 50 ms and another samples the server's resident memory (VmRSS).  Prints one JSON object: the big
request's status and seconds to its answer, the slowest ``/health`` reply and the longest gap between
the stream's chunks while the big request was in flight (and before it, for scale), and the server's RSS
before and at its peak.
A measuring tool for docs/performance.md, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=64.0, help="prompt size in MiB")
    ap.add_argument("--api", choices=("completions", "chat"), default="completions")
    ap.add_argument("serve_args", nargs="*", help="arguments for kvbench serve (after --)")
    a = ap.parse_args()

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvbench.harness.cli", "serve", "--port", str(port), *a.serve_args]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                sys.exit(f"server exited: {' '.join(cmd)}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                sys.exit("server did not come up")
            time.sleep(0.5)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        rss0 = _rss_mb(server.pid)
        stop = threading.Event()
        health: list[tuple[float, float]] = []  # (sent, answered) of every /health request
        chunks: list[float] = []  # arrival of every stream chunk
        peak = [rss0]

        def poll_health() -> None:
            with httpx.Client(timeout=600) as c:
                while not stop.is_set():
                    t = time.perf_counter()
                    c.get(url + "/health")
                    health.append((t, time.perf_counter()))
                    time.sleep(0.05)

        def sample_rss() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _rss_mb(server.pid))
                time.sleep(0.05)

        def stream() -> None:
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line:  # an SSE event (the blank lines between events arrive with them)
                        chunks.append(time.perf_counter())
                    if stop.is_set():
                        break

        threads = [threading.Thread(target=f, daemon=True) for f in (poll_health, sample_rss, stream)]
        for t in threads:
            t.start()
        time.sleep(2.0)  # the stream is decoding
        sentence = "The quick brown fox jumps over the lazy dog near the river bank. "
        text = sentence * int(a.mb * 2**20 / len(sentence))
        if a.api == "chat":
            payload, path = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1}, "/v1/chat/completions"
        else:
            payload, path = {"model": model, "prompt": text, "max_tokens": 1}, "/v1/completions"
        data = json.dumps(payload).encode()
        t0 = time.perf_counter()
        try:
            r = httpx.post(url + path, content=data, headers={"Content-Type": "application/json"}, timeout=600)
            status, message = r.status_code, r.json().get("error", {}).get("message", "")[:160]
        except httpx.HTTPError as e:
            status, message = None, f"{type(e).__name__}: {e}"
        t1 = time.perf_counter()
        elapsed = t1 - t0
        time.sleep(1.0)
        stop.set()
        # requests and chunk gaps that overlap the big request's time in flight
        during = [b - a for a, b in health if b >= t0 and a <= t1]
        gaps = [b - a for a, b in zip(chunks, chunks[1:]) if b >= t0 and a <= t1]
        before = sorted(b - a for a, b in zip(chunks, chunks[1:]) if b < t0)
        out = {
            "body_mb": round(len(data) / 2**20, 1), "api": a.api, "status": status, "message": message,
            "seconds_to_answer": round(elapsed, 2),
            "health_replies_during": len(during), "health_max_ms": round(max(during, default=float("nan")) * 1000, 1),
            "stream_gaps_during": len(gaps), "stream_max_gap_ms": round(max(gaps, default=float("nan")) * 1000, 1),
            "stream_gap_before_ms": {"median": round(before[len(before) // 2] * 1000, 1) if before else None,
                                     "max": round(before[-1] * 1000, 1) if before else None},
            "rss_before_mb": round(rss0), "rss_peak_mb": round(peak[0]), "rss_growth_mb": round(peak[0] - rss0),
            "serve_args": a.serve_args, "cpus": os.cpu_count(),
        }
        print(json.dumps(out, indent=1))
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()

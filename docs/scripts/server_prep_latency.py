"""How long small requests take while big prompts are being prepared by ``kvbench``'s server.

    python docs/scripts/server_prep_latency.py --big-mb 7 --big 4 --context 32768

Starts a server (``create_app`` in a subprocess, as ``kvbench serve`` runs it: worker processes for bodies
over 64 KiB, ``--prep-processes``) over a fake engine (tokens in microseconds, so all the time measured is
request preparation) with a large-vocabulary tokenizer: by default the Qwen2-shaped 150k-token byte-level BPE
of ``tests/large_vocab.py`` (NFC normalizer, Qwen2's split regex, long tokens), or ``--tokenizer DIR``, a
Hugging Face tokenizer directory.  Then:

1. solo: ``--small`` completions of a short prompt (``max_tokens`` 1), one after another;
2. load: ``--big`` completions at once whose prompts are ``--big-mb`` MiB of prose each (with the default
   context they cannot fit: each gets a 400), and meanwhile small completions one after another, as
   before, until every big one is answered.

Prints one JSON object: the small requests' latency (ms: median, p90, max) solo and during the load (those
that overlapped a big request in flight), and the big ones' statuses, seconds to their answer and error
message.  ``--chat`` sends the big prompts as chat messages.  A measuring tool for docs/performance.md,
not a test.
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
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def _serve(a: argparse.Namespace) -> None:
    """The server side (a subprocess): a fake engine with the chosen tokenizer behind ``create_app``."""
    import inspect

    import uvicorn

    sys.path.insert(0, str(REPO / "tests"))
    from test_server_fakes import FakeEngine

    from kvbench.runtime.server import create_app

    engine = FakeEngine(step_s=0.002, max_model_len=a.context)
    if a.tokenizer == "synthetic":
        from large_vocab import large_vocab_tokenizer

        engine.tokenizer = large_vocab_tokenizer()
    else:
        from kvbench.core.tokenizer import load_tokenizer

        engine.tokenizer = load_tokenizer(a.tokenizer)
    kw = {"prep_processes": a.prep_processes} if "prep_processes" in inspect.signature(create_app).parameters else {}
    app = create_app(engine, **kw)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=a.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    prep = getattr(app.state, "prep", None)
    if prep is not None:
        prep.ready.wait(300)
    print(json.dumps({"ready": True, "vocab_size": engine.tokenizer.vocab_size, "prep": kw}), flush=True)
    thread.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    pick = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1)  # noqa: E731
    return {"n": len(xs), "median": pick(0.5), "p90": pick(0.9), "max": round(xs[-1] * 1000, 1)}


def _small_loop(url: str, stop: threading.Event, out: list, limit: int = 0) -> None:
    """Small completions one after another until ``stop`` (or ``limit`` of them); ``out``: (sent, answered)."""
    body = {"prompt": "The weather today is", "max_tokens": 1}
    with httpx.Client(timeout=600) as c:
        while not stop.is_set() and (not limit or len(out) < limit):
            t = time.perf_counter()
            r = c.post(url + "/v1/completions", json=body)
            out.append((t, time.perf_counter()))
            if r.status_code != 200:
                raise RuntimeError(f"small request failed: {r.status_code} {r.text[:200]}")
            time.sleep(0.01)


def _big(url: str, path: str, data: bytes, out: list) -> None:
    t = time.perf_counter()
    r = httpx.post(url + path, content=data, headers={"Content-Type": "application/json"}, timeout=600)
    out.append({"status": r.status_code, "seconds": round(time.perf_counter() - t, 2),
                "message": r.json().get("error", {}).get("message", "")[:120], "t0": t, "t1": time.perf_counter()})


def _measure(a: argparse.Namespace, url: str) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from large_vocab import prose

    solo: list = []
    _small_loop(url, threading.Event(), solo, limit=a.small)
    text = prose(int(a.big_mb * 2**20))
    if a.chat:
        path, payload = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    else:
        path, payload = "/v1/completions", {"prompt": text, "max_tokens": 1}
    data = json.dumps(payload).encode()
    bigs: list = []
    during: list = []
    stop = threading.Event()
    small = threading.Thread(target=_small_loop, args=(url, stop, during), daemon=True)
    small.start()
    time.sleep(0.2)
    threads = [threading.Thread(target=_big, args=(url, path, data, bigs), daemon=True) for _ in range(a.big)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    small.join(60)
    t0, t1 = min(b["t0"] for b in bigs), max(b["t1"] for b in bigs)
    overlap = [e - s for s, e in during if e >= t0 and s <= t1]
    return {
        "small_solo_ms": _ms([e - s for s, e in solo]),
        "small_during_big_ms": _ms(overlap),
        "big": {"n": len(bigs), "body_mb": round(len(data) / 2**20, 2), "statuses": sorted(b["status"] for b in bigs),
                "seconds": sorted(b["seconds"] for b in bigs), "message": bigs[0]["message"]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", type=int, default=4, help="big requests sent at once")
    ap.add_argument("--big-mb", type=float, default=7.0, help="size of each big prompt, MiB")
    ap.add_argument("--small", type=int, default=30, help="small requests measured alone first")
    ap.add_argument("--context", type=int, default=32768, help="the engine's context (max_model_len)")
    ap.add_argument("--tokenizer", default="synthetic", help="'synthetic' (150k-token Qwen2-shaped) or a HF tokenizer dir")
    ap.add_argument("--prep-processes", type=int, default=2, help="worker processes for bodies over 64 KiB (0: threads)")
    ap.add_argument("--chat", action="store_true", help="send the big prompts as chat messages")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return _serve(a)
    port = _free_port()
    cmd = [sys.executable, __file__, "--serve", "--port", str(port), "--context", str(a.context), "--tokenizer", a.tokenizer,
           "--prep-processes", str(a.prep_processes)]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(server.stdout.readline() or "{}")
        if not ready.get("ready"):
            sys.exit(f"server did not come up: {' '.join(cmd)}")
        out = _measure(a, f"http://127.0.0.1:{port}")
        out.update({"tokenizer": a.tokenizer, "vocab_size": ready["vocab_size"], "context": a.context, "chat": a.chat,
                    "server_prep": ready["prep"], "cpus": os.cpu_count()})
        print(json.dumps(out, indent=1))
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()

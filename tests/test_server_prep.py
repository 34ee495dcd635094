"""Request preparation under big prompts (``runtime/server_prep.py``), with a Qwen2-shaped 150k-token
byte-level BPE tokenizer (``tests/large_vocab.py``): the finer byte bound is a true lower bound and refuses
multi-MB prompts untokenized; a prompt that passes it is counted without Python lists; small requests do not
queue behind big ones; a dead worker costs its request a 503, and a killed server's workers end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from large_vocab import LONG_WORD, large_vocab_tokenizer, prose  # noqa: E402
from test_server_fakes import FakeEngine, serve  # noqa: E402

from kvbench.runtime.server import create_app  # noqa: E402

MIB = 2**20
CONTEXT = 65536  # the whole-vocabulary bound (longest token: 128 spaces) lets 7 MiB of prose through here
SMALL_BOUND_S = 0.5  # each small request while big ones are prepared (~10-20 ms when nothing else runs)


@pytest.fixture(scope="module")
def tok():
    return large_vocab_tokenizer()


def _texts() -> dict[str, str]:
    cjk = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(3000))
    return {
        "prose": prose(200_000, seed=3),
        "spaces": ("x" + " " * 300) * 200,
        "rules": ("=" * 64 + "\n" + "-" * 64 + "\n") * 300,
        "long words": (" " + LONG_WORD) * 2000,
        "cjk": cjk,
        "combining": ("e\u0301a\u0308 " * 5000) + "cafe\u0301",  # NFC composes these: not counted
        "mixed": prose(50_000, seed=4) + cjk + " " * 1000 + "\u00e9" * 500,
    }


def test_byte_bound_is_a_true_lower_bound_and_tighter_than_the_longest_token(tok):
    assert tok._byte_bound is not None and tok._byte_bound.nfc  # the NFC normalizer is handled, not refused
    assert tok._token_bound is None  # the old, coarser bound refuses a normalizer: these were all tokenized
    longest = max(len(t) for t in tok._definition()["model"]["vocab"])  # in bytes (one character per byte)
    assert longest >= 128
    for name, text in _texts().items():
        n = len(tok.encode(text, add_special_tokens=False))
        bound = tok.min_token_count(text)
        assert bound <= n, (name, bound, n)
        if name == "prose":
            assert bound * 12 >= n, (bound, n)  # within ~12x of the truth on prose (the coarse bound: ~30x)
            assert bound > 2 * -(-len(text) // longest)


def test_encode_capped_counts_without_ids_past_the_limit(tok):
    text = prose(300_000, seed=5)
    ids = tok.encode(text)
    n, got = tok.encode_capped(text, len(ids))
    assert n == len(ids) and got == ids
    n, got = tok.encode_capped(text, len(ids) - 1)
    assert n == len(ids) and got is None


def _post(url: str, path: str, body: bytes, timeout: float = 120) -> tuple[int, dict, float, float]:
    t0 = time.perf_counter()
    r = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=timeout)
    return r.status_code, r.json(), t0, time.perf_counter()


def _small_requests(url: str, stop: threading.Event, out: list) -> None:
    body = json.dumps({"model": "fake-model", "prompt": "hi there", "max_tokens": 2}).encode()
    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
            out.append((t0, time.perf_counter(), r.status_code))
            time.sleep(0.01)


@pytest.mark.parametrize("processes", [0, 2], ids=["threads", "processes"])
def test_small_requests_do_not_wait_behind_four_7mb_prompts(tok, processes):
    """The issue's case: four 7 MiB prompts under the body cap, over the context; a 2-token request meanwhile."""
    engine = FakeEngine(step_s=0.002, max_model_len=CONTEXT)
    engine.tokenizer = tok
    app = create_app(engine, max_body_bytes=16 * MIB, prep_processes=processes)
    big = [json.dumps({"model": "fake-model", "prompt": prose(7 * MIB, seed=s), "max_tokens": 1}).encode()
           for s in range(4)]
    chat = json.dumps({"model": "fake-model", "max_tokens": 1,
                       "messages": [{"role": "user", "content": prose(7 * MIB, seed=9)}]}).encode()
    with serve(app) as url:
        assert app.state.prep.ready.wait(60) and app.state.prep.uses_processes == bool(processes)
        small: list = []
        stop = threading.Event()
        runner = threading.Thread(target=_small_requests, args=(url, stop, small), daemon=True)
        runner.start()
        time.sleep(0.3)
        with ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(_post, url, "/v1/completions", b) for b in big]
            futures.append(pool.submit(_post, url, "/v1/chat/completions", chat))
            results = [f.result() for f in futures]
        time.sleep(0.2)
        stop.set()
        runner.join(60)
    engine.shutdown()
    t0, t1 = min(r[2] for r in results), max(r[3] for r in results)
    for status, body, a, b in results:
        assert status == 400, body
        err = body["error"]
        assert err["code"] == "context_length_exceeded" and "prompt has at least" in err["message"], err
        assert b - a < 10.0, b - a  # untokenized (each took 27-31 s to be refused before the byte bound)
    during = [b - a for a, b, s in small if b >= t0 and a <= t1]
    assert all(s == 200 for _, _, s in small)
    assert len(during) >= 2 and max(during) < SMALL_BOUND_S, sorted(during)[-5:]


def test_prompt_past_the_bound_is_counted_and_refused_with_its_true_length(tok):
    engine = FakeEngine(step_s=0.002, max_model_len=CONTEXT)
    engine.tokenizer = tok
    text = prose(1 * MIB, seed=11)  # ~250k tokens: the bound (~45k) lets it through, the context does not
    n = len(tok.encode(text))
    assert tok.min_token_count(text) <= CONTEXT < n
    with serve(create_app(engine)) as url:
        status, body, a, b = _post(url, "/v1/completions", json.dumps({"model": "fake-model", "prompt": text,
                                                                     "max_tokens": 1}).encode())
        assert status == 400 and f"prompt has {n} tokens; this model's context is {CONTEXT} tokens" in body["error"]["message"]
        status, body, _, _ = _post(url, "/v1/completions", json.dumps({"model": "fake-model", "prompt": text[:20_000],
                                                                     "max_tokens": 2}).encode())
        assert status == 200 and body["usage"]["prompt_tokens"] == len(tok.encode(text[:20_000]))
    engine.shutdown()


def test_a_dead_worker_fails_its_request_with_503_and_is_replaced(tok):
    engine = FakeEngine(step_s=0.002, max_model_len=CONTEXT, num_pages=CONTEXT // 4)  # room for a whole context
    engine.tokenizer = tok
    app = create_app(engine, max_body_bytes=16 * MIB, prep_processes=1)
    body = json.dumps({"model": "fake-model", "prompt": prose(200_000, seed=2), "max_tokens": 1}).encode()
    with serve(app) as url:
        lanes = app.state.prep
        assert lanes.ready.wait(60)
        (pid,) = list(lanes.big._processes)
        os.kill(pid, 9)
        time.sleep(0.5)
        status, reply, _, _ = _post(url, "/v1/completions", body)
        assert status == 503 and "died" in reply["error"]["message"], reply
        status, reply, _, _ = _post(url, "/v1/completions", body)  # the next one gets a fresh worker
        assert status == 200, reply
    engine.shutdown()


_ORPHAN = """
import os, sys, time
sys.path.insert(0, {tests!r})
from large_vocab import large_vocab_tokenizer
from kvbench.runtime.server_prep import PrepLanes, PrepSpec
lanes = PrepLanes(PrepSpec(large_vocab_tokenizer(20_000), "m", 4096), processes=1)
lanes.start()
assert lanes.ready.wait(60)
print(*lanes.big._processes, flush=True)
time.sleep(600)
"""


def test_workers_end_when_their_server_is_killed():
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN.format(tests=os.path.dirname(__file__))],
                            stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        os.kill(pid, 0)  # alive
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, 9)
        raise AssertionError(f"worker {pid} outlived its killed server")


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for whoever adopted it to reap it counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

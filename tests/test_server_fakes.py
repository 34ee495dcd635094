"""Test helpers (no tests here): a small deterministic engine implementing ``EngineProtocol``, and a
context manager that serves an ASGI app on a loopback port from a background thread.

The fake engine's output is a pure function of the prompt: token ``i`` of the output is the letter
``"abcdefghijklmnopqrstuvwxyz"[(sum(prompt) + i) % 26]``, and unless ``ignore_eos`` it ends with EOS after
``5 + sum(prompt) % 7`` tokens.  It owns a page pool (4 tokens per page) so tests can check that aborted
requests give their pages back.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from kvbench.core.client import ScoreResult
from kvbench.runtime.engine_api import CapacityReport, EngineStats, SamplingParams, StreamDelta

LETTERS = "abcdefghijklmnopqrstuvwxyz"


class FakeTokenizer:
    """Characters are tokens: id = ord(c) + 3; 0 = pad, 1 = BOS, 2 = EOS."""

    vocab_size = 300
    eos_token_ids = (2,)
    bos_token = "<s>"
    chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [min(ord(c), 296) + 3 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        names = {0: "<pad>", 1: "<s>", 2: "</s>"}
        return "".join(("" if skip_special_tokens else names[i]) if i < 3 else chr(i - 3) for i in ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        body = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return body + ("<|assistant|>" if add_generation_prompt else "")


def expected_ids(prompt: list[int], n: int) -> list[int]:
    base = sum(prompt)
    return [ord(LETTERS[(base + i) % 26]) + 3 for i in range(n)]


def natural_len(prompt: list[int]) -> int:
    return 5 + sum(prompt) % 7


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    on_delta: Optional[Callable[[StreamDelta], None]]
    out: list[int] = field(default_factory=list)
    text: str = ""


class FakeEngine:
    def __init__(self, step_s: float = 0.002, num_pages: int = 4096, page_size: int = 4, max_running: int = 64, max_model_len: int = 256):
        self.model_id = "fake-model"
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.step_s, self.num_pages, self.page_size, self.max_running = step_s, num_pages, page_size, max_running
        self.capacity = CapacityReport("bf16", page_size, num_pages, num_pages * page_size, 4.0, num_pages * page_size * 4, max_model_len, num_pages * page_size // max_model_len)
        self._lock = threading.Lock()
        self._waiting: list[_Req] = []
        self._running: dict[str, _Req] = {}
        self._pages: dict[str, int] = {}
        self._counters = EngineStats(pages_total=num_pages)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._next = 0
        self.seen_params: list[SamplingParams] = []

    # -- protocol
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def add_request(self, prompt_token_ids, params, request_id=None, on_delta=None) -> str:
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens exceed the context of {self.max_model_len}")
        with self._lock:
            self._next += 1
            rid = request_id or f"r{self._next}"
            self.seen_params.append(params)
            self._waiting.append(_Req(rid, list(prompt_token_ids), params, on_delta))
        return rid

    def abort(self, request_id: str) -> None:
        with self._lock:
            req = self._running.pop(request_id, None)
            if req is None:
                for r in self._waiting:
                    if r.rid == request_id:
                        req = r
                        self._waiting.remove(r)
                        break
            if req is None:
                return
            self._pages.pop(request_id, None)
            self._counters.requests_aborted += 1
        if req.on_delta:
            req.on_delta(StreamDelta(request_id, [], "", finish_reason="abort"))

    def stats(self) -> EngineStats:
        with self._lock:
            c = self._counters
            return EngineStats(len(self._running), len(self._waiting), sum(self._pages.values()), self.num_pages, c.preemptions,
                               c.prompt_tokens, c.generation_tokens, c.requests_finished, c.requests_aborted)

    def score(self, context_ids, continuation_ids, top_k=0, full_distribution=False):
        lps = [-0.25 - 0.5 * (t % 3) for t in continuation_ids]
        greedy = [t % 3 == 0 for t in continuation_ids]
        top_ids = [[t if g else t + 1] + [7, 8][: max(top_k - 1, 0)] for t, g in zip(continuation_ids, greedy)]
        top_lps = [[-0.25] + [-3.0, -4.0][: max(top_k - 1, 0)] for _ in continuation_ids]
        return ScoreResult(list(continuation_ids), lps, greedy, top_ids if top_k else None, top_lps if top_k else None)

    # -- step loop
    def _pages_for(self, req: _Req) -> int:
        return -(-(len(req.prompt) + len(req.out) + 1) // self.page_size)

    def _step(self) -> list[tuple[_Req, StreamDelta]]:
        events = []
        with self._lock:
            while self._waiting and len(self._running) < self.max_running:
                req = self._waiting[0]
                if sum(self._pages.values()) + self._pages_for(req) > self.num_pages:
                    break
                self._waiting.pop(0)
                self._running[req.rid] = req
                self._counters.prompt_tokens += len(req.prompt)
            for rid, req in list(self._running.items()):
                p = req.params
                i = len(req.out)
                eos = (not p.ignore_eos) and i >= max(natural_len(req.prompt), p.min_tokens)
                tok = 2 if eos else expected_ids(req.prompt, i + 1)[-1]
                req.out.append(tok)
                self._counters.generation_tokens += 1
                piece = "" if eos else chr(tok - 3)
                finish = "stop" if eos else None
                full = req.text + piece
                for s in p.stop:
                    if s and s in full:
                        piece = full[: full.index(s)][len(req.text):]
                        finish = "stop"
                        break
                if finish is None and len(req.out) >= p.max_tokens:
                    finish = "length"
                req.text += piece
                lp = [-0.5] if p.logprobs is not None else None
                top = [{tok: -0.5, 7: -2.0}] if p.logprobs else None
                events.append((req, StreamDelta(rid, [tok], piece, finish, lp, top)))
                self._pages[rid] = self._pages_for(req)
                if finish is not None:
                    del self._running[rid]
                    del self._pages[rid]
                    self._counters.requests_finished += 1
        return events

    def _loop(self) -> None:
        while not self._stop.is_set():
            for req, delta in self._step():
                if req.on_delta:
                    req.on_delta(delta)
            time.sleep(self.step_s)


@contextlib.contextmanager
def serve(app):
    """Serve ``app`` on 127.0.0.1 (a free port) in a thread; yields the base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()

"""``OpenAIClient`` request options over real HTTP on loopback: reasoning kept apart from the answer,
``extra_body`` and ``reasoning_effort`` in the body, retries of refused / reset connections (counted), no
retry of HTTP errors, timeouts classified, and far more than 256 requests in flight at once."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_fakes import serve  # noqa: E402

from kvbench.core.client import GenRequest, RequestFailed, SamplingParams  # noqa: E402
from kvbench.harness.openai_client import OpenAIClient  # noqa: E402
from kvbench.suites.base import GenerationTask, Item, Scored, SuiteOptions  # noqa: E402
from kvbench.suites.runner import run_generation  # noqa: E402

TIMEOUT = 0.5


def _chat(message: dict, finish: str = "stop") -> dict:
    return {"id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


class _App:
    """A chat server whose behaviour is the last word of the user message."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.peak = 0
        self.calls: dict[str, int] = {}
        self.hold = 0

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def chat(request):
            body = await request.json()
            self.bodies.append(body)
            how = body["messages"][-1]["content"].split()[-1]
            self.calls[how] = self.calls.get(how, 0) + 1
            if how == "sglang":
                return JSONResponse(_chat({"content": "Answer: B", "reasoning_content": "think: maybe A, no B"}))
            if how == "vllm":
                return JSONResponse(_chat({"content": "Answer: C", "reasoning": "newer field"}))
            if how == "cutoff":  # max_tokens reached inside the reasoning: no content at all
                return JSONResponse(_chat({"content": None, "reasoning_content": "still thinking about (A)"}, "length"))
            if how in ("bad", "overloaded"):
                code = 400 if how == "bad" else 503
                return JSONResponse({"error": {"message": f"{how} request", "type": "x"}}, status_code=code)
            if how == "slow":
                await asyncio.sleep(4 * TIMEOUT)
            if how == "busy":  # held until ``hold`` requests are in flight at once (at most 10 s)
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
                deadline = time.monotonic() + 10
                while self.peak < self.hold and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                self.in_flight -= 1
            return JSONResponse(_chat({"content": "plain"}))

        async def models(request):
            return JSONResponse({"data": [{"id": "m"}]})

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)])


@pytest.fixture(scope="module")
def server():
    fake = _App()
    with serve(fake.app()) as url:
        yield fake, url


def _req(word: str, **params) -> GenRequest:
    return GenRequest(messages=[{"role": "user", "content": f"question {word}"}], params=SamplingParams(max_tokens=16, **params))


def test_reasoning_is_kept_apart_from_the_answer(server):
    fake, url = server
    c = OpenAIClient(url, model="m", timeout=5)
    try:
        r = c.generate(_req("sglang"))
        assert (r.text, r.reasoning, r.retries) == ("Answer: B", "think: maybe A, no B", 0)
        r = c.generate(_req("vllm"))
        assert (r.text, r.reasoning) == ("Answer: C", "newer field")
        r = c.generate(_req("cutoff"))
        assert (r.text, r.reasoning, r.finish_reason, r.error) == ("", "still thinking about (A)", "length", None)
        assert c.generate(_req("plain")).reasoning is None
    finally:
        c.close()


def test_extra_body_and_reasoning_effort_reach_the_body(server):
    fake, url = server
    c = OpenAIClient(url, model="m", timeout=5)
    extra = {"chat_template_kwargs": {"enable_thinking": True, "depth": [1, 2.5, None]}, "separate_reasoning": True}
    try:
        c.generate(_req("plain", reasoning_effort="high", extra_body=extra, temperature=1.0, top_p=0.9, top_k=20))
        body = fake.bodies[-1]
        assert body["reasoning_effort"] == "high" and body["chat_template_kwargs"] == extra["chat_template_kwargs"]
        assert body["separate_reasoning"] is True
        assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"]) == (1.0, 0.9, 20, 16)
        c.generate(_req("plain"))
        assert "reasoning_effort" not in fake.bodies[-1] and "chat_template_kwargs" not in fake.bodies[-1]
        with pytest.raises(ValueError, match="'model'"):  # a key kvbench sets is never overridden
            c.generate(_req("plain", extra_body={"model": "other"}))
    finally:
        c.close()


def test_http_errors_are_not_retried_and_timeouts_are_classified(server):
    fake, url = server
    c = OpenAIClient(url, model="m", timeout=TIMEOUT, max_retries=3)
    c._sleep = lambda s: pytest.fail("an HTTP status or a timeout must not be retried")
    try:
        for word, code in (("bad", "400"), ("overloaded", "503")):
            r = c.generate(_req(word))
            assert (r.finish_reason, r.error_kind, r.retries) == ("error", "http", 0) and code in r.error
            assert fake.calls[word] == 1
        with pytest.raises(RequestFailed) as e:
            c.generate(_req("slow"))
        assert e.value.error_kind == "timeout" and e.value.retries == 0 and fake.calls["slow"] == 1
    finally:
        c.close()


def test_far_more_than_256_requests_in_flight(server):
    fake, url = server
    c = OpenAIClient(url, model="m", timeout=30)
    n = fake.hold = 300

    class Busy(GenerationTask):
        name = "busy"

        def load_items(self, opts):
            return [Item(f"q{i}", "plain", {}) for i in range(n)], "inline"

        def build(self, item, repeat, params):
            return _req("busy")

        def score(self, item, output):
            return Scored(output, output == item.target, False, {})

        def protocol(self, opts):
            return "busy:v1"

    try:
        t0 = time.monotonic()
        res = run_generation(Busy(), c, SuiteOptions(concurrency=n, progress=False))
        elapsed = time.monotonic() - t0
    finally:
        c.close()
    assert res.summary["accuracy"] == 1.0 and res.summary["errors"] == 0 and len(res.records) == n
    assert fake.peak == n, fake.peak  # all in flight at once: the pool never capped them (it was 256)
    assert elapsed < 9  # nobody waited for the server's 10 s deadline


# ------------------------------------------------------------------------ refused and reset connections
_OK = json.dumps(_chat({"content": "7"})).encode()


class _RawServer:
    """A raw HTTP server on a bound socket: the first ``resets`` connections are reset (RST) after the
    request is read; later ones get a 200.  ``listen()`` starts accepting (until then: connection refused)."""

    def __init__(self, resets: int = 0):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.resets = resets
        self.connections = 0
        self.bodies: list[dict] = []

    def listen(self) -> None:
        if self.connections == 0 and not getattr(self, "_thread", None):
            self.sock.listen(64)
            self._thread = threading.Thread(target=self._accept, daemon=True)
            self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn, self.connections <= self.resets), daemon=True).start()

    def _handle(self, conn: socket.socket, reset: bool) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += conn.recv(65536)
        self.bodies.append(json.loads(body))
        if reset:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         + f"Content-Length: {len(_OK)}\r\n\r\n".encode() + _OK)
        conn.close()

    def close(self) -> None:
        self.sock.close()


def test_reset_connections_are_retried_and_counted():
    srv = _RawServer(resets=2)
    srv.listen()
    c = OpenAIClient(f"http://127.0.0.1:{srv.port}", model="m", timeout=5, max_retries=3, retry_backoff_s=0.01)
    try:
        r = c.generate(_req("x"))
        assert (r.text, r.retries, r.error) == ("7", 2, None)
        assert srv.connections == 3 and len(srv.bodies) == 3  # the same request each time
        assert srv.bodies[0] == srv.bodies[2]
    finally:
        c.close()
        srv.close()


def test_refused_connections_back_off_then_succeed_or_fail_with_the_count():
    srv = _RawServer()
    c = OpenAIClient(f"http://127.0.0.1:{srv.port}", model="m", timeout=5, max_retries=3, retry_backoff_s=0.2)
    waits: list[float] = []

    def sleep(s: float) -> None:  # the server comes up during the second backoff
        waits.append(s)
        if len(waits) == 2:
            srv.listen()

    c._sleep = sleep
    try:
        r = c.generate(_req("x"))
        assert (r.text, r.retries) == ("7", 2) and srv.connections == 1
        # exponential with jitter: retry n waits between half and all of 0.2 * 2**n
        assert 0.1 <= waits[0] <= 0.2 and 0.2 <= waits[1] <= 0.4
    finally:
        c.close()
        srv.close()

    dead = _RawServer()  # never listens
    c = OpenAIClient(f"http://127.0.0.1:{dead.port}", model="m", timeout=5, max_retries=2)
    waits.clear()
    c._sleep = waits.append
    try:
        with pytest.raises(RequestFailed) as e:
            c.generate(_req("x"))
        assert e.value.error_kind == "connection" and e.value.retries == 2 and len(waits) == 2
        assert "after 2 retries" in str(e.value)
    finally:
        c.close()
        dead.close()


class _Echo(GenerationTask):
    name = "echo"

    def load_items(self, opts):
        return [Item("q0", "7", {}), Item("q1", "7", {})], "inline"

    def build(self, item, repeat, params):
        return GenRequest(messages=[{"role": "user", "content": item.item_id}], params=params)

    def score(self, item, output):
        return Scored(output, output == item.target, False, {})

    def protocol(self, opts):
        return "echo:v1"


def test_records_carry_retries_and_request_options():
    srv = _RawServer(resets=1)
    srv.listen()
    c = OpenAIClient(f"http://127.0.0.1:{srv.port}", model="m", timeout=5, max_retries=1, retry_backoff_s=0.01)
    opts = SuiteOptions(concurrency=1, progress=False, request={"reasoning_effort": "low", "extra_body": {"k": 1}})
    try:
        res = run_generation(_Echo(), c, opts)
    finally:
        c.close()
        srv.close()
    assert [r["retries"] for r in res.records] == [1, 0] and res.summary["accuracy"] == 1.0
    assert all(b["reasoning_effort"] == "low" and b["k"] == 1 for b in srv.bodies)
    assert res.records[0]["request_options"] == {"reasoning_effort": "low", "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                                 "max_tokens": 256, "extra_body": {"k": 1}}

    flaky = _RawServer(resets=2)  # q0: reset, retried once, reset again -> a failed record; q1 answered
    flaky.listen()
    c = OpenAIClient(f"http://127.0.0.1:{flaky.port}", model="m", timeout=5, max_retries=1, retry_backoff_s=0.01)
    try:
        res = run_generation(_Echo(), c, SuiteOptions(concurrency=1, progress=False))
    finally:
        c.close()
        flaky.close()
    failed, ok = res.records
    assert (failed["error_kind"], failed["retries"], failed["correct"]) == ("connection", 1, None)
    assert (ok["error"], ok["retries"], ok["correct"]) == (None, 0, True)
    assert failed["request_options"]["reasoning_effort"] is None and failed["reasoning"] is None

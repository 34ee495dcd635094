"""One streamed request against an OpenAI-compatible endpoint, timed with a monotonic clock.

A minimal HTTP/1.1 client on asyncio protocols (keep-alive pool, chunked or sized bodies, optional TLS):
each network read is timestamped (``time.perf_counter``, CLOCK_MONOTONIC on Linux) in the protocol's
``data_received`` callback, the earliest point Python sees the bytes, before any coroutine is woken.
Timing points: ``start`` just before the connection is taken and the request written; one timestamp
per SSE event carrying output text (the first gives TTFT, the rest ITL gaps); ``end`` when the body ends.
"""

from __future__ import annotations

import asyncio
import json
import ssl as _ssl
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlsplit


@dataclass
class StreamOutcome:
    request_id: str
    start: float  # perf_counter at send
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    usage: Optional[dict] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    role_pending: bool = False  # a chat role chunk was timed as the first token; its content chunk follows


def build_payload(api: str, model: str, prompt, max_tokens: int, temperature: float, ignore_eos: bool) -> dict:
    payload: dict = {
        "model": model,
        "max_tokens": int(max_tokens),
        "temperature": float(temperature),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        payload["ignore_eos"] = True
    if api == "chat":
        if not isinstance(prompt, str):
            raise ValueError("the chat API needs text prompts")
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    return payload


class _Response(asyncio.Protocol):
    """Parses one HTTP/1.1 response at a time; body bytes go to ``on_body(data, t_received)``."""

    def __init__(self) -> None:
        self.transport = None
        self.closed = False
        self._reset(None)

    def _reset(self, on_body) -> None:
        self.on_body: Optional[Callable[[bytes, float], None]] = on_body
        self.done: Optional[asyncio.Future] = asyncio.get_running_loop().create_future() if on_body else None
        self.status = 0
        self.keep_alive = True
        self._head = b""
        self._in_body = False
        self._chunked = False
        self._remaining: Optional[int] = None  # bytes left in a sized body or in the current chunk
        self._buf = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.done is not None and not self.done.done():
            if self._in_body and not self._chunked and self._remaining is None:
                self.done.set_result(None)  # body delimited by connection close
            else:
                self.done.set_exception(ConnectionError(f"connection closed mid-response: {exc or 'EOF'}"))

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.done is None or self.done.done():
            return
        try:
            if not self._in_body:
                self._head += data
                end = self._head.find(b"\r\n\r\n")
                if end < 0:
                    return
                head, data = self._head[:end].decode("latin-1"), self._head[end + 4 :]
                self._parse_head(head)
            self._body(data, now)
        except Exception as e:  # noqa: BLE001 - surfaced to the awaiting request
            self.keep_alive = False
            self.done.set_exception(e)

    def _parse_head(self, head: str) -> None:
        lines = head.split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ConnectionError(f"bad HTTP status line: {lines[0][:80]!r}")
        self.status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        self.keep_alive = headers.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
        if self.status in (204, 304) or 100 <= self.status < 200:
            raise ConnectionError(f"unexpected HTTP status {self.status} without a body")
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if not self._chunked and "content-length" in headers:
            self._remaining = int(headers["content-length"])
        self._in_body = True

    def _body(self, data: bytes, now: float) -> None:
        if not self._chunked:
            if self._remaining is not None:
                data = data[: self._remaining]
                self._remaining -= len(data)
            if data:
                self.on_body(data, now)
            if self._remaining == 0:
                self.done.set_result(None)
            return
        self._buf += data
        while True:
            if self._remaining is None:  # expecting a chunk-size line
                eol = self._buf.find(b"\r\n")
                if eol < 0:
                    return
                size = int(self._buf[:eol].split(b";")[0], 16)
                self._buf = self._buf[eol + 2 :]
                if size == 0:
                    self.done.set_result(None)  # trailers, if any, are ignored
                    return
                self._remaining = size
            if len(self._buf) < self._remaining + 2:
                if self._buf and len(self._buf) <= self._remaining:  # pass partial chunk data on now
                    self.on_body(self._buf, now)
                    self._remaining -= len(self._buf)
                    self._buf = b""
                return
            self.on_body(self._buf[: self._remaining], now)
            self._buf = self._buf[self._remaining + 2 :]
            self._remaining = None


class _StaleConnection(Exception):
    pass


class HttpPool:
    """Keep-alive connections to one ``scheme://host:port`` (as many as there are requests in flight)."""

    def __init__(self, base_url: str, headers: Optional[dict] = None, timeout_s: float = 600.0):
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"base_url must be http(s)://host[:port], got {base_url!r}")
        self.host, self.port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self.ssl = _ssl.create_default_context() if u.scheme == "https" else None
        self.prefix = u.path.rstrip("/")
        self.headers = {"Host": f"{self.host}:{self.port}", "Accept": "*/*", **(headers or {})}
        self.timeout_s = timeout_s
        self._idle: list[_Response] = []

    async def preconnect(self, n: int) -> int:
        """Open connections in parallel until ``n`` are idle (a keep-alive client's steady state), so the
        first wave of a load test does not pay TCP/TLS set-up inside its TTFT or queue its sends behind
        it; returns how many are idle.  Failures are left to the requests, which report them."""
        loop = asyncio.get_running_loop()
        want = max(0, n - len(self._idle))
        got = await asyncio.gather(*(loop.create_connection(_Response, self.host, self.port, ssl=self.ssl)
                                     for _ in range(want)), return_exceptions=True)
        self._idle.extend(r[1] for r in got if not isinstance(r, BaseException))
        return len(self._idle)

    async def _conn(self, reuse: bool = True) -> tuple[_Response, bool]:
        while reuse and self._idle:
            proto = self._idle.pop()
            if not proto.closed:
                return proto, True
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(_Response, self.host, self.port, ssl=self.ssl)
        return proto, False

    async def request(self, method: str, path: str, body: Optional[bytes], on_body, headers: Optional[dict] = None) -> int:
        """Send one request; ``on_body(data, t)`` gets every body piece with its arrival time; returns the status.

        A kept-alive connection that the server closed while idle is retried once on a fresh one (only when
        no byte of the response had arrived)."""
        try:
            return await self._request(method, path, body, on_body, headers, reuse=True)
        except _StaleConnection:
            return await self._request(method, path, body, on_body, headers, reuse=False)

    async def _request(self, method, path, body, on_body, headers, reuse: bool) -> int:
        proto, reused = await self._conn(reuse)
        proto._reset(on_body)
        hdrs = {**self.headers, **(headers or {})}
        if body is not None:
            hdrs["Content-Type"] = "application/json"
            hdrs["Content-Length"] = str(len(body))
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
        proto.transport.write(head.encode("latin-1") + (body or b""))
        try:
            await asyncio.wait_for(proto.done, self.timeout_s)
        except ConnectionError:
            proto.transport.close()
            if reused and proto.status == 0 and not proto._head:
                raise _StaleConnection() from None
            raise
        except BaseException:
            proto.transport.close()
            raise
        if proto.keep_alive and not proto.closed:
            self._idle.append(proto)
        else:
            proto.transport.close()
        return proto.status

    async def get_text(self, path: str) -> tuple[int, str]:
        parts: list[bytes] = []
        status = await self.request("GET", path, None, lambda d, _t: parts.append(d))
        return status, b"".join(parts).decode("utf-8", "replace")

    def close(self) -> None:
        for proto in self._idle:
            proto.transport.close()
        self._idle.clear()


def _piece(api: str, choice: dict) -> Optional[str]:
    if api == "chat":
        delta = choice.get("delta") or {}
        # reasoning tokens are output tokens too: sglang / vLLM ``reasoning_content``, newer vLLM ``reasoning``
        return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    return choice.get("text")


def _token_event(api: str, choice: dict) -> bool:
    """A chunk that carries a generated token even when its text is empty: a byte-level BPE token that ends
    inside a UTF-8 character decodes to "" until the next one, and the chat role chunk comes with the first
    token.  ``vllm bench serve`` times every chunk with a choice the same way (its TTFT is the first such chunk);
    a closing chunk with only a finish reason and no text is not a token."""
    if choice.get("finish_reason"):
        return False
    if api == "chat":
        delta = choice.get("delta") or {}
        return any(k in delta for k in ("content", "role", "reasoning_content", "reasoning"))
    return choice.get("text") is not None


def _event(api: str, data: bytes, now: float, out: StreamOutcome, parts: list[str]) -> bool:
    """Handle one SSE ``data:`` payload received at ``now``; True when the stream is over."""
    if data == b"[DONE]":
        return True
    obj = json.loads(data)
    if obj.get("error"):
        err = obj["error"]
        out.error = str(err.get("message", err) if isinstance(err, dict) else err)
        return True
    if obj.get("usage"):
        out.usage = obj["usage"]
    for choice in obj.get("choices") or ():
        piece = _piece(api, choice)
        if piece or _token_event(api, choice):
            if out.role_pending:  # the first token's own chunk, right behind its role chunk: already timed
                out.role_pending = False
            else:
                out.chunk_times.append(now)
                out.role_pending = api == "chat" and "role" in (choice.get("delta") or {}) and not piece
        if piece:
            parts.append(piece)
        if choice.get("finish_reason"):
            out.finish_reason = choice["finish_reason"]
    return False


@dataclass
class SentStream:
    """A finished HTTP exchange whose SSE events are not parsed yet (``parse_stream`` does that)."""

    out: StreamOutcome
    api: str
    events: list  # (SSE data payload, receive time)
    raw: list
    request_error: Optional[str]


async def send_stream(pool: HttpPool, path: str, payload: dict, api: str, request_id: str) -> SentStream:
    """POST ``payload`` (``stream: true``) and timestamp every SSE event as it arrives; no JSON parsing, so a
    caller holding a concurrency slot can give it back the moment the response ends (``parse_stream`` after).
    Never raises for HTTP/stream errors."""
    body = json.dumps(payload).encode()
    raw: list[bytes] = []
    events: list[tuple[bytes, float]] = []
    state = {"buf": b"", "over": False}
    out = StreamOutcome(request_id=request_id, start=time.perf_counter())

    def on_body(data: bytes, now: float) -> None:
        # Runs in the protocol's data_received: only split and timestamp here.  JSON parsing waits until
        # the response is complete, so at high concurrency one stream's parsing does not delay the
        # timestamps of the chunks queued behind it on the event loop.
        if len(raw) < 64:
            raw.append(data)  # kept for error messages
        if state["over"]:
            return
        buf = state["buf"] + data
        cut = buf.rfind(b"\n")
        if cut < 0:
            state["buf"] = buf
            return
        state["buf"] = buf[cut + 1 :]
        for line in buf[:cut].split(b"\n"):
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                events.append((payload, now))
                if payload == b"[DONE]":
                    state["over"] = True
                    return

    request_error = None
    try:
        status = await pool.request("POST", path, body, on_body, {"X-Request-Id": request_id})
        if status != 200:
            request_error = f"HTTP {status}: {b''.join(raw)[:500].decode('utf-8', 'replace')}"
    except (OSError, ConnectionError, asyncio.TimeoutError, ValueError) as e:
        request_error = f"{type(e).__name__}: {e}"
    out.end = time.perf_counter()
    return SentStream(out, api, events, raw, request_error)


def parse_stream(sent: SentStream) -> StreamOutcome:
    """The outcome of a sent stream: token times, text, usage and finish reason from its events."""
    out, parts = sent.out, []
    try:
        for payload, now in sent.events:
            if _event(sent.api, payload, now, out, parts):
                break
    except ValueError as e:  # malformed JSON in a data line
        out.error = f"{type(e).__name__}: {e}"
    if sent.request_error is not None:  # a transport or HTTP failure outranks what the stream said
        out.error = sent.request_error
    out.text = "".join(parts)
    if out.error is None and not out.chunk_times and out.finish_reason is None:
        out.error = "stream ended without output or finish_reason"
    return out


async def stream_request(pool: HttpPool, path: str, payload: dict, api: str, request_id: str) -> StreamOutcome:
    """POST ``payload`` (``stream: true``) and time every output chunk; never raises for HTTP/stream errors."""
    return parse_stream(await send_stream(pool, path, payload, api, request_id))

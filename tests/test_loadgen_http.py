"""The load generator's HTTP client: connections opened ahead of the first wave, and SSE payloads parsed
after the stream (bad JSON and error events still end up in the outcome)."""

from __future__ import annotations

import json
import asyncio

from kvbench.harness.loadgen.http import HttpPool, stream_request


def _sse(*events: bytes) -> bytes:
    body = b"".join(b"data: " + e + b"\n\n" for e in events)
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


async def _serve(events: tuple[bytes, ...], accepted: list[int]):
    async def handle(reader, writer):
        accepted.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0].split(b":")[1])
                await reader.readexactly(n)
                writer.write(_sse(*events))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _run(events: tuple[bytes, ...], preconnect: int = 0):
    async def main():
        accepted: list[int] = []
        server, port = await _serve(events, accepted)
        pool = HttpPool(f"http://127.0.0.1:{port}")
        idle = await pool.preconnect(preconnect) if preconnect else 0
        outs = await asyncio.gather(*(stream_request(pool, "/v1/completions", {"prompt": "x"}, "completions", f"r{i}")
                                      for i in range(3)))
        pool.close()
        server.close()
        await server.wait_closed()
        return outs, idle, len(accepted)

    return asyncio.run(main())


def test_preconnect_opens_the_first_wave_and_requests_reuse_it():
    ok = (b'{"choices":[{"index":0,"text":"a","finish_reason":null}]}',
          b'{"choices":[{"index":0,"text":"b","finish_reason":"length"}]}', b"[DONE]")
    outs, idle, accepted = _run(ok, preconnect=3)
    assert idle == 3 and accepted == 3  # no connection opened by the requests themselves
    for o in outs:
        assert o.error is None and o.text == "ab" and o.finish_reason == "length" and len(o.chunk_times) == 2
        assert o.start <= o.chunk_times[0] <= o.chunk_times[1] <= o.end


def test_preconnect_to_a_closed_port_reports_nothing_and_raises_nothing():
    import socket

    with socket.socket() as s:  # a port that was just free: nothing listens on it now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        return await HttpPool(f"http://127.0.0.1:{port}").preconnect(2)

    assert asyncio.run(main()) == 0


def test_bad_json_and_error_events_are_reported_after_the_stream():
    outs, _, _ = _run((b'{"choices":[{"index":0,"text":"a"}]}', b"{not json", b"[DONE]"))
    assert all(o.error and "JSONDecodeError" in o.error for o in outs)
    outs, _, _ = _run((b'{"choices":[{"index":0,"text":"a"}]}', b'{"error":{"message":"boom"}}',
                       b'{"choices":[{"index":0,"text":"z"}]}', b"[DONE]"))
    # the stream's own error ends the outcome: later events are not counted
    assert all(o.error == "boom" and o.text == "a" and len(o.chunk_times) == 1 for o in outs)


def _times(api: str, events: list[tuple[float, dict]]):
    from kvbench.harness.loadgen.http import StreamOutcome, _event

    out, parts = StreamOutcome(request_id="r", start=0.0), []
    for t, obj in events:
        _event(api, json.dumps(obj).encode(), t, out, parts)
    return out.chunk_times, "".join(parts)


def test_a_token_that_decodes_to_nothing_is_timed_like_vllm_bench_serve():
    """A byte-level BPE token ending inside a UTF-8 character streams as text "" (seen on vLLM 0.26 with random
    outputs): it is a token, so TTFT is its chunk, as `vllm bench serve` times it.  A closing chunk with only a
    finish reason and the usage chunk are not tokens."""
    cmpl = lambda text, fr=None: {"choices": [{"index": 0, "text": text, "finish_reason": fr}]}  # noqa: E731
    times, text = _times("completions", [(1.0, cmpl("")), (1.1, cmpl("\u00e9")), (1.2, cmpl(" b", "length")),
                                         (1.3, {"choices": [], "usage": {"completion_tokens": 3}})])
    assert times == [1.0, 1.1, 1.2] and text == "\u00e9 b"
    times, _ = _times("completions", [(1.0, cmpl("a")), (1.1, cmpl("", "stop"))])  # finish-only chunk after the last token
    assert times == [1.0]


def test_a_chat_role_chunk_times_the_first_token_once():
    """vLLM sends the role (content "") and the first token's content back to back at the first token: one timed
    event, at the role chunk; a role sent together with content is one event too."""
    delta = lambda d, fr=None: {"choices": [{"index": 0, "delta": d, "finish_reason": fr}]}  # noqa: E731
    times, text = _times("chat", [(2.0, delta({"role": "assistant", "content": ""})), (2.001, delta({"content": "Hi"})),
                                  (2.1, delta({"content": " there"})), (2.2, delta({}, "length"))])
    assert times == [2.0, 2.1] and text == "Hi there"
    times, _ = _times("chat", [(3.0, delta({"role": "assistant", "content": "Hi"})), (3.1, delta({"content": "!"}))])
    assert times == [3.0, 3.1]
    times, _ = _times("chat", [(4.0, delta({"reasoning": "think"})), (4.1, delta({"content": "ok"}))])
    assert times == [4.0, 4.1]


def test_a_finished_request_frees_its_slot_before_it_is_parsed(monkeypatch):
    """Under a concurrency cap the next request goes out as soon as a response ends; parsing a finished stream
    (a JSON parse per token) must not hold the slot, or every replacement request leaves late."""
    import kvbench.harness.loadgen.http as http
    from kvbench.harness.loadgen.run import LoadConfig, _run_async
    from kvbench.harness.loadgen.datasets import LoadItem

    ok = (b'{"choices":[{"index":0,"text":"a","finish_reason":"length"}],"usage":{"completion_tokens":1}}', b"[DONE]")
    sent, seen_at_parse = [], []
    send, parse = http.send_stream, http.parse_stream

    async def counting_send(*a, **k):
        sent.append(a[4])
        return await send(*a, **k)

    def recording_parse(s):
        seen_at_parse.append((s.out.request_id, len(sent)))
        return parse(s)

    monkeypatch.setattr(http, "send_stream", counting_send)
    monkeypatch.setattr(http, "parse_stream", recording_parse)

    async def main():
        server, port = await _serve(ok, [])
        try:
            cfg = LoadConfig(num_prompts=3, max_concurrency=1, warmup=0, metrics_interval_s=0, tokenizer="none")
            return await _run_async(f"http://127.0.0.1:{port}", "m", cfg, [LoadItem("x", None, 1)] * 3, None)
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())
    first = [n for rid, n in seen_at_parse if rid.endswith("-0")]
    assert first == [2], seen_at_parse  # request 1 was sent before request 0 was parsed

"""Bad input gets a 4xx with an OpenAI-style error body, and the server keeps serving; clients that go
away abort their requests and free their pages."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_fakes import FakeEngine, serve, wait_until  # noqa: E402

from kvbench.runtime.server import create_app  # noqa: E402


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(step_s=0.003)
    with serve(create_app(engine)) as url:
        yield url, engine
    engine.shutdown()


LONG = "x" * 300  # the fake's context is 256 tokens
BAD = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", {"model": "fake-model"}, 400),  # no prompt
    ("/v1/completions", {"model": "other", "prompt": "hi"}, 404),
    ("/v1/completions", {"model": "fake-model", "prompt": 5}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": ""}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": [1, 2, 99999]}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": "10"}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": -3}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": 10_000}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": LONG, "max_tokens": 1}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "temperature": 9}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "top_p": 0}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "n": 0}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "logprobs": 99}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "stop": 3}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "stream": "yes"}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "min_tokens": 50, "max_tokens": 5}, 400),
    ("/v1/chat/completions", {"model": "fake-model", "messages": []}, 400),
    ("/v1/chat/completions", {"model": "fake-model"}, 400),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": 7}]}, 400),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": LONG}]}, 400),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
    # non-object messages or ones without a role (were 500s); a lone surrogate anywhere; deep nesting; a non-string
    # model; stream_options without stream or with a non-boolean include_usage; seeds outside 64 bits; JSON mode
    ("/v1/chat/completions", {"model": "fake-model", "messages": ["hi"]}, 400),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"content": "hi"}]}, 400),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [None]}, 400),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "\udc00"}]}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "\ud800abc", "max_tokens": 3}, 400),
    ("/tokenize", {"prompt": "\ud800"}, 400),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400),
    ("/v1/completions", {"model": 5, "prompt": "hi"}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "stream_options": {"include_usage": True}}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "stream": True, "stream_options": {"include_usage": "no"}}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "temperature": 1, "seed": 2**64}, 400),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "suffix": "end"}, 400),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400),
    ("/v1/nope", {}, 404),
    ("/tokenize", {"prompt": 3}, 400),
    ("/detokenize", {"tokens": ["a"]}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD)
def test_bad_input_gets_openai_error(server, path, body, status):
    url, _ = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    # still serving
    ok = httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_null_max_completion_tokens_means_not_given(server):
    """Clients serialise unset fields as null: max_tokens then applies (it ran to the whole context before)."""
    url, _ = server
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "max_completion_tokens": None}
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    r = httpx.post(url + "/v1/chat/completions", json={**body, "max_completion_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    # a paired surrogate (an emoji written as two escapes) is valid text
    r = httpx.post(url + "/v1/completions", content=b'{"model": "fake-model", "prompt": "\\ud83d\\ude00 hi", "max_tokens": 2}',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def test_choice_seeds_do_not_repeat_across_requests():
    from kvbench.runtime.server_protocol import SEED_MAX, SEED_MIN, choice_seed

    assert choice_seed(42, 0) == 42  # the first choice keeps the request's seed
    seeds = {choice_seed(s, k) for s in range(40, 48) for k in range(4)}
    assert len(seeds) == 32  # choice 1 of seed s is not choice 0 of seed s + 1
    for s in (SEED_MIN, -1, 0, SEED_MAX):
        assert all(0 <= choice_seed(s, k) <= SEED_MAX for k in range(1, 16))


def test_get_on_post_route_is_openai_error(server):
    r = httpx.get(server[0] + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_hundreds_of_aborted_streams_leak_nothing(server):
    url, engine = server
    n_streams, batch = 300, 50
    before = engine.stats()
    payload = {"model": "fake-model", "prompt": "leak test", "max_tokens": 200, "stream": True, "ignore_eos": True}

    async def one(client):
        async with client.stream("POST", url + "/v1/completions", json=payload) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    break  # got output; hang up mid-stream

    async def main():
        limits = httpx.Limits(max_connections=batch)
        async with httpx.AsyncClient(limits=limits, timeout=30) as client:
            for _ in range(n_streams // batch):
                await asyncio.gather(*(one(client) for _ in range(batch)))

    asyncio.run(main())
    assert wait_until(lambda: engine.stats().running == 0 and engine.stats().waiting == 0, 20)
    after = engine.stats()
    assert after.pages_used == 0
    assert after.requests_aborted - before.requests_aborted == n_streams
    assert after.requests_finished == before.requests_finished  # nobody ran to its 200 tokens


def test_non_streaming_client_gone_aborts(server):
    url, engine = server
    before = engine.stats().requests_aborted
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": "slow", "max_tokens": 240, "ignore_eos": True}, timeout=0.2)
    assert wait_until(lambda: engine.stats().requests_aborted == before + 1, 10)
    assert wait_until(lambda: engine.stats().pages_used == 0, 5)


class _BrokenEngine(FakeEngine):
    def add_request(self, prompt_token_ids, params, request_id=None, on_delta=None):
        if prompt_token_ids[-1] == ord("!") + 3:
            raise RuntimeError("device fell over")
        return super().add_request(prompt_token_ids, params, request_id, on_delta)


def test_engine_failure_is_a_500_with_openai_body():
    engine = _BrokenEngine()
    with serve(create_app(engine)) as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "boom!", "max_tokens": 2})
        assert r.status_code == 500 and "device fell over" in r.json()["error"]["message"]
        assert httpx.post(url + "/v1/completions", json={"prompt": "fine", "max_tokens": 2}).status_code == 200
    engine.shutdown()

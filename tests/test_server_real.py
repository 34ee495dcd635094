"""The real server: the default model (SmolLM2-135M-Instruct GGUF) on CPU behind ``create_app``, on
loopback, driven by the official openai client, raw HTTP bad inputs, hundreds of aborted streams and
the load generator (small bounded runs; everything stops by itself)."""

from __future__ import annotations

import asyncio
import os
import sys

import httpx
import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_fakes import serve, wait_until  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def real():
    from kvbench.runtime.config import EngineConfig
    from kvbench.runtime.engine import Engine
    from kvbench.runtime.server import create_app

    engine = Engine(EngineConfig(device="cpu", kv_budget_gb=0.05, max_model_len=512, max_running=16))
    with serve(create_app(engine)) as url:
        yield url, engine
    engine.shutdown()


def test_openai_client_matches_engine(real):
    from kvbench.runtime.engine_api import SamplingParams

    url, engine = real
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [engine.model_id]
    msgs = [{"role": "user", "content": "What is 2+3? Answer with a number."}]
    r = client.chat.completions.create(model=engine.model_id, messages=msgs, max_tokens=12, temperature=0)
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(msgs), add_special_tokens=False)
    [direct] = engine.generate([ids], SamplingParams(max_tokens=12))
    assert r.choices[0].message.content == direct.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(direct.token_ids)
    chunks = client.completions.create(model=engine.model_id, prompt="The capital of France is", max_tokens=8,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(chunks)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = client.completions.create(model=engine.model_id, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert streamed == whole.choices[0].text and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_echo_logprobs_equal_engine_scoring(real):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    url, engine = real
    ctx = engine.tokenizer.encode("Question: what is two plus two?\nAnswer:")
    cont = engine.tokenizer.encode(" four", add_special_tokens=False)
    body = {"model": engine.model_id, "prompt": [ctx + cont], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    out = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    [(ll, _greedy)] = LocalCompletionsAPI.parse_logprobs(out, tokens=[ctx + cont], ctxlens=[len(ctx)])
    # echo scores the whole prompt teacher-forced after its first token (the server cannot know the split)
    ref = engine.score(ctx[:1], ctx[1:] + cont)
    assert ll == pytest.approx(sum(ref.logprobs[len(ctx) - 1:]), abs=1e-4)
    assert out["choices"][0]["logprobs"]["token_logprobs"][1:len(ctx) + len(cont)] == pytest.approx(ref.logprobs, abs=1e-4)


@pytest.mark.parametrize("body,status", [
    ({"prompt": "x " * 600, "max_tokens": 4}, 400),  # longer than the 512-token context
    ({"prompt": "hi", "max_tokens": 100000}, 400),
    ({"prompt": "hi", "model": "gpt-4"}, 404),
    ({"messages": [], "max_tokens": 4}, 400),
])
def test_bad_inputs_then_still_serving(real, body, status):
    url, engine = real
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(url + path, json={"model": engine.model_id, **body}, timeout=60)
    assert r.status_code == status and "message" in r.json()["error"]
    ok = httpx.post(url + "/v1/completions", json={"model": engine.model_id, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_aborted_streams_free_their_pages(real):
    url, engine = real
    n, batch = 200, 50
    before = engine.stats()
    payload = {"model": engine.model_id, "prompt": "Tell me a long story about a dragon.", "max_tokens": 400,
               "ignore_eos": True, "stream": True}

    async def one(client):
        async with client.stream("POST", url + "/v1/completions", json=payload) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    break

    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=batch)) as client:
            for _ in range(n // batch):
                await asyncio.gather(*(one(client) for _ in range(batch)))

    asyncio.run(main())
    assert wait_until(lambda: engine.stats().running == 0 and engine.stats().waiting == 0, 60)
    after = engine.stats()
    assert after.pages_used == 0, after
    assert after.requests_aborted - before.requests_aborted == n
    assert after.generation_tokens - before.generation_tokens < n * 400 // 4  # nobody ran to the end


def test_load_generator_small_run(real):
    from kvbench.harness.loadgen.run import LoadConfig, run_load

    url, engine = real
    cfg = LoadConfig(num_prompts=8, max_concurrency=4, input_len=32, output_len=8, metrics_interval_s=0.2)
    summary, records = run_load(url, None, cfg)
    assert summary["completed"] == 8 and summary["failed"] == 0
    assert all(r["output_tokens"] == 8 and r["prompt_tokens"] == 32 for r in records)
    assert summary["server_metrics"]["available"] and summary["server_metrics"]["max_running"] <= 4
    assert summary["peak_concurrency"] <= 4 and summary["output_throughput"] > 0

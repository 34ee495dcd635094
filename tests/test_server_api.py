"""The OpenAI-compatible server against a deterministic fake engine: the official ``openai`` client,
streaming and not, usage, logprobs, echo (parsed with lm-eval's own parser), n, seed, stop, tokenizer
routes and /metrics."""

from __future__ import annotations

import os
import sys

import httpx
import openai
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_fakes import FakeEngine, FakeTokenizer, expected_ids, natural_len, serve  # noqa: E402

from kvbench.runtime.server import create_app  # noqa: E402

TOK = FakeTokenizer()


def _text(ids):
    return TOK.decode(ids)


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    with serve(create_app(engine)) as url:
        yield url, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def test_models_health_metrics(server, client):
    url, engine = server
    assert [m.id for m in client.models.list().data] == ["fake-model"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    text = httpx.get(url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_pages_used", "kv_pages_total",
                 "preemptions_total", "prompt_tokens_total", "generation_tokens_total"):
        assert f"kvbench_{name}{{" in text
    assert f'kvbench_kv_pages_total{{model_name="fake-model"}} {float(engine.num_pages)}' in text


def test_completion_matches_engine_output_and_usage(client):
    prompt_ids = TOK.encode("hello world")
    n_nat = natural_len(prompt_ids)
    r = client.completions.create(model="fake-model", prompt="hello world", max_tokens=40, temperature=0)
    assert r.choices[0].text == _text(expected_ids(prompt_ids, n_nat))
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == n_nat + 1  # natural tokens + EOS
    r = client.completions.create(model="fake-model", prompt="hello world", max_tokens=3)
    assert r.choices[0].text == _text(expected_ids(prompt_ids, 3)) and r.choices[0].finish_reason == "length"


def test_streaming_completion_and_ignore_eos(client):
    prompt_ids = TOK.encode("stream me")
    chunks = list(client.completions.create(model="fake-model", prompt="stream me", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == _text(expected_ids(prompt_ids, 12))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_token_id_prompts_and_batches(server):
    url, _ = server
    ids_a, ids_b = [1, 50, 60], [1, 70]
    r = httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": [ids_a, ids_b], "max_tokens": 2}).json()
    by_index = {c["index"]: c["text"] for c in r["choices"]}
    assert by_index == {0: _text(expected_ids(ids_a, 2)), 1: _text(expected_ids(ids_b, 2))}
    assert r["usage"]["prompt_tokens"] == 5 and r["usage"]["completion_tokens"] == 4


def test_chat_stream_and_not(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = TOK.encode(TOK.apply_chat_template(msgs), add_special_tokens=False)
    r = client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=4)
    assert r.choices[0].message.content == _text(expected_ids(ids, 4))
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=4, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == _text(expected_ids(ids, 4))


def test_params_reach_engine(server, client):
    _, engine = server
    client.completions.create(model="fake-model", prompt="abc", max_tokens=5, temperature=0.7, top_p=0.9, seed=11,
                              stop=["zz"], extra_body={"top_k": 5, "min_tokens": 2, "ignore_eos": True})
    p = engine.seen_params[-1]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, tuple(p.stop), p.min_tokens, p.ignore_eos) == \
        (5, 0.7, 0.9, 5, 11, ("zz",), 2, True)
    r = client.completions.create(model="fake-model", prompt="abc", max_tokens=3, n=2, seed=4)
    assert sorted(c.index for c in r.choices) == [0, 1]
    from kvbench.runtime.server_protocol import choice_seed

    assert [q.seed for q in engine.seen_params[-2:]] == [4, choice_seed(4, 1)] and choice_seed(4, 1) != 5


def test_logprobs_completion_and_chat(client):
    r = client.completions.create(model="fake-model", prompt="ab", max_tokens=3, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == [-0.5] * 3 and len(lp.tokens) == 3 and all(len(t) == 2 for t in lp.top_logprobs)
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       logprobs=True, top_logprobs=1)
    content = r.choices[0].logprobs.content
    assert len(content) == 2 and content[0].logprob == -0.5 and len(content[0].top_logprobs) == 1


def test_echo_logprobs_in_lm_eval_format(server):
    """lm-eval's local-completions loglikelihood request, parsed with lm-eval's own parser."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    url, engine = server
    ctx, cont = [1, 40, 41, 42], [60, 63, 66, 61]  # 60, 63, 66 are multiples of 3 -> greedy in the fake
    payload = {"model": "fake-model", "prompt": [ctx + cont], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    out = httpx.post(url + "/v1/completions", json=payload).json()
    assert out["choices"][0]["logprobs"]["token_logprobs"][0] is None
    [(ll, greedy)] = LocalCompletionsAPI.parse_logprobs(out, tokens=[ctx + cont], ctxlens=[len(ctx)])
    ref = engine.score(ctx[:1], ctx[1:] + cont, top_k=1)
    assert ll == pytest.approx(sum(ref.logprobs[len(ctx) - 1:]))
    assert greedy is False  # 61 is not greedy
    out = httpx.post(url + "/v1/completions", json={**payload, "prompt": [ctx + cont[:3]]}).json()
    [(ll, greedy)] = LocalCompletionsAPI.parse_logprobs(out, tokens=[ctx + cont[:3]], ctxlens=[len(ctx)])
    assert greedy is True


def test_tokenizer_routes(server):
    url, _ = server
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["vocab_size"] == 300
    toks = httpx.post(url + "/tokenize", json={"prompt": "hey", "add_special_tokens": False}).json()["tokens"]
    assert toks == TOK.encode("hey", add_special_tokens=False)
    assert httpx.post(url + "/detokenize", json={"tokens": toks}).json()["prompt"] == "hey"


def test_lm_eval_local_completions_end_to_end(server):
    """lm-eval's ``local-completions`` model, tokenizing through the server's /tokenizer_info + /tokenize."""
    import tenacity  # noqa: F401  (lm-eval[api], part of the eval extra; lm-eval API models need it)
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    url, engine = server
    lm = LocalCompletionsAPI(base_url=url + "/v1/completions", model="fake-model", max_retries=1)
    assert lm.tokenizer_backend == "remote"
    got = lm.loglikelihood([Instance("loglikelihood", {}, ("ab", "cd"), 0), Instance("loglikelihood", {}, ("xyz", "f"), 1)])
    for (ll, greedy), (ctx, cont) in zip(got, [("ab", "cd"), ("xyz", "f")]):
        ids = TOK.encode(ctx, add_special_tokens=False) + TOK.encode(cont, add_special_tokens=False)
        n_ctx = len(TOK.encode(ctx, add_special_tokens=False))
        ref = engine.score(ids[:1], ids[1:], top_k=1)
        assert ll == pytest.approx(sum(ref.logprobs[n_ctx - 1:])) and greedy == all(ref.greedy[n_ctx - 1:])
    [text] = lm.generate_until([Instance("generate_until", {}, ("hello", {"until": ["\n"], "max_gen_toks": 5}), 0)])
    assert text == TOK.decode(expected_ids(TOK.encode("hello", add_special_tokens=False), 5))

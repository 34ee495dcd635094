"""``OpenAIClient`` (the Client protocol over HTTP) against the server with a deterministic fake engine."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_server_fakes import FakeEngine, FakeTokenizer, expected_ids, serve  # noqa: E402

from kvbench.core.client import Client, GenRequest, SamplingParams, ScoreRequest  # noqa: E402
from kvbench.harness.openai_client import OpenAIClient  # noqa: E402
from kvbench.runtime.server import create_app  # noqa: E402

TOK = FakeTokenizer()


@pytest.fixture(scope="module")
def client():
    engine = FakeEngine()
    with serve(create_app(engine)) as url:
        c = OpenAIClient(url + "/v1")
        yield c, engine
        c.close()
    engine.shutdown()


def test_protocol_and_model(client):
    c, _ = client
    assert isinstance(c, Client) and c.model_id == "fake-model"
    assert c.info()["max_model_len"] == 256


def test_generate_completion_and_chat(client):
    c, engine = client
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=3, stop=("qq",), logprobs=1)
    r = c.generate(GenRequest(prompt="hey", params=params))
    assert r.text == TOK.decode(expected_ids(TOK.encode("hey"), 6)) and r.finish_reason == "length"
    assert (r.prompt_tokens, r.output_tokens, r.logprobs) == (4, 6, [-0.5] * 6)
    p = engine.seen_params[-1]
    assert (p.seed, tuple(p.stop), p.ignore_eos, p.logprobs) == (3, ("qq",), True, 1)
    msgs = [{"role": "user", "content": "yo"}]
    r = c.generate(GenRequest(messages=msgs, params=SamplingParams(max_tokens=3)))
    ids = TOK.encode(TOK.apply_chat_template(msgs), add_special_tokens=False)
    assert r.text == TOK.decode(expected_ids(ids, 3)) and r.output_tokens == 3


def test_stream_pieces_join_to_generate(client):
    c, _ = client
    req = GenRequest(prompt="stream", params=SamplingParams(max_tokens=9, ignore_eos=True))
    assert "".join(c.stream(req)) == c.generate(req).text


def test_http_error_is_an_error_result(client):
    c, _ = client
    r = c.generate(GenRequest(prompt="x" * 400, params=SamplingParams(max_tokens=4)))
    assert r.finish_reason == "error" and "context" in r.error


def test_score_matches_engine_scoring(client):
    c, engine = client
    res = c.score(ScoreRequest(context="ab", continuation="cdef", top_k=2))
    ctx, cont = TOK.encode("ab"), TOK.encode("cdef", add_special_tokens=False)
    ref = engine.score(ctx[:1], ctx[1:] + cont, top_k=2)
    assert res.token_ids == cont
    assert res.logprobs == pytest.approx(ref.logprobs[len(ctx) - 1:])
    assert res.greedy == ref.greedy[len(ctx) - 1:]
    assert [row[0] for row in res.top_ids] == [row[0] for row in ref.top_ids[len(ctx) - 1:]]


def test_unreachable_server_raises():
    with pytest.raises(ConnectionError):
        OpenAIClient("http://127.0.0.1:9", timeout=2)

"""Failed requests over real HTTP (``OpenAIClient`` against a misbehaving OpenAI-style server on loopback) and
through the lm-eval bridge: each failure becomes an error record of the right ``error_kind``."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_errors_apart import EchoTask  # noqa: E402
from test_server_fakes import serve  # noqa: E402

from kvbench.core.client import GenRequest, RequestFailed, SamplingParams  # noqa: E402
from kvbench.harness.openai_client import OpenAIClient  # noqa: E402
from kvbench.suites.base import SuiteOptions  # noqa: E402
from kvbench.suites.runner import run_generation  # noqa: E402

CLIENT_TIMEOUT = 0.4


def _completion(text: str, finish: str = "stop") -> dict:
    return {"id": "c", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def _app():
    """The last word of the prompt picks the behaviour; anything else answers "7"."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def completions(request):
        body = await request.json()
        how = body["prompt"].split()[-1]
        stream = bool(body.get("stream"))
        if how == "http500":
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        if how == "slow":
            await asyncio.sleep(3 * CLIENT_TIMEOUT)
        if how == "badjson":
            return Response("<html>proxy error</html>", media_type="application/json")
        if how == "cut":  # headers sent, body breaks off: the connection closes mid-chunk

            async def cut():
                yield (b'data: {"choices": [{"index": 0, "text": "7", "finish_reason": null}]}\n\n' if stream
                       else b'{"choices": [{"index": 0, "te')
                raise RuntimeError("backend died")

            return StreamingResponse(cut(), media_type="text/event-stream" if stream else "application/json")
        if stream:
            finish = None if how == "nofinish" else "stop"

            async def events():
                chunk = {"choices": [{"index": 0, "text": "7", "finish_reason": finish}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                if how != "nofinish":
                    yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(_completion("7"))

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def url():
    with serve(_app()) as u:
        yield u


@pytest.fixture()
def client(url):
    c = OpenAIClient(url + "/v1", model="m", timeout=CLIENT_TIMEOUT)
    yield c
    c.close()


def _req(how: str) -> GenRequest:
    return GenRequest(prompt=f"item {how}", params=SamplingParams(max_tokens=4))


def test_generate_classifies_each_failure(client):
    ok = client.generate(_req("fine"))
    assert (ok.text, ok.finish_reason) == ("7", "stop")
    r = client.generate(_req("http500"))
    assert (r.finish_reason, r.error_kind) == ("error", "http") and "500" in r.error and "boom" in r.error
    r = client.generate(_req("badjson"))
    assert (r.finish_reason, r.error_kind) == ("error", "stream") and "malformed" in r.error
    with pytest.raises(RequestFailed) as e:
        client.generate(_req("cut"))
    assert e.value.error_kind == "stream"
    with pytest.raises(RequestFailed) as e:
        client.generate(_req("slow"))
    assert e.value.error_kind == "timeout"


def test_stream_classifies_each_failure(client):
    assert "".join(client.stream(_req("fine"))) == "7"
    for how, kind in (("http500", "http"), ("cut", "stream"), ("nofinish", "stream"), ("slow", "timeout")):
        with pytest.raises(RequestFailed) as e:
            list(client.stream(_req(how)))
        assert e.value.error_kind == kind, (how, str(e.value))


def test_unreachable_server_is_a_connection_error():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    c = OpenAIClient(f"http://127.0.0.1:{port}", model="m", timeout=2)
    try:
        with pytest.raises(RequestFailed) as e:
            c.generate(_req("fine"))
        assert e.value.error_kind == "connection" and isinstance(e.value, ConnectionError)
    finally:
        c.close()


class _HttpTask(EchoTask):
    """Items named after the server's behaviours."""

    HOWS = ["fine", "http500", "cut", "slow", "badjson", "fine2", "fine3"]

    def load_items(self, opts):
        from kvbench.suites.base import Item

        return [Item(h, "7", {}) for h in self.HOWS], "inline"

    def build(self, item, repeat, params):
        return GenRequest(prompt=f"item {item.item_id}", params=params)


def test_suite_over_http_records_error_kinds(client):
    res = run_generation(_HttpTask(), client, SuiteOptions(progress=False, concurrency=4))
    recs = {r["item_id"]: r for r in res.records}
    assert list(recs) == _HttpTask.HOWS
    want = {"http500": "http", "cut": "stream", "slow": "timeout", "badjson": "stream"}
    for how, kind in want.items():
        r = recs[how]
        assert (r["error_kind"], r["finish_reason"], r["correct"], r["invalid"], r["scores"]) == (kind, "error", None, None, {}), how
        assert r["error"]
    for how in ("fine", "fine2", "fine3"):
        assert recs[how]["error"] is None and recs[how]["correct"] is True
    s = res.summary
    assert s["accuracy"] == 1.0 and s["answered"] == 3 and s["errors"] == 4
    assert s["error_rate"] == pytest.approx(4 / 7) and s["error_kinds"] == {"http": 1, "stream": 2, "timeout": 1}


def test_lm_eval_bridge_records_failed_generations(tmp_path):
    pytest.importorskip("lm_eval")
    import yaml

    from kvbench.core.client import GenResult
    from kvbench.suites.fake import FakeClient
    from kvbench.suites.registry import RunContext, run_suite

    rows = [{"q": f"question {i}", "a": "7"} for i in range(5)]
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"task": "tiny_gen", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
           "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{q}}", "doc_to_target": "{{a}}",
           "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4},
           "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}
    (tmp_path / "tiny_gen.yaml").write_text(yaml.safe_dump(cfg))

    class Flaky(FakeClient):
        def generate(self, request):
            if request.prompt.endswith("1"):
                raise TimeoutError("no answer in time")
            if request.prompt.endswith("2"):
                return GenResult("", "error", 0, 0, 0.1, error="HTTP 502: bad gateway", error_kind="http")
            return GenResult("7" if request.prompt.endswith(("0", "3")) else "8", "stop", 3, 1, 0.01)

    res = run_suite("lm_eval:tiny_gen", Flaky(), SuiteOptions(progress=False), RunContext(lm_eval_include=str(tmp_path)))
    recs = {r["item_id"]: r for r in res.records}
    assert len(recs) == 5
    assert (recs["1"]["error_kind"], recs["2"]["error_kind"]) == ("timeout", "http")
    for i in ("1", "2"):
        assert recs[i]["correct"] is None and recs[i]["scores"] == {} and recs[i]["finish_reason"] == "error"
    assert [recs[i]["correct"] for i in ("0", "3", "4")] == [True, True, False]
    assert all(recs[i]["error"] is None for i in ("0", "3", "4"))
    s = res.summary
    # over the 3 answered documents (lm-eval's own aggregate, which scores the failures as 0, is not used)
    assert s["errors"] == 2 and s["accuracy"] == pytest.approx(2 / 3)
    assert s["exact_match,none"] == pytest.approx(2 / 3)


def test_lm_eval_bridge_records_failed_scoring(tmp_path):
    pytest.importorskip("lm_eval")
    import yaml

    from kvbench.core.client import ScoreRequest
    from kvbench.suites.fake import FakeClient
    from kvbench.suites.registry import RunContext, run_suite

    rows = [{"q": "ab", "choices": ["cd", "ef"], "label": 0}, {"q": "gh", "choices": ["ij", "kl"], "label": 1},
            {"q": "mn", "choices": ["op", "qr"], "label": 0}]
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"task": "tiny_mc_err", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
           "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{q}}", "doc_to_choice": "{{choices}}",
           "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    (tmp_path / "tiny_mc_err.yaml").write_text(yaml.safe_dump(cfg))

    class Flaky(FakeClient):
        def score(self, request: ScoreRequest):
            if request.context == "gh" and request.continuation == " kl":  # one of the document's two requests
                raise RequestFailed("stream cut", "stream")
            return super().score(request)

    client = Flaky()
    res = run_suite("lm_eval:tiny_mc_err", client, SuiteOptions(progress=False), RunContext(lm_eval_include=str(tmp_path)))
    recs = {r["item_id"]: r for r in res.records}
    assert recs["1"]["error_kind"] == "stream" and recs["1"]["correct"] is None and recs["1"]["scores"] == {}
    answered = []
    for i in ("0", "2"):
        row = rows[int(i)]
        lls = [client.score(ScoreRequest(row["q"], " " + c)).total_logprob for c in row["choices"]]
        ok = max(range(2), key=lambda j: lls[j]) == row["label"]
        assert recs[i]["error"] is None and recs[i]["correct"] == ok
        answered.append(ok)
    assert res.summary["errors"] == 1 and res.summary["answered"] == 2
    assert res.summary["accuracy"] == pytest.approx(sum(answered) / 2)

"""Request options (harness/request_options.py): sweep validation with key paths, precedence suite > target >
protocol defaults, what records carry (``request_options``, ``reasoning``, ``retries``), reasoning never scored,
and the embedded engine's handling (``reasoning_effort`` as a chat-template variable, ``extra_body`` refused)."""

from __future__ import annotations

import copy
import csv
import re
from types import SimpleNamespace

import pytest

from kvbench.core.client import GenRequest, GenResult, SamplingParams
from kvbench.harness.request_options import RequestOptionsError, apply_request, merge_requests
from kvbench.harness.sweep.config import SweepConfigError, parse_config
from kvbench.suites.base import SuiteError, SuiteOptions
from kvbench.suites.fake import FakeClient
from kvbench.suites.registry import run_suite

SERVER = {"name": "sg", "type": "endpoint", "base_url": "http://127.0.0.1:30000"}
BASE = {"name": "t", "targets": [SERVER], "axes": {"kv": ["bf16"], "concurrency": [4]}, "load": {"enabled": False},
        "suites": [{"name": "gpqa_diamond"}]}


def config(**changes):
    raw = copy.deepcopy(BASE)
    raw.update(changes)
    return parse_config(raw)


def error_of(**changes) -> str:
    with pytest.raises(SweepConfigError) as e:
        config(**changes)
    return str(e.value)


@pytest.mark.parametrize("suite_request,needle", [
    ({"reasoning_effort": "extreme"}, "suites[0].request.reasoning_effort: 'extreme' is not allowed; choose one of: low, medium, high"),
    ({"extra_body": ["a"]}, "suites[0].request.extra_body: expected a mapping"),
    ({"extra_body": {"model": "x"}}, "suites[0].request.extra_body.model: kvbench sets 'model' itself"),
    ({"extra_body": {"messages": []}}, "suites[0].request.extra_body.messages"),
    ({"extra_body": {"stream": True}}, "suites[0].request.extra_body.stream"),
    ({"extra_body": {"temperature": 1}}, "use request.temperature"),
    ({"top_p": 0}, "suites[0].request.top_p: expected a number in (0, 1]"),
    ({"top_p": 1.5}, "suites[0].request.top_p"),
    ({"top_k": -1}, "suites[0].request.top_k: expected an integer >= 0"),
    ({"max_tokens": 0}, "suites[0].request.max_tokens: expected an integer >= 1"),
    ({"temperature": "hot"}, "suites[0].request.temperature"),
    ({"temp": 1}, "suites[0].request: unknown key 'temp'"),
    ("high", "suites[0].request: expected a mapping"),
])
def test_bad_suite_requests_name_their_key_path(suite_request, needle):
    assert needle in error_of(suites=[{"name": "gpqa_diamond", "request": suite_request}])


def test_bad_target_requests_and_embedded_rules():
    bad_target = {**SERVER, "request": {"reasoning_effort": "max"}}
    assert "targets[0].request.reasoning_effort" in error_of(targets=[bad_target])
    assert "targets[0].request.extra_body.prompt" in error_of(targets=[{**SERVER, "request": {"extra_body": {"prompt": "x"}}}])
    embedded = {"name": "e", "type": "embedded"}
    msg = error_of(targets=[{**embedded, "request": {"extra_body": {"x": 1}}}])
    assert "targets[0].request.extra_body: extra_body applies to server and endpoint targets only" in msg
    assert "targets[0].timeout_s: applies to server and endpoint targets only" in error_of(targets=[{**embedded, "timeout_s": 5}])
    assert "targets[0].max_retries: expected an integer >= 0" in error_of(targets=[{**SERVER, "max_retries": -1}])
    assert "targets[0].timeout_s" in error_of(targets=[{**SERVER, "timeout_s": 0}])
    # a suite's extra_body cannot reach an embedded target of the same sweep
    msg = error_of(targets=[SERVER, embedded], suites=[{"name": "gpqa_diamond", "request": {"extra_body": {"x": 1}}}])
    assert "suites[0].request.extra_body" in msg and "e are embedded" in msg
    # reasoning_effort is fine on embedded targets (a chat-template variable)
    config(targets=[{**embedded, "request": {"reasoning_effort": "low"}}])


def test_suite_keys_set_twice_and_prompt_style_params():
    msg = error_of(suites=[{"name": "gpqa_diamond", "max_tokens": 10, "request": {"max_tokens": 20}}])
    assert "suites[0].request.max_tokens: also set as suites[0].max_tokens" in msg
    assert "suites[0].params.prompt_style: 'harmony' is not allowed; choose one of: kvbench, gpt_oss, simple_evals" in \
        error_of(suites=[{"name": "gpqa_diamond", "params": {"prompt_style": "harmony"}}])
    assert "suites[0].params.prompt_style: 'simple_evals' is not allowed; choose one of: kvbench, gpt_oss" in \
        error_of(suites=[{"name": "aime25", "params": {"prompt_style": "simple_evals"}}])
    assert "suites[0].params: unknown key 'shots'" in error_of(suites=[{"name": "aime25", "params": {"shots": 2}}])


def test_target_defaults_and_values():
    cfg = config()
    t = cfg.targets[0]
    assert (t.request, t.timeout_s, t.max_retries) == ({}, 3600.0, 3)
    cfg = config(targets=[{**SERVER, "timeout_s": 7200, "max_retries": 0, "request": {"top_k": 20, "extra_body": {"a": {"b": [1]}}}}])
    t = cfg.targets[0]
    assert (t.request, t.timeout_s, t.max_retries) == ({"top_k": 20, "extra_body": {"a": {"b": [1]}}}, 7200.0, 0)
    assert cfg.to_dict()["targets"][0]["request"] == t.request  # recorded in the manifest


def test_http_client_takes_the_targets_timeout_and_retries():
    from kvbench.harness.targets import http_client

    t = config(targets=[{**SERVER, "timeout_s": 42, "max_retries": 5}]).targets[0]
    c = http_client("http://127.0.0.1:9", "m", None, t)
    try:
        assert (c.timeout_s, c.max_retries) == (42.0, 5)
        assert c._http._transport._pool._max_connections is None or c._http._transport._pool._max_connections > 10**6
    finally:
        c.close()
    c = http_client("http://127.0.0.1:9", "m")
    assert (c.timeout_s, c.max_retries) == (3600.0, 3)
    c.close()


def test_merge_and_apply():
    merged = merge_requests({"reasoning_effort": "low", "temperature": 0.5, "extra_body": {"a": 1, "b": 1}},
                            {"max_tokens": 64, "temperature": None},
                            {"reasoning_effort": "high", "extra_body": {"b": 2}})
    assert merged == {"reasoning_effort": "high", "temperature": 0.5, "max_tokens": 64, "extra_body": {"a": 1, "b": 2}}
    p = apply_request(SamplingParams(max_tokens=8, temperature=0.0, top_p=0.95), {"top_k": 5, "reasoning_effort": "medium"})
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.reasoning_effort, p.extra_body) == (8, 0.0, 0.95, 5, "medium", None)
    with pytest.raises(RequestOptionsError):
        apply_request(SamplingParams(), {"n": 2})
    with pytest.raises(SuiteError, match="unknown request option 'stop'"):
        SuiteOptions(request={"stop": ["x"]})
    with pytest.raises(SuiteError, match="max_tokens given twice"):
        SuiteOptions(max_tokens=5, request={"max_tokens": 6})
    opts = SuiteOptions(request={"max_tokens": 6, "temperature": 0.7, "top_p": 0.5})
    assert (opts.max_tokens, opts.temperature, opts.request) == (6, 0.7, {"top_p": 0.5})


# --------------------------------------------------------------------------- precedence, end to end
def _gpqa_csv(d, n=4):
    with (d / "gpqa_diamond.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["Record ID", "Question", "Correct Answer", "Incorrect Answer 1",
                                          "Incorrect Answer 2", "Incorrect Answer 3"])
        w.writeheader()
        for i in range(n):
            w.writerow({"Record ID": f"r{i}", "Question": f"Q{i}?", "Correct Answer": f"yes{i}", "Incorrect Answer 1": f"no{i}a",
                        "Incorrect Answer 2": f"no{i}b", "Incorrect Answer 3": f"no{i}c"})


class Recording(FakeClient):
    def __init__(self, answer=lambda req: "Answer: A", reasoning=None, finish="stop"):
        super().__init__()
        self.requests: list[GenRequest] = []
        self.answer, self.reasoning, self.finish = answer, reasoning, finish

    def generate(self, request):
        self.requests.append(request)
        return GenResult(self.answer(request), self.finish, 10, 4, 0.01, reasoning=self.reasoning)


def test_suite_request_beats_target_request_beats_protocol_defaults(tmp_path):
    from kvbench.harness.cell_work import DefaultWork

    _gpqa_csv(tmp_path)
    target = {**SERVER, "request": {"reasoning_effort": "low", "temperature": 0.5, "top_p": 0.9, "extra_body": {"a": 1, "b": 1}}}
    suite = {"name": "gpqa_diamond", "max_tokens": 64, "params": {"prompt_style": "gpt_oss"},
             "request": {"reasoning_effort": "high", "extra_body": {"b": 2}}}
    cfg = config(targets=[target], suites=[suite], data_dir=str(tmp_path))
    client = Recording()
    records, summary = DefaultWork(cfg).suite(cfg.suites[0], client, SimpleNamespace(config={"target": "sg"}, concurrency=2), None)
    assert len(records) == 4 and summary["n"] == 4
    p = client.requests[0].params
    # suite > target > protocol defaults (gpt_oss style: temperature 1.0, 32768 tokens, top_p 1, top_k off)
    assert (p.reasoning_effort, p.max_tokens, p.temperature, p.top_p, p.top_k) == ("high", 64, 0.5, 0.9, 0)
    assert p.extra_body == {"a": 1, "b": 2}
    want = {"reasoning_effort": "high", "temperature": 0.5, "top_p": 0.9, "top_k": 0, "max_tokens": 64, "extra_body": {"a": 1, "b": 2}}
    assert all(r["request_options"] == want and r["retries"] == 0 and r["reasoning"] is None for r in records)
    assert records[0]["protocol"].startswith("gpt-oss:gpqa_diamond:") and ":effort-high:body-" in records[0]["protocol"]
    # no request anywhere: the style's own defaults
    cfg = config(suites=[{"name": "gpqa_diamond", "params": {"prompt_style": "gpt_oss"}}], data_dir=str(tmp_path))
    client = Recording()
    records, _ = DefaultWork(cfg).suite(cfg.suites[0], client, SimpleNamespace(config={"target": "sg"}, concurrency=2), None)
    assert records[0]["request_options"] == {"reasoning_effort": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                             "max_tokens": 32768, "extra_body": None}


def test_completion_requests_do_not_record_a_reasoning_effort(tmp_path):
    from kvbench.harness.request_options import effective_options

    p = SamplingParams(reasoning_effort="high")
    assert effective_options(GenRequest(prompt="x", params=p))["reasoning_effort"] is None
    assert effective_options(GenRequest(messages=[{"role": "user", "content": "x"}], params=p))["reasoning_effort"] == "high"


def test_reasoning_is_never_scored(tmp_path):
    _gpqa_csv(tmp_path, n=3)
    opts = SuiteOptions(data_dir=str(tmp_path), progress=False)

    def correct_letter(req):
        return re.search(r"^([ABCD])\) yes", req.messages[0]["content"], flags=re.M).group(1)

    # the reasoning names the right letter, the answer a wrong one: wrong
    wrong = {"A": "B", "B": "C", "C": "D", "D": "A"}
    client = Recording(answer=lambda req: f"Answer: {wrong[correct_letter(req)]}", reasoning="Answer: " + "ABCD" * 3)
    res = run_suite("gpqa_diamond", client, opts)
    assert res.summary["accuracy"] == 0.0 and all(r["reasoning"] == "Answer: " + "ABCD" * 3 for r in res.records)
    # max_tokens hit inside the reasoning: no content -> truncated and invalid, not a failed request
    client = Recording(answer=lambda req: "", reasoning="Answer: A, or rather", finish="length")
    res = run_suite("gpqa_diamond", client, opts)
    s = res.summary
    assert (s["errors"], s["answered"], s["truncation_rate"], s["invalid_rate"], s["accuracy"]) == (0, 3, 1.0, 1.0, 0.0)
    assert all(r["error"] is None and r["extracted"] is None and r["raw_output"] == "" for r in res.records)


# ------------------------------------------------------------------------------------------ embedded
class _Out(SimpleNamespace):
    pass


class _FakeEngine:
    model_id = "fake-engine"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prompts: list[list[int]] = []

    def start(self):
        pass

    def shutdown(self):
        pass

    def generate(self, prompts, params):
        self.prompts.extend(prompts)
        return [_Out(text="Answer: A", finish_reason="stop", token_ids=[1], first_token_time=None, finish_time=None, logprobs=None)
                for _ in prompts]


def _hf_tokenizer(template):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvbench.core.tokenizer import Tokenizer

    raw = RawTokenizer(models.WordLevel({"[UNK]": 0, "hi": 1, "|": 2, "low": 3, "high": 4, "none": 5}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    hf.chat_template = template
    return Tokenizer(hf)


def test_embedded_engine_renders_reasoning_effort_and_refuses_extra_body():
    from kvbench.harness.engine_client import EngineClient

    tok = _hf_tokenizer("{% for m in messages %}{{ m['content'] }} {% endfor %}| {{ reasoning_effort | default('none') }}")
    engine = _FakeEngine(tok)
    client = EngineClient(engine=engine)
    msgs = [{"role": "user", "content": "hi"}]
    client.generate(GenRequest(messages=msgs, params=SamplingParams(reasoning_effort="high")))
    client.generate(GenRequest(messages=msgs, params=SamplingParams()))
    assert engine.prompts == [[1, 2, 4], [1, 2, 5]]  # "hi | high", then the template's default
    with pytest.raises(RequestOptionsError, match="extra_body applies to server and endpoint targets only"):
        client.check_request(GenRequest(messages=msgs, params=SamplingParams(extra_body={"x": 1})))

    plain = EngineClient(engine=_FakeEngine(_hf_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")))
    with pytest.raises(RequestOptionsError, match="has no reasoning_effort variable"):
        plain.check_request(GenRequest(messages=msgs, params=SamplingParams(reasoning_effort="low")))
    plain.check_request(GenRequest(prompt="hi", params=SamplingParams(reasoning_effort="low")))  # completion: not sent


def test_embedded_suite_fails_before_any_request(tmp_path):
    from kvbench.harness.engine_client import EngineClient

    _gpqa_csv(tmp_path)
    engine = _FakeEngine(_hf_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    client = EngineClient(engine=engine)
    for request, needle in (({"extra_body": {"x": 1}}, "extra_body"), ({"reasoning_effort": "high"}, "reasoning_effort 'high'")):
        with pytest.raises(SuiteError, match=needle):
            run_suite("gpqa_diamond", client, SuiteOptions(data_dir=str(tmp_path), progress=False, request=request))
    assert engine.prompts == []

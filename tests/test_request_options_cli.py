"""``kvbench eval`` request flags (--reasoning-effort, --top-p, --top-k, --extra-body, --request-timeout,
--max-retries, --api-key, --prompt-style gpt_oss) end to end against a loopback OpenAI-style server."""

from __future__ import annotations

import csv
import json
import os
import re
import sys

import pytest
from typer.testing import CliRunner

sys.path.insert(0, os.path.dirname(__file__))
from test_server_fakes import serve  # noqa: E402

from kvbench.harness.cli import app  # noqa: E402


def _gpqa(d, n=3):
    with (d / "gpqa_diamond.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Record ID", "Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"])
        for i in range(n):
            w.writerow([f"q{i}", f"Question {i}?", f"good {i}", f"bad {i}x", f"bad {i}y", f"bad {i}z"])


@pytest.fixture(scope="module")
def server():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    seen: list[tuple[dict, str]] = []

    async def chat(request):
        body = await request.json()
        seen.append((body, request.headers.get("authorization", "")))
        letter = re.search(r"^\(([ABCD])\) good", body["messages"][0]["content"], flags=re.M).group(1)
        msg = {"role": "assistant", "content": f"**Answer:** {letter}", "reasoning_content": "(A)? no."}
        return JSONResponse({"choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 9, "completion_tokens": 4}})

    async def models(request):
        return JSONResponse({"data": [{"id": "served-model"}]})

    app_ = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)])
    with serve(app_) as url:
        yield url, seen


def test_eval_sends_the_request_options_and_records_them(server, tmp_path):
    url, seen = server
    _gpqa(tmp_path)
    out = tmp_path / "out"
    extra = {"chat_template_kwargs": {"thinking": True}, "separate_reasoning": True}
    r = CliRunner().invoke(app, [
        "eval", "--suite", "gpqa_diamond", "--data-dir", str(tmp_path), "--endpoint", url, "--prompt-style", "gpt_oss",
        "--reasoning-effort", "high", "--top-p", "0.95", "--top-k", "40", "--extra-body", json.dumps(extra),
        "--request-timeout", "30", "--max-retries", "1", "--api-key", "sk-test", "--max-tokens", "100", "--repeats", "2",
        "--concurrency", "4", "--no-progress", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert len(seen) == 6
    for body, auth in seen:
        assert auth == "Bearer sk-test" and body["model"] == "served-model"
        assert (body["reasoning_effort"], body["top_p"], body["top_k"], body["max_tokens"], body["temperature"]) == \
            ("high", 0.95, 40, 100, 1.0)
        assert body["chat_template_kwargs"] == {"thinking": True} and body["separate_reasoning"] is True
    recs = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and all(r["correct"] for r in recs)
    assert all(r["reasoning"] == "(A)? no." and r["retries"] == 0 for r in recs)
    assert recs[0]["request_options"] == {"reasoning_effort": "high", "temperature": 1.0, "top_p": 0.95, "top_k": 40,
                                          "max_tokens": 100, "extra_body": extra}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["suites"]["gpqa_diamond"]["accuracy"] == 1.0
    assert (summary["target"]["timeout_s"], summary["target"]["max_retries"]) == (30.0, 1)


@pytest.mark.parametrize("args,needle", [
    (["--endpoint", "http://127.0.0.1:9", "--reasoning-effort", "extreme"], "--reasoning-effort: 'extreme' is not allowed"),
    (["--endpoint", "http://127.0.0.1:9", "--extra-body", "[1]"], "--extra-body: expected a mapping"),
    (["--endpoint", "http://127.0.0.1:9", "--extra-body", '{"model": "x"}'], "--extra-body.model: kvbench sets 'model' itself"),
    (["--endpoint", "http://127.0.0.1:9", "--extra-body", "{nope"], "--extra-body must be a JSON object"),
    (["--endpoint", "http://127.0.0.1:9", "--top-p", "2"], "--top-p: expected a number in (0, 1]"),
    (["--endpoint", "http://127.0.0.1:9", "--max-retries", "-1"], "--max-retries must be >= 0"),
    (["--endpoint", "http://127.0.0.1:9", "--request-timeout", "0"], "--request-timeout must be positive"),
    (["--endpoint", "http://127.0.0.1:9", "--suite", "gsm8k"], "--endpoint: no server answers at http://127.0.0.1:9"),
    (["--extra-body", "{}"], "--extra-body applies to --endpoint only"),
    (["--max-retries", "2"], "--max-retries applies to --endpoint only"),
    (["--api-key", "k"], "--api-key applies to --endpoint only"),
    (["--prompt-style", "gpt_oss", "--suite", "gsm8k"], "--prompt-style gpt_oss applies to --suite gpqa_diamond"),
    (["--prompt-style", "simple_evals", "--suite", "aime25"], "'simple_evals' is not a style of aime25"),
])
def test_bad_request_flags_are_usage_errors(args, needle):
    base = ["eval", "--suite", "gpqa_diamond"] if "--suite" not in args else ["eval"]
    r = CliRunner().invoke(app, base + args)
    assert r.exit_code == 2 and needle in " ".join(r.output.split()), r.output

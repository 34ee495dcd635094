"""What a real vLLM 0.26.0 printed and answered on an H200 (2026-11-29, docs/scripts/vllm_gpu.py), kept as
fixtures (tests/fixtures/vllm-0.26/), against kvbench's parsers and the fake vLLM the conformance sweeps use.

- the start-up logs and /metrics give the capacity kvbench reports (655,360 fp8 tokens in 40 GiB, the admission
  limit, the version from 0.26's banner), and an admission limit vLLM never prints is its GPU-dependent default;
- the fake prints the same lines (compared as templates: numbers and paths aside) and answers errors, streams,
  scoring and the cache reset with the same shapes;
- a reset answered ``{"success": false}`` is retried, then refused.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvbench.harness import target_session, targets
from kvbench.harness.server_admission import admission_limit
from kvbench.harness.server_capacity import merge_capacity, parse_metrics_capacity, parse_startup_log

FIX = Path(__file__).resolve().parent / "fixtures" / "vllm-0.26"
FAKE = Path(__file__).resolve().parent / "fake_engines" / "fake_vllm.py"
H200 = {"name": "NVIDIA H200", "memory_mib": 143771}


def real_log(name: str) -> str:
    return (FIX / name).read_text()


def test_capacity_from_the_real_startup_log_and_metrics():
    log = parse_startup_log(real_log("startup-llama8b-dummy-fp8.log"), "vllm", "fp8_e4m3")
    assert log["version"] == "0.26.0" and log["v1"] and log["kv_cache_dtype"] == "fp8"
    assert log["tokens"] == 655_360 and log["context_len"] == 9216 and log["max_num_seqs"] == 256
    assert log["max_concurrency"] == 71 and "kv_bytes" not in log  # --kv-cache-memory-bytes: no memory line
    metrics = parse_metrics_capacity(real_log("metrics-llama8b-dummy-fp8.txt"))
    assert metrics["tokens"] == 655_360 and metrics["kv_bytes"] == 40 * 2**30
    assert (metrics["num_gpu_blocks"], metrics["block_size"], metrics["kv_cache_dtype"]) == (40960, 16, "fp8")
    cap = admission_limit(merge_capacity(log, metrics, "fp8_e4m3"), gpu=H200)
    assert cap["bytes_per_token"] == 65536.0  # 32 layers x 8 heads x 128 x (K + V) x 1 byte
    assert cap["max_concurrency"] == 71 and cap["max_num_seqs_source"] == "server log"


def test_the_eager_smollm2_log_reports_kv_memory_and_the_version_banner():
    cap = parse_startup_log(real_log("startup-smollm2-bf16-eager.log"), None, "bf16")
    assert cap["engine"] == "vllm" and cap["version"] == "0.26.0" and cap["max_num_seqs"] == 128
    assert cap["kv_cache_memory_gib"] == pytest.approx(41.33) and cap["context_len"] == 4096
    # SmolLM2-135M: 30 layers x 3 kv-heads x 64 x (K + V) x 2 bytes = 23,040 bytes per token (vLLM rounds the pool)
    assert cap["bytes_per_token"] == pytest.approx(23040, rel=0.001)
    assert "calculate-kv-scales" in real_log("startup-smollm2-fp8-calculate-kv-scales.log")  # deprecated, and broken here


@pytest.mark.parametrize("gpu, limit", [(H200, 1024), ({"name": "NVIDIA A100-SXM4-80GB", "memory_mib": 81920}, 256),
                                        ({"name": "NVIDIA L4", "memory_mib": 23034}, 256)])
def test_the_admission_limit_vllm_does_not_print_is_its_default_for_the_gpu(gpu, limit):
    text = "\n".join(ln for ln in real_log("startup-llama8b-dummy-fp8.log").splitlines()
                     if "non-default args" not in ln)  # as launched without --max-num-seqs
    cap = admission_limit(parse_startup_log(text, "vllm", "fp8_e4m3"), gpu=gpu)
    assert cap["max_num_seqs"] == limit and gpu["name"] in cap["max_num_seqs_source"]
    assert cap["max_concurrency_kv"] == 71 and cap["max_concurrency"] == min(71, limit)
    cap = admission_limit(parse_startup_log(text.replace("9,216 tokens per request: 71.11x", "4,096 tokens per request: 1576.00x"),
                                            "vllm", "fp8_e4m3"), gpu=H200)
    assert cap["max_concurrency_kv"] == 1576 and cap["max_concurrency"] == 1024  # the report's "1,576 concurrent" was unreachable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """The fake vLLM launched as the real one was for the 8B fp8 server (model swapped for a stand-in)."""
    d = tmp_path_factory.mktemp("fake") / "llama8b-dummy"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32,
                                               "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                               "max_position_embeddings": 16384}))
    port = _free_port()
    args = [sys.executable, str(FAKE), "serve", str(d), "--load-format", "dummy", "--served-model-name", "llama8b",
            "--host", "127.0.0.1", "--port", str(port), "--kv-cache-dtype", "fp8", "--attention-backend", "FLASH_ATTN",
            "--max-model-len", "9216", "--kv-cache-memory-bytes", str(40 * 2**30), "--max-num-seqs", "256",
            "--gpu-memory-utilization", "0.45"]
    log = d.parent / "fake.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        yield base, log
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _template(line: str) -> str:
    """A log line without its process tag, time, source location, numbers and dict/list bodies."""
    msg = re.sub(r"^\((\w+) pid=\d+\) ", r"(\1) ", line)
    msg = re.sub(r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+:\d+\]", "INFO [where]", msg)
    msg = re.sub(r"(with config:|non-default args:).*", r"\1 ...", msg)
    return re.sub(r"\d[\d,.]*", "N", msg).strip()


def test_the_fake_prints_the_real_startup_lines(fake):
    _, log = fake
    real = [ln for ln in real_log("startup-llama8b-dummy-fp8.log").splitlines()
            if not ln.startswith("$") and not re.search(r"torch.compile|Graph capturing|Model loading", ln)]
    fake_lines = {_template(ln) for ln in log.read_text().splitlines()}
    missing = [_template(ln) for ln in real if _template(ln) not in fake_lines]
    assert not missing, missing
    cap = parse_startup_log(log.read_text(), "vllm", "fp8_e4m3")
    assert (cap["tokens"], cap["version"], cap["max_num_seqs"], cap["context_len"]) == (655_360, "0.26.0", 256, 9216)


def _keys(obj) -> set:
    return set(obj) if isinstance(obj, dict) else set()


def test_the_fake_answers_with_the_real_bodies(fake):
    base, _ = fake
    real = json.loads((FIX / "responses-llama8b-dummy-fp8.json").read_text())
    cases = {
        "err_unknown_model": {"model": "nope", "prompt": "x", "max_tokens": 2},
        "err_too_long": {"model": "llama8b", "prompt": "hello " * 12000, "max_tokens": 2},
        "err_max_tokens_negative": {"model": "llama8b", "prompt": "x", "max_tokens": -1},
    }
    for name, body in cases.items():
        r = httpx.post(base + "/v1/completions", json=body, timeout=30)
        want = json.loads(real[name]["body"])["error"]
        got = r.json()["error"]
        assert r.status_code == real[name]["status"] and _keys(got) == _keys(want), (name, got)
        assert (got["type"], got["param"], got["code"]) == (want["type"], want["param"], want["code"]), name
        assert re.sub(r"\d+", "N", got["message"]) == re.sub(r"\d+", "N", want["message"]), name
    r = httpx.post(base + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    want = json.loads(real["err_bad_json"]["body"])["error"]
    assert r.status_code == 400 and (r.json()["error"]["type"], r.json()["error"]["param"]) == (want["type"], want["param"])
    # the cache reset answers {"success": bool}
    r = httpx.post(base + "/reset_prefix_cache")
    assert r.json() == json.loads(real["reset_prefix_cache"]["body"]) == {"success": True}
    # /v1/models and /tokenize carry the fields kvbench reads
    card = httpx.get(base + "/v1/models").json()["data"][0]
    real_card = json.loads(real["models"]["body"])["data"][0]
    assert {"id", "max_model_len", "owned_by", "root"} <= _keys(card) & _keys(real_card) and card["max_model_len"] == 9216
    assert {"count", "max_model_len", "tokens"} <= _keys(httpx.post(base + "/tokenize", json={"prompt": "a b"}).json()) \
        & _keys(json.loads(real["tokenize"]["body"]))


def _events(body: str) -> list:
    return [json.loads(e[len("data: "):]) for e in body.split("\n\n") if e.startswith("data: ") and e != "data: [DONE]"]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_the_fake_streams_the_real_chunk_shapes(fake, api):
    base, _ = fake
    real = _events(json.loads((FIX / "responses-llama8b-dummy-fp8.json").read_text())[f"stream_{'chat' if api == 'chat' else 'completion'}"]["body"])
    body = {"model": "llama8b", "max_tokens": 6, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}  # the real run's dummy weights never sampled EOS in 6 tokens
    if api == "chat":
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "The capital of France is"
    got = _events(httpx.post(f"{base}/v1/{'chat/' if api == 'chat' else ''}completions", json=body, timeout=30).text)
    for events in (real, got):
        first, last = events[0], events[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6  # usage alone in the last chunk
        assert first["object"] == ("chat.completion.chunk" if api == "chat" else "text_completion")
        if api == "chat":  # the role comes first, with empty content
            assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    choice_keys = lambda ev: _keys(ev["choices"][0])  # noqa: E731
    assert choice_keys(got[1]) <= choice_keys(real[1]) and {"index", "finish_reason"} <= choice_keys(got[1])


def test_the_real_scoring_answer_parses():
    """Prompt log-probs through echo + logprobs + return_tokens_as_token_ids, as vLLM 0.26 answered them."""
    real = json.loads(json.loads((FIX / "responses-llama8b-dummy-fp8.json").read_text())["echo_logprobs"]["body"])
    lp = real["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert all(k.startswith("token_id:") for row in lp["top_logprobs"][1:] for k in row)


class _Answer:
    def __init__(self, status: int, body):
        self.status_code, self._body = status, body
        self.text = json.dumps(body)

    def json(self):
        return self._body


def test_a_reset_refused_while_blocks_are_held_is_retried_then_reported(monkeypatch):
    answers = [_Answer(200, {"success": False}), _Answer(200, {"success": False}), _Answer(200, {"success": True})]
    calls = []
    monkeypatch.setattr(httpx, "request", lambda *a, **k: calls.append(a) or answers.pop(0))
    monkeypatch.setattr(target_session.time, "sleep", lambda s: None)
    targets.flush_cache("http://x", "POST /reset_prefix_cache")
    assert len(calls) == 3
    monkeypatch.setattr(httpx, "request", lambda *a, **k: _Answer(200, {"success": False}))
    with pytest.raises(targets.TargetError, match="kept its prefix cache"):
        targets.flush_cache("http://x", "POST /reset_prefix_cache")
    monkeypatch.setattr(httpx, "request", lambda *a, **k: _Answer(200, "Cache flushed."))  # sglang's plain text
    targets.flush_cache("http://x", "POST /flush_cache")

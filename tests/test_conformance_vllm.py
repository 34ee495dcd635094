"""Conformance of the harness with a vLLM server: sweeps through the real runner against the fake vLLM
(tests/fake_engines/fake_vllm.py: ``vllm serve`` flags, V0/V1 start-up lines, /metrics names, chunk and error
shapes of three generations) on loopback.  Checks that cell options reach the server (through the target's
name maps), that capacity.json comes from the server's lines and /metrics (fp8 holds twice the tokens of
bf16), that queueing is measured, that reasoning is kept apart whatever the field is called and request
options reach the server, that the prefix-cache reset needs vLLM's dev mode, that a bad model path fails its
group fast and a resume finishes it, and that bad flags fail the way vLLM does."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fake_engines"))
from conformance import (EXPECTED_CORRECT, FAKE_VLLM, PYTHON, expected_tokens, fake_args, make_data,  # noqa: E402
                         make_model, read_cells, request_log, run)

pytestmark = pytest.mark.timeout(120)

LAUNCH = (f"{PYTHON} {FAKE_VLLM} serve {{model}} --kv-cache-dtype {{kv_dtype}} --attention-backend {{attention_backend}} "
          "--tensor-parallel-size {tp_size} --max-num-seqs 4 --reasoning-parser qwen3 --host {host} --port {port}")
KV_MAP = {"bf16": "bfloat16"}  # fp8_e4m3 is vLLM's name too; backend names go verbatim
OPTION_FLAGS = {"kv_scales": {"calibrate": "--calculate-kv-scales"}}
LOAD = {"num_prompts": 16, "input_len": 32, "output_len": 16, "metrics_interval_s": 0.02, "timeout_s": 30}
SUITES = [{"name": "aime25", "max_tokens": 256, "request": {"reasoning_effort": "high"}},
          {"name": "gpqa_diamond", "max_tokens": 256}]
TARGET_REQUEST = {"reasoning_effort": "low", "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
REASONING = {"low": "Thinking about", "medium": "Thinking about the question",
             "high": "Thinking about the question step by step carefully"}


def target(tmp_path: Path, name: str = "vllm", launch: str = LAUNCH, style: str = "latest", dev_mode: bool = True, **kw) -> dict:
    env = {"FAKE_REQUEST_LOG": str(tmp_path / "requests.log"), "FAKE_VLLM_STYLE": style}
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return {"name": name, "type": "server", "launch": launch, "health_timeout_s": 20, "env": env,
            "flush_cache": "POST /reset_prefix_cache", "kv_dtype_map": KV_MAP, "option_flags": OPTION_FLAGS, **kw}


def sweep(tmp_path: Path, model, **over) -> dict:
    raw = {
        "name": "vllm-conformance",
        "model": model,
        "targets": [target(tmp_path, request=TARGET_REQUEST, extra_args="--seed 7")],
        "axes": {"kv": ["bf16", {"dtype": "fp8_e4m3", "scales": "calibrate"}],
                 "backends": ["TRITON_ATTN", {"backend": "FLASHINFER", "extra_args": "--enforce-eager"}], "concurrency": [2, 8]},
        "accuracy_concurrency": 2,
        "suites": SUITES,
        "load": LOAD,
        "data_dir": str(make_data(tmp_path)),
        "baseline": {"kv_dtype": "bf16"},
        "aa_control": False,
    }
    raw.update(over)
    return raw


def small(tmp_path: Path, model, **over) -> dict:
    return sweep(tmp_path, model, **{"axes": {"kv": ["fp8_e4m3"], "backends": ["FLASHINFER"], "concurrency": [2]},
                                     "baseline": {}, "load": {**LOAD, "num_prompts": 4}, **over})


def sharegpt(tmp_path: Path, n: int = 12) -> str:
    convs = [{"conversations": [{"from": "human", "value": f"Tell me about topic {i} in a few words please."},
                                {"from": "gpt", "value": "Sure."}]} for i in range(n)]
    p = tmp_path / "sharegpt.json"
    p.write_text(json.dumps(convs))
    return str(p)


def test_vllm_sweep_conformance(tmp_path):
    model = make_model(tmp_path)
    raw = sweep(tmp_path, str(model), accuracy_concurrency=3,  # off the load axis: one accuracy-only cell per group
                axes={"concurrency": [2, 8], "combos": [
                    {"backends": "TRITON_ATTN", "kv": "bf16"},
                    {"backends": {"backend": "FLASHINFER", "extra_args": "--enforce-eager"},
                     "kv": {"dtype": "fp8_e4m3", "scales": "calibrate"}}]})
    from kvbench.harness.sweep.config import parse_config

    assert parse_config(raw).targets[0].engine_kind == "vllm"  # sniffed from the launch text
    t0 = time.monotonic()
    outcome = run(raw, tmp_path / "run")
    elapsed = time.monotonic() - t0
    cells = read_cells(tmp_path / "run")
    assert outcome.ok and len(cells) == 6 and all(c.status == "done" for c in cells), [c.summary.get("error") for c in cells]
    assert sorted(c.config["concurrency"] for c in cells) == [2, 2, 3, 3, 8, 8]
    assert elapsed < 60

    launches = {}
    for c in cells:
        for a in fake_args(c.server_log):
            launches.setdefault(c.group, []).append(a)
    assert len(launches) == 2 and all(len(v) == 1 for v in launches.values())
    for (_, _, _, backend, kv), [a] in launches.items():
        args = a["args"]  # names verbatim or through kv_dtype_map; option_flags and every extra_args reach the server
        assert (backend, kv) in (("TRITON_ATTN", "bf16"), ("FLASHINFER", "fp8_e4m3"))  # the combos, not their product
        assert args["kv_cache_dtype"] == KV_MAP.get(kv, kv) and args["attention_backend"] == backend
        assert args["calculate_kv_scales"] == (kv == "fp8_e4m3") and args["enforce_eager"] == (backend == "FLASHINFER")
        assert args["seed"] == 7 and args["tensor_parallel_size"] == 1
        assert args["model_tag"] == str(model) and args["max_num_seqs"] == 4 and a["env"]["VLLM_SERVER_DEV_MODE"] == "1"

    for c in cells:
        cap = c.capacity
        kv_bytes = 1 if c.config["kv_dtype"] == "fp8_e4m3" else 2
        assert cap["engine"] == "vllm" and cap["source"] == "server log+metrics" and cap["version"] == "0.26.0"
        assert cap["tokens"] == expected_tokens(kv_bytes) and cap["num_gpu_blocks"] == cap["num_pages"] == cap["tokens"] // 16
        assert (cap["block_size"], cap["page_size"], cap["context_len"]) == (16, 16, 4096)
        # the KV pool's figure, and the one the server can run: capped by its admission limit (--max-num-seqs 4)
        assert cap["max_concurrency_kv"] == cap["tokens"] // 4096 and cap["max_concurrency"] == min(4, cap["tokens"] // 4096)
        assert cap["kv_dtype"] == c.config["kv_dtype"] and cap["max_num_seqs_source"] == "server log"
        assert cap["kv_cache_dtype"] == KV_MAP.get(c.config["kv_dtype"], c.config["kv_dtype"])
        assert cap["kv_bytes"] == 2**30 and cap["bytes_per_token"] == 2 * 4 * 2 * 64 * kv_bytes
        assert cap["metrics"]["num_gpu_blocks"] == cap["num_gpu_blocks"] and cap["metrics"]["block_size"] == 16
        assert cap["max_num_seqs"] == 4  # from "non-default args": the admission limit the load test runs into
    by_kv = {c.config["kv_dtype"]: c.capacity["tokens"] for c in cells}
    assert by_kv["fp8_e4m3"] == 2 * by_kv["bf16"]

    for c in cells:
        if c.config["concurrency"] == 3:  # accuracy only
            assert c.summary["load"] is None and not c.requests
            continue
        assert not c.items
        sm = c.summary["load"]["server_metrics"]
        assert sm["available"] and sm["samples"] >= 3 and sm["max_running"] <= 4 and sm["preemptions"] == 0
        if c.config["concurrency"] == 2:
            assert sm["max_running_without_queueing"] == 2 and sm["max_waiting"] == 0
        else:
            assert sm["max_running"] == 4 and sm["max_waiting"] >= 1
        assert c.summary["load"]["completed"] == 16 and c.summary["load"]["token_count_source"] == "usage"

    # items: right answers, reasoning ("reasoning" field of newer vLLM) apart, request options as configured
    for c in (c for c in cells if c.config["concurrency"] == 3):
        assert {(r["suite"], r["item_id"]): r["correct"] for r in c.items} == EXPECTED_CORRECT
        for r in c.items:
            effort = "high" if r["suite"] == "aime25" else "low"
            assert r["request_options"]["reasoning_effort"] == effort
            assert r["request_options"]["extra_body"] == TARGET_REQUEST["extra_body"]
            assert r["reasoning"] == REASONING[effort] and "Thinking" not in r["raw_output"] and r["retries"] == 0
    reqs = request_log(tmp_path / "requests.log")
    chats = [r["body"] for r in reqs if r["route"] == "/v1/chat/completions"]
    assert len(chats) == 2 * 6
    assert all(b["chat_template_kwargs"] == {"enable_thinking": True} and b["max_tokens"] == 256 for b in chats)
    assert sorted({b["reasoning_effort"] for b in chats}) == ["high", "low"]
    flushes = [r for r in reqs if r["route"] == "/reset_prefix_cache"]
    assert len(flushes) == sum(1 + (c.summary["load"] is not None) for c in cells)  # before suites / each load test


@pytest.mark.parametrize("style, fields", [("legacy", ("reasoning_content",)), ("v1", ("reasoning_content", "reasoning")),
                                           ("latest", ("reasoning",))])
def test_vllm_generations(tmp_path, style, fields):
    """Each generation's lines give the same capacity; its reasoning field is kept apart in items and streamed
    reasoning tokens are timed in a chat load test like any other output token."""
    model = make_model(tmp_path)
    raw = small(tmp_path, str(model), load={**LOAD, "num_prompts": 8, "api": "chat", "dataset": "sharegpt",
                                            "dataset_path": sharegpt(tmp_path)})
    raw["targets"] = [target(tmp_path, style=style)]
    assert run(raw, tmp_path / "run").ok
    [cell] = read_cells(tmp_path / "run")
    v0 = style == "legacy"
    assert ("# GPU blocks:" in cell.server_log) == v0 and ("GPU KV cache size:" in cell.server_log) != v0
    cap = cell.capacity
    assert cap["tokens"] == expected_tokens(1) and cap["num_gpu_blocks"] == cap["tokens"] // 16 and cap["block_size"] == 16
    assert cap["context_len"] == 4096
    if v0:  # V0 printed no non-default args: the admission limit is unknown and the KV pool's figure stands
        assert cap["max_concurrency"] == cap["tokens"] // 4096 and "max_concurrency_kv" not in cap
    else:  # capped by --max-num-seqs 4
        assert cap["max_concurrency_kv"] == cap["tokens"] // 4096 and cap["max_concurrency"] == 4
    assert ("kv_bytes" in cap) != v0  # V0 prints no KV memory line
    assert {(r["suite"], r["item_id"]): r["correct"] for r in cell.items} == EXPECTED_CORRECT
    for r in cell.items:  # no target request here: gpqa goes without reasoning_effort (the fake's medium), aime asks high
        assert r["reasoning"] == REASONING["high" if r["suite"] == "aime25" else "medium"] and "Thinking" not in r["raw_output"]
    sm = cell.summary["load"]["server_metrics"]
    assert sm["available"] and sm["kv_usage_max"] is not None
    assert cell.requests and all(r["success"] and r["output_tokens"] == 16 for r in cell.requests)
    # the 4 reasoning tokens stream first: each must be a timed chunk (TTFT is the first token, reasoning or not)
    assert all(len(r["itl_s"]) == r["output_tokens"] - 1 for r in cell.requests), [len(r["itl_s"]) for r in cell.requests]


def test_prefix_cache_reset_needs_dev_mode(tmp_path):
    model = make_model(tmp_path)
    raw = small(tmp_path, str(model), suites=[])
    raw["targets"] = [target(tmp_path, dev_mode=False)]
    outcome = run(raw, tmp_path / "run")
    [cell] = read_cells(tmp_path / "run")
    assert not outcome.ok and cell.status == "failed"
    assert re.search(r"POST http://127\.0\.0\.1:\d+/reset_prefix_cache \(prefix-cache flush\) answered HTTP 404", cell.summary["error"])


def test_bad_flags_and_bad_model_path_fail_fast_and_resume_finishes(tmp_path):
    good, missing = make_model(tmp_path, "good"), tmp_path / "later"
    raw = small(tmp_path, [str(good), str(missing)], suites=[])
    legacy_flag = LAUNCH + " --enable-reasoning"  # removed from vLLM serve: argparse refuses it
    raw["targets"] = [target(tmp_path), target(tmp_path, name="oldflag", launch=legacy_flag),
                      target(tmp_path, name="badenv", env={"VLLM_ATTENTION_BACKEND": "NOPE", "VLLM_SERVER_DEV_MODE": "1"})]
    t0 = time.monotonic()
    run(raw, tmp_path / "run")
    assert time.monotonic() - t0 < 30
    cells = {(c.config["model"], c.config["target"]): c for c in read_cells(tmp_path / "run")}
    assert cells[(str(good), "vllm")].status == "done"
    for model in (str(good), str(missing)):
        err = cells[(model, "oldflag")].summary["error"]
        assert "exited with code 2" in err and "vllm: error: unrecognized arguments: --enable-reasoning" in err
    err = cells[(str(good), "badenv")].summary["error"]
    assert "exited with code 1" in err and "Invalid attention backend: 'NOPE'" in err
    err = cells[(str(missing), "vllm")].summary["error"]
    assert "exited with code 1" in err and f"Invalid repository ID or local directory specified: '{missing}'" in err
    done_dir = tmp_path / "run" / "cells" / cells[(str(good), "vllm")].key
    before = {p.name: p.stat().st_mtime_ns for p in done_dir.iterdir()}

    make_model(tmp_path, "later")
    raw["targets"] = raw["targets"][:1] + [target(tmp_path, name="oldflag"), target(tmp_path, name="badenv")]  # recipes fixed
    outcome = run(raw, tmp_path / "run", resume=True)
    assert outcome.ok and outcome.skipped == [cells[(str(good), "vllm")].key] and len(outcome.done) == 5
    assert {p.name: p.stat().st_mtime_ns for p in done_dir.iterdir()} == before
    assert all(c.status == "done" and c.capacity["tokens"] == expected_tokens(1) for c in read_cells(tmp_path / "run"))


def test_an_endpoint_target_gets_capacity_from_metrics(tmp_path):
    """An already-running vLLM (an endpoint target: no start-up log of ours) still gets capacity.json from its
    /metrics (vllm:cache_config_info: blocks x block size), like a server target."""
    import subprocess

    from kvbench.harness.sweep.specs import TargetSpec
    from kvbench.harness.targets import free_port, kill_group, open_endpoint

    model = make_model(tmp_path)
    port = free_port()
    proc = subprocess.Popen([PYTHON, str(FAKE_VLLM), "serve", str(model), "--kv-cache-dtype", "fp8_e4m3",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        spec = TargetSpec(name="running", type="endpoint", base_url=f"http://127.0.0.1:{port}", health_timeout_s=20)
        with open_endpoint(spec) as session:
            cap = session.capacity()
        assert cap is not None and cap["tokens"] == expected_tokens(1), cap
        assert cap["source"] == "server metrics" and cap["page_size"] > 0
    finally:
        kill_group(proc)

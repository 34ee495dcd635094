"""Conformance of the harness with an SGLang server: sweeps through the real runner against the fake SGLang
(tests/fake_engines/fake_sglang.py: SGLang's flags, start-up lines, /metrics names, chunk and error shapes)
on loopback.  Checks that every cell option reaches the server verbatim, that capacity.json comes from the
server's own lines (fp8 holds twice the tokens of bf16), that queueing is measured from /metrics, that items
are scored with reasoning kept apart, that a bad model path fails its group fast and a resume finishes it,
and that a mistyped flag fails the way argparse does."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fake_engines"))
from conformance import (EXPECTED_CORRECT, FAKE_SGLANG, PYTHON, expected_tokens, fake_args, make_data,  # noqa: E402
                         make_model, read_cells, request_log, run)

pytestmark = pytest.mark.timeout(120)

LAUNCH = (f"{PYTHON} {FAKE_SGLANG} --model-path {{model}} --kv-cache-dtype {{kv_dtype}} "
          "--prefill-attention-backend {prefill_backend} --decode-attention-backend {decode_backend} "
          "--tp-size {tp_size} --max-running-requests 4 --enable-metrics --reasoning-parser qwen3 --host {host} --port {port}")
SUITES = [{"name": "aime25", "max_tokens": 256}, {"name": "gpqa_diamond", "max_tokens": 256}]
LOAD = {"num_prompts": 16, "input_len": 32, "output_len": 16, "metrics_interval_s": 0.02, "timeout_s": 30}


def sweep(tmp_path: Path, model, launch: str = LAUNCH, **over) -> dict:
    raw = {
        "name": "sglang-conformance",
        "model": model,
        "targets": [{"name": "sgl", "type": "server", "launch": launch, "health_timeout_s": 20,
                     "flush_cache": "POST /flush_cache", "env": {"FAKE_REQUEST_LOG": str(tmp_path / "requests.log")}}],
        "axes": {"kv": ["bf16", "fp8_e4m3"], "backends": ["triton+flashinfer", "fa3"], "concurrency": [2, 8]},
        "accuracy_concurrency": 2,
        "suites": SUITES,
        "load": LOAD,
        "data_dir": str(make_data(tmp_path)),
        "baseline": {"kv_dtype": "bf16"},
        "aa_control": False,
    }
    raw.update(over)
    return raw


def test_sglang_sweep_conformance(tmp_path):
    from kvbench.harness.sweep.config import parse_config

    model = make_model(tmp_path)
    raw = sweep(tmp_path, str(model))
    raw["targets"][0]["tp_size"] = 2
    assert parse_config(raw).targets[0].engine_kind == "sglang"  # sniffed from the launch text
    t0 = time.monotonic()
    outcome = run(raw, tmp_path / "run", parallel=2, devices=[0, 1, 2, 3])  # two tp=2 servers side by side
    elapsed = time.monotonic() - t0
    cells = read_cells(tmp_path / "run")
    assert outcome.ok and len(cells) == 8 and all(c.status == "done" for c in cells), [c.summary.get("error") for c in cells]
    assert elapsed < 60

    # every cell option reached the server verbatim (one launch per group: its first cell holds the launch output)
    launches = {}
    for c in cells:
        for a in fake_args(c.server_log):
            launches.setdefault(c.group, []).append(a["args"])
            # the devices the runner gave the group reach the server as CUDA_VISIBLE_DEVICES
            assert a["env"]["CUDA_VISIBLE_DEVICES"] in ("0,1", "2,3")
            assert a["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, c.summary["target"]["devices"]))
    assert len(launches) == 4 and all(len(v) == 1 for v in launches.values())
    for (_, _, prefill, decode, kv), [args] in launches.items():
        assert (args["kv_cache_dtype"], args["prefill_attention_backend"], args["decode_attention_backend"]) == (kv, prefill, decode)
        assert args["model_path"] == str(model) and args["enable_metrics"] and args["max_running_requests"] == 4
        assert args["tp_size"] == 2

    # capacity.json from the server's own lines, for every cell
    for c in cells:
        cap = c.capacity
        assert cap is not None and cap["engine"] == "sglang" and cap["source"].startswith("server log")
        kv_bytes = 1 if c.config["kv_dtype"] == "fp8_e4m3" else 2
        assert cap["tokens"] == cap["max_total_num_tokens"] == expected_tokens(kv_bytes, tp=2)
        assert cap["tp_size"] == 2 and cap["kv_bytes_ranks"] == 2  # both ranks' pools counted once each
        assert (cap["max_running_requests"], cap["context_len"], cap["page_size"]) == (4, 4096, 1)
        assert cap["kv_dtype"] == c.config["kv_dtype"] and cap["max_concurrency_kv"] == cap["tokens"] // 4096
        assert cap["max_concurrency"] == 4  # capped by --max-running-requests 4
        assert cap["bytes_per_token"] == pytest.approx(2 * 4 * 2 * 64 * kv_bytes, rel=0.02)
        assert cap["metrics"]["max_total_num_tokens"] == cap["tokens"]  # /metrics agrees with the log
    by_kv = {c.config["kv_dtype"]: c.capacity["tokens"] for c in cells}
    assert by_kv["fp8_e4m3"] == 2 * by_kv["bf16"]

    # queueing measured from /metrics: at most 4 run (--max-running-requests), the rest wait
    for c in cells:
        load = c.summary["load"]
        sm = load["server_metrics"]
        assert sm["available"] and sm["samples"] >= 3, sm
        assert sm["max_running"] <= 4 and sm["preemptions"] == 0
        if c.config["concurrency"] == 2:
            assert sm["max_running_without_queueing"] == 2 and sm["max_waiting"] == 0
        else:
            assert sm["max_running"] == 4 and sm["max_waiting"] >= 1
            assert sm["max_running_without_queueing"] is None or sm["max_running_without_queueing"] <= 4
        assert 0 < sm["kv_usage_max"] < 0.01
        assert load["completed"] == 16 and load["failed"] == 0 and load["token_count_source"] == "usage"
        assert all(r["output_tokens"] == 16 for r in c.requests)

    # items: scored from the answer text, reasoning kept apart, request options recorded
    acc = [c for c in cells if c.config["concurrency"] == 2]
    assert len(acc) == 4 and not any(c.items for c in cells if c.config["concurrency"] == 8)
    for c in acc:
        got = {(r["suite"], r["item_id"]): r["correct"] for r in c.items}
        assert got == EXPECTED_CORRECT
        for r in c.items:
            assert r["error"] is None and r["finish_reason"] == "stop" and r["output_tokens"] > 0
            assert "Thinking" not in r["raw_output"] and "<think>" not in r["raw_output"]
            assert r["reasoning"] == "Thinking about the question"  # sglang's reasoning_content, apart
            assert r["request_options"]["max_tokens"] == 256
        assert c.summary["suites"]["aime25"]["accuracy"] == pytest.approx(2 / 3)

    # the prefix cache was flushed before every cell's suites and load test
    reqs = request_log(tmp_path / "requests.log")
    assert sum(1 for r in reqs if r["route"] == "/flush_cache") == 2 * len(cells)
    chats = [r["body"] for r in reqs if r["route"] == "/v1/chat/completions"]
    assert len(chats) == 4 * 6 and all(b["max_tokens"] == 256 for b in chats)
    loads = [r["body"] for r in reqs if r["route"] == "/v1/completions"]
    assert loads and all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] for b in loads)

    # the report shows server capacity like embedded capacity, with the server's admission limit beside it
    from typer.testing import CliRunner

    from kvbench.harness.cli import app

    res = CliRunner().invoke(app, ["report", str(tmp_path / "run"), "--out", str(tmp_path / "rep"), "--baseline", "kv_dtype=bf16,prefill_backend=triton"])
    assert res.exit_code == 0, res.output
    md = (tmp_path / "rep" / "report.md").read_text()
    cap_section = md.split("### KV capacity by format", 1)[1].split("###", 1)[0]
    assert "running limit" in cap_section and "server log" in cap_section
    rows = [ln for ln in cap_section.splitlines() if ln.startswith("|") and ("fp8_e4m3" in ln or "bf16" in ln)]
    assert rows and all(f"| {expected_tokens(1 if 'fp8_e4m3' in ln.split('|')[2] else 2, tp=2):,} |" in ln
                        and "| 4 |" in ln for ln in rows), rows


def test_bad_model_path_fails_its_group_fast_and_resume_finishes_it(tmp_path):
    good = make_model(tmp_path, "good")
    missing = tmp_path / "later"
    raw = sweep(tmp_path, [str(good), str(missing)], suites=[], axes={"kv": ["fp8_e4m3"], "backends": ["triton"], "concurrency": [2, 4]},
                load={**LOAD, "num_prompts": 4}, baseline={})
    t0 = time.monotonic()
    outcome = run(raw, tmp_path / "run")
    assert time.monotonic() - t0 < 10  # the good group's two load tests and the bad group's failed start
    cells = read_cells(tmp_path / "run")
    ok = [c for c in cells if c.config["model"] == str(good)]
    bad = [c for c in cells if c.config["model"] == str(missing)]
    assert len(ok) == len(bad) == 2 and all(c.status == "done" for c in ok) and all(c.status == "failed" for c in bad)
    for c in bad:  # every cell of the group, with one line saying so and the engine's own error from the log tail
        err = c.summary["error"]
        assert err.splitlines()[0].startswith("target 'sgl' failed to start: TargetError: server exited with code 1")
        assert f"OSError: {missing} is not a local folder" in err
    assert sorted(outcome.failed) == sorted(c.key for c in bad)
    before = {c.key: {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run" / "cells" / c.key).iterdir()} for c in ok}

    make_model(tmp_path, "later")
    outcome = run(raw, tmp_path / "run", resume=True)
    assert outcome.ok and sorted(outcome.skipped) == sorted(c.key for c in ok) and sorted(outcome.done) == sorted(c.key for c in bad)
    after = {c.key: {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run" / "cells" / c.key).iterdir()} for c in ok}
    assert after == before  # the done cells were not redone
    again = [c for c in read_cells(tmp_path / "run") if c.config["model"] == str(missing)]
    assert all(c.status == "done" and c.capacity["tokens"] == expected_tokens(1) for c in again)


def test_mistyped_flag_fails_like_argparse_and_metrics_need_enable_metrics(tmp_path):
    from kvbench.harness.config_checks import SweepConfigError

    model = make_model(tmp_path)
    typo = LAUNCH.replace("--kv-cache-dtype {kv_dtype}", "--kv-cache-dtpye {kv_dtype}")
    bad_value = LAUNCH.replace("--tp-size {tp_size}", "--tp-size {tp_size} --schedule-policy fifo")
    no_metrics = LAUNCH.replace(" --enable-metrics", "")
    raw = sweep(tmp_path, str(model), suites=[], axes={"kv": ["bf16"], "backends": ["triton"], "concurrency": [2]},
                load={**LOAD, "num_prompts": 4}, baseline={})
    raw["targets"] = [{"name": "typo", "type": "server", "launch": typo, "health_timeout_s": 20},
                      {"name": "badvalue", "type": "server", "launch": bad_value, "health_timeout_s": 20},
                      {"name": "plain", "type": "server", "launch": no_metrics, "health_timeout_s": 20}]
    run(raw, tmp_path / "run")
    cells = {c.config["target"]: c for c in read_cells(tmp_path / "run")}
    err = cells["typo"].summary["error"]
    assert cells["typo"].status == "failed" and "exited with code 2" in err
    assert "launch_server.py: error: unrecognized arguments: --kv-cache-dtpye bf16" in err
    err = cells["badvalue"].summary["error"]
    assert "exited with code 2" in err and "argument --schedule-policy: invalid choice: 'fifo'" in err
    plain = cells["plain"]
    assert plain.status == "done" and plain.summary["load"]["server_metrics"] == {"available": False}
    assert plain.capacity["source"] == "server log" and plain.capacity["tokens"] == expected_tokens(2)  # no /metrics to merge

    # a template that cannot carry a cell's KV dtype (the value hard-coded) is refused before anything starts
    raw["targets"] = [{"name": "fixed", "type": "server", "launch": LAUNCH.replace("{kv_dtype}", "fp8_e4m3")}]
    with pytest.raises(SweepConfigError, match=r"axes\.kv\[0\].*kv_dtype 'bf16' does not reach target 'fixed'.*"
                                               r"for sglang: --kv-cache-dtype \{kv_dtype\}"):
        run(raw, tmp_path / "run2")
    assert not (tmp_path / "run2").exists()


def test_session_of_an_sglang_server_errors_and_capacity(tmp_path):
    """open_server straight: the engine's 400 body reaches the client as an http error with its message; the
    session's capacity() reads this launch's lines (not an earlier launch's in the same log) and /metrics."""
    from kvbench.core.client import GenRequest, SamplingParams
    from kvbench.harness.sweep.config import parse_config
    from kvbench.harness.targets import open_server

    model = make_model(tmp_path)
    spec = parse_config({"targets": [{"name": "sgl", "type": "server", "launch": LAUNCH, "health_timeout_s": 20}]}).targets[0]
    cell = {"model": str(model), "target": "sgl", "prefill_backend": "triton", "decode_backend": "triton",
            "kv_dtype": "fp8_e4m3", "kv_scales": "unit", "concurrency": 1}
    log = tmp_path / "srv.log"
    log.write_text("$ an earlier launch\n[TP0] max_total_num_tokens=11, max_prefill_tokens=1, max_running_requests=1, context_len=8\n")
    with open_server(spec, cell, log) as s:
        r = s.client.generate(GenRequest(messages=[{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=5000)))
        assert r.finish_reason == "error" and r.error_kind == "http"
        assert r.error.startswith("HTTP 400") and "maximum context length of 4096 tokens" in r.error
        ok = s.client.generate(GenRequest(messages=[{"role": "user", "content": "ANSWER=9 in \\boxed{}"}],
                                          params=SamplingParams(max_tokens=64)))
        assert ok.error is None and ok.text == "The final answer is \\boxed{9}" and ok.reasoning == "Thinking about the question"
        assert ok.output_tokens == 4 + 5 and ok.prompt_tokens == 3  # 4 reasoning + 5 answer words
        cap = s.capacity()
    assert cap["tokens"] == expected_tokens(1) and cap["source"] == "server log+metrics" and cap["kv_dtype"] == "fp8_e4m3"
    assert cap["metrics"] == {"max_total_num_tokens": cap["tokens"], "page_size": 1, "num_pages": cap["tokens"],
                              "tokens": cap["tokens"]}


def test_legacy_sglang_lines_still_give_capacity(tmp_path):
    model = make_model(tmp_path)
    raw = sweep(tmp_path, str(model), suites=[], axes={"kv": ["fp8_e4m3"], "backends": ["triton"], "concurrency": [2]},
                load={**LOAD, "num_prompts": 4}, baseline={})
    raw["targets"][0]["env"]["FAKE_SGLANG_STYLE"] = "legacy"
    assert run(raw, tmp_path / "run").ok
    [cell] = read_cells(tmp_path / "run")
    assert "#tokens" not in cell.server_log and "max_total_num_tokens=" in cell.server_log
    assert cell.capacity["tokens"] == expected_tokens(1) and cell.capacity["max_running_requests"] == 4
    assert "kv_bytes" not in cell.capacity  # the old lines carry no pool size in bytes

"""End to end on the embedded default model (CPU): the real suites, fidelity, load generator (through an
in-process HTTP server) and capacity, in a two-format, one-concurrency sweep."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.harness.matrix import expand
from kvbench.harness.runner import run_sweep
from kvbench.core.records import ITEM_FIELDS, REQUEST_FIELDS
from kvbench.core.store import RunStore
from kvbench.harness.sweep.config import parse_config

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_embedded_sweep_end_to_end(tmp_path):
    if not (DATA / "gsm8k_test.jsonl").exists():
        pytest.fail(f"test data missing: {DATA}/gsm8k_test.jsonl")
    cfg = parse_config({
        "name": "e2e",
        "engine": {"device": "cpu", "dtype": "float32", "kv_budget_gb": 0.05, "max_model_len": 1024, "max_running": 4},
        "axes": {"kv": ["bf16", {"dtype": "fp8_e4m3", "scales": "unit"}], "concurrency": [2]},
        "suites": [{"name": "gsm8k_chat", "limit": 2, "max_tokens": 12},
                   {"name": "fidelity", "limit": 1, "params": {"top_k": 8, "greedy_tokens": 4}}],
        "load": {"num_prompts": 2, "input_len": 16, "output_len": 4, "warmup": 0, "metrics_interval_s": 0},
        "data_dir": str(DATA),
    })
    out = run_sweep(cfg, tmp_path / "run", progress=False)
    st = RunStore(tmp_path / "run")
    errors = {k: st.read_json(k, "summary")["error"] for k in out.failed}
    assert out.ok, errors
    for c in expand(cfg):
        items = st.read_items(c.key)
        assert [r["suite"] for r in items] == ["gsm8k_chat", "gsm8k_chat", "fidelity"]
        assert all(set(ITEM_FIELDS) <= set(r) for r in items)
        fid = items[-1]
        assert fid["correct"] is None and {"kl_mean", "top1_agree", "first_divergence"} <= set(fid["scores"])
        cap = st.read_json(c.key, "capacity")
        assert cap["kv_dtype"] == c.config["kv_dtype"] and cap["tokens"] > 0 and cap["bytes_per_token"] > 0
        s = st.read_json(c.key, "summary")
        assert s["suites"]["gsm8k_chat"]["n"] == 2
        if c.config.get("aa_control"):  # the A/A control (on by default): accuracy only, at concurrency 1
            assert c.config["concurrency"] == 1 and st.read_requests(c.key) == [] and s["load"] is None
            continue
        reqs = st.read_requests(c.key)
        assert len(reqs) == 2 and all(r["success"] and set(REQUEST_FIELDS) <= set(r) for r in reqs)
        assert s["load"]["completed"] == 2
    bf16, fp8, aa = expand(cfg)
    assert aa.config["aa_control"] is True
    # the baseline rerun under other batching, on the same items (its outputs may differ: that is the noise)
    ids = [(r["suite"], r["item_id"], r["prompt_hash"]) for r in st.read_items(bf16.key)]
    assert ids == [(r["suite"], r["item_id"], r["prompt_hash"]) for r in st.read_items(aa.key)]
    kl_ref = st.read_items(bf16.key)[-1]["scores"]["kl_mean"]
    assert abs(kl_ref) < 1e-3  # the reference against itself
    cap16, cap8 = st.read_json(bf16.key, "capacity"), st.read_json(fp8.key, "capacity")
    assert cap8["bytes_per_token"] == pytest.approx(cap16["bytes_per_token"] / 2)
    assert len(list((tmp_path / "run" / "fidelity").glob("*.npz"))) == 1  # one reference pass per run

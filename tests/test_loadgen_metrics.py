"""Serving metrics exactly as docs/design.md §9 defines them, on hand-made records; datasets and config checks."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvbench.harness.loadgen.run import LoadConfig, format_block, jsonable
from kvbench.harness.loadgen.datasets import random_items, sharegpt_items
from kvbench.core.serving_metrics import peak_concurrency, peak_output_throughput, percentile, summarize
from kvbench.harness.loadgen.server_metrics import parse_prometheus


def _rec(rid, start, ttft, itl, out_tokens, prompt=10, ok=True):
    latency = ttft + sum(itl)
    tpot = (latency - ttft) / (out_tokens - 1) if ok and out_tokens > 1 else None
    return {"request_id": rid, "success": ok, "error": None if ok else "boom", "prompt_tokens": prompt,
            "output_tokens": out_tokens, "start_s": start, "ttft_s": ttft if ok else None, "latency_s": latency,
            "itl_s": itl if ok else [], "tpot_s": tpot}


RECS = [
    _rec("a", 0.0, 0.10, [0.02, 0.03, 0.05], 4),
    _rec("b", 0.05, 0.20, [0.01, 0.01], 3),
    _rec("c", 0.50, 0.05, [0.04], 2, prompt=30),
    _rec("d", 0.60, 0.30, [], 1),
    _rec("e", 0.70, 0.0, [], 0, ok=False) | {"latency_s": 0.5},  # failed requests still occupy a slot
]


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.random(n).tolist()
        for q in (0, 50, 90, 95, 99, 100):
            assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert math.isnan(percentile([], 50))


def test_summary_definitions():
    s = summarize(RECS, duration_s=2.0, slo={"ttft_ms": 350, "tpot_ms": 35})
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["total_input_tokens"] == 10 + 10 + 30 + 10 and s["total_output_tokens"] == 4 + 3 + 2 + 1
    assert s["request_throughput"] == pytest.approx(2.0) and s["output_throughput"] == pytest.approx(5.0)
    assert s["total_token_throughput"] == pytest.approx(35.0)
    assert s["mean_ttft_ms"] == pytest.approx(1000 * (0.10 + 0.20 + 0.05 + 0.30) / 4)
    # TPOT = (latency - ttft) / (output_tokens - 1), only for requests with >1 output token
    tpots = [0.10 / 3, 0.02 / 2, 0.04 / 1]
    assert s["mean_tpot_ms"] == pytest.approx(1000 * np.mean(tpots))
    assert s["p99_tpot_ms"] == pytest.approx(1000 * np.percentile(tpots, 99))
    # ITL pools every gap of every request
    gaps = [0.02, 0.03, 0.05, 0.01, 0.01, 0.04]
    assert s["median_itl_ms"] == pytest.approx(1000 * np.median(gaps)) and s["max_itl_ms"] == pytest.approx(50)
    e2e = [0.20, 0.22, 0.09, 0.30]
    assert s["p90_e2el_ms"] == pytest.approx(1000 * np.percentile(e2e, 90))
    # goodput: a (tpot 33.3 ms) and b pass, c (tpot 40 ms) fails, d (one token: no TPOT) passes on TTFT
    assert s["good_requests"] == 3 and s["request_goodput"] == pytest.approx(1.5)
    assert summarize(RECS, 2.0, slo={"e2el_ms": 210})["good_requests"] == 2  # a (200 ms) and c (90 ms)


def test_peak_concurrency_and_throughput():
    assert peak_concurrency(RECS) == 2  # a and b overlap, d and e overlap
    three = RECS + [_rec("f", 0.61, 0.2, [0.1], 2)]
    assert peak_concurrency(three) == 3
    # back-to-back requests do not overlap
    assert peak_concurrency([_rec("x", 0.0, 0.5, [0.5], 2), _rec("y", 1.0, 0.5, [], 1)]) == 1
    # tokens land at start + ttft + cumsum(itl); with 0.1 s buckets, [0.2, 0.3) holds a@0.20 and b@0.25, 0.26, 0.27
    assert peak_output_throughput(RECS, 0.1) == pytest.approx(4 / 0.1)
    assert peak_output_throughput(RECS, 1.0) == pytest.approx(10.0)
    # each chunk carries output_tokens / chunks tokens
    assert peak_output_throughput([_rec("z", 0.0, 0.5, [], 1) | {"output_tokens": 8}], 1.0) == pytest.approx(8.0)


def test_summary_is_json_clean_and_block_prints():
    s = jsonable(summarize([RECS[-1]], 1.0))
    json.dumps(s, allow_nan=False)
    s = summarize(RECS, 2.0)
    block = format_block(s)
    assert "Serving Benchmark Result" in block and "Mean TTFT (ms):" in block and "P99 ITL (ms):" in block
    assert f"{s['mean_ttft_ms']:.2f}" in block


def test_block_names_kernel_compiles_when_the_server_counts_them():
    s = summarize(RECS, 2.0)
    metrics = {"available": True, "max_running": 2, "max_running_without_queueing": 2, "kv_usage_max": 0.1,
               "preemptions": 0}
    assert "Kernel compiles" not in format_block({**s, "server_metrics": {**metrics, "kernel_compiles": None}})
    block = format_block({**s, "server_metrics": {**metrics, "kernel_compiles": 3}})
    assert "Kernel compiles (stalls):               3" in block
    assert "Engine busy" not in block
    steps = {"prefill": {"steps": 4, "seconds": 1.0, "tokens": 400, "ms_per_step": 250.0},
             "decode": {"steps": 100, "seconds": 1.0, "tokens": 800, "ms_per_step": 10.0},
             "window_s": 4.0, "busy_fraction": 0.5}
    block = format_block({**s, "server_metrics": {**metrics, "engine_steps": steps}})
    assert "Engine busy (fraction of the run):      0.500" in block
    assert "Prefill steps (n, ms each, tok each):   4, 250.00, 100" in block
    assert "Decode steps (n, ms each, tok each):    100, 10.00, 8" in block and "Mixed steps" not in block


def test_random_dataset_is_seeded_and_bounded():
    a = random_items(50, 100, 20, 0.5, seed=1, vocab_size=5000)
    b = random_items(50, 100, 20, 0.5, seed=1, vocab_size=5000)
    c = random_items(50, 100, 20, 0.5, seed=1, salt="cell-2", vocab_size=5000)
    assert [x.prompt for x in a] == [x.prompt for x in b] and [x.prompt for x in a] != [x.prompt for x in c]
    assert all(50 <= len(x.prompt) == x.prompt_len <= 150 and 10 <= x.output_len <= 30 for x in a)
    assert len({len(x.prompt) for x in a}) > 5
    assert all(0 <= t < 5000 for x in a for t in x.prompt)
    fixed = random_items(5, 64, 8, 0.0, vocab_size=5000)
    assert {len(x.prompt) for x in fixed} == {64} and {x.output_len for x in fixed} == {8}
    with pytest.raises(ValueError, match="tokenizer"):
        random_items(2, 8, 8, as_text=True)


def test_sharegpt_dataset(tmp_path):
    convs = [{"conversations": [{"from": "human", "value": f"question number {i} " * 3}, {"from": "gpt", "value": "ans " * (i + 1)}]} for i in range(10)]
    convs.append({"conversations": [{"from": "human", "value": "only one turn"}]})
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    items = sharegpt_items(str(path), 4, seed=0, output_len=7)
    assert len(items) == 4 and all(isinstance(x.prompt, str) and x.output_len == 7 for x in items)
    assert [x.prompt for x in items] == [x.prompt for x in sharegpt_items(str(path), 4, seed=0, output_len=7)]
    with pytest.raises(ValueError, match="only 10"):
        sharegpt_items(str(path), 50, output_len=7)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="list"):
        sharegpt_items(str(bad), 1, output_len=7)


@pytest.mark.parametrize("kw", [dict(num_prompts=0), dict(max_concurrency=0), dict(request_rate=0), dict(burstiness=0),
                                dict(dataset="nope"), dict(dataset="sharegpt"), dict(api="rest"), dict(range_ratio=1.5, dataset="random")])
def test_config_rejects_bad_values(kw):
    if kw.get("range_ratio"):
        with pytest.raises(ValueError):
            random_items(2, 8, 8, kw["range_ratio"])
        return
    with pytest.raises(ValueError):
        LoadConfig(**kw)


def test_parse_prometheus_sums_labels():
    text = "# HELP x y\nvllm:num_requests_running{model_name=\"a\"} 3\nvllm:num_requests_running{model_name=\"b\"} 2\nfoo 1.5\nbad line x\n"
    assert parse_prometheus(text) == {"vllm:num_requests_running": 5.0, "foo": 1.5}


def test_replicas_step_times_add_up_per_kind():
    """Data-parallel replicas (harness/loadgen/replicas.py): each replica's engine step counters added per kind,
    ms per step recomputed from the sums, the busy fraction their mean; replicas without them are left out."""
    from kvbench.harness.loadgen.replicas import combine_server_metrics

    def one(pre_n, pre_s, dec_n, dec_s, busy):
        return {"available": True, "samples": 3, "interval_s": 0.5, "preemptions": 0, "kernel_compiles": 0,
                "engine_steps": {"prefill": {"steps": pre_n, "seconds": pre_s, "tokens": 100 * pre_n,
                                             "ms_per_step": 1000 * pre_s / pre_n},
                                 "decode": {"steps": dec_n, "seconds": dec_s, "tokens": 8 * dec_n,
                                            "ms_per_step": 1000 * dec_s / dec_n},
                                 "window_s": 4.0, "busy_fraction": busy}}

    vllm_like = {"available": True, "samples": 3, "interval_s": 0.5, "preemptions": 1, "engine_steps": None}
    out = combine_server_metrics([one(2, 1.0, 100, 1.0, 0.5), one(4, 1.0, 300, 2.0, 0.75), vllm_like],
                                 ["a", "b", "c"], concurrent=True)
    es = out["engine_steps"]
    assert es["prefill"] == {"steps": 6, "seconds": 2.0, "tokens": 600, "ms_per_step": pytest.approx(2000 / 6)}
    assert es["decode"]["steps"] == 400 and es["decode"]["ms_per_step"] == pytest.approx(7.5)
    assert es["busy_fraction"] == pytest.approx(0.625) and "mixed" not in es
    assert combine_server_metrics([vllm_like], ["c"], concurrent=True)["engine_steps"] is None

"""Server capacity from start-up logs and /metrics (harness/server_capacity.py), on log excerpts shaped like
those of several SGLang and vLLM versions, with their prefixes, rank tags and colours."""

from __future__ import annotations

from dataclasses import fields

import pytest

from kvbench.harness.loadgen.server_metrics import parse_prometheus
from kvbench.harness.server_admission import admission_limit
from kvbench.harness.server_capacity import (merge_capacity, parse_metrics_capacity, parse_startup_log, server_capacity,
                                             sniff_engine)
from kvbench.runtime.engine_api import CapacityReport

CAPACITY_KEYS = [f.name for f in fields(CapacityReport) if f.name != "extra"]

SGLANG_NEW = """\
[2025-11-04 05:27:00] server_args=ServerArgs(model_path='/m/llama', tokenizer_path='/m/llama', kv_cache_dtype='fp8_e4m3', tp_size=2, dp_size=1, page_size=16, attention_backend=None)
[2025-11-04 05:27:13 TP1] KV Cache is allocated. #tokens: 524288, K size: 8.00 GB, V size: 8.00 GB
[2025-11-04 05:27:13 TP0] KV Cache is allocated. #tokens: 524288, K size: 8.00 GB, V size: 8.00 GB
[2025-11-04 05:27:14 TP0] max_total_num_tokens=524288, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=4096, context_len=131072, available_gpu_mem=12.34 GB
[2025-11-04 05:27:20] The server is fired up and ready to roll!
"""

SGLANG_MLA_DP = """\
[2025-11-04 05:27:13 DP0 TP0 EP0] KV Cache is allocated. #tokens: 100000, KV size: 4.00 GB
[2025-11-04 05:27:13 DP1 TP1 EP1] KV Cache is allocated. #tokens: 90000, KV size: 3.60 GB
"""

SGLANG_LEGACY = """\
[gpu=0] max_total_num_tokens=200000, max_prefill_tokens=16384, max_running_requests=2000, context_len=8192
[gpu=1] max_total_num_tokens=199000, max_prefill_tokens=16384, max_running_requests=2000, context_len=8192
"""

SGLANG_OLDEST = "Rank 0: max_total_num_token=30000, max_prefill_num_token=4096, context_len=2048, \n"

VLLM_V1 = """\
(APIServer pid=1) \x1b[32mINFO\x1b[0m 08-20 10:00:00 [api_server.py:1805] vLLM API server version 0.10.1.1
(APIServer pid=1) INFO 08-20 10:00:00 [utils.py:326] non-default args: {'model_tag': 'Qwen/Qwen3-8B', 'kv_cache_dtype': 'fp8', 'max_num_seqs': 64, 'tensor_parallel_size': 2}
(EngineCore_DP0 pid=258) \x1b[32mINFO\x1b[0m 08-20 10:00:01 [core.py:74] Initializing a V1 LLM engine (v0.10.1.1) with config: model='Qwen/Qwen3-8B', speculative_config=None, dtype=torch.bfloat16, max_seq_len=32768, tensor_parallel_size=2, pipeline_parallel_size=1, kv_cache_dtype=fp8, seed=0
(VllmWorker TP0 pid=300) INFO 08-20 10:00:30 [gpu_worker.py:276] Available KV cache memory: 4.00 GiB
(VllmWorker TP1 pid=301) INFO 08-20 10:00:30 [gpu_worker.py:276] Available KV cache memory: 4.00 GiB
(EngineCore_DP0 pid=258) INFO 08-20 10:00:31 [kv_cache_utils.py:849] GPU KV cache size: 131,072 tokens
(EngineCore_DP0 pid=258) INFO 08-20 10:00:31 [kv_cache_utils.py:853] Maximum concurrency for 32,768 tokens per request: 4.00x
(APIServer pid=1) INFO 08-20 10:00:40 [loggers.py:142] Engine 000: vllm cache_config_info with initialization after num_gpu_blocks is: 8192
"""

VLLM_V0 = """\
INFO 10-01 12:00:00 api_server.py:528] vLLM API server version 0.6.3
INFO 10-01 12:00:05 gpu_executor.py:122] # GPU blocks: 27319, # CPU blocks: 2048
INFO 10-01 12:00:05 gpu_executor.py:126] Maximum concurrency for 4096 tokens per request: 106.71x
"""

VLLM_CUDA_BLOCKS = """\
INFO 12-01 12:00:05 executor_base.py:110] # cuda blocks: 2000, # CPU blocks: 512
INFO 12-01 12:00:05 executor_base.py:115] Maximum concurrency for 2048 tokens per request: 15.62x
"""

VLLM_MERGED = "(EngineCore pid=258) INFO kv_cache_utils.py:1708 GPU KV cache size: 34,952 tokens, Maximum concurrency for 8,192 tokens per request: 4.27x\n"

VLLM_DP2 = """\
(EngineCore_DP0 pid=10) INFO [kv_cache_utils.py:1087] GPU KV cache size: 50,000 tokens
(EngineCore_DP1 pid=11) INFO [kv_cache_utils.py:1087] GPU KV cache size: 48,000 tokens
(EngineCore_DP0 pid=10) INFO [kv_cache_utils.py:1091] Maximum concurrency for 4,096 tokens per request: 12.21x
(EngineCore_DP1 pid=11) INFO [kv_cache_utils.py:1091] Maximum concurrency for 4,096 tokens per request: 11.72x
"""


def test_sglang_current_lines_give_every_capacity_key():
    cap = parse_startup_log(SGLANG_NEW, kv_dtype="fp8_e4m3")
    assert cap["engine"] == "sglang" and cap["source"] == "server log"
    assert set(CAPACITY_KEYS) <= set(cap), set(CAPACITY_KEYS) - set(cap)
    assert cap["tokens"] == cap["max_total_num_tokens"] == 524288
    assert (cap["max_running_requests"], cap["context_len"], cap["chunked_prefill_size"]) == (4096, 131072, 8192)
    assert cap["max_prefill_tokens"] == 16384 and cap["available_gpu_mem_gb"] == 12.34
    assert (cap["page_size"], cap["num_pages"], cap["tp_size"]) == (16, 524288 // 16, 2)
    assert cap["max_concurrency"] == 4
    assert cap["kv_bytes"] == 32 * 2**30 and cap["kv_bytes_ranks"] == 2  # two TP ranks, each 8 GB K + 8 GB V
    assert cap["bytes_per_token"] == pytest.approx(32 * 2**30 / 524288)
    assert cap["kv_dtype"] == "fp8_e4m3" and cap["kv_cache_dtype"] == "fp8_e4m3"


def test_sglang_mla_pool_and_data_parallel_ranks_add_up():
    cap = parse_startup_log(SGLANG_MLA_DP)
    assert cap["engine"] == "sglang" and cap["tokens"] == 190000
    assert cap["kv_bytes"] == int(round(7.6 * 2**30))
    assert "max_concurrency" not in cap  # no context length printed


@pytest.mark.parametrize("text, tokens, running, ctx", [(SGLANG_LEGACY, 199000, 2000, 8192), (SGLANG_OLDEST, 30000, None, 2048)])
def test_sglang_older_lines(text, tokens, running, ctx):
    cap = parse_startup_log(text, engine_kind="sglang")
    assert cap["tokens"] == tokens and cap.get("max_running_requests") == running and cap["context_len"] == ctx
    assert cap["max_concurrency"] == tokens // ctx
    assert "kv_bytes" not in cap and "bytes_per_token" not in cap


def test_vllm_v1_with_colours_prefixes_and_tp_workers():
    cap = parse_startup_log(VLLM_V1, engine_kind="generic", kv_dtype="fp8_e4m3")
    assert cap["engine"] == "vllm" and cap["version"] == "0.10.1.1"
    assert set(CAPACITY_KEYS) <= set(cap), set(CAPACITY_KEYS) - set(cap)
    assert cap["tokens"] == 131072 and cap["num_gpu_blocks"] == cap["num_pages"] == 8192
    assert cap["block_size"] == cap["page_size"] == 16
    assert (cap["context_len"], cap["max_model_len"], cap["max_concurrency"]) == (32768, 32768, 4)
    assert cap["max_concurrency_at_len"] == 4.0 and cap["tp_size"] == 2 and cap["max_num_seqs"] == 64
    assert cap["kv_cache_memory_gib"] == 4.0 and cap["kv_bytes"] == 8 * 2**30  # per worker x 2 TP workers
    assert cap["bytes_per_token"] == pytest.approx(8 * 2**30 / 131072)
    assert cap["kv_dtype"] == "fp8_e4m3" and cap["kv_cache_dtype"] == "fp8"


@pytest.mark.parametrize("text, tokens, blocks, block, ctx, conc", [
    (VLLM_V0, 27319 * 16, 27319, 16, 4096, 106),
    (VLLM_CUDA_BLOCKS, 2000 * 16, 2000, 16, 2048, 15),
    (VLLM_MERGED, 34952, None, None, 8192, 4),
    (VLLM_DP2, 98000, None, None, 4096, 23),
])
def test_vllm_other_generations(text, tokens, blocks, block, ctx, conc):
    cap = parse_startup_log(text)
    assert cap["engine"] == "vllm"
    assert (cap["tokens"], cap.get("num_gpu_blocks"), cap.get("block_size")) == (tokens, blocks, block)
    assert (cap["context_len"], cap["max_concurrency"]) == (ctx, conc)


def test_kvbench_serve_line():
    report = CapacityReport(kv_dtype="nvfp4", page_size=16, num_pages=2589, tokens=41424, bytes_per_token=6480.0,
                            kv_bytes=2**28, context_len=2304, max_concurrency=17)
    cap = parse_startup_log(f"INFO kvbench.runtime.engine: {report.log_line()}\n")
    assert cap == {"engine": "kvbench", "tokens": 41424, "kv_cache_dtype": "nvfp4", "kv_bytes": 2**28, "max_concurrency": 17,
                   "context_len": 2304, "source": "server log", "kv_dtype": "nvfp4", "bytes_per_token": round(2**28 / 41424, 3)}


def test_the_last_launch_of_a_log_counts_and_unknown_logs_give_none():
    two = "$ launch one\n" + SGLANG_LEGACY + "$ launch two\n" + SGLANG_NEW
    assert parse_startup_log(two)["tokens"] == 524288
    relaunch_without_lines = "$ launch one\n" + SGLANG_NEW + "$ launch two\nTraceback: boom\n"
    assert parse_startup_log(relaunch_without_lines) is None
    assert parse_startup_log("Uvicorn running on http://0.0.0.0:8000\n") is None
    assert parse_startup_log(VLLM_V1, engine_kind="sglang") is None  # a declared engine is taken at its word
    assert sniff_engine(SGLANG_NEW) == "sglang" and sniff_engine(VLLM_V0) == "vllm"
    assert sniff_engine("starting vllm ...") == "vllm" and sniff_engine("hello") is None


METRICS_VLLM = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="fp8",enable_prefix_caching="True",num_cpu_blocks="None",num_gpu_blocks="8192"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""

METRICS_SGLANG = """\
sglang:max_total_num_tokens{engine_type="unified",model_name="m",tp_rank="0"} 524288.0
cache_config_info{num_pages="32768",page_size="16"} 1.0
"""


def test_metrics_capacity_and_merge():
    m = parse_metrics_capacity(METRICS_VLLM)
    assert m == {"num_gpu_blocks": 8192, "block_size": 16, "kv_cache_dtype": "fp8", "tokens": 131072, "num_pages": 8192,
                 "page_size": 16}
    s = parse_metrics_capacity(METRICS_SGLANG)
    assert s == {"max_total_num_tokens": 524288, "page_size": 16, "num_pages": 32768, "tokens": 524288}
    # the log wins; /metrics fills the gaps and is kept apart
    merged = merge_capacity(parse_startup_log(VLLM_MERGED), m, "fp8_e4m3")
    assert merged["tokens"] == 34952 and merged["block_size"] == 16 and merged["num_gpu_blocks"] == 8192
    assert merged["source"] == "server log+metrics" and merged["metrics"] == m and merged["kv_dtype"] == "fp8_e4m3"
    only = merge_capacity(None, s)
    assert only["source"] == "server metrics" and only["tokens"] == 524288 and "kv_dtype" not in only
    assert merge_capacity(None, {}) is None


def test_server_capacity_reads_the_launch_from_its_offset(tmp_path):
    log = tmp_path / "srv.log"
    log.write_text("$ old launch\n" + SGLANG_LEGACY)
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write("$ new launch\n" + SGLANG_NEW)
    assert server_capacity(log, offset=offset, kv_dtype="bf16")["tokens"] == 524288
    assert server_capacity(log, offset=offset + len("$ new launch\n") + len(SGLANG_NEW)) is None
    assert server_capacity(tmp_path / "missing.log") is None
    # an unreachable /metrics costs nothing
    assert server_capacity(log, base_url="http://127.0.0.1:9", offset=offset, timeout_s=0.5)["tokens"] == 524288


def test_prometheus_sums_queues_and_averages_kv_usage_over_engines():
    text = ('vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_running{engine="1"} 4\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:kv_cache_usage_perc{engine="1"} 0.7\n')
    got = parse_prometheus(text)
    assert got["vllm:num_requests_running"] == 7.0 and got["vllm:kv_cache_usage_perc"] == pytest.approx(0.6)


def test_kvbench_serve_scheduler_line_gives_the_admission_limit():
    report = CapacityReport(kv_dtype="fp8_e4m3", page_size=16, num_pages=40960, tokens=655360, bytes_per_token=65536.0,
                            kv_bytes=40 * 2**30, context_len=9216, max_concurrency=71)
    log = f"$ kvbench serve ...\n{report.log_line()}\nscheduler: max running 32, max batched tokens 8192\n"
    cap = parse_startup_log(log)
    assert cap["max_running_requests"] == 32
    capped = admission_limit(dict(cap))
    assert (capped["max_concurrency"], capped["max_concurrency_kv"]) == (32, 71)
    assert "max_running_requests" not in parse_startup_log(f"{report.log_line()}\n")  # older servers: no limit known

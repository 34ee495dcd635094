"""engine_perf's prefill section (``tools/engine_measure.prefill_breakdown``) on the CPU: one prefill step of the
asked shape is timed, its pages are given back, and kernel names are sorted into GEMMs, attention and the rest
(the kernel times themselves need a GPU: docs/performance.md)."""

from __future__ import annotations

import contextlib

from kvbench.runtime.config import EngineConfig
from kvbench.runtime.engine import Engine
from kvbench.tools.engine_measure import kernel_kind, prefill_breakdown

TINY = "synthetic:llama-3-8b,layers=2,hidden=64,heads=2,kv_heads=1,head_dim=32,intermediate_size=128,vocab=300"


def test_kernel_kinds():
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "gemm"
    assert kernel_kind("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT") == "gemm"
    assert kernel_kind("_prefill_kernel") == "attention"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>>") == "other"
    assert kernel_kind("_fused_rope_quant_append_kernel") == "other"


@contextlib.contextmanager
def _tiny_engine(**kw):
    e = Engine(EngineConfig(model=TINY, device="cpu", kv_budget_gb=0.01, max_model_len=128, **kw))
    try:
        yield e
    finally:
        e.shutdown()


def test_prefill_breakdown_times_the_step_and_frees_its_pages():
    with _tiny_engine(max_num_batched_tokens=96) as e:
        row = prefill_breakdown(e, seqs=3, prompt=32, iters=2)
    assert row["tokens"] == 96 and row["step_ms"] > 0 and row["tokens_per_s"] > 0
    assert e.cache.allocator.num_used == 0
    assert set(row) >= {"gemm_ms", "attention_ms", "other_ms", "kernel_ms", "kernels"}


def test_served_decode_step_counts_the_steps_between_two_runs():
    from kvbench.tools.engine_measure import served_decode_step

    with _tiny_engine(max_running=3) as e:
        row = served_decode_step(e, batch=3, ctx=40, steps=8)
    # 8 tokens per request take 7 decode steps (the first token comes from the prefill), 2 take 1: 6 in between
    assert row["steps"] == 6 and row["step_s"] > 0
    assert e.cache.allocator.num_used == 0

"""The engine with an MLA model (synthetic DeepSeek shapes, CPU): concurrent generation on the torch and
triton backends, scoring, preemption, no page leaks, capacity of the latent cache, start-up errors."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math
import time

import pytest

from kvbench.core.client import SamplingParams
from kvbench.runtime.attention.base import UnsupportedBackend
from kvbench.runtime.config import EngineConfig
from kvbench.runtime.engine import Engine
from kvbench.runtime.models.loader import load_model

MODEL = ("synthetic:deepseek-v2-lite,layers=2,hidden=128,heads=4,kv_lora_rank=64,qk_rope_head_dim=32,"
         "qk_nope_head_dim=16,v_head_dim=16,intermediate_size=192,vocab=256")
PROMPTS = [list(range(1, 12)), [200 - i for i in range(30)], [5, 6, 7], [(i * 37) % 256 for i in range(21)]]


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, seed=1)


def _engine(loaded, **kw) -> Engine:
    kw.setdefault("kv_budget_gb", 0.01)
    kw.setdefault("max_model_len", 256)
    return Engine(EngineConfig(**kw), loaded=loaded)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16"])
def test_concurrent_greedy_identical_on_torch_and_triton(loaded, kv_dtype):
    # bf16: the interpreter's float32->bf16 cast truncates (docs/design.md §12), so the Triton engine appends
    # through the unfused torch quantizer; fp16 casts are exact and use the fused append kernel.
    fused = kv_dtype == "fp16"
    outs = {}
    for be in ("torch", "triton"):
        e = _engine(loaded, kv_dtype=kv_dtype, prefill_backend=be, decode_backend=be, max_running=4, fused_append=fused)
        try:
            outs[be] = [o.token_ids for o in e.generate(PROMPTS, _greedy(12))]
            assert e.stats().running == 0 and e.cache.allocator.num_used == 0
        finally:
            e.shutdown()
    assert all(len(t) == 12 for t in outs["torch"])
    assert outs["torch"] == outs["triton"]
    # hybrid prefill/decode pairs write the same latent layout
    e = _engine(loaded, kv_dtype=kv_dtype, prefill_backend="triton", decode_backend="torch", fused_append=fused)
    try:
        assert [o.token_ids for o in e.generate(PROMPTS[:2], _greedy(12))] == outs["torch"][:2]
    finally:
        e.shutdown()


def test_score_matches_generation(loaded):
    e = _engine(loaded)
    try:
        gen = e.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1))[0]
        sc = e.score(PROMPTS[0], gen.token_ids, top_k=3)
        assert all(sc.greedy) and len(sc.logprobs) == 6
        assert all(math.isfinite(x) and x <= 0 for x in sc.logprobs)
        assert e.cache.allocator.num_used == 0
    finally:
        e.shutdown()


def test_preemption_and_chunked_prefill_keep_greedy_tokens(loaded):
    ref_e = _engine(loaded)
    try:
        ref = [o.token_ids for o in ref_e.generate(PROMPTS, _greedy(20))]
        bpt = ref_e.cache.bytes_per_token
    finally:
        ref_e.shutdown()
    # 7 pages of 16 tokens for 4 sequences of up to 50 tokens: must preempt; 8-token prefill chunks
    tiny = _engine(loaded, kv_budget_gb=7 * 16 * bpt / 2**30, max_num_batched_tokens=8, max_model_len=64)
    try:
        outs = tiny.generate(PROMPTS, _greedy(20))
        assert tiny.stats().preemptions > 0
        assert [o.token_ids for o in outs] == ref
        assert tiny.cache.allocator.num_used == 0
    finally:
        tiny.shutdown()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_steps_run_whole_through_mla_layers(loaded, backend):
    """MLA keeps the round-trip path for ``mixed_prefill``: each layer's ``forward_mla`` gets the whole mixed
    step (prefill phase, its decode rows first and flagged round-trip: decode semantics in one extend) rather
    than a decode part and a prefill part.  Prompts arrive while others decode and prefill in one chunk each
    (as in separate steps), so tokens and log-probs equal separate steps (fp8: the decode rows read their
    latent as stored)."""
    res = {}
    for mixed in (False, True):
        e = _engine(loaded, kv_dtype="fp8_e4m3", prefill_backend=backend, decode_backend=backend,
                    max_num_batched_tokens=64, mixed_prefill=mixed)
        calls, inner, got = [], e.runner.backend.forward_mla, {}

        def spy(*args):
            meta = args[-1]
            calls.append((meta.phase, meta.decode_rows, list(meta.roundtrip_seqs_cpu)))
            return inner(*args)

        e.runner.backend.forward_mla = spy
        try:
            for k, p in enumerate(PROMPTS):
                e.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1),
                              on_delta=lambda d, k=k: got.setdefault(k, []).extend(zip(d.token_ids, d.logprobs)))
                e.step()
                e.step()
            while e.step():
                pass
            res[mixed] = got
            assert e.cache.allocator.num_used == 0
        finally:
            e.shutdown()
        whole = [(n, rt) for ph, n, rt in calls if ph == "prefill" and n]
        if mixed:
            assert whole and all(rt[:n] == [True] * n and len(rt) > n for n, rt in whole)
            assert max(n for n, _ in whole) >= 2
        else:
            assert not whole
    assert sorted(res[True]) == sorted(res[False]) == [0, 1, 2, 3]
    for k, sep in res[False].items():
        mix = res[True][k]
        assert [t for t, _ in mix] == [t for t, _ in sep] and len(sep) == 8
        assert max(abs(a - b) for (_, a), (_, b) in zip(mix, sep)) < 1e-4


def test_no_page_leaks_after_finished_and_aborted(loaded):
    e = _engine(loaded, max_running=2, max_num_batched_tokens=16)
    try:
        e.start()
        long_id = e.add_request(PROMPTS[1], _greedy(400))
        queued = [e.add_request(PROMPTS[i % 4], _greedy(10)) for i in range(4)]
        e.abort(queued[-1])
        stream = e.stream(PROMPTS[2], _greedy(50))
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()
        e.abort(long_id)
        outs = e.generate(PROMPTS[:2], [_greedy(5), SamplingParams(max_tokens=7, seed=3)])
        assert [o.finish_reason for o in outs] == ["length", "length"]
        deadline = time.monotonic() + 60
        while e.scheduler.has_work() and time.monotonic() < deadline:
            time.sleep(0.05)
        st = e.stats()
        assert st.running == 0 and st.waiting == 0 and st.requests_aborted >= 2
        assert e.cache.allocator.num_used == 0 and e.cache.allocator.num_free == e.cache.num_pages
    finally:
        e.shutdown()


def test_latent_cache_capacity_and_calibrated_scales(loaded):
    e = _engine(loaded, kv_dtype="fp8_e4m3", kv_scales="calibrate", calibration_prompts=2)
    try:
        spec = e.cache.spec
        assert spec.mla and spec.num_kv_heads == 1 and spec.head_dim == 64 + 32
        assert e.cache.bytes_per_token == 2 * (64 + 32) * 1.0  # one plane, 2 layers, 1 byte/element
        assert e.cache.v_data is e.cache.k_data  # no V plane
        k = e.cache.k_scale
        assert k.shape == (2, 1) and (k > 0).all() and (k != 1).all()  # one calibrated scale per layer
        assert e.capacity.bytes_per_token == e.cache.bytes_per_token
        assert len(e.generate([PROMPTS[0]], _greedy(4))[0].token_ids) == 4
    finally:
        e.shutdown()


def test_full_width_preset_config():
    from kvbench.runtime.models.synthetic import parse_synthetic

    cfg = parse_synthetic("synthetic:deepseek-v2-lite,layers=3")
    assert (cfg.is_mla, cfg.num_kv_heads, cfg.head_dim, cfg.kv_head_dim, cfg.intermediate_size) == (True, 1, 192, 576, 10944)
    spec = cfg.kv_spec("bf16", 16)
    assert spec.mla and spec.planes == 1 and spec.head_dim == 576
    v3 = parse_synthetic("synthetic:deepseek-v3,layers=1")
    assert v3.q_lora_rank == 1536 and v3.num_heads == 128 and v3.kv_head_dim == 576
    from kvbench.runtime.models.deepseek_config import mla_softmax_scale
    from kvbench.runtime.models.mla_shapes import get_mla_shape

    assert mla_softmax_scale(cfg) == pytest.approx(get_mla_shape("deepseek-v2-lite").softmax_scale)
    with pytest.raises(ValueError, match="window"):
        parse_synthetic("synthetic:deepseek-v2-lite,window=64")


def test_unsupported_backends_fail_at_start_up(loaded):
    with pytest.raises(UnsupportedBackend, match="MLA") as ei:
        Engine(EngineConfig(model=MODEL, decode_backend="flashinfer"))
    assert "torch" in str(ei.value) and "triton" in str(ei.value)


def test_moe_checkpoint_is_refused():
    from kvbench.runtime.models.hf_config import from_hf_config

    cfg = {"architectures": ["DeepseekV2ForCausalLM"], "num_hidden_layers": 27, "n_routed_experts": 64,
           "first_k_dense_replace": 1, "hidden_size": 2048}
    with pytest.raises(ValueError, match="mixture of experts"):
        from_hf_config(cfg)


def test_dense_deepseek_hf_config():
    from kvbench.runtime.models.hf_config import from_hf_config
    from kvbench.runtime.models.deepseek_config import mla_softmax_scale

    cfg = from_hf_config({
        "architectures": ["DeepseekV2ForCausalLM"], "num_hidden_layers": 2, "n_routed_experts": None,
        "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 512, "vocab_size": 1000,
        "q_lora_rank": None, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5},
        "max_position_embeddings": 163840,
    })
    assert cfg.is_mla and cfg.rope_style == "interleaved" and cfg.kv_head_dim == 80 and cfg.rope_dim == 16
    m1, m_all = 0.1 * math.log(40) + 1, 0.05 * math.log(40) + 1
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(m1 / m_all)
    assert mla_softmax_scale(cfg) == pytest.approx(48**-0.5 * m_all**2)

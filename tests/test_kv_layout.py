"""The two page layouts of the paged cache: head-major pages (HND, the runtime's default) and token-major
pages (NHD).  Kernels address either through the planes' strides; the runtime allocates the one chosen."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvbench.tools import kernel_check as C
from kvbench.tools.kernel_check import as_layout
from kvbench.runtime.config import ConfigError, EngineConfig, KVCacheSpec
from kvbench.runtime.kv_cache import PagedKVCache

FORMATS = ["bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_on_head_major_pages(fmt):
    """Decode (plain, window + sinks), prefill over a prefix and the fused / unfused append on HND planes,
    bf16 queries (the 16-bit-unit paths for fp8 / nvfp4), against the float64 references."""
    cases = [
        C.check_decode(fmt, [37, 5, 64], 8, 2, 32, 16, device="cpu", layout="HND", seed=1),
        C.check_decode(fmt, [37, 5, 64], 8, 2, 32, 8, device="cpu", layout="HND", seed=2, window=20, sinks=True),
        C.check_prefill(fmt, [9, 17], [20, 3], 8, 2, 32, 8, device="cpu", layout="HND", seed=3),
        C.check_append(fmt, 7, 4, 2, 32, 8, device="cpu", layout="HND", seed=4, fused=True, exact=False),
        C.check_append(fmt, 7, 4, 2, 32, 8, device="cpu", layout="HND", seed=5, fused=False, exact=False),
    ]
    for c in cases:
        assert c.ok, c.line()
        assert "HND" in c.label


def test_as_layout_keeps_values_and_moves_memory():
    x = torch.arange(3 * 4 * 2 * 5, dtype=torch.float32).reshape(3, 4, 2, 5)
    h = as_layout(x, "HND")
    assert torch.equal(h, x) and not h.is_contiguous() and h.permute(0, 2, 1, 3).is_contiguous()
    c = h.clone()  # the append check's working copies: a copy, in the same layout
    assert c.data_ptr() != h.data_ptr() and c.stride() == h.stride()
    assert as_layout(x, "NHD").is_contiguous()
    with pytest.raises(ValueError, match="layout"):
        as_layout(x, "HDN")


def test_paged_cache_allocates_the_layout():
    for layout in ("HND", "NHD"):
        cache = PagedKVCache(KVCacheSpec(2, 3, 32, "nvfp4", 4, layout=layout), num_pages=5)
        for t in (cache.k_data[1], cache.v_data[0], cache.k_block_scale[0], cache.v_block_scale[1]):
            assert t.shape[:3] == (6, 4, 3)
            assert t.permute(0, 2, 1, 3).is_contiguous() if layout == "HND" else t.is_contiguous()
    # the same writes read back the same values in either layout
    k = torch.randn(6, 3, 32)
    slots = torch.tensor([0, 5, 6, 13, 19, 2])
    reads = []
    for layout in ("HND", "NHD"):
        cache = PagedKVCache(KVCacheSpec(1, 3, 32, "fp8_e4m3", 4, layout=layout), num_pages=5)
        cache.write(0, slots, k, 2 * k)
        reads.append(cache.read_slots(0, slots))
    assert torch.equal(reads[0][0], reads[1][0]) and torch.equal(reads[0][1], reads[1][1])


def test_layout_errors_are_clear():
    from kvbench.kernels.config import PagedKV
    from kvbench.kernels.decode import paged_decode

    with pytest.raises(ConfigError, match="layout"):
        KVCacheSpec(1, 2, 32, "bf16", 16, layout="HDN")
    with pytest.raises(ConfigError, match="kv_layout"):
        EngineConfig(kv_layout="hnd")
    gen = torch.Generator().manual_seed(0)
    kc, _, ks, _ = C.make_cache("fp8_e4m3", 4, 16, 2, 32, "cpu", gen, "NHD")
    vc, _, vs, _ = C.make_cache("fp8_e4m3", 4, 16, 2, 32, "cpu", gen, "HND")
    q = torch.randn(1, 4, 32, dtype=torch.bfloat16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(ValueError, match="same layout"):
        paged_decode(q, PagedKV("fp8_e4m3", kc, vc, ks, vs), table, lens)
    odd = kc.transpose(1, 3)  # neither NHD nor HND memory
    with pytest.raises(ValueError, match="NHD"):
        paged_decode(q, PagedKV("fp8_e4m3", odd, odd, ks, vs), table, lens)


@pytest.mark.slow
def test_engine_layouts_give_the_same_tokens():
    """The default model, torch backend, fp8 KV: HND and NHD pages give identical greedy tokens and
    log-probs (the same values, stored elsewhere)."""
    from kvbench.core.client import SamplingParams
    from kvbench.runtime.engine import Engine
    from kvbench.runtime.models.loader import load_model

    loaded = load_model(None)
    outs = []
    for layout in ("HND", "NHD"):
        e = Engine(EngineConfig(kv_budget_gb=0.05, kv_dtype="fp8_e4m3", kv_layout=layout), loaded=loaded)
        try:
            assert e.cache.spec.layout == layout
            prompts = [e.tokenizer.encode(p) for p in ("The capital of France is", "def add(a, b):")]
            outs.append(e.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)))
        finally:
            e.shutdown()
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert [sorted(x.items()) for x in a.top_logprobs] == [sorted(x.items()) for x in b.top_logprobs]

"""The Triton attention backend (CPU interpreter) against the torch reference backend: a prefill, an
extend step over a cached prefix and a decode step, each on its own cache, for several KV formats,
with GQA, sliding window and sinks.  Outputs and cache contents must agree."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvbench.tools import kernel_check as C
from kvbench.runtime.attention.base import AttentionLayer, AttentionMetadata, BackendOptions, build_rope_cache
from kvbench.runtime.attention.registry import backend_class
from kvbench.runtime.attention.torch_backend import TorchBackend
from kvbench.runtime.attention.triton_backend import TritonBackend
from kvbench.runtime.config import KVCacheSpec
from kvbench.runtime.kv_cache import PagedKVCache

H, HK, D, PAGE = 4, 2, 32, 8


def _meta(phase, q_lens, seq_lens, tables, rope, dev="cpu"):
    positions, slots = [], []
    for ql, sl, tb in zip(q_lens, seq_lens, tables):
        for p in range(sl - ql, sl):
            positions.append(p)
            slots.append(tb[p // PAGE] * PAGE + p % PAGE)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return AttentionMetadata(
        phase=phase, positions=torch.tensor(positions), slot_mapping=torch.tensor(slots), page_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), cu_seqlens_q=cu, max_seqlen_q=max(q_lens),
        max_seqlen_k=max(seq_lens), page_size=PAGE, rope=rope, seq_lens_cpu=list(seq_lens), q_lens_cpu=list(q_lens),
    )


@pytest.mark.parametrize("fmt,window,sinks,fused,qq", [
    ("bf16", None, False, True, False),
    ("fp8_e4m3", 12, True, False, False),
    ("nvfp4", None, True, True, True),
])
def test_triton_backend_agrees_with_torch(fmt, window, sinks, fused, qq):
    _agree(fmt, window, sinks, fused, qq)


@pytest.mark.parametrize("fmt,window,sinks", [("nvfp4", None, True), ("fp8_e5m2", 12, False)])
def test_triton_backend_extend_over_the_prefix_workspace(monkeypatch, fmt, window, sinks):
    # the backend passes the step's longest prefix, so an extend with enough new tokens dequantizes its prefix
    # once into the workspace (thresholds lowered to these small steps); it must still agree with torch
    from kvbench.kernels import prefill as P

    monkeypatch.setattr(P, "WORKSPACE_MIN_Q", {2: 8, 1: 8})
    used = []
    real = P._over_workspace
    monkeypatch.setattr(P, "_over_workspace", lambda plan, *a: (used.append(plan), real(plan, *a))[1])
    _agree(fmt, window, sinks, True, False)
    assert [(p.npp, p.group) for p in used] == [(2, 2)]  # the extend step only (prefix 10 and 5: 2 pages of 8)


def _agree(fmt, window, sinks, fused, qq):
    gen = torch.Generator().manual_seed(7)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=HK, head_dim=D, kv_dtype=fmt, page_size=PAGE)
    caches = [PagedKVCache(spec, 12), PagedKVCache(spec, 12)]
    scale = C.calibrated_scale(fmt, torch.randn(64, HK, D, generator=gen) * 2)
    for c in caches:
        c.set_scales(scale[None], scale[None])
    opts = BackendOptions(kv_dtype=fmt, fused_append=fused, quantize_query=qq)
    backends = [TorchBackend(opts), TritonBackend(opts)]
    rope = build_rope_cache(D // 2, 256, style="interleaved")
    layer = AttentionLayer(0, H, HK, D, D**-0.5, sliding_window=window,
                           sinks=torch.randn(H, generator=gen) if sinks else None, q_scale=0.02)
    tables = [[3, 7, 1], [0, 9, 4, 2]]
    steps = [("prefill", [10, 5], [10, 5]), ("prefill", [7, 20], [17, 25]), ("decode", [1, 1], [18, 26])]
    for phase, q_lens, seq_lens in steps:
        t = sum(q_lens)
        q = torch.randn(t, H, D, generator=gen)
        k = torch.randn(t, HK, D, generator=gen) * 2
        v = torch.randn(t, HK, D, generator=gen)
        outs = []
        for be, cache in zip(backends, caches):
            meta = _meta(phase, q_lens, seq_lens, tables, rope)
            be.plan(meta, cache)
            outs.append(be.forward(q, k, v, layer, cache, meta))
        assert outs[1].shape == (t, H * D)
        err = C.rel_err(outs[1], outs[0].double())
        assert err < 1e-5, f"{phase} {err}"  # float32 compute, identical cache contents
    for a, b in ((caches[0].k_data[0], caches[1].k_data[0]), (caches[0].v_data[0], caches[1].v_data[0]),
                 (caches[0].k_block_scale[0], caches[1].k_block_scale[0])):
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_registry_and_support():
    assert backend_class("triton") is TritonBackend
    assert all(TritonBackend.supports(f, p) for f in ("bf16", "fp8_e5m2", "nvfp4") for p in ("prefill", "decode"))
    assert not TritonBackend.supports("int4", "decode")
    ok, why = TritonBackend.available()
    assert ok, why  # TRITON_INTERPRET=1 is set by this module

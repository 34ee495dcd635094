"""Torch attention backend vs a float64 reference written from the spec (runtime/attention/base.py)."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.kernels.formats import get_format
from kvbench.runtime.attention.base import AttentionLayer, AttentionMetadata, BackendOptions, apply_rope, build_rope_cache
from kvbench.runtime.attention.registry import check_supported, create_backend, support_table
from kvbench.runtime.attention.base import UnsupportedBackend
from kvbench.runtime.attention.torch_backend import TorchBackend
from kvbench.runtime.config import KVCacheSpec
from kvbench.runtime.kv_cache import PagedKVCache

PS = 4
H, HK, D = 4, 2, 32


def _rope_ref(x: torch.Tensor, pos: torch.Tensor, base: float, style: str) -> torch.Tensor:
    """float64 RoPE written independently (angles from scratch)."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double()[:, None] * inv[None]  # [T, d/2]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    x = x.double()
    if style == "neox":
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat((a * c - b * s, b * c + a * s), -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, b * c + a * s), -1).flatten(-2)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_matches_reference(style):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 3, D, generator=g)
    pos = torch.tensor([0, 1, 2, 5, 17, 100, 3, 4, 63])
    rope = build_rope_cache(D, 128, 10000.0, style=style)
    out = apply_rope(x, pos, rope)
    ref = _rope_ref(x, pos, 10000.0, style)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).norm() / ref.norm() < 1e-6


def _setup(kv_dtype, seqs, window=None, sinks=False, seed=0):
    """seqs: list of (prefix_len, q_len).  Returns cache, meta, q, k, v, layer and the prefix K/V."""
    g = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec(1, HK, D, kv_dtype, PS)
    npages = sum(-(-(p + q) // PS) for p, q in seqs) + 2
    cache = PagedKVCache(spec, npages)
    if get_format(kv_dtype).is_quantized:
        cache.set_scales(torch.tensor([0.02]), torch.tensor([0.015]))
    rope = build_rope_cache(D, 256, 10000.0)
    perm = torch.randperm(npages, generator=g).tolist()  # scattered pages
    tables, pos, slots, cu, seq_lens, prefixes = [], [], [], [0], [], []
    for p, q in seqs:
        n = -(-(p + q) // PS)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        prefixes.append((torch.randn(p, HK, D, generator=g), torch.randn(p, HK, D, generator=g)))
        # prefix written through the cache (post-RoPE K) as earlier steps would have
        if p:
            ppos = torch.arange(p)
            psl = torch.tensor([table[i // PS] * PS + i % PS for i in range(p)])
            cache.write(0, psl, apply_rope(prefixes[-1][0], ppos, rope), prefixes[-1][1])
        for i in range(p, p + q):
            pos.append(i)
            slots.append(table[i // PS] * PS + i % PS)
        cu.append(cu[-1] + q)
        seq_lens.append(p + q)
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [npages] * (width - len(t)) for t in tables], dtype=torch.int32)
    T = cu[-1]
    phase = "decode" if all(q == 1 for _, q in seqs) and all(p > 0 for p, _ in seqs) else "prefill"
    meta = AttentionMetadata(
        phase, torch.tensor(pos), torch.tensor(slots), table_t, torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(cu, dtype=torch.int32), max(q for _, q in seqs), max(seq_lens), PS, rope,
        list(seq_lens), [q for _, q in seqs],
    )
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, HK, D, generator=g)
    v = torch.randn(T, HK, D, generator=g)
    layer = AttentionLayer(0, H, HK, D, 1 / math.sqrt(D), window, torch.randn(H, generator=g) if sinks else None)
    return cache, meta, q, k, v, layer, prefixes


def _reference(kv_dtype, meta, q, k, v, layer, prefixes, cache):
    """float64: prefix K/V round-tripped through the format; new K/V exact in prefill, round-tripped in decode.

    Values that get stored are roped with the float32 ``apply_rope`` (checked against float64 above) so
    the format's rounding sees the same inputs; everything else is float64."""
    fmt = get_format(kv_dtype)
    ks, vs = cache.k_scale[0], cache.v_scale[0]
    out = torch.zeros(q.shape[0], H * D, dtype=torch.float64)
    cu = meta.cu_seqlens_q.tolist()
    for b, (pk, pv) in enumerate(prefixes):
        r0, r1 = cu[b], cu[b + 1]
        p = pk.shape[0]
        pos_new = meta.positions[r0:r1]
        kn = _rope_ref(k[r0:r1], pos_new, 10000.0, "neox")
        vn = v[r0:r1].double()
        kp = fmt.roundtrip(apply_rope(pk, torch.arange(p), meta.rope), ks).double()
        vp = fmt.roundtrip(pv, vs).double()
        if meta.phase == "decode":
            kn = fmt.roundtrip(apply_rope(k[r0:r1], pos_new, meta.rope), ks).double()
            vn = fmt.roundtrip(vn.float(), vs).double()
        K, V = torch.cat((kp, kn)), torch.cat((vp, vn))
        qq = _rope_ref(q[r0:r1], pos_new, 10000.0, "neox")
        for i in range(r1 - r0):
            qp = p + i
            for h in range(H):
                kh = h // (H // HK)
                sc = (K[: qp + 1, kh] @ qq[i, h]) * layer.softmax_scale
                if layer.sliding_window is not None:
                    lo = max(0, qp - layer.sliding_window + 1)
                    sc[:lo] = float("-inf")
                m = sc.max()
                if layer.sinks is not None:
                    m = torch.maximum(m, layer.sinks[h].double())
                e = (sc - m).exp()
                den = e.sum() + ((layer.sinks[h].double() - m).exp() if layer.sinks is not None else 0.0)
                out[r0 + i, h * D : (h + 1) * D] = (e / den) @ V[: qp + 1, kh]
    return out


CASES = {
    "prefill_fresh": ([(0, 7), (0, 1), (0, 12)], None, False),
    "extend_prefix": ([(5, 6), (9, 3), (0, 4)], None, False),
    "decode": ([(6, 1), (13, 1), (1, 1)], None, False),
    "window_sinks_prefill": ([(5, 9), (0, 6)], 4, True),
    "window_sinks_decode": ([(11, 1), (3, 1)], 5, True),
}


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4"])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_backend_matches_float64_reference(kv_dtype, case):
    seqs, window, sinks = CASES[case]
    cache, meta, q, k, v, layer, prefixes = _setup(kv_dtype, seqs, window, sinks, seed=hash(case) % 1000)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    be = TorchBackend(BackendOptions(kv_dtype=kv_dtype))
    be.plan(meta, cache)
    out = torch.full((q.shape[0], H * D), float("nan"))  # poisoned
    out = be.forward(q, k, v, layer, cache, meta)
    ref = _reference(kv_dtype, meta, q, k, v, layer, prefixes, cache)
    assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0), "inputs mutated"
    assert torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5, err
    # the new tokens were appended: reading them back gives the format's round trip of post-RoPE K
    kk, vv = cache.read_slots(0, meta.slot_mapping)
    fmt = get_format(kv_dtype)
    kr = apply_rope(k, meta.positions, meta.rope)
    assert torch.equal(kk, fmt.roundtrip(kr, cache.k_scale[0]))
    assert torch.equal(vv, fmt.roundtrip(v, cache.v_scale[0]))


def test_quantize_query_changes_output_and_stays_close():
    cache, meta, q, k, v, layer, prefixes = _setup("fp8_e4m3", [(8, 1), (20, 1)], seed=3)
    ref = TorchBackend(BackendOptions(kv_dtype="fp8_e4m3"))
    base = ref.forward(q, k, v, layer, cache, meta)
    cache2, meta2, *_ = _setup("fp8_e4m3", [(8, 1), (20, 1)], seed=3)
    out = TorchBackend(BackendOptions(kv_dtype="fp8_e4m3", quantize_query=True)).forward(q, k, v, layer, cache2, meta2)
    rel = ((out - base).norm() / base.norm()).item()
    assert 0 < rel < 0.1


def test_registry_errors_and_table():
    table = support_table()
    assert table["torch"]["decode"] == ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4"]
    with pytest.raises(UnsupportedBackend, match="unknown attention backend 'nope'"):
        check_supported("nope", "torch", "bf16")
    with pytest.raises(UnsupportedBackend, match="does not support kv_dtype='nvfp4' for decode") as ei:
        check_supported("torch", "flashinfer", "nvfp4")
    assert "torch       decode   bf16, fp16, fp8_e4m3, fp8_e5m2, nvfp4" in str(ei.value)  # the supported list
    single = create_backend("torch", "torch", BackendOptions())
    assert isinstance(single, TorchBackend)
    from kvbench.runtime.attention.hybrid import HybridBackend

    class Other(TorchBackend):
        name = "other"

    hyb = HybridBackend(TorchBackend(BackendOptions()), Other(BackendOptions()))
    cache, meta, q, k, v, layer, _ = _setup("bf16", [(3, 1)], seed=4)
    assert hyb._pick(meta).name == "other" and hyb.label == "torch+other"

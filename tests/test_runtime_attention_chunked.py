"""The torch backend's chunked attention (per sequence, query chunks, keys sliced to each chunk's reach)
against a dense float64 reference written from base.py's semantics: extend over a cached prefix, ragged
multi-sequence batches, sliding windows, sinks, GQA, quantize_query, decode with padding rows, round-trip
sequences (scoring with decode semantics), every KV format, and chunk sizes forced small so several
chunks, and chunk boundaries inside windows, are exercised.

Poison: every cache page is filled with NaN bytes before the valid tokens are written and the padding
rows' q/k/v are NaN, so reading a slot the semantics do not allow shows up as a non-finite output."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.kernels.formats import get_format
from kvbench.runtime.attention.base import AttentionLayer, AttentionMetadata, BackendOptions, apply_rope, build_rope_cache
from kvbench.runtime.attention.torch_backend import TorchBackend, attend_chunked
from kvbench.runtime.config import KVCacheSpec
from kvbench.runtime.kv_cache import PagedKVCache

PS = 4
FORMATS = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4"]
NAN_BYTES = {"bf16": None, "fp16": None, "fp8_e4m3": 0x7F, "fp8_e5m2": 0x7F, "nvfp4": 0x7F}


def _poison(cache: PagedKVCache) -> None:
    """NaN in every stored element (nvfp4: in every block scale, its codes have no NaN)."""
    for planes in (cache.k_data, cache.v_data, cache.k_block_scale, cache.v_block_scale):
        for t in planes:
            if t is None:
                continue
            if t.dtype in (torch.bfloat16, torch.float16):
                t.fill_(float("nan"))
            elif t.dtype != torch.uint8:  # fp8 data or nvfp4 block scales: the e4m3/e5m2 NaN pattern
                t.view(torch.uint8).fill_(0x7F)


def _build(kv_dtype, seqs, H, HK, D, window=None, sinks=False, seed=0, roundtrip=None, pad_rows=0):
    """seqs: [(prefix_len, q_len)].  Prefix K/V written through the cache as earlier steps would have."""
    g = torch.Generator().manual_seed(seed)
    spec = KVCacheSpec(1, HK, D, kv_dtype, PS)
    npages = sum(-(-(p + q) // PS) for p, q in seqs) + 3
    cache = PagedKVCache(spec, npages)
    _poison(cache)
    if get_format(kv_dtype).is_quantized:
        cache.set_scales(torch.tensor([0.03]), torch.tensor([0.02]))
    rope = build_rope_cache(D, 512, 10000.0)
    perm = torch.randperm(npages, generator=g).tolist()  # scattered pages
    tables, pos, slots, cu, seq_lens, prefixes = [], [], [], [0], [], []
    for p, q in seqs:
        n = -(-(p + q) // PS)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        pk, pv = torch.randn(p, HK, D, generator=g), torch.randn(p, HK, D, generator=g)
        prefixes.append((pk, pv))
        if p:
            psl = torch.tensor([table[i // PS] * PS + i % PS for i in range(p)])
            cache.write(0, psl, apply_rope(pk, torch.arange(p), rope), pv)
        pos += list(range(p, p + q))
        slots += [table[i // PS] * PS + i % PS for i in range(p, p + q)]
        cu.append(cu[-1] + q)
        seq_lens.append(p + q)
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [npages] * (width - len(t)) for t in tables], dtype=torch.int32)
    T = cu[-1] + pad_rows
    pos += [0] * pad_rows
    slots += [-1] * pad_rows
    phase = "decode" if all(q == 1 for _, q in seqs) and roundtrip is None else "prefill"
    meta = AttentionMetadata(
        phase, torch.tensor(pos), torch.tensor(slots), table_t, torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(cu, dtype=torch.int32), max(q for _, q in seqs), max(seq_lens), PS, rope,
        list(seq_lens), [q for _, q in seqs],
    )
    if roundtrip is not None:
        meta.roundtrip_seqs_cpu = list(roundtrip)
        meta.roundtrip_rows = torch.tensor([r for r, (_, q) in zip(roundtrip, seqs) for _ in range(q)] + [False] * pad_rows)
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, HK, D, generator=g)
    v = torch.randn(T, HK, D, generator=g)
    if pad_rows:
        q[cu[-1]:], k[cu[-1]:], v[cu[-1]:] = float("nan"), float("nan"), float("nan")
    layer = AttentionLayer(0, H, HK, D, 1 / math.sqrt(D), window, torch.randn(H, generator=g) if sinks else None)
    return cache, meta, q, k, v, layer, prefixes


def _reference(kv_dtype, meta, q, k, v, layer, prefixes, cache, quantize_query=False):
    """float64 dense attention per query from the spec.  Stored values go through the same float32 RoPE
    and the format's round trip (what the pages hold); the rest is float64."""
    fmt = get_format(kv_dtype)
    ks, vs = cache.k_scale[0], cache.v_scale[0]
    H, D = layer.num_heads, layer.head_dim
    G = H // layer.num_kv_heads
    out = torch.zeros(q.shape[0], H * D, dtype=torch.float64)
    cu = meta.cu_seqlens_q.tolist()
    rt = meta.roundtrip_seqs_cpu or [meta.phase == "decode"] * len(prefixes)
    qr = apply_rope(q, meta.positions, meta.rope)
    if quantize_query:
        qr = (qr / layer.q_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * layer.q_scale
    kr = apply_rope(k, meta.positions, meta.rope)
    for b, (pk, pv) in enumerate(prefixes):
        r0, r1 = cu[b], cu[b + 1]
        p = pk.shape[0]
        kp = fmt.roundtrip(apply_rope(pk, torch.arange(p), meta.rope), ks).double()
        vp = fmt.roundtrip(pv, vs).double()
        if meta.phase == "decode" or rt[b]:  # the new tokens as stored
            kn, vn = fmt.roundtrip(kr[r0:r1], ks).double(), fmt.roundtrip(v[r0:r1], vs).double()
        else:
            kn, vn = kr[r0:r1].double(), v[r0:r1].double()
        K, V = torch.cat((kp, kn)), torch.cat((vp, vn))
        for i in range(r1 - r0):
            qp = p + i
            for h in range(H):
                sc = (K[: qp + 1, h // G] @ qr[r0 + i, h].double()) * layer.softmax_scale
                if layer.sliding_window is not None:
                    sc[: max(0, qp - layer.sliding_window + 1)] = float("-inf")
                parts = [sc] if layer.sinks is None else [sc, layer.sinks[h].double().view(1)]
                w = torch.softmax(torch.cat(parts), 0)[: qp + 1]
                out[r0 + i, h * D : (h + 1) * D] = w @ V[: qp + 1, h // G]
    return out


CASES = {
    # name: (seqs, window, sinks, roundtrip, heads (H, HK), pad rows)
    "extend_prefix_ragged": ([(13, 11), (0, 7), (5, 1), (22, 9)], None, False, None, (4, 2), 0),
    "fresh_prompts_mha": ([(0, 17), (0, 3)], None, False, None, (2, 2), 0),
    "window_extend": ([(14, 12), (0, 10), (3, 5)], 5, False, None, (6, 2), 0),
    "window_sinks_extend": ([(9, 13), (0, 6)], 4, True, None, (4, 1), 0),
    "sinks_full": ([(6, 8), (11, 2)], None, True, None, (4, 2), 0),
    "decode_padded": ([(6, 1), (17, 1), (1, 1), (30, 1)], None, False, None, (4, 2), 3),
    "decode_window_sinks": ([(11, 1), (3, 1), (25, 1)], 5, True, None, (6, 3), 2),
    "roundtrip_mixed": ([(10, 9), (7, 6), (0, 5)], None, False, [True, False, True], (4, 2), 0),
    "roundtrip_window_sinks": ([(12, 10), (4, 7)], 6, True, [True, False], (4, 2), 0),
}


@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk", [3, None])
def test_chunked_attention_matches_float64_reference(kv_dtype, case, chunk):
    seqs, window, sinks, roundtrip, (H, HK), pad = CASES[case]
    D = 32
    cache, meta, q, k, v, layer, prefixes = _build(kv_dtype, seqs, H, HK, D, window, sinks, seed=len(case), roundtrip=roundtrip, pad_rows=pad)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    be = TorchBackend(BackendOptions(kv_dtype=kv_dtype, extra={} if chunk is None else {"torch_query_chunk": chunk}))
    be.plan(meta, cache)
    out = be.forward(q, k, v, layer, cache, meta)
    n = int(meta.cu_seqlens_q[-1])
    assert out.shape == (q.shape[0], H * D)
    assert torch.equal(q.nan_to_num(7.0), q0.nan_to_num(7.0)) and torch.equal(k.nan_to_num(7.0), k0.nan_to_num(7.0))
    assert torch.equal(v.nan_to_num(7.0), v0.nan_to_num(7.0)), "inputs mutated"
    assert torch.isfinite(out[:n]).all(), "a poisoned slot was read"
    ref = _reference(kv_dtype, meta, q, k, v, layer, prefixes, cache)[:n]
    err = ((out[:n].double() - ref).norm() / ref.norm()).item()
    assert err < 2e-6, err


def test_quantize_query_chunked_matches_reference():
    cache, meta, q, k, v, layer, prefixes = _build("fp8_e4m3", [(9, 7), (3, 5)], 4, 2, 32, window=4, seed=11)
    layer.q_scale = 0.05
    be = TorchBackend(BackendOptions(kv_dtype="fp8_e4m3", quantize_query=True, extra={"torch_query_chunk": 2}))
    out = be.forward(q, k, v, layer, cache, meta)
    ref = _reference("fp8_e4m3", meta, q, k, v, layer, prefixes, cache, quantize_query=True)
    assert torch.isfinite(out).all()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-6


def test_roundtrip_flag_changes_a_quantized_format():
    """The flag is not a no-op: flagged rows see their K/V as stored, which differs for fp8."""
    outs = []
    for rt in (None, [True]):
        cache, meta, q, k, v, layer, _ = _build("fp8_e5m2", [(5, 9)], 4, 2, 32, seed=5, roundtrip=rt)
        outs.append(TorchBackend(BackendOptions(kv_dtype="fp8_e5m2")).forward(q, k, v, layer, cache, meta))
    rel = ((outs[0] - outs[1]).norm() / outs[0].norm()).item()
    assert 1e-4 < rel < 0.2, rel


@pytest.mark.parametrize("window,sinks", [(None, False), (7, True), (1, False)])
def test_attend_chunked_is_independent_of_the_chunk_size(window, sinks):
    g = torch.Generator().manual_seed(2)
    Q, S, H, HK, D = 37, 50, 6, 2, 16
    q, k, v = torch.randn(Q, H, D, generator=g), torch.randn(S, HK, D, generator=g), torch.randn(S, HK, D, generator=g)
    s = torch.randn(H, generator=g) if sinks else None
    outs = [attend_chunked(q, k, v, S - Q, 0, 0.25, window, s, chunk=c) for c in (1, 4, 16, 1000)]
    for o in outs[1:]:
        assert torch.allclose(o, outs[0], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="cover"):
        attend_chunked(q, k[:-1], v[:-1], S - Q, 0, 0.25)


def test_chunk_option_is_validated():
    with pytest.raises(ValueError, match="torch_query_chunk"):
        TorchBackend(BackendOptions(extra={"torch_query_chunk": 0}))

"""MLA decode in the absorbed form (Triton): split-K flash-decoding over the latent pages.

Each program takes ``BLOCK_H`` query heads of one sequence and one split of its context.  The latent
tile of ``BLOCK_N`` tokens is loaded once, dequantized in registers and used twice: as K
(``q_lat · c + q_pe · k_pe``) and as V (``p · c``).  The per-layer ``k_scale`` is folded into the softmax
scale and into the final reduce; nvfp4 block scales are applied in registers.  Stage 2 merges the
splits by their log-sum-exp.  Output is the latent ``o_lat [B, H, rank]`` (apply ``W_UV`` afterwards).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from kvbench.kernels.mla import LatentCache
from kvbench.kernels.mla_common import check_cache, check_paging, load_latent_tile, tl_dtype


@triton.jit
def _mla_decode_split(
    QL, QP, KV, BS, KSCALE, QSCALE, PT, SL, MO, ML,
    sm_scale_log2,
    stride_lb, stride_lh, stride_pb, stride_ph, stride_pt, stride_mb, stride_mh, stride_ms,
    H, num_splits,
    PAGE: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT: tl.constexpr, DT: tl.constexpr, Q_FP8: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    hg = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(SL + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = sp * chunk
    end = tl.minimum(start + chunk, seq_len)
    h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    dr = tl.arange(0, RANK)
    dp = tl.arange(0, ROPE)
    ql = tl.load(QL + b * stride_lb + h[:, None] * stride_lh + dr[None, :], mask=hm[:, None], other=0.0).to(DT)
    qp = tl.load(QP + b * stride_pb + h[:, None] * stride_ph + dp[None, :], mask=hm[:, None], other=0.0).to(DT)
    scale = sm_scale_log2 * tl.load(KSCALE)
    if Q_FP8:
        scale = scale * tl.load(QSCALE)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nm = pos < end
        page = tl.load(PT + b * stride_pt + pos // PAGE, mask=nm, other=0).to(tl.int64)
        slot = page * PAGE + pos % PAGE
        c, kpe = load_latent_tile(KV, BS, slot, nm, RANK, ROPE, FMT, DT)
        s = tl.dot(ql, tl.trans(c)) + tl.dot(qp, tl.trans(kpe))
        s = tl.where(nm[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DT), c)
        m = m_new
    base = b * stride_mb + h * stride_mh + sp * stride_ms
    if start < end:
        tl.store(MO + base[:, None] + dr[None, :], acc / l[:, None], mask=hm[:, None])
        tl.store(ML + b * (H * num_splits) + h * num_splits + sp, m + tl.log2(l), mask=hm)
    else:
        tl.store(ML + b * (H * num_splits) + h * num_splits + sp, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=hm)


@triton.jit
def _mla_decode_merge(
    MO, ML, KSCALE, OUT, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, H, num_splits,
    RANK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    dr = tl.arange(0, RANK)
    lse_base = ML + b * (H * num_splits) + h * num_splits
    mx = float("-inf")
    for s in range(0, num_splits):
        mx = tl.maximum(mx, tl.load(lse_base + s))
    acc = tl.zeros([RANK], tl.float32)
    w = 0.0
    for s in range(0, num_splits):
        lse = tl.load(lse_base + s)
        if lse > float("-inf"):
            e = tl.exp2(lse - mx)
            acc += e * tl.load(MO + b * stride_mb + h * stride_mh + s * stride_ms + dr)
            w += e
    out = tl.where(w > 0, acc / tl.maximum(w, 1e-30), 0.0) * tl.load(KSCALE)
    tl.store(OUT + b * stride_ob + h * stride_oh + dr, out.to(OUT.dtype.element_ty))


def default_num_splits(batch: int, head_groups: int, max_len: int, block_n: int, num_sms: int) -> int:
    """Enough programs to fill the device twice over, never splits shorter than a few tiles."""
    want = max(1, (2 * num_sms + batch * head_groups - 1) // (batch * head_groups))
    most = max(1, max_len // (4 * block_n))
    return int(min(want, most, 64))


def mla_decode(q_lat, q_pe, cache: LatentCache, page_table, seq_lens, sm_scale: float, *,
               q_scale=None, num_splits: int | None = None, max_seq_len: int | None = None,
               block_h: int = 64, block_n: int = 64, num_warps: int = 8, num_stages: int = 2, out=None):
    """Absorbed MLA decode: one query token per sequence.

    ``q_lat [B, H, rank]``, ``q_pe [B, H, rope]`` (RoPE applied) in the compute dtype, or both fp8 e4m3
    with ``q_scale`` (fp32 [1]); ``seq_lens`` counts every cached token, the one just appended included.
    Returns ``o_lat [B, H, rank]`` in the compute dtype (bfloat16 for fp8 queries).
    """
    import torch

    fmt = check_cache(cache)
    lay = cache.layout
    dev = cache.data.device
    if q_lat.dim() != 3 or q_lat.shape[2] != lay.kv_lora_rank:
        raise ValueError(f"q_lat must be [B, H, {lay.kv_lora_rank}], got {tuple(q_lat.shape)}")
    b, h = q_lat.shape[:2]
    if tuple(q_pe.shape) != (b, h, lay.rope_dim) or q_pe.dtype != q_lat.dtype:
        raise ValueError(f"q_pe must be [B={b}, H={h}, {lay.rope_dim}] of q_lat's dtype, got {tuple(q_pe.shape)} {q_pe.dtype}")
    if q_lat.device != dev or q_pe.device != dev:
        raise ValueError("queries must be on the cache's device")
    if q_lat.stride(2) != 1 or q_pe.stride(2) != 1:
        raise ValueError("q_lat and q_pe must be contiguous in their last dimension")
    q_fp8 = q_lat.dtype == torch.float8_e4m3fn
    if q_fp8 and (q_scale is None or q_scale.dtype != torch.float32):
        raise ValueError("fp8 queries need q_scale, an fp32 tensor [1]")
    cdt = torch.bfloat16 if q_fp8 else q_lat.dtype
    # fp8 queries: dot operands in fp16 (fp8 / e2m1·e4m3 values are exact in it) unless the cache is bf16.
    dt = tl_dtype(torch.bfloat16 if cache.data.dtype == torch.bfloat16 else torch.float16) if q_fp8 else tl_dtype(cdt)
    check_paging(page_table, seq_lens, b, dev)
    if out is None:
        out = torch.empty(b, h, lay.kv_lora_rank, dtype=cdt, device=dev)
    if b == 0:
        return out
    block_h = max(16, min(block_h, triton.next_power_of_2(h)))
    hg = triton.cdiv(h, block_h)
    if num_splits is None:
        longest = max_seq_len if max_seq_len is not None else int(seq_lens.max().item())
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        num_splits = default_num_splits(b, hg, longest, block_n, sms)
    mid_o = torch.empty(b, h, num_splits, lay.kv_lora_rank, dtype=torch.float32, device=dev)
    mid_l = torch.empty(b, h, num_splits, dtype=torch.float32, device=dev)
    bs = cache.block_scale if cache.block_scale is not None else cache.data
    qs = q_scale if q_fp8 else cache.k_scale
    _mla_decode_split[(b, hg, num_splits)](
        q_lat, q_pe, cache.data, bs, cache.k_scale, qs, page_table, seq_lens, mid_o, mid_l,
        float(sm_scale) * math.log2(math.e),
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        h, num_splits,
        PAGE=cache.page_size, RANK=lay.kv_lora_rank, ROPE=lay.rope_dim, BLOCK_H=block_h, BLOCK_N=block_n,
        FMT=fmt, DT=dt, Q_FP8=q_fp8, num_warps=num_warps, num_stages=num_stages,
    )
    _mla_decode_merge[(b, h)](
        mid_o, mid_l, cache.k_scale, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        out.stride(0), out.stride(1), h, num_splits, RANK=lay.kv_lora_rank, num_warps=4,
    )
    return out

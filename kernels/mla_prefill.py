"""MLA prefill / extend in the absorbed form (Triton).

The new tokens of a sequence attend, causally, to its cached prefix — read from the quantized latent
pages — and to their own latent and rope keys in compute precision (not round-tripped through the cache
format; docs/design.md §6 "Prefill / extend").  All heads share the latent (one KV head), so a program's rows are
(token, head) pairs: ``TB`` tokens × ``HB`` heads, each latent tile serving every row.  Output is
``o_lat [T, H, rank]``.

The prefix of an fp8 / nvfp4 cache is read one of two ways.  Dequantized in registers by every program
that reads it; or (``prefix_workspace``, the default whenever it fits its budget) dequantized once per
step into a bounded compute-precision workspace (``_dequant_prefix``: stored values, exact in
bf16 / fp16, the per-layer scale still folded in by the kernel), which the attention then reads as a
16-bit cache.  Every (token-tile, head-group) program reads the whole prefix, so the first way converts
each prefix tile ``cdiv(new tokens, TB) · cdiv(H, HB)`` times, and converting a tile costs more than
reading it: with the workspace, extends over an 8192-token prefix ran 1.2-2.0x faster on an H200, from one
new token to 512 (docs/mla.md, "Prefix workspace"); serving engines dequantize an MLA prefix into a
workspace for the same reason.  The workspace holds whole sequences, at most ``workspace_bytes`` at a time
(sequences are processed in groups); a single prefix larger than that falls back to the first way.

An extend of a few tokens has few (token tile, head group) programs; the prefix is then split over several
programs per tile (``num_splits``, ``default_num_splits``), and ``mla_decode``'s merge combines their partial
outputs by log-sum-exp (2 × 8192 cached + 1 new at 16 heads on an H200: 522 -> 33 us; docs/mla.md, "Prefix
split").
"""

from __future__ import annotations

import functools
import math

import triton
import triton.language as tl

from kvbench.kernels.config import MLAPrefillOptions
from kvbench.kernels.mla import LatentCache
from kvbench.kernels.mla_common import FMT_NVFP4, check_cache, check_paging, load_latent_tile, tl_dtype


@triton.jit
def _attend_tile(acc, m, l, ql, qp, c, kpe, visible, scale, vscale, DT: tl.constexpr):
    s = tl.dot(ql, tl.trans(c)) + tl.dot(qp, tl.trans(kpe))
    return _softmax_pv(acc, m, l, s, c, visible, scale, vscale, DT)


@triton.jit
def _softmax_pv(acc, m, l, s, c, visible, scale, vscale, DT: tl.constexpr):
    """Online softmax over the scores ``s`` of one tile, and ``P·c`` into the accumulator."""
    s = tl.where(visible, s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot((p * vscale).to(DT), c)
    return acc, m_new, l


@triton.jit
def _mla_prefill_kernel(
    QL, QP, QLH, QPH, CN, KN, KV, BS, KSCALE, QSCALE, PT, SL, CU, OUT, MO, ML,
    sm_scale_log2,
    stride_lt, stride_lh, stride_pt_, stride_ph, stride_ct, stride_kt, stride_tab, stride_ot, stride_oh,
    H, num_splits,
    PAGE: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, TB: tl.constexpr, HB: tl.constexpr,
    BLOCK_N: tl.constexpr, FMT: tl.constexpr, DT: tl.constexpr, Q_FP8: tl.constexpr, FP8_SCORES: tl.constexpr = False,
    SPLIT: tl.constexpr = False,
):
    """``FP8_SCORES`` (e4m3 queries over an e4m3 latent): the prefix tiles' scores as fp8 dots of the query
    on the tile as stored, which is converted only for ``P·c``; the new tokens' part loads the query from
    ``QLH`` / ``QPH``, the same values in ``DT`` (converted before the launch; loaded as fp8 and converted
    here, a 2048-token prefill with nothing cached took 544 us against 509, 16 heads on an H100).
    ``SPLIT``: program axis 2 is (head group, split); split ``sp`` of ``num_splits`` takes its share of the
    prefix tiles, the last one also the new tokens, and each stores its normalized partial output to
    ``MO [T, H, num_splits, RANK]`` (float32) and its log2-sum-exp to ``ML [T, H, num_splits]`` for
    ``mla_decode``'s merge (``-inf``: the split saw no key)."""
    tb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    if SPLIT:
        hg = tl.program_id(2) // num_splits
        sp = tl.program_id(2) % num_splits
    else:
        hg = tl.program_id(2)
        sp = 0
    q0 = tl.load(CU + b)
    q_len = tl.load(CU + b + 1) - q0
    if tb * TB < q_len:
        prefix = tl.load(SL + b) - q_len
        if SPLIT:  # this split's prefix tiles
            share = tl.cdiv(tl.cdiv(prefix, num_splits), BLOCK_N) * BLOCK_N
            p_lo = sp * share
            p_hi = tl.minimum(p_lo + share, prefix)
        else:
            p_lo = 0
            p_hi = prefix
        r = tl.arange(0, TB * HB)
        tt = tb * TB + r // HB
        hh = hg * HB + r % HB
        rm = (tt < q_len) & (hh < H)
        tok = (q0 + tl.where(rm, tt, 0)).to(tl.int64)
        hs = tl.where(rm, hh, 0).to(tl.int64)
        dr = tl.arange(0, RANK)
        dp = tl.arange(0, ROPE)
        ql_ptr = QL + tok[:, None] * stride_lt + hs[:, None] * stride_lh + dr[None, :]
        qp_ptr = QP + tok[:, None] * stride_pt_ + hs[:, None] * stride_ph + dp[None, :]
        if FP8_SCORES:
            ql8 = tl.load(ql_ptr)
            qp8 = tl.load(qp_ptr)
        else:
            ql = tl.load(ql_ptr).to(DT)
            qp = tl.load(qp_ptr).to(DT)
        scale = sm_scale_log2
        if Q_FP8:
            scale = scale * tl.load(QSCALE)
        kscale = tl.load(KSCALE)
        m = tl.full([TB * HB], float("-inf"), tl.float32)
        l = tl.zeros([TB * HB], tl.float32)
        acc = tl.zeros([TB * HB, RANK], tl.float32)
        # Cached prefix, from the pages (every prefix token precedes every new token).
        for n0 in range(p_lo, p_hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            nm = pos < p_hi
            page = tl.load(PT + b * stride_tab + pos // PAGE, mask=nm, other=0).to(tl.int64)
            if FP8_SCORES:
                c8, kpe8 = load_latent_tile(KV, BS, page * PAGE + pos % PAGE, nm, RANK, ROPE, FMT, KV.dtype.element_ty)
                s = tl.dot(qp8, tl.trans(kpe8), tl.dot(ql8, tl.trans(c8)))
                acc, m, l = _softmax_pv(acc, m, l, s, c8.to(DT), nm[None, :], scale * kscale, kscale, DT)
            else:
                c, kpe = load_latent_tile(KV, BS, page * PAGE + pos % PAGE, nm, RANK, ROPE, FMT, DT)
                acc, m, l = _attend_tile(acc, m, l, ql, qp, c, kpe, nm[None, :], scale * kscale, kscale, DT)
        if FP8_SCORES:  # the new tokens' keys are in compute precision
            ql = tl.load(QLH + tok[:, None] * stride_lt + hs[:, None] * stride_lh + dr[None, :])
            qp = tl.load(QPH + tok[:, None] * stride_pt_ + hs[:, None] * stride_ph + dp[None, :])
        # The new tokens themselves, causally, in compute precision (the last split's share).
        hi = tl.where(sp == num_splits - 1, tl.minimum(q_len, (tb + 1) * TB), 0)
        for n0 in range(0, hi, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            jm = j < hi
            jt = (q0 + tl.where(jm, j, 0)).to(tl.int64)
            c = tl.load(CN + jt[:, None] * stride_ct + dr[None, :], mask=jm[:, None], other=0.0).to(DT)
            kpe = tl.load(KN + jt[:, None] * stride_kt + dp[None, :], mask=jm[:, None], other=0.0).to(DT)
            vis = jm[None, :] & (j[None, :] <= tt[:, None])
            acc, m, l = _attend_tile(acc, m, l, ql, qp, c, kpe, vis, scale, 1.0, DT)
        if SPLIT:
            seen = l > 0
            out = acc / tl.where(seen, l, 1.0)[:, None]
            row = (tok * H + hs) * num_splits + sp
            tl.store(MO + row[:, None] * RANK + dr[None, :], out, mask=rm[:, None])
            tl.store(ML + row, tl.where(seen, m + tl.log2(tl.where(seen, l, 1.0)), float("-inf")), mask=rm)
        else:
            out = acc / l[:, None]
            tl.store(OUT + tok[:, None] * stride_ot + hs[:, None] * stride_oh + dr[None, :], out.to(OUT.dtype.element_ty), mask=rm[:, None])


@triton.jit
def _dequant_prefix(
    KV, BS, PT, SL, CU, WS, stride_tab, WS_ROWS,
    PAGE: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, FMT: tl.constexpr, DT: tl.constexpr,
    SUB: tl.constexpr,
):
    """Prefix tokens ``[k·SUB, (k+1)·SUB)`` of sequence ``b`` (the cached ones: ``seq_len − new``) from the
    pages into workspace rows ``b·WS_ROWS + position``, as stored values in ``DT`` (no per-layer scale)."""
    b = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    prefix = tl.load(SL + b) - (tl.load(CU + b + 1) - tl.load(CU + b))
    if k * SUB < prefix:
        pos = k * SUB + tl.arange(0, SUB)
        nm = pos < prefix
        page = tl.load(PT + b * stride_tab + pos // PAGE, mask=nm, other=0).to(tl.int64)
        c, kpe = load_latent_tile(KV, BS, page * PAGE + pos % PAGE, nm, RANK, ROPE, FMT, DT)
        row = WS + (b * WS_ROWS + pos)[:, None] * (RANK + ROPE)
        tl.store(row + tl.arange(0, RANK)[None, :], c, mask=nm[:, None])
        tl.store(row + RANK + tl.arange(0, ROPE)[None, :], kpe, mask=nm[:, None])


# Prefix workspace (fp8 / nvfp4 caches): at most this many bytes at a time (the runtime reserves them with its
# activations, runtime/models/engine_setup.py).
WORKSPACE_BYTES = 512 << 20
# Split prefix (few-token extends): the float32 partial outputs stay within this many bytes.
_SPLIT_BYTES = 256 << 20

# Launch defaults by format code (block_m, heads_per_block, block_n, num_warps, num_stages): 64 rows of 4 tokens x 16
# heads on two warp groups (the 64 x 512 fp32 accumulator spills on one).  H100, 2026-11-21 20:44 UTC, batch 2 x 256
# new tokens over 8192 cached (.scratch/prefill_sweep.py), 128 heads: bf16 13.9 -> 4.5 ms, fp8 21.3 -> 6.2 ms, nvfp4
# 30.7 -> 8.5 ms against the previous (64, 16, 32, 4, 2); the same ratios at 16 heads.
_PREFILL_DEFAULTS = {0: (64, 16, 64, 8, 2), 1: (64, 16, 64, 8, 2), 2: (64, 16, 64, 8, 1)}


_DEFAULT_OPTS = MLAPrefillOptions()


def mla_prefill(q_lat, q_pe, c_kv, k_pe, cache: LatentCache, page_table, seq_lens, cu_seqlens_q, sm_scale: float, *,
                q_scale=None, out=None, opts: MLAPrefillOptions = _DEFAULT_OPTS):
    """Absorbed MLA prefill/extend over ragged batches.

    ``q_lat [T, H, rank]``, ``q_pe [T, H, rope]`` (RoPE applied; or both fp8 e4m3 with ``q_scale``),
    ``c_kv [T, rank]`` and ``k_pe [T, rope]`` (RoPE applied) are the new tokens in compute precision,
    sequence ``i`` owning rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``; ``seq_lens`` counts cached prefix
    plus new tokens.  The new latent must already be appended (or be appended in the same step): only the
    prefix is read from the pages.  Returns ``o_lat [T, H, rank]``.  ``opts`` (``config.MLAPrefillOptions``):
    ``max_q_len`` (the most new tokens of one sequence; ``None``: read from ``cu_seqlens_q``), launch parameters
    (left ``None``, they come from ``_PREFILL_DEFAULTS`` for the cache format), the prefix workspace and split.
    ``fp8_scores`` (e4m3 queries over an fp8_e4m3 latent; the default with 64-row tiles, which run on
    ``wgmma``): the prefix scores as fp8 dots of the query on the stored tiles, which are converted only
    for ``P·c``.  (The exact split of bfloat16 queries into two e4m3 terms, as mla_decode does above 32
    heads, was slower here: 8.6 against 6.2 ms at 128 heads, docs/mla.md.)
    """
    import torch

    max_q_len, block_m, heads_per_block, block_n = opts.max_q_len, opts.block_m, opts.heads_per_block, opts.block_n
    num_warps, num_stages, fp8_scores = opts.num_warps, opts.num_stages, opts.fp8_scores
    prefix_workspace, workspace_bytes, num_splits = opts.prefix_workspace, opts.workspace_bytes, opts.num_splits
    fmt = check_cache(cache)
    lay = cache.layout
    dev = cache.data.device
    if q_lat.dim() != 3 or q_lat.shape[2] != lay.kv_lora_rank:
        raise ValueError(f"q_lat must be [T, H, {lay.kv_lora_rank}], got {tuple(q_lat.shape)}")
    t, h = q_lat.shape[:2]
    if tuple(q_pe.shape) != (t, h, lay.rope_dim) or q_pe.dtype != q_lat.dtype:
        raise ValueError(f"q_pe must be [T={t}, H={h}, {lay.rope_dim}] of q_lat's dtype")
    if tuple(c_kv.shape) != (t, lay.kv_lora_rank) or tuple(k_pe.shape) != (t, lay.rope_dim):
        raise ValueError(f"c_kv must be [T={t}, {lay.kv_lora_rank}] and k_pe [T={t}, {lay.rope_dim}]")
    for x in (q_lat, q_pe, c_kv, k_pe, cu_seqlens_q):
        if x.device != dev:
            raise ValueError("all inputs must be on the cache's device")
    if q_lat.stride(2) != 1 or q_pe.stride(2) != 1 or c_kv.stride(1) != 1 or k_pe.stride(1) != 1:
        raise ValueError("inputs must be contiguous in their last dimension")
    b = page_table.shape[0]
    check_paging(page_table, seq_lens, b, dev)
    if cu_seqlens_q.dtype != torch.int32 or tuple(cu_seqlens_q.shape) != (b + 1,):
        raise ValueError(f"cu_seqlens_q must be int32 [batch + 1 = {b + 1}]")
    q_fp8 = q_lat.dtype == torch.float8_e4m3fn
    if q_fp8 and (q_scale is None or q_scale.dtype != torch.float32):
        raise ValueError("fp8 queries need q_scale, an fp32 tensor [1]")
    cdt = c_kv.dtype if q_fp8 else q_lat.dtype
    # Dot operands in the compute dtype, that of the new tokens: e4m3 queries and fp8 / e2m1·e4m3 latents are
    # exact in bf16 and fp16, and the new tokens are not converted (with fp16 operands under bf16 new tokens,
    # a 2048-token prefill took 624 us against 416; H100, 2026-11-21).
    tl_dtype(cdt)  # a supported compute dtype
    b_blocks = (block_m, heads_per_block, block_n, num_warps, num_stages)
    if out is None:
        out = torch.empty(t, h, lay.kv_lora_rank, dtype=cdt, device=dev)
    # The prefix workspace: rows per sequence = the page table's width in tokens (bounds every prefix, no sync).
    page = cache.page_size
    rows = page_table.shape[1] * page
    seq_bytes = rows * lay.head_dim * (torch.finfo(cdt).bits // 8)
    budget = WORKSPACE_BYTES if workspace_bytes is None else int(workspace_bytes)
    ws_ok = fmt != 0 and rows > 0 and seq_bytes <= budget
    if prefix_workspace and fmt == 0:
        raise ValueError("prefix_workspace applies to fp8 / nvfp4 caches (a 16-bit cache is read as it is)")
    if prefix_workspace and fp8_scores:
        raise ValueError("prefix_workspace and fp8_scores exclude each other (the workspace is read in compute precision)")
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item()) if b else 0
    if prefix_workspace is None:
        prefix_workspace = ws_ok and fp8_scores is not True
    elif prefix_workspace:
        if rows == 0:
            prefix_workspace = False  # nothing cached: nothing to dequantize
        elif not ws_ok:
            raise ValueError(f"one sequence's prefix ({seq_bytes} bytes) exceeds workspace_bytes ({budget})")
    if num_splits is not None and int(num_splits) < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    if t == 0 or b == 0:
        return out
    tb, hb, bn = _blocks(0 if prefix_workspace else fmt, h, block_m, heads_per_block, block_n, None, None)[:3]
    if num_splits is None:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        num_splits = default_num_splits(triton.cdiv(max_q_len, tb) * b * triton.cdiv(h, hb), rows, bn, sms,
                                        t * h * lay.kv_lora_rank * 4)
    mid = None
    if num_splits > 1:
        mid = (torch.empty(t, h, num_splits, lay.kv_lora_rank, dtype=torch.float32, device=dev),
               torch.empty(t, h, num_splits, dtype=torch.float32, device=dev), int(num_splits))
    if prefix_workspace:
        group = min(b, budget // seq_bytes)  # sequences per workspace fill (ws_ok: at least one)
        ws = torch.empty(group * rows // page, page, 1, lay.head_dim, dtype=cdt, device=dev)
        ws_pt = _identity_table(dev, group, rows // page)
        if q_fp8:  # converted once for every group (exact; _launch's own conversion is then a no-op)
            q_lat, q_pe = q_lat.to(cdt).contiguous(), q_pe.to(cdt).contiguous()
        sub = 64
        for g0 in range(0, b, group):
            g1 = min(b, g0 + group)
            pt_g, sl_g, cu_g = page_table[g0:g1], seq_lens[g0:g1], cu_seqlens_q[g0:g1 + 1]
            _dequant_prefix[(g1 - g0, triton.cdiv(rows, sub))](
                cache.data, _bs_of(cache), pt_g, sl_g, cu_g, ws, page_table.stride(0), rows,
                PAGE=page, RANK=lay.kv_lora_rank, ROPE=lay.rope_dim, FMT=fmt, DT=tl_dtype(cdt), SUB=sub,
            )
            _launch(q_lat, q_pe, c_kv, k_pe, ws, ws, cache.k_scale, q_scale if q_fp8 else cache.k_scale, ws_pt[: g1 - g0],
                    sl_g, cu_g, out, sm_scale, max_q_len, h, page, lay, 0, cdt, q_fp8, False, *b_blocks, mid=mid)
        return _merge(mid, out, h, lay.kv_lora_rank)
    if fmt == FMT_NVFP4 and block_n is not None and block_n > 64:
        # the GPU check (mla_check, "prefill 128-token tiles") found 2.4e-1 relative error with nvfp4 at 128-token
        # tiles on an H100 with Triton 3.6 (the interpreter is exact); refused rather than wrong
        raise ValueError(f"block_n above 64 is not supported for an nvfp4 latent (got {block_n}); leave block_n "
                         "unset for the default (64) or pass 64 or less, or use the prefix workspace")
    _launch(q_lat, q_pe, c_kv, k_pe, cache.data, _bs_of(cache), cache.k_scale, q_scale if q_fp8 else cache.k_scale,
            page_table, seq_lens, cu_seqlens_q, out, sm_scale, max_q_len, h, page, lay, fmt, cdt, q_fp8, fp8_scores,
            *b_blocks, mid=mid)
    return _merge(mid, out, h, lay.kv_lora_rank)


def _merge(mid, out, h: int, rank: int):
    """The split partial outputs of every new token merged into ``out`` (``mla_decode``'s merge, one row per
    token; the partials already carry ``k_scale``); ``mid`` None: nothing to do."""
    if mid is None:
        return out
    from kvbench.kernels.mla_decode import _mla_decode_merge

    mo, ml, splits = mid
    _mla_decode_merge[(out.shape[0], h)](
        mo, ml, mo, out, mo.stride(0), mo.stride(1), mo.stride(2), out.stride(0), out.stride(1), h, splits,
        RANK=rank, NSP=max(64, triton.next_power_of_2(splits)), SB=8, SCALED=False, num_warps=4,
    )
    return out


@functools.lru_cache(maxsize=32)
def _identity_table(dev, seqs: int, width: int):
    """The workspace's page table: sequence ``i`` owns pages ``i·width .. i·width + width − 1`` (int32, on ``dev``;
    kept, as it never changes, so a call does not launch a fill for it)."""
    import torch

    return torch.arange(seqs * width, dtype=torch.int32, device=dev).view(seqs, width)


def _bs_of(cache: LatentCache):
    """The block-scale tensor to pass (the data itself when the format has none: the kernel never reads it)."""
    return cache.block_scale if cache.block_scale is not None else cache.data


def _blocks(fmt, h, block_m, heads_per_block, block_n, num_warps, num_stages):
    """Launch parameters for format code ``fmt`` (``None`` = ``_PREFILL_DEFAULTS``): (tb, hb, block_n, warps, stages)."""
    d_bm, d_hb, d_bn, d_nw, d_ns = _PREFILL_DEFAULTS[fmt]
    block_m = d_bm if block_m is None else block_m
    heads_per_block = d_hb if heads_per_block is None else heads_per_block
    hb = min(triton.next_power_of_2(h), heads_per_block, block_m)
    return (max(1, block_m // hb), hb, d_bn if block_n is None else block_n, d_nw if num_warps is None else num_warps,
            d_ns if num_stages is None else num_stages)


def default_num_splits(programs: int, prefix_bound: int, block_n: int, num_sms: int, mid_bytes_per_split: int) -> int:
    """Splits of the prefix when the launch has fewer programs than SMs: about one program per SM, never
    splits shorter than four tiles, at most 64, and the partial outputs within ``_SPLIT_BYTES``."""
    n = min(max(1, num_sms // max(programs, 1)), max(1, prefix_bound // (4 * block_n)), 64)
    while n > 1 and n * mid_bytes_per_split > _SPLIT_BYTES:
        n //= 2
    return n


def _launch(q_lat, q_pe, c_kv, k_pe, kv, bs, k_scale, qs, page_table, seq_lens, cu_seqlens_q, out, sm_scale, max_q_len, h,
            page, lay, fmt, cdt, q_fp8, fp8_scores, block_m, heads_per_block, block_n, num_warps, num_stages, mid=None):
    """One launch of the prefill kernel over a (possibly workspace) latent cache of format code ``fmt``;
    ``mid = (MO, ML, num_splits)``: the prefix split, partial outputs there (merged by the caller)."""
    tb, hb, block_n, num_warps, num_stages = _blocks(fmt, h, block_m, heads_per_block, block_n, num_warps, num_stages)
    scores_ok = lay.kv_dtype == "fp8_e4m3" and q_fp8 and fmt != 0
    if fp8_scores and not scores_ok:
        raise ValueError("fp8_scores needs e4m3 queries (with q_scale) and an fp8_e4m3 latent cache")
    # default with 64-row tiles: H100, 2026-11-21 21:35 UTC (.scratch/prefill_q8b.py), 2 x 256 new over 8192
    # cached: 128 heads 6279 -> 5140 us, 16 heads 815 -> 699; with nothing cached (1 x 2048 new) it costs
    # 3018 -> 3309 and 453 -> 509 (the own-token part gains nothing and the fp8 query takes registers)
    fp8_scores = (scores_ok and tb * hb >= 64) if fp8_scores is None else bool(fp8_scores)
    qlh, qph = q_lat, q_pe
    if q_fp8:  # exact in fp16 / bf16; converted here, as mla_decode does (loaded as fp8, the kernel ran 1.5x slower)
        qlh, qph = q_lat.to(cdt).contiguous(), q_pe.to(cdt).contiguous()
        if not fp8_scores:
            q_lat, q_pe = qlh, qph
        elif qlh.stride() != q_lat.stride() or qph.stride() != q_pe.stride():  # the kernel indexes both alike
            q_lat, q_pe = q_lat.contiguous(), q_pe.contiguous()
    b = page_table.shape[0]
    mo, ml, splits = mid if mid is not None else (out, out, 1)
    grid = (triton.cdiv(max_q_len, tb), b, triton.cdiv(h, hb) * splits)
    _mla_prefill_kernel[grid](
        q_lat, q_pe, qlh, qph, c_kv, k_pe, kv, bs, k_scale, qs, page_table, seq_lens, cu_seqlens_q, out, mo, ml,
        float(sm_scale) * math.log2(math.e),
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), c_kv.stride(0), k_pe.stride(0),
        page_table.stride(0), out.stride(0), out.stride(1),
        h, splits,
        PAGE=page, RANK=lay.kv_lora_rank, ROPE=lay.rope_dim, TB=tb, HB=hb, BLOCK_N=block_n,
        FMT=fmt, DT=tl_dtype(cdt), Q_FP8=q_fp8, FP8_SCORES=fp8_scores, SPLIT=mid is not None,
        num_warps=num_warps, num_stages=num_stages,
    )

"""Paged decode attention over the quantized KV cache (Triton, split-K flash-decoding).

One program per (sequence, kv head, split) processes every query head of its GQA group as the rows of
one ``tl.dot``; K/V tiles are gathered from the pages through the page table and dequantized in
registers.  fp8: ``k_scale`` is folded into the softmax scale and ``v_scale`` into the final reduce;
nvfp4: the packed bytes are split into even / odd elements (the query is split the same way), the e2m1
codes become float16 bit patterns and are multiplied by their e4m3 block scale.  A second small kernel
merges the splits, adds the attention-sink logit to the denominator and applies ``v_scale``; with a
single split the first kernel does that itself and the second is not launched.
The split count is a launch constant and every split bound is computed on the device from
``seq_lens``, so one launch configuration serves any lengths (CUDA-graph friendly).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from kvbench.kernels._triton_utils import (cache_dot_code, check_kv, check_query, dequant_tile, format_code,
                                          fp8_pairs_split, load_raw_tile, next_pow2, nvfp4_units_split, page_rows,
                                          pdl, pdl_enter, pdl_launch, to_dot)
from kvbench.kernels.config import AttentionParams, DecodeOptions, PagedKV
from kvbench.kernels.formats import get_format

__all__ = ["paged_decode", "default_num_splits"]

LOG2E = 1.4426950408889634


# per-step integers left unspecialized (Triton would compile a variant for each divisible-by-16 class): the page
# table's row stride (an eager step's table is as wide as its longest sequence), the split count and the
# partial-result strides that follow it; the sequence lengths and page table are read as slices of a mixed step's
# (runtime/attention/mixed.py), so their alignment is not specialized either
@triton.jit(do_not_specialize=["spt_b", "sml_b", "sml_h", "num_splits"],
            do_not_specialize_on_alignment=["SEQ_LENS", "PT"])
def _decode_split_kernel(
    Q, KC, VC, KBS, VBS, K_SCALE, Q_SCALE, PT, SEQ_LENS, ACC, ML, OUT, V_SCALE, SINKS,
    sm_scale_log2,
    sq_b, sq_h, s_page, s_tok, skc_h, svc_h, sb_page, sb_tok, skb_h, svb_h, spt_b,
    sacc_b, sacc_h, sacc_s, sml_b, sml_h, sml_s, so_b, so_h,
    window, num_splits,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, DP_PAD: tl.constexpr, NB: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr, DOT: tl.constexpr, HAS_Q_SCALE: tl.constexpr,
    PREFETCH: tl.constexpr, SPLIT8: tl.constexpr = False, E5M2: tl.constexpr = False, NV4: tl.constexpr = False,
    DIRECT: tl.constexpr = False, HAS_SINKS: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)  # PDL: a programmatic dependent launch (``_triton_utils.pdl_enter``)
    # DIRECT (one split): the program finishes the softmax itself (sinks, v_scale) and writes OUT, and no
    # reduce kernel runs; otherwise it writes its unnormalised partial sums to ACC / ML.
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b)
    start = seq_len * 0
    if window > 0:
        start = tl.maximum(seq_len - window, 0)
    per = tl.cdiv(tl.cdiv(seq_len - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per
    hi = tl.minimum(lo + per, seq_len)

    g = tl.arange(0, G_PAD)
    gmask = g < G
    heads = hk * G + g
    qk_scale = sm_scale_log2
    if FMT != 0:
        qk_scale = qk_scale * tl.load(K_SCALE + hk)
    if HAS_Q_SCALE:
        qk_scale = qk_scale * tl.load(Q_SCALE)
    i = tl.arange(0, DP_PAD)
    pt_row = PT + b.to(tl.int64) * spt_b
    n_off = tl.arange(0, BLOCK_N)
    m_i = tl.full([G_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    if NV4:  # nvfp4 read as 16-bit units of 4 elements: four interleaved quarters
        imask = i < D // 4
        qrow = Q + b.to(tl.int64) * sq_b + heads[:, None] * sq_h
        qm = gmask[:, None] & imask[None, :]
        q_0 = to_dot(tl.load(qrow + 4 * i[None, :], mask=qm, other=0.0), DOT)
        q_1 = to_dot(tl.load(qrow + 4 * i[None, :] + 1, mask=qm, other=0.0), DOT)
        q_2 = to_dot(tl.load(qrow + 4 * i[None, :] + 2, mask=qm, other=0.0), DOT)
        q_3 = to_dot(tl.load(qrow + 4 * i[None, :] + 3, mask=qm, other=0.0), DOT)
        acc_0 = tl.zeros([G_PAD, DP_PAD], tl.float32)
        acc_1 = tl.zeros([G_PAD, DP_PAD], tl.float32)
        acc_2 = tl.zeros([G_PAD, DP_PAD], tl.float32)
        acc_3 = tl.zeros([G_PAD, DP_PAD], tl.float32)
    elif FMT == 2 or SPLIT8:
        imask = i < D // 2
        qrow = Q + b.to(tl.int64) * sq_b + heads[:, None] * sq_h
        qm = gmask[:, None] & imask[None, :]
        q_e = to_dot(tl.load(qrow + 2 * i[None, :], mask=qm, other=0.0), DOT)
        q_o = to_dot(tl.load(qrow + 2 * i[None, :] + 1, mask=qm, other=0.0), DOT)
        acc_e = tl.zeros([G_PAD, DP_PAD], tl.float32)
        acc_o = tl.zeros([G_PAD, DP_PAD], tl.float32)
    else:
        imask = i < D
        q = tl.load(Q + b.to(tl.int64) * sq_b + heads[:, None] * sq_h + i[None, :],
                    mask=gmask[:, None] & imask[None, :], other=0.0)
        q = to_dot(q, DOT)
        acc = tl.zeros([G_PAD, DP_PAD], tl.float32)

    # PREFETCH: the next tile's raw bytes are loaded before this tile is computed, which helps nvfp4's
    # longer dequantization; for the other formats Triton's own pipelining does better (measured).
    offs = lo + n_off
    tmask = offs < hi
    row, brow = page_rows(pt_row, offs, tmask, PAGE, s_page, s_tok, sb_page, sb_tok, FMT)
    kx, kb = load_raw_tile(KC, KBS, row, brow, hk, skc_h, skb_h, i, imask, tmask, NB, D // 16, FMT)
    vx, vb = load_raw_tile(VC, VBS, row, brow, hk, svc_h, svb_h, i, imask, tmask, NB, D // 16, FMT)
    for j in range(lo, hi, BLOCK_N):
        if PREFETCH:
            offs_n = j + BLOCK_N + n_off
            tmask_n = offs_n < hi
            row_n, brow_n = page_rows(pt_row, offs_n, tmask_n, PAGE, s_page, s_tok, sb_page, sb_tok, FMT)
            kx_n, kb_n = load_raw_tile(KC, KBS, row_n, brow_n, hk, skc_h, skb_h, i, imask, tmask_n, NB, D // 16, FMT)
            vx_n, vb_n = load_raw_tile(VC, VBS, row_n, brow_n, hk, svc_h, svb_h, i, imask, tmask_n, NB, D // 16, FMT)
        else:
            offs = j + n_off
            tmask = offs < hi
            row, brow = page_rows(pt_row, offs, tmask, PAGE, s_page, s_tok, sb_page, sb_tok, FMT)
            kx, kb = load_raw_tile(KC, KBS, row, brow, hk, skc_h, skb_h, i, imask, tmask, NB, D // 16, FMT)
            vx, vb = load_raw_tile(VC, VBS, row, brow, hk, svc_h, svb_h, i, imask, tmask, NB, D // 16, FMT)
        if NV4:
            k_0, k_1, k_2, k_3 = nvfp4_units_split(kx, kb, NB)
            qk = tl.dot(q_0, tl.trans(k_0)) + tl.dot(q_1, tl.trans(k_1)) + tl.dot(q_2, tl.trans(k_2)) + tl.dot(
                q_3, tl.trans(k_3))
        elif SPLIT8:
            k_a, k_b = fp8_pairs_split(kx, E5M2)
            qk = tl.dot(q_e, tl.trans(k_a)) + tl.dot(q_o, tl.trans(k_b))
        elif FMT == 2:
            k_a, k_b = dequant_tile(kx, kb, NB, FMT, DOT)
            qk = tl.dot(q_e, tl.trans(k_a)) + tl.dot(q_o, tl.trans(k_b))
        else:
            k_a, k_b = dequant_tile(kx, kb, NB, FMT, DOT)
            qk = tl.dot(q, tl.trans(k_a))
        qk = tl.where(tmask[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pd = to_dot(p, DOT)
        if NV4:
            v_0, v_1, v_2, v_3 = nvfp4_units_split(vx, vb, NB)
            acc_0 = acc_0 * alpha[:, None] + tl.dot(pd, v_0)
            acc_1 = acc_1 * alpha[:, None] + tl.dot(pd, v_1)
            acc_2 = acc_2 * alpha[:, None] + tl.dot(pd, v_2)
            acc_3 = acc_3 * alpha[:, None] + tl.dot(pd, v_3)
        elif FMT == 2 or SPLIT8:
            if SPLIT8:
                v_a, v_b = fp8_pairs_split(vx, E5M2)
            else:
                v_a, v_b = dequant_tile(vx, vb, NB, FMT, DOT)
            acc_e = acc_e * alpha[:, None] + tl.dot(pd, v_a)
            acc_o = acc_o * alpha[:, None] + tl.dot(pd, v_b)
        else:
            v_a, v_b = dequant_tile(vx, vb, NB, FMT, DOT)
            acc = acc * alpha[:, None] + tl.dot(pd, v_a)
        m_i = m_new
        if PREFETCH:
            kx, kb, vx, vb, tmask = kx_n, kb_n, vx_n, vb_n, tmask_n

    om = gmask[:, None] & imask[None, :]
    if DIRECT:
        mx = m_i
        den = l_i * 0.0
        if HAS_SINKS:
            sink = tl.load(SINKS + heads, mask=gmask, other=0.0).to(tl.float32) * 1.4426950408889634
            mx = tl.maximum(mx, sink)
            den = tl.math.exp2(sink - mx)
        w = tl.math.exp2(m_i - mx)
        den += l_i * w
        f = tl.where(den > 0, w / den, 0.0)
        if FMT != 0:
            f = f * tl.load(V_SCALE + hk)
        orow = OUT + b.to(tl.int64) * so_b + heads[:, None] * so_h
        if NV4:
            tl.store(orow + 4 * i[None, :], (acc_0 * f[:, None]).to(OUT.dtype.element_ty), mask=om)
            tl.store(orow + 4 * i[None, :] + 1, (acc_1 * f[:, None]).to(OUT.dtype.element_ty), mask=om)
            tl.store(orow + 4 * i[None, :] + 2, (acc_2 * f[:, None]).to(OUT.dtype.element_ty), mask=om)
            tl.store(orow + 4 * i[None, :] + 3, (acc_3 * f[:, None]).to(OUT.dtype.element_ty), mask=om)
        elif FMT == 2 or SPLIT8:
            tl.store(orow + 2 * i[None, :], (acc_e * f[:, None]).to(OUT.dtype.element_ty), mask=om)
            tl.store(orow + 2 * i[None, :] + 1, (acc_o * f[:, None]).to(OUT.dtype.element_ty), mask=om)
        else:
            tl.store(orow + i[None, :], (acc * f[:, None]).to(OUT.dtype.element_ty), mask=om)
    else:
        ml = ML + b.to(tl.int64) * sml_b + heads * sml_h + split * sml_s
        tl.store(ml, m_i, mask=gmask)
        tl.store(ml + 1, l_i, mask=gmask)
        arow = ACC + b.to(tl.int64) * sacc_b + heads[:, None] * sacc_h + split * sacc_s
        if NV4:
            tl.store(arow + 4 * i[None, :], acc_0, mask=om)
            tl.store(arow + 4 * i[None, :] + 1, acc_1, mask=om)
            tl.store(arow + 4 * i[None, :] + 2, acc_2, mask=om)
            tl.store(arow + 4 * i[None, :] + 3, acc_3, mask=om)
        elif FMT == 2 or SPLIT8:
            tl.store(arow + 2 * i[None, :], acc_e, mask=om)
            tl.store(arow + 2 * i[None, :] + 1, acc_o, mask=om)
        else:
            tl.store(arow + i[None, :], acc, mask=om)


# the split count is a run-time argument, unspecialized: one compile per power-of-two bound S_PAD, not one per
# count (a mixed step's decode rows come in any number, and each new count compiled mid-load)
@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    ACC, ML, OUT, V_SCALE, SINKS,
    sacc_b, sacc_h, sacc_s, sml_b, sml_h, sml_s, so_b, so_h, num_splits,
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
    FMT: tl.constexpr, HAS_SINKS: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    smask = s < num_splits
    d = tl.arange(0, D_PAD)
    dmask = d < D
    ml = ML + b * sml_b + h * sml_h + s * sml_s
    m = tl.load(ml, mask=smask, other=-1.0e30)
    l = tl.load(ml + 1, mask=smask, other=0.0)
    mx = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        mx = tl.maximum(mx, sink)
    w = tl.math.exp2(m - mx)
    denom = tl.sum(l * w, axis=0)
    if HAS_SINKS:
        denom += tl.math.exp2(sink - mx)
    acc = tl.load(ACC + b * sacc_b + h * sacc_h + s[:, None] * sacc_s + d[None, :],
                  mask=smask[:, None] & dmask[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0)
    o = tl.where(denom > 0, o / denom, 0.0)
    if FMT != 0:
        o = o * tl.load(V_SCALE + h // G)
    tl.store(OUT + b * so_b + h * so_h + d, o.to(OUT.dtype.element_ty), mask=dmask)


# Per-format launch defaults from decode sweeps on an H200 (batch 64 x 8192, 32/8 heads, D 128, page 16;
# docs/kernels.md): format code -> (block_n, programs per SM, prefetch, num_warps, num_stages, maxnreg).
# fp8 and nvfp4 (read as 16-bit units, float16 dots) take 128-token tiles over 4 warps with the registers
# capped at 128 per thread, which leaves registers for four programs per SM (Nsight Compute showed the
# previous fp8 default latency-bound at two, 25% occupancy); fp8 292 -> 274 us, nvfp4 419 -> 384 us.
# The cap applies to the float16-dot paths it was measured on (``maxnreg`` overrides it; 0 lifts it).
# Below five stages Triton gives the tile loads one shared-memory buffer here too (page-table indirection; sm_90
# compile), but five stages were slower on an H100 (2026-11-21 23:14 UTC, graph replays; docs/mla.md, "The same on
# an H100"): bf16 716.6 -> 768.9 us, fp8 364.0 -> 412.6, nvfp4 349.7 -> 358.0.  The depths stay.
_DEFAULTS = {0: (64, 2, False, 4, 2, None), 1: (128, 2, False, 4, 3, 128), 2: (128, 2, False, 4, 2, 128)}


# Every format fills four resident slots per SM once where the batch is small: H100, 2026-11-24, 8 × 32768,
# 32/8 heads, HND (``python docs/scripts/speed_probes.py decode-sweep``): nvfp4 5 splits (2 per SM) 284.9 µs, 8
# splits 195.1 µs, 16 splits 200.5 µs; H200, 2026-11-29 (``python docs/scripts/decode_probes.py splits``): bf16
# 5 splits 286.8 µs (88% of copy), 8 splits 251.9 µs (100%); fp8_e4m3 149.8 (84%) against 135.3 µs (93%).  At 64 ×
# 8192 both rules give one split.
_FILL = {0: 4, 1: 4, 2: 4}


def default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132, block_n: int = 64,
                       programs_per_sm: int = 2, fill: Optional[int] = None) -> int:
    """About ``programs_per_sm`` programs per SM (rounded up), or with ``fill`` (resident programs per SM)
    as many as fill every resident slot once (rounded down); never more splits than tiles, at most 64."""
    work = max(batch * num_kv_heads, 1)
    if fill:
        splits = max(1, fill * num_sms // work)
    else:
        splits = max(1, math.ceil(programs_per_sm * num_sms / work))
    return int(min(splits, max(1, math.ceil(max_seq_len / block_n)), 64))


_NO_ATTN = AttentionParams()
_DEFAULT_OPTS = DecodeOptions()


def paged_decode(
    q: torch.Tensor, kv: PagedKV, page_table: torch.Tensor, seq_lens: torch.Tensor, *,
    attn: AttentionParams = _NO_ATTN, out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
    opts: DecodeOptions = _DEFAULT_OPTS,
) -> torch.Tensor:
    """Decode attention: ``q`` ``[B, H_q, D]`` (bf16/fp16/fp32, or float8_e4m3fn with ``attn.q_scale``) over
    each sequence's ``seq_lens[b]`` cached tokens (including the one just appended) in ``kv`` → ``[B, H_q, D]``.
    ``opts`` (``config.DecodeOptions``): ``block_n``, ``num_splits``, ``num_warps``, ``num_stages``,
    ``prefetch`` (load the next tile before computing this one) and ``maxnreg`` (a register cap per thread,
    GPU only) default per format (``_DEFAULTS``).  ``units16`` (default on for fp8 and nvfp4 caches with a
    float16 dot): read the tiles as 16-bit units and split them into interleaved element tiles (fp8: even /
    odd, ``_triton_utils.fp8_pairs_split``; nvfp4: four quarters, ``nvfp4_units_split``).  With one split the
    split kernel writes the output itself; ``split_reduce=True`` keeps the separate reduce kernel.
    ``gluon``: nvfp4 through the explicit-layout kernel of ``decode_nv4.py``.  ``None`` (default): there when
    it applies (a CUDA GPU, head dim 128, at most 16 query heads per kv head, a bf16/fp16 query, pages of a
    multiple of 16 tokens: ``decode_nv4.unsupported``) and no Triton launch option (``block_n``, ``num_warps``,
    ``num_stages``, ``units16``, ``prefetch``, ``maxnreg``) is given, this kernel otherwise; ``True``: that kernel
    or a ValueError saying why not (``prefetch`` and ``maxnreg`` then apply to it, ``decode_nv4.PREFETCH`` /
    ``MAXNREG`` by default); ``False``: this kernel.  Its tile is 128 tokens over 4 warps."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [B, H_q, D] with a contiguous last dim, got {tuple(q.shape)}")
    bsz, hq, d = q.shape
    kv_format, q_scale, sinks = kv.kv_format, attn.q_scale, attn.sinks
    kc, vc = check_kv(kv, d)
    hk = kc.num_kv_heads
    if hq % hk:
        raise ValueError(f"H_q ({hq}) must be a multiple of H_kv ({hk})")
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] < bsz:
        raise ValueError(f"page_table must be int32 [B, max_pages], got {page_table.dtype} {tuple(page_table.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape[0] < bsz:
        raise ValueError(f"seq_lens must be int32 [B], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    is_fp8_q = check_query(q, q_scale, sinks, hq)
    fmt = format_code(kv_format)
    odt = out_dtype or (torch.bfloat16 if is_fp8_q else q.dtype)
    out = torch.empty(bsz, hq, d, dtype=odt, device=q.device) if out is None else out
    if bsz == 0:
        return out
    g = hq // hk
    scale = (attn.sm_scale if attn.sm_scale is not None else d**-0.5) * LOG2E
    if _use_gluon(q, kc, vc, g, q_scale, kv_format, opts):
        return _decode_gluon(q, kc, vc, page_table, seq_lens, out, sinks, scale, attn.sliding_window, g, opts)
    def_bn, def_pps, def_pf, def_nw, def_ns, def_reg = _DEFAULTS[fmt]
    num_warps = def_nw if opts.num_warps is None else opts.num_warps
    num_stages = def_ns if opts.num_stages is None else opts.num_stages
    block_n = def_bn if opts.block_n is None else opts.block_n
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    prefetch = def_pf if opts.prefetch is None else opts.prefetch
    num_splits = opts.num_splits
    if num_splits is None:
        num_splits = default_num_splits(bsz, hk, page_table.shape[1] * kc.page_size, _num_sms(q.device), block_n,
                                        def_pps, _FILL.get(fmt) if block_n == def_bn and num_warps == def_nw else None)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    direct = num_splits == 1 and not opts.split_reduce
    if direct:  # the split kernel writes out; the partial buffers are never touched
        acc = ml = out
    else:
        acc = torch.empty(bsz, hq, num_splits, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(bsz, hq, num_splits, 2, dtype=torch.float32, device=q.device)
    dot = cache_dot_code(kv_format, odt if is_fp8_q else q.dtype)
    units = fmt != 0 and dot == 1 and opts.units16 is not False and d % 2 == 0
    maxnreg = opts.maxnreg
    if maxnreg is None:
        maxnreg = def_reg if units and q.is_cuda else None
    split8, nv4 = units and fmt == 1, units and fmt == 2
    dp = d // 4 if nv4 else d // 2 if fmt == 2 or split8 else d
    kdata, vdata = kc.data, vc.data
    sp, st, khs, vhs = kc.page_stride, kc.tok_stride, kc.head_stride, vc.head_stride
    if units:  # the same bytes seen as int16; strides in 16-bit units
        kdata, vdata = kdata.view(torch.int16), vdata.view(torch.int16)
        sp, st, khs, vhs = sp // 2, st // 2, khs // 2, vhs // 2
    on = pdl()
    _decode_split_kernel[(bsz, hk, num_splits)](
        q, kdata, vdata, kc.bs_ptr, vc.bs_ptr, kc.scale, q_scale if q_scale is not None else kc.scale,
        page_table, seq_lens, acc, ml, out, vc.scale, sinks if sinks is not None else vc.scale, scale,
        q.stride(0), q.stride(1), sp, st, khs, vhs,
        kc.bs_page_stride, kc.bs_tok_stride, kc.bs_head_stride, vc.bs_head_stride, page_table.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1), ml.stride(2),
        out.stride(0), out.stride(1), int(attn.sliding_window or 0), num_splits,
        G=g, G_PAD=max(16, next_pow2(g)), D=d, DP_PAD=next_pow2(dp), NB=next_pow2(max(d // 16, 1)), PAGE=kc.page_size, BLOCK_N=block_n,
        FMT=fmt, DOT=dot, HAS_Q_SCALE=q_scale is not None, PREFETCH=bool(prefetch), SPLIT8=split8,
        E5M2=get_format(kv_format).name == "fp8_e5m2", NV4=nv4, DIRECT=direct, HAS_SINKS=sinks is not None,
        PDL=on, num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}),
        **pdl_launch(on),
    )
    if direct:
        return out
    return _reduce_splits(acc, ml, out, vc, sinks, g, num_splits, fmt)


def _use_gluon(q, kc, vc, g: int, q_scale, kv_format: str, opts: DecodeOptions) -> bool:
    """Whether the call runs ``decode_nv4``'s explicit-layout kernel (``DecodeOptions.gluon``); a ValueError
    saying why not when it was asked for and cannot take the call."""
    gluon = opts.gluon
    if gluon is None:  # the explicit-layout kernel where it applies, unless a Triton launch option was given
        gluon = (get_format(kv_format).name == "nvfp4" and q.is_cuda
                 and all(o is None for o in (opts.block_n, opts.num_warps, opts.num_stages, opts.units16,
                                             opts.prefetch, opts.maxnreg)))
        if gluon:
            from kvbench.kernels import decode_nv4

            gluon = not decode_nv4.unsupported(q, kc, vc, g, q_scale, kv_format)
    elif gluon:  # asked for: the kernel or the reason it cannot take the call
        from kvbench.kernels import decode_nv4

        why = decode_nv4.unsupported(q, kc, vc, g, q_scale, kv_format)
        if why:
            raise ValueError(f"gluon=True: {why} (leave gluon unset to get the Triton kernel for such calls)")
    return bool(gluon)


def _decode_gluon(q, kc, vc, page_table, seq_lens, out, sinks, scale: float, window, g: int,
                  opts: DecodeOptions) -> torch.Tensor:
    """The nvfp4 decode through ``decode_nv4`` (its split count, then its splits merged by the reduce kernel)."""
    from kvbench.kernels import decode_nv4

    bsz, hq, d = q.shape
    num_splits = opts.num_splits
    if num_splits is None:
        num_splits = default_num_splits(bsz, kc.num_kv_heads, page_table.shape[1] * kc.page_size, _num_sms(q.device),
                                        decode_nv4.TILE, 2, decode_nv4.FILL)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_splits == 1 and not opts.split_reduce:
        decode_nv4.launch(q, kc, vc, page_table, seq_lens, out, sinks=sinks, scale=scale, window=window, g=g,
                          opts=opts)
        return out
    acc = torch.empty(bsz, hq, num_splits, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(bsz, hq, num_splits, 2, dtype=torch.float32, device=q.device)
    decode_nv4.launch(q, kc, vc, page_table, seq_lens, out, sinks=sinks, scale=scale, window=window, g=g,
                      splits=(acc, ml, num_splits), opts=opts)
    return _reduce_splits(acc, ml, out, vc, sinks, g, num_splits, 2)


def _reduce_splits(acc, ml, out, vc, sinks, g: int, num_splits: int, fmt: int) -> torch.Tensor:
    """Merge the splits' partial results (``acc`` / ``ml``, written by either split kernel) into ``out``."""
    bsz, hq, d = out.shape
    on = pdl()
    _decode_reduce_kernel[(bsz, hq)](
        acc, ml, out, vc.scale, sinks if sinks is not None else vc.scale,
        acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1), ml.stride(2), out.stride(0), out.stride(1),
        num_splits, G=g, D=d, D_PAD=next_pow2(d), S_PAD=next_pow2(num_splits), FMT=fmt,
        HAS_SINKS=sinks is not None, PDL=on, num_warps=4 if d >= 128 else 2, **pdl_launch(on),
    )
    return out


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count

"""MLA decode in the absorbed form (Triton): split-K flash-decoding over the latent pages.

Each program takes ``BLOCK_H`` query heads of one sequence and one split of its context.  The latent
tile of ``BLOCK_N`` tokens is loaded once, dequantized in registers and used twice: as K
(``q_lat · c + q_pe · k_pe``) and as V (``p · c``).  The per-layer ``k_scale`` is folded into the softmax
scale and into the final reduce; nvfp4 block scales are applied in registers.  With a half-precision
query, fp8 and nvfp4 tiles are read as 16-bit units and split into interleaved element tiles (float16
dots), which keeps them on the 16-bit shared-memory path of the dot operands.  Stage 2 merges the
splits by their log-sum-exp; the split kernel stores the even / odd (or quarter) element tiles as contiguous
runs and the merge puts them back in element order.  Output is the latent ``o_lat [B, H, rank]`` (apply ``W_UV`` afterwards).
Launch defaults depend on the head count (``_DEFAULTS``: 64-head wgmma tiles above 32 heads; below,
16-head tiles, two programs per SM and, for fp8, the latent in four column chunks and five pipeline
stages, which is what gives the tile loads two shared-memory buffers behind the page-table load).  Above 32 heads,
bfloat16 queries over an e4m3 latent are split exactly into two e4m3 terms per row (``_fp8_split``): the
scores run as fp8 dots on the stored tile, and only ``P·c`` converts it (``q_split``).  With e4m3 queries
(``quantize_query``) over an e4m3 latent above 32 heads, the scores are one fp8 dot per part on the stored
tile (``fp8_scores``); ``P·c`` stays in fp16, since an fp8 dot would need the tile transposed.  On an sm_90 GPU
those many-head paths run the Hopper kernel (``mla_decode_wg``) with the same arithmetic.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from kvbench.kernels.mla import LatentCache
from kvbench.kernels._fp8_split import split_e4m3
from kvbench.kernels._triton_utils import fp8_pairs_split, interpreting, nvfp4_units_split
from kvbench.kernels.config import MLADecodeOptions
from kvbench.kernels.mla_common import check_cache, check_paging, load_latent_tile, tl_dtype


@triton.jit
def _units(KV, slot, nm, col0, W: tl.constexpr, PDU: tl.constexpr):
    """int16 units ``[N, W]`` of the latent rows ``slot``, from unit ``col0`` (``PDU`` units per row)."""
    j = tl.arange(0, W)
    return tl.load(KV + slot[:, None] * PDU + col0 + j[None, :], mask=nm[:, None], other=0)


@triton.jit
def _scales(BS, slot, nm, col0, W: tl.constexpr, stride_bs):
    """e4m3 block scales ``[N, W]`` of rows ``slot`` from block ``col0``.  A 576-wide row has 36 scales, so
    rows are only 4-byte aligned; Triton 3.6 carries the first row's alignment over to the others of a
    broadcast row offset and vectorizes the loads (8 bytes, a misaligned-address fault on the H200, seen
    with compute-sanitizer).  Selecting the offsets against 0 leaves the compiler no contiguity to
    vectorize on; these are 1/8 of the bytes of the tile."""
    j = tl.arange(0, W)
    m = nm[:, None] & (j[None, :] < W)
    offs = tl.where(m, slot[:, None] * stride_bs + col0 + j[None, :], 0)
    return tl.load(BS + offs, mask=m, other=0.0)


@triton.jit
def _q_part(row, k: tl.constexpr, STEP: tl.constexpr, W: tl.constexpr, hm, DT: tl.constexpr):
    """Elements ``STEP·j + k`` (j < W) of the query rows (pointers ``row``)."""
    j = tl.arange(0, W)
    return tl.load(row[:, None] + STEP * j[None, :] + k, mask=hm[:, None], other=0.0).to(DT)


@triton.jit
def _q_pairs(row, col0, W: tl.constexpr, hm, DT: tl.constexpr):
    """Elements ``col0 + 2j`` and ``col0 + 2j + 1`` (j < W) of the query rows: one contiguous load of 2W
    columns, split in registers (two stride-2 loads cost ~4.5 us of prologue per program, H100)."""
    j = tl.arange(0, 2 * W)
    x = tl.load(row[:, None] + col0 + j[None, :], mask=hm[:, None], other=0.0).to(DT)
    return tl.split(tl.reshape(x, (x.shape[0], W, 2)))


@triton.jit
def _pairs_scores(u, qa, qb, E5M2: tl.constexpr):
    """Scores of one column chunk of fp8 pairs ``u`` (int16 units) against the query's (even, odd) parts."""
    ca, cb = fp8_pairs_split(u, E5M2)
    return tl.dot(qa, tl.trans(ca)) + tl.dot(qb, tl.trans(cb))


@triton.jit
def _pairs_out(u, acc_a, acc_b, pd, alpha, E5M2: tl.constexpr):
    """The (even, odd) output accumulators of one column chunk, rescaled and advanced by ``pd · c``."""
    ca, cb = fp8_pairs_split(u, E5M2)
    return acc_a * alpha[:, None] + tl.dot(pd, ca), acc_b * alpha[:, None] + tl.dot(pd, cb)


@triton.jit
def _pairs_store(orow, acc_a, acc_b, inv, hm, col0, W: tl.constexpr):
    """The (even, odd) accumulators of the column chunk from unit ``col0`` as two contiguous runs, [even | odd]
    (the merge writes them back in element order; ``_element_col``).  Interleaved stride-2 stores cost ~4.5 us
    per program (H100)."""
    j = tl.arange(0, W)
    tl.store(orow[:, None] + 2 * col0 + j[None, :], acc_a * inv[:, None], mask=hm[:, None])
    tl.store(orow[:, None] + 2 * col0 + W + j[None, :], acc_b * inv[:, None], mask=hm[:, None])


@triton.jit
def _element_col(c, NP: tl.constexpr, W: tl.constexpr):
    """The output column of the split kernel's stored column ``c``: it stores runs of ``W`` columns per part,
    ``NP`` parts per group of ``NP·W`` (run ``k``, position ``j`` holds element ``NP·j + k`` of the group);
    NP 1 is the identity."""
    g = (c // (NP * W)) * (NP * W)
    r = c - g
    return g + NP * (r % W) + r // W


@triton.jit
def _mla_decode_split(
    QL, QP, KV, BS, KSCALE, QSCALE, PT, SL, MO, ML,
    sm_scale_log2,
    stride_lb, stride_lh, stride_pb, stride_ph, stride_pt, stride_mb, stride_mh, stride_ms, stride_bs,
    H, num_splits,
    PAGE: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT: tl.constexpr, DT: tl.constexpr, Q_FP8: tl.constexpr, UNITS: tl.constexpr = 0, E5M2: tl.constexpr = False,
    Q_SPLIT: tl.constexpr = False, EXACT_CAST: tl.constexpr = False, CHUNKS: tl.constexpr = 1,
    PAGE_TILES: tl.constexpr = False, FP8_SCORES: tl.constexpr = False,
):
    """``UNITS`` 0: tiles in their stored type; 1: fp8 read as int16 pairs, split into even / odd element
    tiles; 2: nvfp4 read as int16 units of four codes, split into four interleaved quarters.  The query
    and the accumulator are split the same way, so the output stays in element order.
    ``Q_SPLIT`` (UNITS 0, e4m3 latent, bf16 query): each query row is split exactly into two e4m3 terms
    (``_fp8_split``), the scores are fp8 dots on the latent tile as stored, and only the ``P·c`` operand
    is converted.
    ``CHUNKS`` (UNITS 1: 1, 2 or 4): the latent is loaded, converted and used in that many column chunks,
    each a load of its own, so each dot's operand is a quarter (or half) of the tile (fp8 at 16 heads on an
    H100: 145 -> 141 us with four; docs/mla.md).  ``PAGE_TILES``: ``BLOCK_N`` divides the page size, so a
    tile lies in one page and its slots come from one page-table entry."""
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
    lrow = QL + b * stride_lb + h * stride_lh
    prow = QP + b * stride_pb + h * stride_ph
    scale = sm_scale_log2 * tl.load(KSCALE)
    if Q_FP8:
        scale = scale * tl.load(QSCALE)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    PDU: tl.constexpr = (RANK + ROPE) // 2 if UNITS == 1 else (RANK + ROPE) // 4
    if UNITS == 1:
        RH: tl.constexpr = RANK // 2
        PH: tl.constexpr = ROPE // 2
        CW: tl.constexpr = RH // CHUNKS  # units per column chunk
        qp_0, qp_1 = _q_pairs(prow, 0, PH, hm, DT)
        ql_0, ql_1 = _q_pairs(lrow, 0, CW, hm, DT)
        acc_0 = tl.zeros([BLOCK_H, CW], tl.float32)
        acc_1 = tl.zeros([BLOCK_H, CW], tl.float32)
        if CHUNKS >= 2:
            ql_2, ql_3 = _q_pairs(lrow, 2 * CW, CW, hm, DT)
            acc_2 = tl.zeros([BLOCK_H, CW], tl.float32)
            acc_3 = tl.zeros([BLOCK_H, CW], tl.float32)
        if CHUNKS == 4:
            ql_4, ql_5 = _q_pairs(lrow, 4 * CW, CW, hm, DT)
            ql_6, ql_7 = _q_pairs(lrow, 6 * CW, CW, hm, DT)
            acc_4 = tl.zeros([BLOCK_H, CW], tl.float32)
            acc_5 = tl.zeros([BLOCK_H, CW], tl.float32)
            acc_6 = tl.zeros([BLOCK_H, CW], tl.float32)
            acc_7 = tl.zeros([BLOCK_H, CW], tl.float32)
    elif UNITS == 2:
        RQ: tl.constexpr = RANK // 4
        PQ: tl.constexpr = ROPE // 4
        ql_0 = _q_part(lrow, 0, 4, RQ, hm, DT)
        ql_1 = _q_part(lrow, 1, 4, RQ, hm, DT)
        ql_2 = _q_part(lrow, 2, 4, RQ, hm, DT)
        ql_3 = _q_part(lrow, 3, 4, RQ, hm, DT)
        qp_0 = _q_part(prow, 0, 4, PQ, hm, DT)
        qp_1 = _q_part(prow, 1, 4, PQ, hm, DT)
        qp_2 = _q_part(prow, 2, 4, PQ, hm, DT)
        qp_3 = _q_part(prow, 3, 4, PQ, hm, DT)
        acc_0 = tl.zeros([BLOCK_H, RQ], tl.float32)
        acc_1 = tl.zeros([BLOCK_H, RQ], tl.float32)
        acc_2 = tl.zeros([BLOCK_H, RQ], tl.float32)
        acc_3 = tl.zeros([BLOCK_H, RQ], tl.float32)
    elif FP8_SCORES:
        ql = _q_part(lrow, 0, 1, RANK, hm, QL.dtype.element_ty)
        qp = _q_part(prow, 0, 1, ROPE, hm, QL.dtype.element_ty)
        acc = tl.zeros([BLOCK_H, RANK], tl.float32)
    elif Q_SPLIT:
        ql_hi, ql_lo, inv_l = split_e4m3(_q_part(lrow, 0, 1, RANK, hm, tl.float32), EXACT_CAST)
        qp_hi, qp_lo, inv_p = split_e4m3(_q_part(prow, 0, 1, ROPE, hm, tl.float32), EXACT_CAST)
        acc = tl.zeros([BLOCK_H, RANK], tl.float32)
    else:
        ql = _q_part(lrow, 0, 1, RANK, hm, DT)
        qp = _q_part(prow, 0, 1, ROPE, hm, DT)
        acc = tl.zeros([BLOCK_H, RANK], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nm = pos < end
        if PAGE_TILES:  # one page-table entry per tile
            slot = (tl.load(PT + b * stride_pt + n0 // PAGE).to(tl.int64) * PAGE + n0 % PAGE
                    + tl.arange(0, BLOCK_N))
        else:
            page = tl.load(PT + b * stride_pt + pos // PAGE, mask=nm, other=0).to(tl.int64)
            slot = page * PAGE + pos % PAGE
        if UNITS == 1:
            s = _pairs_scores(_units(KV, slot, nm, RH, PH, PDU), qp_0, qp_1, E5M2)
            u_0 = _units(KV, slot, nm, 0, CW, PDU)
            s += _pairs_scores(u_0, ql_0, ql_1, E5M2)
            if CHUNKS >= 2:
                u_1 = _units(KV, slot, nm, CW, CW, PDU)
                s += _pairs_scores(u_1, ql_2, ql_3, E5M2)
            if CHUNKS == 4:
                u_2 = _units(KV, slot, nm, 2 * CW, CW, PDU)
                s += _pairs_scores(u_2, ql_4, ql_5, E5M2)
                u_3 = _units(KV, slot, nm, 3 * CW, CW, PDU)
                s += _pairs_scores(u_3, ql_6, ql_7, E5M2)
        elif UNITS == 2:
            c_0, c_1, c_2, c_3 = nvfp4_units_split(_units(KV, slot, nm, 0, RQ, PDU),
                                                   _scales(BS, slot, nm, 0, RANK // 16, stride_bs), RANK // 16)
            k_0, k_1, k_2, k_3 = nvfp4_units_split(_units(KV, slot, nm, RQ, PQ, PDU),
                                                   _scales(BS, slot, nm, RANK // 16, ROPE // 16, stride_bs), ROPE // 16)
            s = (tl.dot(ql_0, tl.trans(c_0)) + tl.dot(ql_1, tl.trans(c_1)) + tl.dot(ql_2, tl.trans(c_2))
                 + tl.dot(ql_3, tl.trans(c_3)) + tl.dot(qp_0, tl.trans(k_0)) + tl.dot(qp_1, tl.trans(k_1))
                 + tl.dot(qp_2, tl.trans(k_2)) + tl.dot(qp_3, tl.trans(k_3)))
        elif FP8_SCORES:  # e4m3 query against the stored e4m3 tile: one fp8 dot per part
            c8, kpe8 = load_latent_tile(KV, BS, slot, nm, RANK, ROPE, FMT, KV.dtype.element_ty)
            s = tl.dot(qp, tl.trans(kpe8), tl.dot(ql, tl.trans(c8)))
        elif Q_SPLIT:  # the stored e4m3 tile in both score dots; converted once, for P·c
            c8, kpe8 = load_latent_tile(KV, BS, slot, nm, RANK, ROPE, FMT, KV.dtype.element_ty)
            c = c8.to(DT)
            s_l = tl.dot(ql_lo, tl.trans(c8), tl.dot(ql_hi, tl.trans(c8)))
            s_p = tl.dot(qp_lo, tl.trans(kpe8), tl.dot(qp_hi, tl.trans(kpe8)))
            s = s_l * inv_l[:, None] + s_p * inv_p[:, None]
        else:
            c, kpe = load_latent_tile(KV, BS, slot, nm, RANK, ROPE, FMT, DT)
            s = tl.dot(ql, tl.trans(c)) + tl.dot(qp, tl.trans(kpe))
        s = tl.where(nm[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        pd = p.to(DT)
        if FP8_SCORES:  # P·c in half precision: an fp8 dot would need the tile transposed (K-major)
            acc = acc * alpha[:, None] + tl.dot(pd, c8.to(DT))
        elif UNITS == 1:
            acc_0, acc_1 = _pairs_out(u_0, acc_0, acc_1, pd, alpha, E5M2)
            if CHUNKS >= 2:
                acc_2, acc_3 = _pairs_out(u_1, acc_2, acc_3, pd, alpha, E5M2)
            if CHUNKS == 4:
                acc_4, acc_5 = _pairs_out(u_2, acc_4, acc_5, pd, alpha, E5M2)
                acc_6, acc_7 = _pairs_out(u_3, acc_6, acc_7, pd, alpha, E5M2)
        elif UNITS == 2:
            acc_0 = acc_0 * alpha[:, None] + tl.dot(pd, c_0)
            acc_1 = acc_1 * alpha[:, None] + tl.dot(pd, c_1)
            acc_2 = acc_2 * alpha[:, None] + tl.dot(pd, c_2)
            acc_3 = acc_3 * alpha[:, None] + tl.dot(pd, c_3)
        else:
            acc = acc * alpha[:, None] + tl.dot(pd, c)
        m = m_new
    base = b * stride_mb + h * stride_mh + sp * stride_ms
    if start < end:
        inv = 1.0 / l
        orow = MO + base
        if UNITS == 1:
            _pairs_store(orow, acc_0, acc_1, inv, hm, 0, CW)
            if CHUNKS >= 2:
                _pairs_store(orow, acc_2, acc_3, inv, hm, CW, CW)
            if CHUNKS == 4:
                _pairs_store(orow, acc_4, acc_5, inv, hm, 2 * CW, CW)
                _pairs_store(orow, acc_6, acc_7, inv, hm, 3 * CW, CW)
        elif UNITS == 2:
            j4 = tl.arange(0, RQ)  # quarters as four contiguous runs (_element_col)
            tl.store(orow[:, None] + j4[None, :], acc_0 * inv[:, None], mask=hm[:, None])
            tl.store(orow[:, None] + RQ + j4[None, :], acc_1 * inv[:, None], mask=hm[:, None])
            tl.store(orow[:, None] + 2 * RQ + j4[None, :], acc_2 * inv[:, None], mask=hm[:, None])
            tl.store(orow[:, None] + 3 * RQ + j4[None, :], acc_3 * inv[:, None], mask=hm[:, None])
        else:
            tl.store(orow[:, None] + dr[None, :], acc * inv[:, None], mask=hm[:, None])
        tl.store(ML + b * (H * num_splits) + h * num_splits + sp, m + tl.log2(l), mask=hm)
    else:
        tl.store(ML + b * (H * num_splits) + h * num_splits + sp, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=hm)


@triton.jit
def _mla_decode_merge(
    MO, ML, KSCALE, OUT, stride_mb, stride_mh, stride_ms, stride_ob, stride_oh, H, num_splits,
    RANK: tl.constexpr, NSP: tl.constexpr, SB: tl.constexpr, NP: tl.constexpr = 1, W: tl.constexpr = 1,
    SCALED: tl.constexpr = True,
):
    """One (sequence, head): the splits' partial outputs weighted by their log-sum-exp.  The maximum over
    all log-sum-exps first (``NSP``: 64, or the split count rounded up to a power of two above that; masked
    to ``num_splits``, so one compile serves every split count up to 64), then the partial outputs ``SB``
    splits at a time as ``[SB, RANK]`` tiles, in the split kernel's column order (``NP``, ``W``:
    ``_element_col``), which the store puts back in element order.  Loads of the partials in element order
    (a gather of each tile) took 11 us against 4 at 16 heads, 64 x 8192 (H100)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    dr = tl.arange(0, RANK)
    lse_row = ML + b * (H * num_splits) + h * num_splits
    allsp = tl.arange(0, NSP)
    mx = tl.max(tl.load(lse_row + allsp, mask=allsp < num_splits, other=float("-inf")), axis=0)
    mx = tl.where(mx > float("-inf"), mx, 0.0)  # no split saw a token: every weight below is 0
    acc = tl.zeros([RANK], tl.float32)
    w = 0.0
    for s0 in range(0, num_splits, SB):
        sp = s0 + tl.arange(0, SB)
        lse = tl.load(lse_row + sp, mask=sp < num_splits, other=float("-inf"))
        live = lse > float("-inf")  # splits that saw tokens (the others left their partial output unwritten)
        e = tl.where(live, tl.exp2(lse - mx), 0.0)
        w += tl.sum(e, axis=0)
        part = tl.load(MO + b * stride_mb + h * stride_mh + sp[:, None] * stride_ms + dr[None, :],
                       mask=live[:, None], other=0.0)
        acc += tl.sum(part * e[:, None], axis=0)
    out = tl.where(w > 0, acc / tl.maximum(w, 1e-30), 0.0)
    if SCALED:  # False: the partials already carry the per-layer scale (mla_prefill's split)
        out = out * tl.load(KSCALE)
    tl.store(OUT + b * stride_ob + h * stride_oh + _element_col(dr, NP, W), out.to(OUT.dtype.element_ty))


def default_num_splits(batch: int, head_groups: int, max_len: int, block_n: int, num_sms: int, per_sm: int = 3) -> int:
    """About ``per_sm`` programs per SM (never more), never splits shorter than four tiles, at most 64 splits,
    or 128 when one sequence is the only program row (batch 1, one head group).  H100, 2026-11-21 21:02 UTC
    (``.scratch/splits_b1.py``, graph replays), 16 heads, batch 1 x 131072: bf16 125.6 -> 83.1 us, fp8 89.6
    -> 66.7, nvfp4 185.1 -> 113.1 at 128 splits; at 1 x 32768 0.4-7 us faster; at batch 2 and more, or 128
    heads, more splits than the defaults were slower."""
    want = max(1, (per_sm * num_sms) // (batch * head_groups))
    most = max(1, max_len // (4 * block_n))
    return int(min(want, most, 128 if batch * head_groups == 1 else 64))


# Launch defaults from sweeps at batch 64 x 8192 (docs/mla.md): format code -> per head-count regime
# (units16, block_h, block_n, num_warps, num_stages, programs per SM, column chunks of the 16-bit-unit latent).
# "many" (> 32 heads, e.g. DeepSeek-V3's 128) runs 64-head wgmma tiles and is bound by the tensor cores; "few"
# (16 heads: V2-Lite, or V3 at tensor-parallel 8) is bound by memory and latency.  "few" on an H100,
# 2026-11-21: two programs per SM (one wave of long splits; the 253-register fp8 kernel fits two per SM, so
# four per SM ran two waves) and the fp8 latent in four column chunks: fp8 176 -> 142 us, bf16 239 -> 227 us,
# nvfp4 269 -> 235-240 us (with one page-table entry per tile and the merge loading splits as tiles).
# Pipeline depth: the tile's slots come from a page-table load, one level of indirection, and Triton 3.6 then
# gives the tile loads a single shared-memory buffer below five stages (the next tile's copy is issued after
# the last read of this one, so its whole latency is exposed); from five stages on, two buffers.  fp8 at 16
# heads, 5 stages (two programs still fit per SM: 94 KB each): H200 2026-11-21 22:14 UTC, graph replays
# (.scratch/stages.py), 123.2 -> 112.0 us; bf16 and nvfp4 gained nothing there.  On an H100 (23:13 UTC,
# ``mla_check --stages``) the same change gained 1.5%: 133.3 -> 131.3 us.
_DEFAULTS = {
    "many": {0: (False, 64, 64, 8, 2, 3, 1), 1: (True, 64, 64, 8, 2, 3, 1), 2: (True, 64, 64, 8, 1, 3, 1)},
    "few": {0: (False, 16, 64, 4, 3, 2, 1), 1: (True, 16, 64, 4, 5, 2, 4), 2: (True, 16, 32, 4, 2, 2, 1)},
}
# Stages of the many-heads paths that read the e4m3 tile as stored (q_split, fp8_scores): two buffers as above.
# Same run, 128 heads: q_split 649.9 -> 602.4 us, e4m3 queries (fp8_scores) 485.2 -> 415.2 us.
_STORED_FP8_STAGES = 5


def _defaults(fmt: int, heads: int):
    return _DEFAULTS["many" if heads > 32 else "few"][fmt]


_DEFAULT_OPTS = MLADecodeOptions()


def mla_decode(q_lat, q_pe, cache: LatentCache, page_table, seq_lens, sm_scale: float, *, q_scale=None, out=None,
               opts: MLADecodeOptions = _DEFAULT_OPTS):
    """Absorbed MLA decode: one query token per sequence.

    ``q_lat [B, H, rank]``, ``q_pe [B, H, rope]`` (RoPE applied) in the compute dtype, or both fp8 e4m3
    with ``q_scale`` (fp32 [1]); ``seq_lens`` counts every cached token, the one just appended included.
    Returns ``o_lat [B, H, rank]`` in the compute dtype (bfloat16 for fp8 queries).  ``opts``
    (``config.MLADecodeOptions``): ``num_splits`` and ``max_seq_len`` (the longest sequence, sizing the default
    split count; ``None``: read from ``seq_lens``), tiles, warps, stages, and the kernel variants:
    ``units16`` (fp8 / nvfp4 caches, half-precision compute): read the latent as 16-bit units and split
    it in registers (see ``_mla_decode_split``); the default and the tile sizes come from ``_defaults``.
    ``q_split`` (e4m3 latent, bfloat16 queries, more than 32 heads by default): split each query row
    exactly into two e4m3 terms and compute the scores as fp8 dots on the stored latent.
    ``chunks`` (1, 2 or 4; fp8 latents read as 16-bit units): load and use the latent in that many column
    chunks (default from ``_defaults``: 4 at 32 heads or fewer); it has no effect on other paths.
    ``fp8_scores`` (e4m3 queries with ``q_scale`` over an fp8_e4m3 latent; default above 32 heads): the scores
    ``q_lat·c + q_pe·k_pe`` as fp8 dots of the query on the tile as stored, the same values as the
    converted path up to float32 summation order.  At 16 heads Triton lowers those dots to 16-row fp16
    ``mma`` and the converted 16-bit-unit path is faster.
    ``wgmma``: the Hopper kernel with warpgroup MMAs from shared memory (``mla_decode_wg``: bf16 queries over
    a bf16 latent; bf16 queries, split as ``q_split`` does, or e4m3 queries over an e4m3 latent, and the split
    bf16 queries over an e5m2 latent, the scores on the stored tile and ``P·c`` in fp16; or ``fp8_pv``); by
    default above 32 heads wherever it applies and no tile or launch option of the Triton kernel (``block_h``, ``block_n``, ``num_warps``, ``num_stages``,
    ``units16``, ``chunks``, ``q_split=False``, ``fp8_scores=False``) is given; ``True`` raises where it does
    not apply or with any of those options.
    ``fp8_pv`` (e4m3 queries over an fp8_e4m3 latent; off by default): ``fp8_scores`` and ``P·c`` as an fp8 MMA
    too, with ``P`` rounded to e4m3 (lossy: the regime of fp8 attention kernels); runs ``mla_decode_wg``.
    """
    import torch

    num_splits, max_seq_len, block_h, block_n = opts.num_splits, opts.max_seq_len, opts.block_h, opts.block_n
    num_warps, num_stages, units16, q_split, chunks = opts.num_warps, opts.num_stages, opts.units16, opts.q_split, opts.chunks
    fp8_scores, wgmma, fp8_pv = opts.fp8_scores, opts.wgmma, opts.fp8_pv
    # the Triton kernel's own options, as given (they select it over the Hopper kernel)
    # (q_split / fp8_scores off: the tile converted for the scores, which only the Triton kernel does)
    triton_opts = [k for k, v in (("block_h", block_h), ("block_n", block_n), ("num_warps", num_warps),
                                  ("num_stages", num_stages), ("units16", units16), ("chunks", chunks)) if v is not None]
    triton_opts += [k for k, v in (("q_split", q_split), ("fp8_scores", fp8_scores)) if v is False]
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
    d_units, d_bh, d_bn, d_nw, d_ns, per_sm, d_chunks = _defaults(fmt, h)
    split_ok = lay.kv_dtype == "fp8_e4m3" and q_lat.dtype == torch.bfloat16
    if q_split and not split_ok:
        raise ValueError("q_split needs an fp8_e4m3 latent cache and bfloat16 queries")
    if q_split and units16:
        raise ValueError("q_split reads the latent as stored; it excludes units16")
    # default: split above 32 heads (64-row wgmma tiles; measured 852 -> 671 us at 128 heads, 64 x 8192 on
    # an H200), not at 16 (16-row tiles: Triton lowers an fp8 dot to fp16 mma there; 163 -> 470 us)
    q_split = split_ok and (h > 32 and not units16 if q_split is None else bool(q_split))
    scores_ok = q_fp8 and lay.kv_dtype == "fp8_e4m3"
    if fp8_scores and not scores_ok:
        raise ValueError("fp8_scores needs e4m3 queries (with q_scale) and an fp8_e4m3 latent cache")
    if fp8_scores and units16:
        raise ValueError("fp8_scores reads the latent as stored; it excludes units16")
    if fp8_pv and not scores_ok:
        raise ValueError("fp8_pv needs e4m3 queries (with q_scale) and an fp8_e4m3 latent cache")
    if fp8_pv and (wgmma is False or fp8_scores is False):
        raise ValueError("fp8_pv runs the wgmma kernel with fp8 scores only")
    # default: above 32 heads (64-row wgmma tiles), as for q_split; always under fp8_pv
    fp8_scores = scores_ok and (bool(fp8_pv) or (h > 32 and not units16 if fp8_scores is None else bool(fp8_scores)))
    units = ((d_units if units16 is None else bool(units16)) and fmt != 0 and cdt != torch.float32 and not q_split
             and not fp8_scores)
    if chunks is not None and chunks not in (1, 2, 4):
        raise ValueError(f"chunks must be 1, 2 or 4, got {chunks}")
    chunks = (d_chunks if chunks is None else chunks) if units and fmt == 1 else 1
    while chunks > 1 and lay.kv_lora_rank // (2 * chunks) < 16:  # a dot needs 16 units of depth
        chunks //= 2
    if (wgmma or fp8_pv) and triton_opts:
        raise ValueError(f"{'fp8_pv' if fp8_pv else 'wgmma'} runs the Hopper kernel, which takes none of the Triton "
                         f"kernel's options: {', '.join(triton_opts)}")
    wg_why = None
    if wgmma or fp8_pv or (wgmma is None and h > 32 and not triton_opts):
        from kvbench.kernels import mla_decode_wg

        wg_why = mla_decode_wg.unsupported(cache, q_lat, fp8_pv)
        if (wgmma or fp8_pv) and wg_why:
            opt = "fp8_pv" if fp8_pv else "wgmma"
            hint = ("leave fp8_pv off for the Triton kernel, with P in float16" if fp8_pv
                    else "leave wgmma unset for the Triton kernel")
            raise ValueError(f"{opt}: {wg_why} ({hint})")
    wgmma = (wgmma or fp8_pv or (wgmma is None and h > 32 and not triton_opts)) and wg_why is None
    if wgmma and q_fp8:
        fp8_scores = True  # the Hopper kernel's scores over an e4m3 latent run on the tile as stored
    block_h = d_bh if block_h is None else block_h
    block_n = d_bn if block_n is None else block_n
    num_warps = d_nw if num_warps is None else num_warps
    if num_stages is None:
        num_stages = _STORED_FP8_STAGES if q_split or fp8_scores else d_ns
    # fp8 queries, 16-bit units or the query split: dot operands in fp16 (fp8 / e2m1·e4m3 values are exact
    # in it) unless the cache is bf16.
    if q_fp8 or units or q_split:
        dt = tl_dtype(torch.bfloat16 if cache.data.dtype == torch.bfloat16 else torch.float16)
    else:
        dt = tl_dtype(cdt)
    if q_fp8 and not fp8_scores:
        # e4m3 is exact in fp16 and bf16.  Converted here, not in the kernel: loaded as fp8 there, the 16-head
        # units kernel took 241 us against 142 for the same values in fp16 (H100, 64 x 8192, 2026-11-21).
        qdt = torch.bfloat16 if dt == tl.bfloat16 else torch.float16
        q_lat, q_pe = q_lat.to(qdt), q_pe.to(qdt)
    check_paging(page_table, seq_lens, b, dev)
    if out is None:
        out = torch.empty(b, h, lay.kv_lora_rank, dtype=cdt, device=dev)
    if b == 0:
        return out
    block_h = max(16, min(block_h, triton.next_power_of_2(h)))
    if wgmma:  # one program per SM (its shared memory), 64-head groups and 64-token tiles
        block_h, block_n, per_sm, units, chunks = mla_decode_wg.BLOCK_H, mla_decode_wg.BLOCK_N, 1, False, 1
    hg = triton.cdiv(h, block_h)
    if num_splits is None:
        longest = max_seq_len if max_seq_len is not None else int(seq_lens.max().item())
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        num_splits = default_num_splits(b, hg, longest, block_n, sms, per_sm)
    elif int(num_splits) < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    parts = 2 * fmt if units else 1  # element tiles per column chunk: fp8 (even, odd), nvfp4 four quarters
    mid_o = torch.empty(b, h, num_splits, lay.kv_lora_rank, dtype=torch.float32, device=dev)
    mid_l = torch.empty(b, h, num_splits, dtype=torch.float32, device=dev)
    bs = cache.block_scale if cache.block_scale is not None else cache.data
    kv = cache.data.view(torch.int16) if units else cache.data
    qs = q_scale if q_fp8 else cache.k_scale
    if wgmma:
        mla_decode_wg.launch(q_lat, q_pe, cache, page_table, seq_lens, mid_o, mid_l,
                             float(sm_scale) * math.log2(math.e), qs, num_splits, fp8_pv)
    else:
        _mla_decode_split[(b, hg, num_splits)](
            q_lat, q_pe, kv, bs, cache.k_scale, qs, page_table, seq_lens, mid_o, mid_l,
            float(sm_scale) * math.log2(math.e),
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), page_table.stride(0),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), (lay.head_dim // 16),
            h, num_splits,
            PAGE=cache.page_size, RANK=lay.kv_lora_rank, ROPE=lay.rope_dim, BLOCK_H=block_h, BLOCK_N=block_n,
            FMT=fmt, DT=dt, Q_FP8=q_fp8, UNITS=(fmt if units else 0), E5M2=cache.layout.kv_dtype == "fp8_e5m2",
            Q_SPLIT=q_split, EXACT_CAST=interpreting(), CHUNKS=chunks, PAGE_TILES=cache.page_size % block_n == 0,
            FP8_SCORES=fp8_scores,
            num_warps=num_warps, num_stages=num_stages,
        )
    _mla_decode_merge[(b, h)](
        mid_o, mid_l, cache.k_scale, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        out.stride(0), out.stride(1), h, num_splits, RANK=lay.kv_lora_rank,
        NSP=max(64, triton.next_power_of_2(num_splits)), SB=8, num_warps=4,
        NP=parts, W=lay.kv_lora_rank // (parts * chunks),
    )
    return out

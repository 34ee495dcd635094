"""Paged prefill / extend attention over a quantized prefix (Triton).

New tokens of several sequences come packed (``cu_seqlens_q``).  Each program takes ``BLOCK_M`` new
tokens of one sequence and one query head and runs causal flash attention in two phases:

1. the cached prefix ``[0, seq_len − q_len)``, gathered tile by tile from the pages through the page
   table and dequantized in registers (fp8: ``k_scale`` folded into the logit scale, ``v_scale`` applied
   to each tile's ``P·V``; nvfp4: even / odd element tiles with their e4m3 block scales) — or, for long
   extends over nvfp4 (and fp8 whose scores cannot run on the stored K), from the batch's prefix
   dequantized once into a bounded float16 workspace (``workspace_plan``), since every program would
   otherwise unpack every prefix tile again;
2. the new tokens themselves, read from ``k_new`` / ``v_new`` in compute precision (the append kernel
   wrote their quantized copy to the pages in the same step), with the causal mask on the diagonal
   tiles only.

Sliding window and attention sinks follow ``reference.py``'s conventions.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from kvbench.kernels._fp8_split import split_e4m3
from kvbench.kernels._triton_utils import (
    CacheArgs,
    cache_dot_code,
    check_kv,
    check_query,
    dot_code,
    format_code,
    interpreting,
    load_nvfp4_tile,
    load_plain_tile,
    next_pow2,
    page_rows,
    to_dot,
)
from kvbench.kernels.config import AttentionParams, PagedKV, PrefillOptions

log = logging.getLogger("kvbench.kernels")

__all__ = ["paged_prefill", "tma_ok"]

LOG2E = 1.4426950408889634


@triton.jit
def _load_new(KN, tok, hk, s_t, s_h, i, imask, tmask, SPLIT: tl.constexpr, DOT: tl.constexpr,
              UNMASKED: tl.constexpr = False):
    """``UNMASKED``: every row is in range and the head dim fills the tile (full tiles), no predicates."""
    base = KN + tok[:, None] * s_t + hk * s_h
    m = tmask[:, None] & imask[None, :]
    if SPLIT:
        if UNMASKED:
            a = to_dot(tl.load(base + 2 * i[None, :]), DOT)
            b = to_dot(tl.load(base + 2 * i[None, :] + 1), DOT)
        else:
            a = to_dot(tl.load(base + 2 * i[None, :], mask=m, other=0.0), DOT)
            b = to_dot(tl.load(base + 2 * i[None, :] + 1, mask=m, other=0.0), DOT)
    else:
        if UNMASKED:
            a = to_dot(tl.load(base + i[None, :]), DOT)
        else:
            a = to_dot(tl.load(base + i[None, :], mask=m, other=0.0), DOT)
        b = a
    return a, b


@triton.jit
def _new_tile(KN, VN, q_start, j, n_off, q_len, hk, skn_t, skn_h, svn_t, svn_h, i, imask, D: tl.constexpr,
              SPLIT: tl.constexpr, DOT: tl.constexpr, TMA: tl.constexpr, UNMASKED: tl.constexpr):
    """Keys and values ``j + n_off`` of the new tokens of the sequence starting at ``q_start``: one
    descriptor copy each (``TMA``), or pointer loads (``UNMASKED``: a full tile, no predicates)."""
    if TMA:
        k_a = to_dot(KN.load([q_start + j, hk * D]), DOT)
        v_a = to_dot(VN.load([q_start + j, hk * D]), DOT)
        k_b = k_a
        v_b = v_a
    else:
        offs = j + n_off
        kt = q_start.to(tl.int64) + offs
        k_a, k_b = _load_new(KN, kt, hk, skn_t, skn_h, i, imask, offs < q_len, SPLIT, DOT, UNMASKED)
        v_a, v_b = _load_new(VN, kt, hk, svn_t, svn_h, i, imask, offs < q_len, SPLIT, DOT, UNMASKED)
    return k_a, k_b, v_a, v_b


@triton.jit
def _update(q_a, q_b, k_a, k_b, v_a, v_b, acc_a, acc_b, m_i, l_i, mask, scale, vscale,
            SPLIT: tl.constexpr, DOT: tl.constexpr, SCALE_V: tl.constexpr, MASKED: tl.constexpr,
            Q_SPLIT: tl.constexpr = False):
    """``Q_SPLIT``: q = hi + lo (``q_a``, ``q_b``, fp8) against the stored fp8 K, two chained fp8 dots, and
    ``scale`` is per row (it carries each row's inverse power-of-two scale)."""
    qk = tl.dot(q_a, tl.trans(k_a))
    if SPLIT:
        qk += tl.dot(q_b, tl.trans(k_b))
    if Q_SPLIT:
        qk = tl.dot(q_b, tl.trans(k_a), qk)
        sc = scale[:, None]
    else:
        sc = scale
    if MASKED:
        qk = tl.where(mask, qk, float("-inf"))
    # scale > 0 (checked by the launcher): max(s·x) = s·max(x), and s·x − m is one FMA per element
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale)
    p = tl.math.exp2(qk * sc - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if SCALE_V:
        p = p * vscale
    pd = to_dot(p, DOT)
    acc_a = acc_a * alpha[:, None] + tl.dot(pd, v_a)
    if SPLIT:
        acc_b = acc_b * alpha[:, None] + tl.dot(pd, v_b)
    return acc_a, acc_b, m_new, l_i


@triton.jit
def _prefix_tile(KC, VC, KBS, VBS, pt_row, offs, prefix, qpos, wlim, hk, i, imask, qp_a, qp_b, acc_a, acc_b, m_i,
                 l_i, pscale, vscale, s_page, s_tok, skc_h, svc_h, sb_page, sb_tok, skb_h, svb_h,
                 PAGE: tl.constexpr, NB: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, DOT_P: tl.constexpr,
                 SPLIT: tl.constexpr, FP8_QK: tl.constexpr, MASKED: tl.constexpr, Q_SPLIT: tl.constexpr):
    """One tile of the cached prefix: keys ``offs`` read through the page table and dequantized in
    registers (``FP8_QK``: K kept in fp8 for an fp8 ``Q·Kᵀ``; ``Q_SPLIT``: against a split bf16 q), then
    the online-softmax update."""
    tmask = offs < prefix
    row, brow = page_rows(pt_row, offs, tmask, PAGE, s_page, s_tok, sb_page, sb_tok, FMT)
    if FMT == 2:
        k_a, k_b = load_nvfp4_tile(KC, KBS, row, brow, hk, skc_h, skb_h, i, imask, tmask, NB, D // 16, DOT_P)
        v_a, v_b = load_nvfp4_tile(VC, VBS, row, brow, hk, svc_h, svb_h, i, imask, tmask, NB, D // 16, DOT_P)
    else:
        k_a = load_plain_tile(KC, row, hk, skc_h, i, imask, tmask, 4 if FP8_QK else DOT_P)
        v_a = load_plain_tile(VC, row, hk, svc_h, i, imask, tmask, DOT_P)
        k_b = k_a
        v_b = v_a
    mask = tmask[None, :] & ((qpos[:, None] - offs[None, :]) < wlim)
    return _update(qp_a, qp_b, k_a, k_b, v_a, v_b, acc_a, acc_b, m_i, l_i, mask, pscale, vscale, SPLIT, DOT_P,
                   FMT != 0, MASKED, Q_SPLIT)


# the page table's row stride changes with every step's longest sequence; a mixed step's prefill part reads the
# sequence lengths and page-table rows after its decode rows (runtime/attention/mixed.py), so their alignment
# changes with the decode-row count: neither is specialized (one compile, not one per class met while serving)
@triton.jit(do_not_specialize=["spt_b"], do_not_specialize_on_alignment=["SEQ_LENS", "PT"])
def _prefill_kernel(
    Q, KN, VN, KC, VC, KBS, VBS, K_SCALE, V_SCALE, Q_SCALE, SINKS, PT, SEQ_LENS, CU_Q, OUT,
    sm_scale_log2,
    sq_t, sq_h, skn_t, skn_h, svn_t, svn_h, so_t, so_h,
    s_page, s_tok, skc_h, svc_h, sb_page, sb_tok, skb_h, svb_h, spt_b,
    window,
    G: tl.constexpr, D: tl.constexpr, DP_PAD: tl.constexpr, NB: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr, DOT: tl.constexpr, DOT_P: tl.constexpr,
    HAS_Q_SCALE: tl.constexpr, HAS_SINKS: tl.constexpr, HEAVY_FIRST: tl.constexpr = True,
    FULL_D: tl.constexpr = False, FP8_QK: tl.constexpr = False, PREFIX_FULL: tl.constexpr = True,
    BLOCK_NP: tl.constexpr = 64, TMA: tl.constexpr = False, Q_SPLIT: tl.constexpr = False,
    EXACT_CAST: tl.constexpr = False, NO_PREFIX: tl.constexpr = False,
):
    # FULL_D: the head dim (or its halves) fills DP_PAD, so full tiles of new tokens load without masks
    # HEAVY_FIRST: the last query blocks (the most causal work) are launched first, so the short ones
    # fill the tail of the grid
    # BLOCK_NP: keys per tile over the prefix (no causal waste there, so larger tiles than BLOCK_N pay)
    # TMA: Q, KN and VN are tensor descriptors over the packed [T, H·D] rows (Hopper's tensor memory
    # accelerator: one bulk copy per tile, no per-element addresses or predicates; rows past T read as
    # zeros, and rows of the next sequence in a tile's tail are masked like any key past the query)
    # Q_SPLIT (with FP8_QK): a bf16 q over an e4m3 prefix is split exactly into two e4m3 terms per row
    # (``_fp8_split``), so the prefix's Q·Kᵀ runs as two fp8 dots on the stored K with no K conversion
    # NO_PREFIX: the caller said no sequence has a cached prefix (prompts only): phase 1 is not compiled, so
    # the cache is never read (an nvfp4 cache's prompts then run the plain path: no half-head split, TMA)
    mb = tl.program_id(0)
    if HEAVY_FIRST:
        mb = tl.num_programs(0) - 1 - mb
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    seq_len = tl.load(SEQ_LENS + b)
    prefix = seq_len - q_len
    hk = h // G
    SPLIT: tl.constexpr = FMT == 2
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    tok = (q_start + rows).to(tl.int64)
    i = tl.arange(0, DP_PAD)
    if SPLIT:
        imask = i < D // 2
    else:
        imask = i < D
    # q for the new tokens (q_a, q_b) and for the prefix tiles (qp_a, qp_b), which may use another dot dtype
    if TMA:
        q_raw = Q.load([q_start + mb * BLOCK_M, h * D])
        q_a = to_dot(q_raw, DOT)
        q_b = q_a
    else:
        q_a, q_b = _load_new(Q, tok, h, sq_t, sq_h, i, imask, rmask, SPLIT, DOT)
    if Q_SPLIT:  # bf16 q, e4m3 prefix: hi + lo in e4m3, two fp8 dots of the stored values
        qp_a, qp_b, qinv = split_e4m3(q_a.to(tl.float32), EXACT_CAST)
    elif FP8_QK:  # fp8 q, e4m3 prefix: the prefix's Q·Kᵀ as an fp8 dot of the stored values
        if TMA:
            qp_a = q_raw
            qp_b = q_raw
        else:
            qp_a, qp_b = _load_new(Q, tok, h, sq_t, sq_h, i, imask, rmask, SPLIT, 4)
    elif DOT_P == DOT:
        qp_a = q_a
        qp_b = q_b
    elif TMA:  # the prefix tiles use their own dot dtype (fp16 for fp8 / nvfp4)
        qp_a = to_dot(q_raw, DOT_P)
        qp_b = qp_a
    else:
        qp_a, qp_b = _load_new(Q, tok, h, sq_t, sq_h, i, imask, rmask, SPLIT, DOT_P)
    scale = sm_scale_log2
    if HAS_Q_SCALE:
        scale = scale * tl.load(Q_SCALE)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, DP_PAD], tl.float32)
    acc_b = tl.zeros([BLOCK_M, DP_PAD], tl.float32)
    n_off = tl.arange(0, BLOCK_N)

    # ---- phase 1: the cached prefix, from the pages
    qpos = prefix + rows
    kstart = prefix * 0
    if window > 0:
        kstart = tl.maximum(prefix + mb * BLOCK_M - window + 1, 0)
    pscale = scale
    vscale = 1.0
    if FMT != 0:
        pscale = scale * tl.load(K_SCALE + hk)
        vscale = tl.load(V_SCALE + hk)
    if Q_SPLIT:
        pscale = pscale * qinv
    pt_row = PT + b.to(tl.int64) * spt_b
    wlim = tl.where(window > 0, window, 1 << 30)  # keys with qpos − kpos >= wlim are outside the window
    # without a window, the whole tiles of the prefix need no logit mask; the rest (the prefix's last
    # partial tile, or every tile under a window) takes the masked path
    pfull = kstart
    if PREFIX_FULL:
        pfull = tl.where(window > 0, kstart, kstart + ((prefix - kstart) // BLOCK_NP) * BLOCK_NP)
    np_off = tl.arange(0, BLOCK_NP)
    if not NO_PREFIX:
        for j in range(kstart, pfull, BLOCK_NP):
            acc_a, acc_b, m_i, l_i = _prefix_tile(
                KC, VC, KBS, VBS, pt_row, j + np_off, prefix, qpos, wlim, hk, i, imask, qp_a, qp_b, acc_a, acc_b,
                m_i, l_i, pscale, vscale, s_page, s_tok, skc_h, svc_h, sb_page, sb_tok, skb_h, svb_h,
                PAGE, NB, D, FMT, DOT_P, SPLIT, FP8_QK, False, Q_SPLIT)
        for j in range(pfull, prefix, BLOCK_NP):
            acc_a, acc_b, m_i, l_i = _prefix_tile(
                KC, VC, KBS, VBS, pt_row, j + np_off, prefix, qpos, wlim, hk, i, imask, qp_a, qp_b, acc_a, acc_b,
                m_i, l_i, pscale, vscale, s_page, s_tok, skc_h, svc_h, sb_page, sb_tok, skb_h, svb_h,
                PAGE, NB, D, FMT, DOT_P, SPLIT, FP8_QK, True, Q_SPLIT)

    # ---- phase 2: the new tokens (compute precision); full tiles first, then the diagonal
    jstart = prefix * 0
    if window > 0:
        jstart = tl.maximum(mb * BLOCK_M - window + 1, 0)
    diag = (mb * BLOCK_M // BLOCK_N) * BLOCK_N
    full_end = diag
    if window > 0:
        full_end = jstart  # the window cuts into tiles: every tile takes the masked path
    for j in range(jstart, full_end, BLOCK_N):
        k_a, k_b, v_a, v_b = _new_tile(KN, VN, q_start, j, n_off, q_len, hk, skn_t, skn_h, svn_t, svn_h, i, imask, D,
                                       SPLIT, DOT, TMA, FULL_D)
        acc_a, acc_b, m_i, l_i = _update(q_a, q_b, k_a, k_b, v_a, v_b, acc_a, acc_b, m_i, l_i, rmask[:, None],
                                         scale, 1.0, SPLIT, DOT, False, False)
    jend = tl.minimum(q_len, (mb + 1) * BLOCK_M)
    for j in range(full_end, jend, BLOCK_N):
        offs = j + n_off
        tmask = offs < q_len
        k_a, k_b, v_a, v_b = _new_tile(KN, VN, q_start, j, n_off, q_len, hk, skn_t, skn_h, svn_t, svn_h, i, imask, D,
                                       SPLIT, DOT, TMA, False)
        diff = rows[:, None] - offs[None, :]
        mask = tmask[None, :] & (diff >= 0) & (diff < wlim)
        acc_a, acc_b, m_i, l_i = _update(q_a, q_b, k_a, k_b, v_a, v_b, acc_a, acc_b, m_i, l_i, mask,
                                         scale, 1.0, SPLIT, DOT, False, True)

    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.math.exp2(sink - m_new)
        acc_a = acc_a * alpha[:, None]
        acc_b = acc_b * alpha[:, None]
    inv = 1.0 / l_i
    obase = OUT + tok[:, None] * so_t + h * so_h
    om = rmask[:, None] & imask[None, :]
    if SPLIT:
        tl.store(obase + 2 * i[None, :], (acc_a * inv[:, None]).to(OUT.dtype.element_ty), mask=om)
        tl.store(obase + 2 * i[None, :] + 1, (acc_b * inv[:, None]).to(OUT.dtype.element_ty), mask=om)
    else:
        tl.store(obase + i[None, :], (acc_a * inv[:, None]).to(OUT.dtype.element_ty), mask=om)


@triton.jit
def _dequant_prefix_kernel(
    KC, VC, KBS, VBS, PT, SEQ_LENS, CU_Q, KW, VW,
    s_page, s_tok, skc_h, svc_h, sb_page, sb_tok, skb_h, svb_h, spt_b,
    sw_page, sw_tok, sw_h, npp,
    D: tl.constexpr, DP_PAD: tl.constexpr, NB: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr,
    FMT: tl.constexpr,
):
    """Tokens ``[t0, t0 + BLOCK_T)`` of sequence ``b``'s cached prefix, kv head ``hk``: read through the page
    table, dequantized exactly to float16 (nvfp4: e2m1 × e4m3 block scale; fp8: the stored value; the
    per-head scales stay out, as on the in-register path) and written to the workspace, whose sequence
    ``b`` owns pages ``b·npp ..`` (same page size)."""
    tb = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    prefix = tl.load(SEQ_LENS + b) - (tl.load(CU_Q + b + 1) - tl.load(CU_Q + b))
    t0 = tb * BLOCK_T
    if t0 >= prefix:
        return
    offs = t0 + tl.arange(0, BLOCK_T)
    tmask = (offs < prefix) & (offs < npp * PAGE)
    row, brow = page_rows(PT + b.to(tl.int64) * spt_b, offs, tmask, PAGE, s_page, s_tok, sb_page, sb_tok, FMT)
    wrow = (b.to(tl.int64) * npp + offs // PAGE) * sw_page + (offs % PAGE) * sw_tok + hk * sw_h
    i = tl.arange(0, DP_PAD)
    if FMT == 2:
        imask = i < D // 2
        k_a, k_b = load_nvfp4_tile(KC, KBS, row, brow, hk, skc_h, skb_h, i, imask, tmask, NB, D // 16, 1)
        v_a, v_b = load_nvfp4_tile(VC, VBS, row, brow, hk, svc_h, svb_h, i, imask, tmask, NB, D // 16, 1)
        # (even, odd) → interleaved rows of D
        k = tl.reshape(tl.join(k_a, k_b), (BLOCK_T, 2 * DP_PAD))
        v = tl.reshape(tl.join(v_a, v_b), (BLOCK_T, 2 * DP_PAD))
        j = tl.arange(0, 2 * DP_PAD)
        wm = tmask[:, None] & (j[None, :] < D)
    else:
        imask = i < D
        k = load_plain_tile(KC, row, hk, skc_h, i, imask, tmask, 1)
        v = load_plain_tile(VC, row, hk, svc_h, i, imask, tmask, 1)
        j = i
        wm = tmask[:, None] & imask[None, :]
    tl.store(KW + wrow[:, None] + j[None, :], k, mask=wm)
    tl.store(VW + wrow[:, None] + j[None, :], v, mask=wm)


_LAUNCH = ("block_m", "block_n", "block_n_prefix", "num_warps", "num_stages")
# (block_m, block_n, block_n_prefix, num_warps, num_stages) on a GPU, from the sweeps of
# ``tools/prefill_bench.py`` and of the TMA comparison on an H200 (docs/kernels.md), by head dim and case:
# "prefix" (a cached prefix, or unknown; "prefix_tma" with the new tokens read through tensor descriptors),
# "tma" (prompts read through tensor descriptors; "tma_short" below ``_SHORT`` tokens, where smaller query
# blocks waste less of the causal triangle) and "plain" (prompts without descriptors: nvfp4 caches, odd
# strides).  Small tiles elsewhere (the CPU interpreter).  "prefix_tma" at D 128: 128-key tiles over the
# new tokens too, the fastest of the 9 benchmark tiles for the bf16 and fp8 extends in four runs
# (2026-11-21, H200; 1.6-3% over (128, 64, 128, 8, 3)).
_GPU_DEFAULTS = {
    128: {"prefix": (128, 64, 128, 8, 3), "prefix_tma": (128, 128, 128, 8, 3), "tma": (128, 128, 128, 8, 3),
          "tma_short": (64, 64, 64, 4, 3), "plain": (128, 64, 64, 8, 3)},
    64: {"prefix": (128, 64, 128, 4, 3), "prefix_tma": (128, 64, 128, 4, 3), "tma": (64, 64, 64, 4, 3),
         "tma_short": (64, 64, 64, 4, 3), "plain": (128, 64, 64, 4, 3)},
    # D 256 (Gemma 3): the D 128 tiles need 300-525 KB of shared memory (an H200 has 227 KB per block); of 9
    # tiles that fit, (128, 64, 64, 8, 2) was the fastest for an 8k prompt and a 4 x (7168 + 1024) extend, bf16,
    # fp8 and nvfp4 (2026-11-29, H200: docs/scripts/head_dim_256.py, docs/kernels.md "head_dim 256")
    256: {c: (128, 64, 64, 8, 2) for c in ("prefix", "prefix_tma", "tma", "tma_short", "plain")},
}
_SHORT = 2048
_CPU_DEFAULTS = (64, 64, 64, 4, 2)


def launch_defaults(device, head_dim: int, max_prefix_len: Optional[int] = None, max_q_len: Optional[int] = None,
                    tma: bool = False) -> dict:
    """Tiles, warps and stages for ``paged_prefill`` when the caller gives none.  ``max_prefix_len`` 0 says
    the batch holds prompts only (None: maybe a prefix); ``tma``: the new tokens are read through tensor
    descriptors."""
    if torch.device(device).type != "cuda" or interpreting():
        return dict(zip(_LAUNCH, _CPU_DEFAULTS))
    table = _GPU_DEFAULTS[64 if head_dim <= 64 else 128 if head_dim <= 128 else 256]
    if max_prefix_len != 0:
        case = "prefix_tma" if tma else "prefix"
    elif not tma:
        case = "plain"
    else:
        case = "tma_short" if max_q_len is not None and max_q_len < _SHORT else "tma"
    return dict(zip(_LAUNCH, table[case]))


def tma_ok(x: torch.Tensor) -> bool:
    """Whether ``x`` [T, H, D] can be read through a 2-D tensor descriptor over its ``[T, H·D]`` rows: heads
    packed along each row, a power-of-two head dim of at least 16 bytes, 16-byte aligned start and row
    stride (what the tensor memory accelerator requires)."""
    t, h, d = x.shape
    es = x.element_size()
    return (x.stride(2) == 1 and (x.stride(1) == d or h == 1) and d == next_pow2(d) and 16 <= d * es and d <= 256
            and x.data_ptr() % 16 == 0 and (x.stride(0) * es) % 16 == 0 and t > 0)


@functools.lru_cache(maxsize=None)
def _sm_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def _descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    t, h, d = x.shape
    return TensorDescriptor(x, [t, h * d], [x.stride(0), 1], [rows, d])


_NO_ATTN = AttentionParams()
_DEFAULT_OPTS = PrefillOptions()


def paged_prefill(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cu_seqlens_q: torch.Tensor, max_q_len: int,
    kv: PagedKV, page_table: torch.Tensor, seq_lens: torch.Tensor, *, attn: AttentionParams = _NO_ATTN,
    out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None, opts: PrefillOptions = _DEFAULT_OPTS,
) -> torch.Tensor:
    """Causal attention of packed new tokens ``q`` ``[T, H_q, D]`` (``k_new``/``v_new`` ``[T, H_kv, D]``,
    compute dtype) over their prefix in the pages of ``kv`` plus themselves → ``[T, H_q, D]``.
    ``cu_seqlens_q`` int32 ``[B+1]``; ``seq_lens`` int32 ``[B]`` counts prefix + new tokens.
    ``opts`` (``config.PrefillOptions``): ``heavy_first`` launches the query blocks in reverse order (longest
    causal rows first).  Tiles (``block_n`` keys per tile over the new tokens, ``block_n_prefix`` over the cached
    prefix), warps and stages default to ``launch_defaults``; ``fp8_qk`` (default: whenever it applies) runs
    the scores over an e4m3 prefix as fp8 dots of the stored K (an fp8 q as is, a bfloat16 q split exactly
    into two e4m3 terms; ``False``: convert each K tile instead); ``prefix_full=False`` masks every prefix tile
    (the old path, kept for comparison).  ``max_prefix_len`` (host int, optional): the longest cached
    prefix in the batch; 0 (prompts only) selects the prefix-less launch defaults.  ``tma`` (default: on a
    GPU of compute capability 9 or newer, whenever ``tma_ok`` says the tensors allow it) reads q and the new
    tokens' k / v through tensor descriptors.  ``prefix_workspace`` (``workspace_plan``; default: nvfp4, or
    fp8 whose scores cannot run on the stored K, with ``max_prefix_len`` known and at least
    ``WORKSPACE_MIN_Q`` new tokens) dequantizes the cached prefix once into a float16 workspace of at most
    ``WORKSPACE_CAP_BYTES`` and attends over it, instead of dequantizing every prefix tile in every program;
    ``max_prefix_len`` must then be at least every sequence's prefix (a longer one reads a spare page, never
    outside the workspace)."""
    kv_format, sm_scale, q_scale, sinks = kv.kv_format, attn.sm_scale, attn.q_scale, attn.sinks
    max_prefix_len, prefix_workspace = opts.max_prefix_len, opts.prefix_workspace
    if q.dim() != 3 or k_new.dim() != 3 or v_new.shape != k_new.shape:
        raise ValueError(f"q [T,H_q,D], k_new/v_new [T,H_kv,D] expected, got {tuple(q.shape)}, {tuple(k_new.shape)}, {tuple(v_new.shape)}")
    t, hq, d = q.shape
    if k_new.shape[0] != t or k_new.shape[2] != d:
        raise ValueError(f"k_new {tuple(k_new.shape)} does not match q {tuple(q.shape)}")
    for name, x in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    kc, vc = check_kv(kv, d)
    hk = kc.num_kv_heads
    if k_new.shape[1] != hk or hq % hk:
        raise ValueError(f"H_kv mismatch: cache {hk}, k_new {k_new.shape[1]}, H_q {hq}")
    if cu_seqlens_q.dtype != torch.int32 or seq_lens.dtype != torch.int32 or page_table.dtype != torch.int32:
        raise ValueError("cu_seqlens_q, seq_lens and page_table must be int32")
    bsz = cu_seqlens_q.shape[0] - 1
    if seq_lens.shape[0] < bsz or page_table.shape[0] < bsz:
        raise ValueError(f"seq_lens / page_table have fewer rows than the {bsz} sequences")
    is_fp8_q = check_query(q, q_scale, sinks, hq)
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"sm_scale must be positive, got {sm_scale}")
    fmt = format_code(kv_format)
    odt = out_dtype or (k_new.dtype if is_fp8_q else q.dtype)
    out = torch.empty(t, hq, d, dtype=odt, device=q.device) if out is None else out
    if t == 0 or bsz == 0 or max_q_len <= 0:
        return out
    plan = _use_wgmma(opts, q, k_new, v_new, kc, vc, kv_format, attn, max_q_len, bsz)
    if plan:
        from kvbench.kernels import prefill_wg

        sm = sm_scale if sm_scale is not None else d**-0.5
        if plan is True:
            prefill_wg.launch(q, k_new, v_new, kc, vc, page_table, seq_lens, cu_seqlens_q, max_q_len, out, sm,
                              opts.heavy_first)
        else:  # a quantized prefix: dequantized into a workspace of q's dtype first
            _over_workspace(plan, kc, vc, page_table, seq_lens, cu_seqlens_q, bsz, fmt, q,
                            lambda kwc, vwc, pt, sl, cu, n: prefill_wg.launch_dequantized(
                                q, k_new, v_new, kwc, vwc, pt, sl, cu, max_q_len, out, sm, opts.heavy_first),
                            dtype=q.dtype)
        return out
    dp = d // 2 if fmt == 2 else d
    # over an e4m3 prefix, the prefix's Q·Kᵀ runs on the stored fp8 values (fp8 tensor-core dots, float32
    # accumulation) instead of converting every K tile: an fp8 q directly, a bf16 q split exactly into two
    # e4m3 terms per row (``_fp8_split``; a float16 q has too many significant bits for two terms)
    on_stored_k = opts.fp8_qk is not False and kv.k_cache.dtype == torch.float8_e4m3fn and d == next_pow2(d) and d >= 32
    q_split = on_stored_k and q.dtype == torch.bfloat16
    fp8_qk = on_stored_k and (is_fp8_q or q_split)
    scale = (sm_scale if sm_scale is not None else d**-0.5) * LOG2E
    ws_plan = workspace_plan(fmt, fp8_qk, max_prefix_len, max_q_len, bsz, hk, d, kc.page_size, prefix_workspace)
    if prefix_workspace and ws_plan is None and fmt != 0 and max_prefix_len != 0:  # (no prefix: nothing to do)
        raise ValueError("prefix_workspace=True needs max_prefix_len (the batch's longest cached prefix) and one "
                         f"sequence's prefix within WORKSPACE_CAP_BYTES ({WORKSPACE_CAP_BYTES} bytes)")
    src_fmt = fmt
    if ws_plan is not None:  # the kernel sees a cache of float16 values with per-head scales, not nvfp4
        fmt, fp8_qk, q_split = 1, False, False
    # prompts only over an nvfp4 cache (the caller says so: max_prefix_len 0): nothing cached is read, so the
    # new tokens take the plain path instead of the half-head split (13x SDPA at head_dim 256 on an H200)
    no_prefix = fmt == 2 and max_prefix_len == 0
    if no_prefix:
        fmt, dp = 0, d
    tma = _resolve_tma(opts.tma, fmt, q, k_new, v_new, kv_format)
    tiles = _tiles(opts, q.device, d, max_q_len, tma)
    chosen = all(getattr(opts, k) is None for k in _LAUNCH)  # the defaults: shrink them where they do not fit
    key = (str(q.device), d, q.dtype, fmt, ws_plan is not None, tiles)
    tiles = _SHRUNK.get(key, tiles) if chosen else tiles
    while True:
        block_m, block_n, block_n_prefix, num_warps, num_stages, tma = tiles
        qa, ka, va = q, k_new, v_new
        if tma:
            qa, ka, va = _descriptor(q, block_m), _descriptor(k_new, block_n), _descriptor(v_new, block_n)
        common = dict(
            G=hq // hk, D=d, NB=next_pow2(max(d // 16, 1)), BLOCK_M=block_m, BLOCK_N=block_n, DOT=dot_code(k_new.dtype),
            DOT_P=dot_code(k_new.dtype) if no_prefix else cache_dot_code(kv_format, k_new.dtype),
            HAS_Q_SCALE=q_scale is not None,
            HAS_SINKS=sinks is not None, HEAVY_FIRST=opts.heavy_first, PREFIX_FULL=opts.prefix_full,
            BLOCK_NP=block_n_prefix, TMA=bool(tma), EXACT_CAST=interpreting(), num_warps=num_warps, num_stages=num_stages,
        )
        args = (qa, ka, va, q_scale if q_scale is not None else kc.scale, sinks if sinks is not None else kc.scale,
                out, scale, int(attn.sliding_window or 0), max_q_len, common)
        try:
            if ws_plan is not None:
                extra = dict(DP_PAD=next_pow2(d), FULL_D=d == next_pow2(d), FP8_QK=False, Q_SPLIT=False)
                _over_workspace(ws_plan, kc, vc, page_table, seq_lens, cu_seqlens_q, bsz, src_fmt, q,
                                lambda kwc, vwc, pt, sl, cu, n: _launch_prefill(*args, kwc, vwc, pt, sl, cu, n, q, k_new,
                                                                                v_new, 1, extra))
            else:
                _launch_prefill(*args, kc, vc, page_table, seq_lens, cu_seqlens_q, bsz, q, k_new, v_new, fmt,
                                dict(DP_PAD=next_pow2(dp), FULL_D=dp == next_pow2(dp), FP8_QK=fp8_qk, Q_SPLIT=q_split,
                                     NO_PREFIX=no_prefix))
            break
        except OutOfResources:
            smaller = _shrink(tiles) if chosen else None
            if smaller is None:
                raise
            log.info("paged_prefill: tiles %s need more shared memory than this GPU has (D %d, %s); trying %s",
                     tiles[:5], d, q.dtype, smaller[:5])
            _SHRUNK[key] = tiles = smaller
    return out


_SHRUNK: dict = {}  # default tiles that did not fit this GPU's shared memory → the smaller ones that did
# PrefillOptions.wgmma=None: the Hopper kernel where it applies to an extend (a cached prefix, ``max_prefix_len`` > 0
# given) at head dim 128, where it was measured faster on an H200: 1.03-1.47x the Triton kernel over five extend
# shapes, 1.46x (1.01x vLLM's FA3) on the benchmark's 4 x (7168 + 1024); prompts alone stay on the Triton kernel,
# faster on four of six prompt shapes (docs/kernels.md, "The extend against vLLM's FlashAttention 3")
WGMMA_DEFAULT = True
# ... and over a quantized prefix (dequantized into a workspace of q's dtype first) from this many new tokens in the
# batch's longest sequence, by cache format code (fp8 1, nvfp4 2).  H200, 2026-11-30, 4 x (7168 + new), the Hopper
# kernel over the workspace against the Triton kernel's defaults (docs/scripts/prefill_probes.py quant, two runs):
# from 512 new tokens 1.11-1.63x for e4m3, e5m2 and nvfp4; at 256 0.59-1.52x, at 64 and 128 0.34-1.33x (calls this
# short moved by up to 2x between the runs)
WGMMA_WORKSPACE_MIN_Q = {1: 512, 2: 512}


def _use_wgmma(opts: PrefillOptions, q, k_new, v_new, kc, vc, kv_format: str, attn, max_q_len: int = 0,
               bsz: int = 1):
    """Whether the call runs ``prefill_wg``'s Hopper kernel (``PrefillOptions.wgmma``): False, True (a 16-bit
    cache), or, for a quantized cache, the workspace plan its prefix is dequantized by first (into q's dtype); a
    ValueError saying why not when it was asked for and cannot take the call."""
    want = opts.wgmma
    if want is False or not q.is_cuda or interpreting():
        if want:
            raise ValueError("wgmma=True needs a CUDA device (the Gluon kernel has no interpreter)")
        return False
    fmt = format_code(kv_format)
    if want is None and (not WGMMA_DEFAULT or any(getattr(opts, k) is not None for k in _LAUNCH)
                         or opts.tma is False or not opts.prefix_full or not opts.max_prefix_len
                         or opts.fp8_qk is not None
                         or q.shape[-1] != 128 or (fmt and max_q_len < WGMMA_WORKSPACE_MIN_Q[fmt])):
        return False
    from kvbench.kernels import prefill_wg

    plan, why = None, None
    if fmt and opts.prefix_workspace is False:
        why = "a quantized prefix is read through a workspace, and prefix_workspace=False refuses one"
    elif fmt:
        plan = workspace_plan(fmt, False, opts.max_prefix_len, max_q_len, bsz, kc.num_kv_heads, kc.head_dim,
                              kc.page_size, True)
        if plan is None:
            why = (f"a quantized prefix needs max_prefix_len and one sequence's prefix within WORKSPACE_CAP_BYTES "
                   f"({WORKSPACE_CAP_BYTES} bytes)")
    why = why or prefill_wg.unsupported(q, k_new, v_new, kc, vc, kv_format, attn,
                                        all(tma_ok(x) for x in (q, k_new, v_new)), workspace=bool(fmt))
    if why and want:
        raise ValueError(f"wgmma=True: {why} (leave wgmma unset for the Triton kernel)")
    return False if why else (plan or True)


def _shrink(tiles: tuple) -> Optional[tuple]:
    """The next smaller launch after an out-of-shared-memory error: one stage fewer, then half the prefix tile,
    half the key tile, half the query block (warps capped at one per 16 rows); None below 16-row tiles."""
    block_m, block_n, block_np, warps, stages, tma = tiles
    if stages > 1:
        return block_m, block_n, block_np, warps, stages - 1, tma
    if block_np > 16:
        return block_m, block_n, block_np // 2, warps, stages, tma
    if block_n > 16:
        return block_m, block_n // 2, block_np, warps, stages, tma
    if block_m > 16:
        return block_m // 2, block_n, block_np, max(1, min(warps, block_m // 32)), stages, tma
    return None


def _resolve_tma(tma: Optional[bool], fmt: int, q, k_new, v_new, kv_format: str):
    """``PrefillOptions.tma`` resolved: ``None`` → whether the tensors and the GPU allow tensor descriptors;
    ``True`` → a ValueError where they do not (``tma`` is returned as given otherwise)."""
    if tma is None:
        return (fmt != 2 and q.is_cuda and not interpreting() and _sm_major(q.device) >= 9
                and all(tma_ok(x) for x in (q, k_new, v_new)))
    if tma:
        bad = [n for n, x in (("q", q), ("k_new", k_new), ("v_new", v_new)) if not tma_ok(x)]
        if fmt == 2 or bad:
            raise ValueError("tma=True reads the new tokens through tensor descriptors, which needs a cache format "
                             "other than nvfp4 and q / k_new / v_new with heads packed along each row, a power-of-two "
                             "head dim of 16 bytes to 256 elements and 16-byte aligned rows"
                             + (f" (not met by {', '.join(bad)})" if bad else f" (kv_format is {kv_format})"))
        if q.is_cuda and _sm_major(q.device) < 9:
            raise ValueError("tma=True needs a GPU of compute capability 9.0 or newer (Hopper); leave tma unset")
    return tma


def _tiles(opts: PrefillOptions, device, d: int, max_q_len: int, tma):
    """``(block_m, block_n, block_n_prefix, num_warps, num_stages, tma)``: the options over ``launch_defaults``,
    checked; ``tma`` dropped (unless it was asked for: then a ValueError) for tiles over 256 rows."""
    dflt = launch_defaults(device, d, opts.max_prefix_len, max_q_len, bool(tma))
    block_m = dflt["block_m"] if opts.block_m is None else opts.block_m
    # an explicit block_n tiles both phases alike
    block_n_prefix = (opts.block_n or dflt["block_n_prefix"]) if opts.block_n_prefix is None else opts.block_n_prefix
    block_n = dflt["block_n"] if opts.block_n is None else opts.block_n
    num_warps = dflt["num_warps"] if opts.num_warps is None else opts.num_warps
    num_stages = dflt["num_stages"] if opts.num_stages is None else opts.num_stages
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_n_prefix", block_n_prefix)):
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if tma and max(block_m, block_n) > 256:  # a descriptor's box spans at most 256 rows
        if opts.tma is not None:
            raise ValueError(f"tma=True reads tiles of at most 256 rows, got block_m={block_m}, block_n={block_n}")
        tma = False
    return block_m, block_n, block_n_prefix, num_warps, num_stages, tma


def _launch_prefill(qa, ka, va, qsc, snk, out, scale, window, max_q_len, common, kc, vc, page_table, seq_lens, cu_q,
                    nseq, q, k_new, v_new, fmt, extra):
    grid = (triton.cdiv(max_q_len, common["BLOCK_M"]), q.shape[1], nseq)
    _prefill_kernel[grid](
        qa, ka, va, kc.data, vc.data, kc.bs_ptr, vc.bs_ptr, kc.scale, vc.scale, qsc, snk,
        page_table, seq_lens, cu_q, out, scale,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        out.stride(0), out.stride(1),
        kc.page_stride, kc.tok_stride, kc.head_stride, vc.head_stride,
        kc.bs_page_stride, kc.bs_tok_stride, kc.bs_head_stride, vc.bs_head_stride, page_table.stride(0),
        window, PAGE=kc.page_size, FMT=fmt, **extra, **common,
    )


# ---------------------------------------------------------------- dequantize-once prefix (workspace)
# Each program of the prefill kernel takes one query block of one query head, so over a quantized prefix
# every prefix tile is dequantized once per (query block, query head of its GQA group): 32 times per kv head
# for 1024 new tokens at G = 4.  For nvfp4 that unpacking, not the bytes, bounds the extend.  With enough new
# tokens it pays to dequantize the batch's prefix once into a float16 workspace (exact: every nvfp4 and fp8
# value is a float16) and run the extend over it as over an fp8 cache of float16 values: the same per-head
# scales, the same dot operands as the in-register path, no conversion in the loop.
WORKSPACE_CAP_BYTES = 256 << 20  # one workspace at most; batches whose prefixes need more run in sequence groups
# auto: the workspace from this many new tokens in the batch's longest sequence, by cache format code (nvfp4 2,
# fp8 1 when its scores cannot run on the stored K).  H100, 2026-11-24, batch 4 over a 7168-token prefix,
# ``python -m kvbench.tools.prefill_bench`` (workspace speed-up over registers): nvfp4 1.14 / 1.02 / 0.90 / 1.60 /
# 1.91 / 2.16 / 2.66x at 16 / 64 / 128 / 256 / 512 / 1024 / 2048 new tokens; fp8_e5m2 0.47x up to 128,
# 0.75x at 256, 1.02x at 512, 1.06x at 1024, 1.10x at 2048.
WORKSPACE_MIN_Q = {2: 256, 1: 1024}
_WS_BLOCK_T = 64  # the workspace fill's tokens per program, and its warps
_WS_FILL_WARPS = 4


@dataclass
class _WorkspacePlan:
    npp: int  # workspace pages per sequence
    group: int  # sequences per workspace fill


def workspace_plan(fmt: int, fp8_qk: bool, max_prefix_len: Optional[int], max_q_len: int,
                   bsz: int, num_kv_heads: int, head_dim: int, page_size: int, want: Optional[bool],
                   cap: Optional[int] = None) -> Optional[_WorkspacePlan]:
    """Whether (and how) the extend dequantizes its prefix once into a float16 workspace; None: in registers.
    ``want`` None chooses: nvfp4 (or fp8 whose scores cannot run on the stored values) with a known
    ``max_prefix_len`` and at least ``WORKSPACE_MIN_Q[fmt]`` new tokens; True forces it where it applies (needs
    ``max_prefix_len``), False never.  The workspace holds at most ``cap`` bytes; a larger batch is run in
    groups of sequences, and a single prefix over the cap stays in registers."""
    if want is False or fmt == 0 or not max_prefix_len or max_prefix_len <= 0:
        return None
    if want is None and (max_q_len < WORKSPACE_MIN_Q[fmt] or (fmt == 1 and fp8_qk)):
        return None
    npp = -(-max_prefix_len // page_size)
    per_seq = npp * page_size * num_kv_heads * head_dim * 2 * 2  # float16, K and V
    group = min(bsz, (WORKSPACE_CAP_BYTES if cap is None else cap) // per_seq)
    if group < 1:
        return None
    return _WorkspacePlan(npp, group)


def _over_workspace(plan: _WorkspacePlan, kc: CacheArgs, vc: CacheArgs, page_table, seq_lens, cu_q, bsz, fmt, q,
                    run, dtype=torch.float16) -> None:
    """The extend in groups of ``plan.group`` sequences, each over its prefix dequantized into one workspace of
    ``dtype`` (float16 for the Triton kernel; q's 16-bit dtype for the Hopper kernel: exact either way, every nvfp4
    and fp8 value being both a float16 and a bfloat16) in HND pages of the cache's page size, page ``group · npp``
    a spare one for table entries past the planned prefix.  ``run(kc, vc, page_table, seq_lens, cu_q, n)``
    attends over one group's workspace."""
    page, hk, d = kc.page_size, kc.num_kv_heads, kc.head_dim
    npages = plan.group * plan.npp
    kw = torch.empty(npages + 1, hk, page, d, dtype=dtype, device=q.device)
    vw = torch.empty_like(kw)
    kwv, vwv = kw.permute(0, 2, 1, 3), vw.permute(0, 2, 1, 3)
    table = torch.full((plan.group, max(page_table.shape[1], plan.npp)), npages, dtype=torch.int32, device=q.device)
    table[:, :plan.npp] = torch.arange(npages, dtype=torch.int32, device=q.device).view(plan.group, plan.npp)
    kwc = CacheArgs(kwv, None, kc.scale, page, hk, d)
    vwc = CacheArgs(vwv, None, vc.scale, page, hk, d)
    dp = d // 2 if fmt == 2 else d
    for b0 in range(0, bsz, plan.group):
        n = min(plan.group, bsz - b0)
        sl, cu, pt = seq_lens[b0:b0 + n], cu_q[b0:b0 + n + 1], page_table[b0:b0 + n]
        _dequant_prefix_kernel[(triton.cdiv(plan.npp * page, _WS_BLOCK_T), hk, n)](
            kc.data, vc.data, kc.bs_ptr, vc.bs_ptr, pt, sl, cu, kw, vw,
            kc.page_stride, kc.tok_stride, kc.head_stride, vc.head_stride,
            kc.bs_page_stride, kc.bs_tok_stride, kc.bs_head_stride, vc.bs_head_stride, pt.stride(0),
            kwv.stride(0), kwv.stride(1), kwv.stride(2), plan.npp,
            D=d, DP_PAD=next_pow2(dp), NB=next_pow2(max(d // 16, 1)), PAGE=page, BLOCK_T=_WS_BLOCK_T, FMT=fmt,
            num_warps=_WS_FILL_WARPS,
        )
        run(kwc, vwc, table, sl, cu, n)

"""Paged prefill / extend on Hopper with warpgroup MMAs (Gluon), over 16-bit pages: the cached prefix arrives by
TMA, one copy per page into a slice of the tile's shared-memory buffer, the new tokens by one copy per tile, and
the previous tile's ``P·V`` runs on the tensor cores while the warps compute this tile's softmax.

Why: the Triton kernel (``prefill.py``) gathers the prefix with pointer loads (a tensor descriptor's box cannot
span pages in random order) and runs each tile's score MMA, softmax and output MMA in turn; on an H200 it reaches
0.71x vLLM's FlashAttention 3 on the extend (docs/kernels.md, "The extend against vLLM's FlashAttention 3").

Layout (one program per 128 query rows x query head x sequence; two warpgroups of 64 rows):

* q ``[128, D]`` is copied once into shared memory; the score MMA reads it there.
* Tiles of ``WS_BLOCK_N`` keys, in order: the prefix's (through the page table: one TMA copy per page, pages of a
  multiple of 16 tokens; a tile past the prefix's last page re-reads that page), then the new tokens' (``k_new``
  / ``v_new`` rows of the sequence).  ``WS_STAGES`` K / V buffers, one "ready" and one "empty" mbarrier each.
* Warp-specialized (``_prefill_ws``): a producer warp issues every copy (waiting on a stage's "empty" mbarrier
  before refilling it), and each warpgroup is a partition of its own running its 64 rows through all tiles of
  ``WS_BLOCK_N`` (128) keys over ``WS_STAGES`` (3) stages: tile ``t``'s scores and tile ``t − 1``'s ``P·V`` are
  issued together, tile ``t``'s online softmax (base 2; the causal and prefix-end masks only on the tiles that need
  them) runs while ``P·V`` does, with ``P`` in registers as its left operand, and tile ``t − 1``'s stage is released
  when ``P·V`` is done.  No barrier spans the two warpgroups, so one's softmax also runs while the other's MMAs do.
  (A one-partition form, every warp issuing copies and a barrier over all eight per tile, ran 1.4-1.6x slower on
  every problem timed and was removed; docs/kernels.md.)
* On an H200 (docs/kernels.md, "The extend against vLLM's FlashAttention 3") the warp-specialized kernel runs the
  benchmark's extend 4 x (7168 + 1024) in 882.9 µs against vLLM's FA3's 892.2 (1.01x; the Triton kernel 1287) and
  other extends 1.03-1.47x faster than the Triton kernel; prompts alone are mixed (0.36-1.44x), so ``paged_prefill``
  runs it by default for extends with a known cached prefix at head dim 128 (``prefill.WGMMA_DEFAULT``).

A quantized (fp8 / nvfp4) prefix reaches it through ``prefill.py``'s workspace, dequantized exactly into q's 16-bit
dtype first; its per-head scales apply in the loop (``SCALED``: the K scale in a prefix tile's score scale, the V
scale once on the output accumulator when the last prefix tile's ``P·V`` is in it).  Sliding windows, sinks and
fp8 queries stay with the Triton kernel (``unsupported``).  Gluon has no interpreter: the CPU path is
``prefill.py``; this kernel is checked against the float64 reference on a GPU (``tests/test_gpu_kernels.py``) and
compiled for sm_90 on the CPU (``tests/test_prefill_wg.py``).
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kvbench.kernels import _gluon_compat as compat

__all__ = ["BLOCK_M", "WS_BLOCK_N", "WS_STAGES", "unsupported", "launch", "launch_dequantized"]

BLOCK_M = 128  # query rows per program: two warpgroups of 64
# the registers each warpgroup partition asks for (Triton 3.6 spills 8 bytes at 240, 44 at 232)
WS_REGS = 240
# the warp-specialized kernel's key tile and K / V stages (3 x 64 KB at 128 keys, D 128, next to q's 32 KB)
WS_BLOCK_N = 128
WS_STAGES = 3
LOG2E = 1.4426950408889634
_sync, _tma_load = compat.sync, compat.tma_load


@gluon.jit
def _issue(KC_DESC, VC_DESC, KN_DESC, VN_DESC, k_buf, v_buf, bar, PT, pt_row, t, n_pre, prefix, q_start, hk,
           PAGE: gl.constexpr, HKV: gl.constexpr, HND: gl.constexpr, D: gl.constexpr, BN: gl.constexpr):
    """TMA copies of tile ``t``'s K and V: a prefix tile through the page table (one copy per page it spans, or one
    for the tile when pages hold whole tiles), else rows of the new tokens.  Both take the same bytes."""
    mbarrier.expect(bar, 2 * KN_DESC.block_type.nbytes)
    if t < n_pre:
        R: gl.constexpr = KC_DESC.block_type.shape[0]  # rows per copy
        last = (prefix - 1) // PAGE
        for j in gl.static_range(BN // R):
            pos = t * BN + j * R
            pg = gl.load(PT + pt_row + gl.minimum(pos // PAGE, last))
            if HND:  # the plane as [pages x kv heads x page rows, D]
                row = (pg * HKV + hk) * PAGE + pos % PAGE
                col = 0
            else:  # as [pages x page rows, kv heads x D]
                row = pg * PAGE + pos % PAGE
                col = hk * D
            _tma_load(KC_DESC, [row, col], bar, k_buf.slice(j * R, R))
            _tma_load(VC_DESC, [row, col], bar, v_buf.slice(j * R, R))
    else:
        r0 = q_start + (t - n_pre) * BN
        _tma_load(KN_DESC, [r0, hk * D], bar, k_buf)
        _tma_load(VN_DESC, [r0, hk * D], bar, v_buf)


@gluon.jit
def _zero_tail(buf, valid, BN: gl.constexpr, D: gl.constexpr, LAY: gl.constexpr):
    """Rows ``valid..`` of a ``[BN, D]`` tile in shared memory set to zero."""
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, LAY))
    x = buf.load(LAY)
    buf.store(gl.where((rows < valid)[:, None], x, gl.zeros_like(x)))


@gluon.jit
def _program(CU_Q, SEQ_LENS, spt_b, G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, HEAVY_FIRST: gl.constexpr):
    """The program's work: query block ``mb`` (the ones with the most keys first, ``HEAVY_FIRST``) of query head ``h``
    of sequence ``b``, that sequence's new tokens and cached prefix, its kv head, the number of prefix tiles and of
    tiles in all, and its page-table row offset."""
    mb = gl.program_id(0)
    if HEAVY_FIRST:
        mb = gl.num_programs(0) - 1 - mb
    h = gl.program_id(1)
    b = gl.program_id(2)
    q_start = gl.load(CU_Q + b)
    q_len = gl.load(CU_Q + b + 1) - q_start
    seq_len = gl.load(SEQ_LENS + b)
    prefix = seq_len - q_len
    n_pre = gl.cdiv(prefix, BN)
    n_tiles = n_pre + gl.cdiv(gl.minimum(q_len, (mb + 1) * BM), BN)
    return mb, h, h // G, q_start, q_len, seq_len, prefix, n_pre, n_tiles, b.to(gl.int64) * spt_b


# ------------------------------------------------------------------ the warp-specialized kernel
# One producer warp issues q's and every tile's copies (waiting on a stage's "empty" barrier before refilling it);
# each of the two warpgroups is a partition of its own that runs its 64 rows through all tiles and arrives on the
# stage's empty barrier when its P·V is done: no barrier spans the warpgroups, so one's softmax can run while the
# other's MMAs do.


@gluon.jit
def _ws_producer(Q_DESC, KN_DESC, VN_DESC, KC_DESC, VC_DESC, PT, pt_row, q_s, k_s, v_s, ready, empty, n_tiles, n_pre,
                 prefix, q_start, hk, h, mb, PAGE: gl.constexpr, HKV: gl.constexpr, HND: gl.constexpr):
    BM: gl.constexpr = Q_DESC.block_type.shape[0]
    BN: gl.constexpr = KN_DESC.block_type.shape[0]
    D: gl.constexpr = KN_DESC.block_type.shape[1]
    STAGES: gl.constexpr = k_s.shape[0]
    qbar = ready.index(STAGES)
    mbarrier.expect(qbar, Q_DESC.block_type.nbytes)
    _tma_load(Q_DESC, [q_start + mb * BM, h * D], qbar, q_s)
    for t in range(n_tiles):
        st = t % STAGES
        if t >= STAGES:  # both warpgroups are past the tile this stage held
            mbarrier.wait(empty.index(st), ((t // STAGES) - 1) & 1)
        _issue(KC_DESC, VC_DESC, KN_DESC, VN_DESC, k_s.index(st), v_s.index(st), ready.index(st), PT, pt_row, t, n_pre,
               prefix, q_start, hk, PAGE, HKV, HND, D, BN)


@gluon.jit
def _softmax(s, m_i, l_i, t, n_pre, prefix, seq_len, q_lo, qpos, cols, scale, sc_pre, BN: gl.constexpr,
             SCALED: gl.constexpr):
    """Tile ``t``'s online softmax in base 2 on its raw scores ``s`` (``scale`` folded into each exponent's FFMA)
    → (``P`` for ``P·V``, the output's rescale, the new row maximum and sum); the masks (causal, the prefix's end,
    the sequence's end) are computed only on a tile that needs them: the prefix's last partial tile and the new
    tokens' tiles that reach past the warpgroup's first row (``q_lo``).  ``SCALED`` (a prefix of dequantized values
    with per-head scales): a prefix tile's scores take ``sc_pre`` (``scale`` times the K scale); the V scale is the
    consumer's (``_ws_consumer``)."""
    kbase = gl.where(t < n_pre, t * BN, prefix + (t - n_pre) * BN)
    lim = gl.where(t < n_pre, prefix, seq_len)
    if (kbase + BN <= lim) & (kbase + BN - 1 <= q_lo):
        x = s
    else:
        kpos = kbase + cols
        x = gl.where((kpos[None, :] <= qpos[:, None]) & (kpos < lim)[None, :], s, float("-inf"))
    pre = t < n_pre
    if SCALED:
        sc = gl.where(pre, sc_pre, scale)
    else:
        sc = scale
    m_new = gl.maximum(m_i, gl.max(x, axis=1) * sc)
    p = gl.exp2(x * sc - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@gluon.jit
def _ws_zero_tail(v_buf, t, n_pre, prefix, BN: gl.constexpr, D: gl.constexpr, T_L: gl.constexpr):
    """The prefix's last tile: V rows past its end zeroed before ``P·V`` reads them (both warpgroups write the same
    zeros; each reads after its own)."""
    if t == n_pre - 1:
        if prefix % BN != 0:
            _zero_tail(v_buf, prefix - t * BN, BN, D, T_L)
            fence_async_shared()
            _sync()


@gluon.jit
def _ws_consumer(q_s, k_s, v_s, ready, empty, OUT, so_t, so_h, h, q_start, q_len, prefix, seq_len, n_pre, n_tiles, mb,
                 scale, sc_pre, vs, SCALED: gl.constexpr, W: gl.constexpr):
    """Warpgroup ``W``'s rows ``64·W ..`` of the program's 128 through every tile; q's rows stay in shared memory as
    the score MMA's left operand.  Tile ``t``'s scores and tile ``t − 1``'s ``P·V`` are issued together, and tile
    ``t``'s softmax runs while ``P·V`` does (``P`` of tile ``t − 1`` held in registers); tile ``t − 1``'s stage is
    released when its ``P·V`` is done.  ``SCALED``: the prefix tiles come first, so the V scale ``vs`` multiplies the
    accumulator once, when the last prefix tile's ``P·V`` is in it (exact for any scale; no work per score)."""
    STAGES: gl.constexpr = k_s.shape[0]
    BN: gl.constexpr = k_s.shape[1]
    D: gl.constexpr = k_s.shape[2]
    DT: gl.constexpr = k_s.dtype
    R: gl.constexpr = 64
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    PA_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    T_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    mbarrier.wait(ready.index(STAGES), 0)
    q = q_s.slice(W * R, R)
    q_lo = prefix + mb * 128 + W * R
    qpos = q_lo + gl.arange(0, R, layout=gl.SliceLayout(1, S_L))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, S_L))
    m_i = gl.full([R], -1.0e30, gl.float32, gl.SliceLayout(1, S_L))
    l_i = gl.zeros([R], gl.float32, gl.SliceLayout(1, S_L))
    o = gl.zeros([R, D], gl.float32, O_L)
    zero_s = gl.zeros([R, BN], gl.float32, S_L)
    mbarrier.wait(ready.index(0), 0)
    s = warpgroup_mma(q, k_s.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s])
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, 0, n_pre, prefix, seq_len, q_lo, qpos, cols, scale, sc_pre, BN, SCALED)
    _ws_zero_tail(v_s.index(0), 0, n_pre, prefix, BN, D, T_L)
    pa = gl.convert_layout(p.to(DT), PA_L)
    for t in range(1, n_tiles):
        st = t % STAGES
        sp = (t - 1) % STAGES
        mbarrier.wait(ready.index(st), (t // STAGES) & 1)
        s = warpgroup_mma(q, k_s.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        o = warpgroup_mma(pa, v_s.index(sp), o, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s])  # the scores; P·V of tile t - 1 still runs
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, t, n_pre, prefix, seq_len, q_lo, qpos, cols, scale, sc_pre, BN,
                                      SCALED)
        _ws_zero_tail(v_s.index(st), t, n_pre, prefix, BN, D, T_L)
        o = warpgroup_mma_wait(0, deps=[o])
        _sync()  # this warpgroup's four warps are past tile t - 1
        mbarrier.arrive(empty.index(sp))
        if SCALED:  # o holds every prefix tile's P·V once tile n_pre - 1's is in: the V scale, once
            alpha = gl.where(t == n_pre, alpha * vs, alpha)
        o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        pa = gl.convert_layout(p.to(DT), PA_L)
    # the last tile is always one of new tokens (a program has its diagonal tile), so the V scale went in above
    o = warpgroup_mma(pa, v_s.index((n_tiles - 1) % STAGES), o, is_async=True)
    o = warpgroup_mma_wait(0, deps=[o])
    inv = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, O_L))
    orow = mb * 128 + W * R + gl.arange(0, R, layout=gl.SliceLayout(1, O_L))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, O_L))
    optr = OUT + (q_start + orow).to(gl.int64)[:, None] * so_t + h * so_h + d[None, :]
    gl.store(optr, (o * inv[:, None]).to(OUT.dtype.element_ty), mask=(orow < q_len)[:, None])


@gluon.jit
def _ws_consumer0(q_s, k_s, v_s, ready, empty, OUT, so_t, so_h, h, q_start, q_len, prefix, seq_len, n_pre, n_tiles, mb,
                  scale, sc_pre, vs, SCALED: gl.constexpr):
    _ws_consumer(q_s, k_s, v_s, ready, empty, OUT, so_t, so_h, h, q_start, q_len, prefix, seq_len, n_pre, n_tiles, mb,
                 scale, sc_pre, vs, SCALED, 0)


@gluon.jit
def _ws_consumer1(q_s, k_s, v_s, ready, empty, OUT, so_t, so_h, h, q_start, q_len, prefix, seq_len, n_pre, n_tiles, mb,
                  scale, sc_pre, vs, SCALED: gl.constexpr):
    _ws_consumer(q_s, k_s, v_s, ready, empty, OUT, so_t, so_h, h, q_start, q_len, prefix, seq_len, n_pre, n_tiles, mb,
                 scale, sc_pre, vs, SCALED, 1)


@gluon.jit
def _prefill_ws(
    Q_DESC, KN_DESC, VN_DESC, KC_DESC, VC_DESC, PT, SEQ_LENS, CU_Q, OUT, K_SCALE, V_SCALE,
    scale, so_t, so_h, spt_b,
    G: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr, HKV: gl.constexpr, HND: gl.constexpr,
    STAGES: gl.constexpr, HEAVY_FIRST: gl.constexpr, REGS: gl.constexpr, SCALED: gl.constexpr,
):
    BM: gl.constexpr = 128
    BN: gl.constexpr = KN_DESC.block_type.shape[0]
    DT: gl.constexpr = Q_DESC.dtype
    mb, h, hk, q_start, q_len, seq_len, prefix, n_pre, n_tiles, pt_row = _program(CU_Q, SEQ_LENS, spt_b, G, BM, BN,
                                                                                  HEAVY_FIRST)
    if mb * BM >= q_len:
        return
    # the prefix's per-kv-head scales (used where SCALED): K's into its tiles' score scale, V's into their P
    vs = gl.load(V_SCALE + hk)
    sc_pre = scale * gl.load(K_SCALE + hk)
    q_s = gl.allocate_shared_memory(DT, [BM, D], Q_DESC.layout)
    k_s = gl.allocate_shared_memory(DT, [STAGES, BN, D], KN_DESC.layout)
    v_s = gl.allocate_shared_memory(DT, [STAGES, BN, D], KN_DESC.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES + 1, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES + 1):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=2)  # one arrival per warpgroup
    fence_async_shared()
    _sync()
    cargs = (q_s, k_s, v_s, ready, empty, OUT, so_t, so_h, h, q_start, q_len, prefix, seq_len, n_pre, n_tiles, mb,
             scale, sc_pre, vs, SCALED)
    gl.warp_specialize([
        (_ws_consumer0, cargs),
        (_ws_consumer1, cargs),
        (_ws_producer, (Q_DESC, KN_DESC, VN_DESC, KC_DESC, VC_DESC, PT, pt_row, q_s, k_s, v_s, ready, empty, n_tiles,
                        n_pre, prefix, q_start, hk, h, mb, PAGE, HKV, HND)),
    ], [4, 1], [REGS, 24])


def unsupported(q, k_new, v_new, kc, vc, kv_format: str, attn, descriptors_ok: bool,
                workspace: bool = False) -> str | None:
    """Why this kernel does not apply (None when it does): an sm_90 GPU; a bf16 or float16 cache with q, k_new and
    v_new of its dtype, readable through tensor descriptors (``descriptors_ok``: the caller's ``prefill.tma_ok`` of
    all three); head dim 64 or 128; pages of a multiple of 16 tokens; no sliding window, sinks or q scale.
    ``workspace``: a quantized cache whose prefix the caller dequantizes into a workspace of q's dtype (HND pages
    of the cache's size) first; then q, k_new and v_new must be bf16 or float16 and the cache's own layout does not
    matter."""
    import torch

    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "needs an sm_90 (Hopper) GPU"
    if workspace:
        if q.dtype not in (torch.bfloat16, torch.float16) or not (q.dtype == k_new.dtype == v_new.dtype):
            return "needs bf16 or float16 q, k_new and v_new of one dtype"
    elif kv_format not in ("bf16", "fp16") or not (q.dtype == k_new.dtype == v_new.dtype == kc.data.dtype):
        return "needs a bf16 or float16 cache with q, k_new and v_new of its dtype"
    if kc.head_dim not in (64, 128):
        return f"needs head dim 64 or 128, got {kc.head_dim}"
    if kc.page_size % 16:
        return f"needs pages of a multiple of 16 tokens, got {kc.page_size}"
    if attn.sliding_window or attn.sinks is not None or attn.q_scale is not None:
        return "no sliding window, sinks or q scale (the Triton kernel takes them)"
    if not descriptors_ok:
        return "q, k_new and v_new must be readable through tensor descriptors (prefill.tma_ok)"
    if workspace:
        return None
    for c in (kc, vc):
        x = c.data
        hnd = x.stride(2) == c.page_size * c.head_dim and x.stride(1) == c.head_dim
        nhd = x.stride(1) == c.num_kv_heads * c.head_dim and x.stride(2) == c.head_dim
        if x.stride(3) != 1 or not (hnd or nhd) or x.stride(0) != c.page_size * c.num_kv_heads * c.head_dim:
            return "needs a contiguous HND or NHD cache plane"
        if x.data_ptr() % 16:
            return "needs a 16-byte aligned cache"
    return None


@functools.lru_cache(maxsize=None)
def _layout(d: int, dtype, bn: int):
    return gl.NVMMASharedLayout.get_default_for([bn, d], dtype)


def launch(q, k_new, v_new, kc, vc, page_table, seq_lens, cu_seqlens_q, max_q_len: int, out, sm_scale: float,
           heavy_first: bool = True) -> None:
    """The kernel over ``(query blocks, query heads, sequences)`` (``unsupported`` must have said None)."""
    _launch(q, k_new, v_new, kc, vc, page_table, seq_lens, cu_seqlens_q, max_q_len, out, sm_scale, heavy_first, False)


def launch_dequantized(q, k_new, v_new, kc, vc, page_table, seq_lens, cu_seqlens_q, max_q_len: int, out,
                       sm_scale: float, heavy_first: bool = True) -> None:
    """``launch`` over planes of dequantized values (a workspace of q's dtype) whose per-kv-head scales
    ``kc.scale`` / ``vc.scale`` apply to the prefix (the warp-specialized kernel only)."""
    _launch(q, k_new, v_new, kc, vc, page_table, seq_lens, cu_seqlens_q, max_q_len, out, sm_scale, heavy_first, True)


def _launch(q, k_new, v_new, kc, vc, page_table, seq_lens, cu_seqlens_q, max_q_len: int, out, sm_scale: float,
            heavy_first: bool, scaled: bool) -> None:
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if WS_STAGES < 2:  # a tile's stage is released after the next tile's scores were issued
        raise ValueError(f"prefill_wg.WS_STAGES must be at least 2, got {WS_STAGES}")
    t, hq, d = q.shape
    hk, page = kc.num_kv_heads, kc.page_size
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    hnd = kc.data.stride(2) == page * d
    bn = WS_BLOCK_N
    lay = _layout(d, gdt, bn)
    rows = min(page, bn)

    def plane(c):
        x = c.data.permute(0, 2, 1, 3) if hnd else c.data  # memory order
        x2 = x.reshape(-1, d) if hnd else x.reshape(-1, hk * d)
        return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [rows, d], lay)

    def packed(x, r):
        return TensorDescriptor(x, [t, x.shape[1] * d], [x.stride(0), 1], [r, d],
                                gl.NVMMASharedLayout.get_default_for([r, d], gdt))

    nseq = cu_seqlens_q.shape[0] - 1
    grid = (-(-max_q_len // BLOCK_M), hq, nseq)
    _prefill_ws[grid](
        packed(q, BLOCK_M), packed(k_new, bn), packed(v_new, bn), plane(kc), plane(vc), page_table,
        seq_lens, cu_seqlens_q, out, kc.scale, vc.scale, float(sm_scale * LOG2E), out.stride(0), out.stride(1),
        page_table.stride(0), G=hq // hk, D=d, PAGE=page, HKV=hk, HND=hnd, STAGES=WS_STAGES,
        HEAVY_FIRST=heavy_first, REGS=WS_REGS, SCALED=scaled, num_warps=4,
    )

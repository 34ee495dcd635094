"""MLA decode at many heads on Hopper with warpgroup MMAs (Gluon): the latent tiles arrive by TMA into
shared memory and both products run as ``wgmma`` from shared memory, so the registers hold the accumulators
only.  The default of ``mla_decode`` above 32 heads on an sm_90 GPU where it applies (``unsupported``).

Why: at 128 heads the absorbed decode is bound by the tensor cores (242 FLOP per cached byte in bf16), and
the Triton kernel (``mla_decode.py``) reached about 240 TFLOP/s there: its 64 x 512 fp32 accumulator and
the query operand of the score dot shared the registers and spilled (docs/mla.md, "Targets").

Layout (one program per 64 query heads x sequence x split; 8 warps = two warpgroups):

* The query ``[64, rank]`` and ``[64, rope]`` is staged once in shared memory (the left operand of the
  scores).  Each 64-token tile is brought in by two TMA copies per page it spans (latent ``[rows, rank]``, rope
  key ``[rows, rope]``: the tile, or one page of 8 to 32 tokens) into a ring of ``STAGES`` buffers guarded by
  one mbarrier each.
* The scores ``S = q_lat·cᵀ + q_pe·k_peᵀ`` ``[64 heads, 64 tokens]``: the MMA layout puts the two
  warpgroups on the token halves, so each computes ``[64, 32]`` over the full depth.  The row maximum is
  taken across both halves; the row sums stay per element until the end.
* ``P`` goes to shared memory in the operand type, and ``O += P·c`` ``[64, rank]`` runs with the tile as
  stored as the right operand; the warpgroups hold the output's column halves (128 fp32 registers per
  thread at rank 512).  A tile's ``P·c`` is issued at the top of the next iteration, before the wait for the
  next tile, and runs on the tensor cores with that tile's scores.
* The last tile of a sequence may hold slots past its end whose bytes are whatever the page holds (NaN
  included): those rows of the latent are zeroed in shared memory before ``P·c`` reads them.
* ``CVT``: an e4m3 latent with bf16 queries (``SPLIT``: each row split before the launch into two e4m3 terms
  with one power-of-two scale, ``_fp8_split.split_rows``) or e4m3 queries; an e5m2 latent with the split bf16
  queries (e4m3 × e5m2 MMAs).  The scores run as fp8 MMAs on the tile as copied; ``P·c`` runs in float16 (``P``
  in float16) on the tile converted by the warps into a float16 buffer, exactly (rows past the sequence's end
  converted as zeros).  Per tile ``i``: ``P·c`` of tile ``i − 1`` runs while the softmax of tile ``i`` writes its
  ``P`` (two ``P`` buffers); then the scores of tile ``i + 1`` run while the warps convert tile ``i`` into the
  float16 buffer, which ``P·c`` of tile ``i − 1`` no longer reads.
* ``FP8`` (``mla_decode``'s ``fp8_pv``): e4m3 queries over an e4m3 latent, both products as fp8 MMAs.  The
  scores are ``fp8_scores``' values; ``P`` is rounded to e4m3 (lossy, as fp8 attention kernels do), and ``P·c``
  takes the tile transposed into a second pair of buffers (an fp8 MMA's right operand must have its depth,
  the tokens, contiguous), written by the warps while the score MMAs run.

The partial outputs and log-sum-exps have ``mla_decode``'s split layout (element order), and its merge
kernel combines them.  Gluon has no interpreter: the CPU path and the float64 checks of the CPU tests go
through ``mla_decode.py``; ``tools/mla_check.py`` and ``tests/test_gpu_kernels.py`` check this kernel against
the float64 reference on a GPU.  Measured against the Triton kernel and flashinfer in docs/mla.md ("The Hopper
kernel at 128 heads", "An e4m3 latent on the Hopper kernel").  ``PARTS`` (a module setting for timing probes only;
0, the default, is the kernel) compiles it with the softmax or one of the products left out
(``docs/scripts/mla_probes.py decode-wg --parts``; not under ``CVT``).
"""

from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kvbench.kernels import _gluon_compat as compat

__all__ = ["BLOCK_H", "BLOCK_N", "STAGES", "unsupported", "launch"]

BLOCK_H = 64  # query heads per program: the M of one warpgroup MMA
BLOCK_N = 64  # tokens per tile: a page of 64 holds one tile
# tile buffers: bf16 2 x 72 KB next to the 72 KB query; fp8_pv 3 x 36 KB; an fp8 latent with a float16 P·c next to
# its 64 KB float16 buffer: "split" (bf16 queries as two e4m3 terms, 72 KB) 2 x 36 KB, "e4m3" (e4m3 queries, 36 KB)
# 3 x 36 KB (H200, 128 heads, 64 x 8192: 345.1 -> 330.7 us with pages of 64, 388.8 -> 372.5 with pages of 16)
STAGES = {False: 2, True: 3, "split": 2, "e4m3": 3}
_sync, _tma_load = compat.sync, compat.tma_load


@gluon.jit
def _issue(C_DESC, PE_DESC, c_buf, pe_buf, bar, PT, pt_row, n0, end, PAGE: gl.constexpr, RANK: gl.constexpr,
           BN: gl.constexpr):
    """TMA copies of the tile at token ``n0``, one per page it spans (pages of 8, 16 or 32 tokens) or one for
    the tile (pages of a multiple of ``BN``: a tile never straddles one).  Pages past the sequence's last are
    read as its last page (their rows lie past ``end``: masked, and zeroed before ``P·c``), so no page-table
    entry past the sequence's own is read."""
    R: gl.constexpr = C_DESC.block_type.shape[0]  # rows per copy
    mbarrier.expect(bar, (C_DESC.block_type.nbytes + PE_DESC.block_type.nbytes) * (BN // R))
    last = (end - 1) // PAGE
    for j in gl.static_range(BN // R):
        pos = n0 + j * R
        row = gl.load(PT + pt_row + gl.minimum(pos // PAGE, last)) * PAGE + pos % PAGE
        _tma_load(C_DESC, [row, 0], bar, c_buf.slice(j * R, R))
        _tma_load(PE_DESC, [row, RANK], bar, pe_buf.slice(j * R, R))


@gluon.jit
def _stage_rows(SRC, row_ptr, hm, dst, W: gl.constexpr, LAY: gl.constexpr):
    """Rows ``[64, W]`` of a query tensor (row pointers ``row_ptr``, masked heads zero) into ``dst``."""
    d = gl.arange(0, W, layout=gl.SliceLayout(0, LAY))
    x = gl.load(row_ptr[:, None] + d[None, :], mask=hm[:, None], other=0.0)
    dst.store(x)


@gluon.jit
def _zero_tail(buf, valid, BN: gl.constexpr, W: gl.constexpr, COLS: gl.constexpr, LAY: gl.constexpr):
    """Zero rows ``valid..`` of a ``[BLOCK_N, W]`` tile in shared memory, ``COLS`` columns at a time."""
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, LAY))
    keep = (rows < valid)[:, None]
    for j in gl.static_range(W // COLS):
        part = buf.slice(j * COLS, COLS, dim=1)
        x = part.load(LAY)
        part.store(gl.where(keep, x, gl.zeros_like(x)))


@gluon.jit
def _transpose(src, dst, W: gl.constexpr, COLS: gl.constexpr, LAY: gl.constexpr):
    """The ``[BN, W]`` tile ``src`` into ``dst`` ``[W, BN]`` (its transpose), ``COLS`` of its columns at a time."""
    for j in gl.static_range(W // COLS):
        dst.slice(j * COLS, COLS, dim=0).permute((1, 0)).store(src.slice(j * COLS, COLS, dim=1).load(LAY))


@gluon.jit
def _convert(src, dst, valid, BN: gl.constexpr, W: gl.constexpr, COLS: gl.constexpr, LAY: gl.constexpr):
    """The fp8 tile ``src`` ``[BN, W]`` into the float16 tile ``dst``, ``COLS`` columns at a time, rows ``valid..``
    zeroed (a sequence's last tile: the slots' bytes are whatever the page holds, and ``P·c`` reads them)."""
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, LAY))
    keep = (rows < valid)[:, None]
    for j in gl.static_range(W // COLS):
        x = src.slice(j * COLS, COLS, dim=1).load(LAY).to(dst.dtype)
        dst.slice(j * COLS, COLS, dim=1).store(gl.where(keep, x, gl.zeros_like(x)))


@gluon.jit
def _scores_fp8(q_s, qp_s, z, c_buf, pe_buf, bar, phase, BH: gl.constexpr, BN: gl.constexpr, S_L: gl.constexpr,
                SPLIT: gl.constexpr):
    """Wait for the fp8 tile and issue its score MMAs on it as stored: e4m3 queries, or (``SPLIT``) the hi and lo
    e4m3 terms of bf16 queries, all into one accumulator (one scale per row of both parts).  The query terms are
    ``q_s`` / ``qp_s`` entries ``z`` (and ``z + 1``), ``z`` a zero the compiler cannot see as a constant, so the
    operand descriptors are formed at each use instead of held in registers through the loop."""
    mbarrier.wait(bar, phase)
    s = gl.zeros([BH, BN], gl.float32, S_L)
    s = warpgroup_mma(q_s.index(z), c_buf.permute((1, 0)), s, use_acc=False, is_async=True)
    if SPLIT:
        s = warpgroup_mma(q_s.index(z + 1), c_buf.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(qp_s.index(z), pe_buf.permute((1, 0)), s, is_async=True)
    if SPLIT:
        s = warpgroup_mma(qp_s.index(z + 1), pe_buf.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _scores(q_s, qp_s, c_buf, pe_buf, bar, phase, n0, end, BH: gl.constexpr, BN: gl.constexpr, RANK: gl.constexpr,
            S_L: gl.constexpr, T_L: gl.constexpr, PARTS: gl.constexpr = 0):
    """Wait for the tile at token ``n0``, zero its latent rows past ``end`` (the sequence's last tile: the
    slots' bytes are whatever the page holds, and ``P·c`` reads them), and issue its score MMAs (not for
    ``PARTS`` 3, a timing probe's: zeros)."""
    mbarrier.wait(bar, phase)
    if n0 + BN > end:
        _zero_tail(c_buf, end - n0, BN, RANK, 32, T_L)
        fence_async_shared()
        _sync()
    s = gl.zeros([BH, BN], gl.float32, S_L)
    if PARTS != 3:
        s = warpgroup_mma(q_s, c_buf.permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(qp_s, pe_buf.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _softmax_p(s, m_i, l_acc, n0, end, scale, BN: gl.constexpr, S_L: gl.constexpr):
    """One tile's online softmax: ``P`` (base 2, scaled, slots past ``end`` at zero), the new row maxima, the
    per-element row sums and the factors ``alpha`` that rescale the output to the new maxima (``CVT`` applies them
    once ``P·c`` of the tile before, in flight during the softmax, is done)."""
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, S_L))
    s = gl.where((n0 + cols < end)[None, :], s * scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    return p, m_new, l_acc * alpha[:, None] + p, alpha


@gluon.jit
def _softmax(s, m_i, l_acc, o, n0, end, scale, BN: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr):
    """``_softmax_p`` with the output rescaled at once."""
    p, m_new, l_acc, alpha = _softmax_p(s, m_i, l_acc, n0, end, scale, BN, S_L)
    return p, m_new, l_acc, o * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]


@gluon.jit
def _p_to_shared(s, m_i, l_acc, o, p_s, n0, end, scale, BN: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr,
                 PARTS: gl.constexpr):
    """The tile's softmax (``_softmax``) and ``P`` into shared memory in the operand type, visible to the MMAs
    and to both warpgroups (fence, barrier).  Timing probes (``PARTS``): 1 stores the raw scores, 2 and 3 store
    nothing."""
    if PARTS == 0:
        p, m_i, l_acc, o = _softmax(s, m_i, l_acc, o, n0, end, scale, BN, S_L, O_L)
    else:
        p = s
    if PARTS < 2:
        p_s.store(p.to(p_s.dtype))
    fence_async_shared()
    _sync()
    return m_i, l_acc, o


@gluon.jit
def _mla_decode_wg(
    C_DESC, PE_DESC, QL, QP, QL2, QP2, QINV, KSCALE, QSCALE, PT, SL, MO, ML,
    sm_scale_log2,
    stride_lb, stride_lh, stride_pb, stride_ph, stride_pt, stride_mb, stride_mh, stride_ms,
    H, num_splits,
    PAGE: gl.constexpr, RANK: gl.constexpr, ROPE: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
    PARTS: gl.constexpr = 0, CVT: gl.constexpr = False, SPLIT: gl.constexpr = False,
):
    BH: gl.constexpr = 64
    BN: gl.constexpr = 64
    KI: gl.constexpr = 32 if FP8 else 16  # the MMA instruction's depth: 32 bytes of operand
    KS: gl.constexpr = 32 if (FP8 or CVT) else 16  # the same for the score MMAs (on the fp8 tile under CVT)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, KS])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, RANK // 2, KI])
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # 16-byte loads of query rows
    T_L: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [8, 1], [1, 0])  # 32-column slices of a tile
    QDT: gl.constexpr = QL.dtype.element_ty
    PDT: gl.constexpr = gl.float16 if CVT else C_DESC.dtype  # P in the type of P·c's right operand
    X_L: gl.constexpr = gl.BlockedLayout([4, 4], [8, 4], [2, 4], [1, 0])  # the e4m3 tile's transposition
    # 128-column slices of an fp8 tile: 16 threads read a 128-byte row segment, 8 write 128 bytes of float16
    C_L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])

    hg = gl.program_id(0)
    b = gl.program_id(1).to(gl.int64)
    sp = gl.program_id(2)
    seq_len = gl.load(SL + b)
    chunk = gl.cdiv(gl.cdiv(seq_len, num_splits), BN) * BN
    start = sp * chunk
    end = gl.minimum(start + chunk, seq_len)
    n_tiles = gl.cdiv(end - start, BN)

    # the query, once, into shared memory (CVT: q_s / qp_s hold the e4m3 query, or the bf16 one's hi and lo terms)
    hq = hg * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, LD))
    hmq = hq < H
    if CVT:
        NQ: gl.constexpr = 2 if SPLIT else 1
        q_s = gl.allocate_shared_memory(QDT, [NQ, BH, RANK], gl.NVMMASharedLayout.get_default_for([BH, RANK], QDT))
        qp_s = gl.allocate_shared_memory(QDT, [NQ, BH, ROPE], gl.NVMMASharedLayout.get_default_for([BH, ROPE], QDT))
        _stage_rows(QL, QL + b * stride_lb + hq * stride_lh, hmq, q_s.index(0), RANK, LD)
        _stage_rows(QP, QP + b * stride_pb + hq * stride_ph, hmq, qp_s.index(0), ROPE, LD)
        if SPLIT:
            _stage_rows(QL2, QL2 + b * stride_lb + hq * stride_lh, hmq, q_s.index(1), RANK, LD)
            _stage_rows(QP2, QP2 + b * stride_pb + hq * stride_ph, hmq, qp_s.index(1), ROPE, LD)
    else:
        q_s = gl.allocate_shared_memory(QDT, [BH, RANK], gl.NVMMASharedLayout.get_default_for([BH, RANK], QDT))
        qp_s = gl.allocate_shared_memory(QDT, [BH, ROPE], gl.NVMMASharedLayout.get_default_for([BH, ROPE], QDT))
        _stage_rows(QL, QL + b * stride_lb + hq * stride_lh, hmq, q_s, RANK, LD)
        _stage_rows(QP, QP + b * stride_pb + hq * stride_ph, hmq, qp_s, ROPE, LD)

    c_s = gl.allocate_shared_memory(C_DESC.dtype, [STAGES, BN, RANK], C_DESC.layout)  # the copies' swizzle
    pe_s = gl.allocate_shared_memory(PE_DESC.dtype, [STAGES, BN, ROPE], PE_DESC.layout)
    if CVT:  # P of two tiles: P·c of the one before runs while the softmax of the next writes its P
        p_s = gl.allocate_shared_memory(PDT, [2, BH, BN], gl.NVMMASharedLayout.get_default_for([BH, BN], PDT))
    else:
        p_s = gl.allocate_shared_memory(PDT, [BH, BN], gl.NVMMASharedLayout.get_default_for([BH, BN], PDT))
    if FP8:  # the latent transposed (tokens contiguous), as an fp8 MMA's right operand must be; two buffers
        vt_s = gl.allocate_shared_memory(C_DESC.dtype, [2, RANK, BN],
                                         gl.NVMMASharedLayout.get_default_for([RANK, BN], C_DESC.dtype))
    if CVT:  # the fp8 latent converted to float16 for P·c (exact; one buffer)
        w_s = gl.allocate_shared_memory(gl.float16, [BN, RANK], gl.NVMMASharedLayout.get_default_for([BN, RANK],
                                                                                                   gl.float16))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()
    _sync()

    pt_row = b * stride_pt
    for i in gl.static_range(STAGES):
        if i < n_tiles:
            _issue(C_DESC, PE_DESC, c_s.index(i), pe_s.index(i), ready.index(i), PT, pt_row, start + i * BN, end, PAGE,
                   RANK, BN)

    scale = sm_scale_log2 * gl.load(KSCALE)
    if FP8 or (CVT and not SPLIT):
        scale = scale * gl.load(QSCALE)
    if SPLIT:  # the rows' inverse scales of the query terms
        hs = hg * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, S_L))
        q_inv = gl.load(QINV + b * H + hs, mask=hs < H, other=1.0)
    m_i = gl.full([BH], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_acc = gl.zeros([BH, BN], gl.float32, S_L)
    o = gl.zeros([BH, RANK], gl.float32, O_L)
    if CVT:
        # Per tile i: P·c of tile i - 1 runs while the softmax of tile i writes its P (the other P buffer); then,
        # both warpgroups past that P·c, the scores of tile i + 1 run on its stored fp8 tile while the warps
        # convert tile i into the float16 buffer.  Nothing is in flight across an iteration's end: the next
        # tile's scores are waited for after the conversion (the last iteration recomputes its own tile's, so
        # no MMA depends on a runtime test).  A stage is refilled in the iteration after its tile's scores and
        # conversion, once P·c is issued.
        s = gl.zeros([BH, BN], gl.float32, S_L)
        if n_tiles > 0:
            s = _scores_fp8(q_s, qp_s, 0, c_s.index(0), pe_s.index(0), ready.index(0), 0, BH, BN, S_L, SPLIT)
            s = warpgroup_mma_wait(0, deps=[s])
            if SPLIT:
                s = s * q_inv[:, None]
            p, m_i, l_acc, alpha = _softmax_p(s, m_i, l_acc, start, end, scale, BN, S_L)
            p_s.index(0).store(p.to(PDT))
            j = gl.minimum(1, n_tiles - 1)
            s = _scores_fp8(q_s, qp_s, 0, c_s.index(j % STAGES), pe_s.index(j % STAGES), ready.index(j % STAGES),
                            (j // STAGES) & 1, BH, BN, S_L, SPLIT)
            _convert(c_s.index(0), w_s, end - start, BN, RANK, 128, C_L)
            s = warpgroup_mma_wait(0, deps=[s])
            fence_async_shared()
            _sync()
        for i in range(1, n_tiles):
            prev = (i - 1) % STAGES
            n0 = start + i * BN
            o = warpgroup_mma(p_s.index((i - 1) % 2), w_s, o, is_async=True)
            if i - 1 + STAGES < n_tiles:  # after P·c's issue: the page-table loads' latency overlaps it
                _issue(C_DESC, PE_DESC, c_s.index(prev), pe_s.index(prev), ready.index(prev), PT, pt_row,
                       start + (i - 1 + STAGES) * BN, end, PAGE, RANK, BN)
            if SPLIT:
                s = s * q_inv[:, None]
            p, m_i, l_acc, alpha = _softmax_p(s, m_i, l_acc, n0, end, scale, BN, S_L)
            p_s.index(i % 2).store(p.to(PDT))
            o = warpgroup_mma_wait(0, deps=[o])
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            _sync()  # both warpgroups are past P·c of tile i - 1: the float16 buffer may be rewritten
            j = gl.minimum(i + 1, n_tiles - 1)
            s = _scores_fp8(q_s, qp_s, i >> 30, c_s.index(j % STAGES), pe_s.index(j % STAGES),
                            ready.index(j % STAGES), (j // STAGES) & 1, BH, BN, S_L, SPLIT)
            _convert(c_s.index(i % STAGES), w_s, end - n0, BN, RANK, 128, C_L)
            s = warpgroup_mma_wait(0, deps=[s])
            fence_async_shared()
            _sync()
        if n_tiles > 0:
            o = warpgroup_mma(p_s.index((n_tiles - 1) % 2), w_s, o, is_async=True)
            o = warpgroup_mma_wait(0, deps=[o])
    else:
        # Tile i's P·c is issued at the top of iteration i + 1, ahead of the wait for tile i + 1 and its scores,
        # and waited for with them: no MMA is in flight across an iteration's end (ptxas serializes the MMAs when
        # an accumulator in flight crosses the loop's back edge).  Tile 0's scores run before the loop.
        if n_tiles > 0:
            s = _scores(q_s, qp_s, c_s.index(0), pe_s.index(0), ready.index(0), 0, start, end, BH, BN, RANK, S_L,
                        T_L, PARTS)
            if FP8:
                _transpose(c_s.index(0), vt_s.index(0), RANK, 128, X_L)
            if PARTS != 3:
                s = warpgroup_mma_wait(0, deps=[s])
            m_i, l_acc, o = _p_to_shared(s, m_i, l_acc, o, p_s, start, end, scale, BN, S_L, O_L, PARTS)
        for i in range(1, n_tiles):
            st = i % STAGES
            prev = (i - 1) % STAGES
            if PARTS != 2:
                if FP8:
                    o = warpgroup_mma(p_s, vt_s.index((i - 1) % 2).permute((1, 0)), o, is_async=True)
                else:
                    o = warpgroup_mma(p_s, c_s.index(prev), o, is_async=True)
            n0 = start + i * BN
            s = _scores(q_s, qp_s, c_s.index(st), pe_s.index(st), ready.index(st), (i // STAGES) & 1, n0, end,
                        BH, BN, RANK, S_L, T_L, PARTS)
            if FP8:  # the buffer was last read by P·c two tiles back, retired in the previous iteration
                _transpose(c_s.index(st), vt_s.index(i % 2), RANK, 128, X_L)
            if PARTS == 2:
                s = warpgroup_mma_wait(0, deps=[s])
            elif PARTS == 3:
                o = warpgroup_mma_wait(0, deps=[o])
            else:
                s, o = warpgroup_mma_wait(0, deps=[s, o])
            # both warpgroups are past the previous tile's P·c: its stage and P may be refilled
            _sync()
            if i - 1 + STAGES < n_tiles:
                _issue(C_DESC, PE_DESC, c_s.index(prev), pe_s.index(prev), ready.index(prev), PT, pt_row,
                       start + (i - 1 + STAGES) * BN, end, PAGE, RANK, BN)
            m_i, l_acc, o = _p_to_shared(s, m_i, l_acc, o, p_s, n0, end, scale, BN, S_L, O_L, PARTS)
        if n_tiles > 0:
            if FP8:
                o = warpgroup_mma(p_s, vt_s.index((n_tiles - 1) % 2).permute((1, 0)), o, is_async=True)
            else:
                o = warpgroup_mma(p_s, c_s.index((n_tiles - 1) % STAGES), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=[o])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    ho = hg * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, O_L))
    hmo = ho < H
    hs = hg * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, S_L))
    lse_ptr = ML + b * (H * num_splits) + hs * num_splits + sp
    if n_tiles > 0:
        l_i = gl.sum(l_acc, axis=1)
        inv = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, O_L))
        d = gl.arange(0, RANK, layout=gl.SliceLayout(0, O_L))
        optr = MO + b * stride_mb + ho[:, None] * stride_mh + sp * stride_ms + d[None, :]
        gl.store(optr, o * inv[:, None], mask=hmo[:, None])
        gl.store(lse_ptr, m_i + gl.log2(l_i), mask=hs < H)
    else:
        gl.store(lse_ptr, gl.full([BH], float("-inf"), gl.float32, gl.SliceLayout(1, S_L)), mask=hs < H)


def unsupported(cache, q_lat, fp8: bool) -> str | None:
    """Why this kernel does not apply (None when it does): an sm_90 CUDA device, a bf16 latent with bf16 queries,
    an e4m3 latent with bf16 or e4m3 queries, or (``fp8``: ``mla_decode``'s ``fp8_pv``) an e4m3 latent with e4m3
    queries, rank 512 / rope 64 (DeepSeek's;
    the operand tiles and the shared-memory budget are sized for them), and pages of 8, 16 or 32 tokens (a
    tile's copies, one per page, start on the 8-row period of the shared-memory swizzle) or of a multiple of
    64."""
    import torch

    lay = cache.layout
    if fp8:
        if lay.kv_dtype != "fp8_e4m3" or q_lat.dtype != torch.float8_e4m3fn:
            return "fp8 P·c needs an fp8_e4m3 latent and e4m3 queries"
    elif lay.kv_dtype == "fp8_e4m3":
        if q_lat.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            return "over an fp8_e4m3 latent it needs bf16 or e4m3 queries"
    elif lay.kv_dtype not in ("bf16", "fp8_e5m2") or q_lat.dtype != torch.bfloat16:
        return ("needs a bf16 or fp8_e5m2 latent with bf16 queries, or an fp8_e4m3 latent with bf16 or e4m3 "
                "queries")
    if (lay.kv_lora_rank, lay.rope_dim) != (512, 64):
        return f"sized for rank 512 and rope 64, got {lay.kv_lora_rank} / {lay.rope_dim}"
    if cache.page_size % BLOCK_N and cache.page_size not in (8, 16, 32):
        return f"needs pages of 8, 16 or 32 tokens or a multiple of {BLOCK_N}, got {cache.page_size}"
    if cache.data.stride(-1) != 1 or cache.data.data_ptr() % 16:
        return "needs a contiguous, 16-byte aligned latent"
    dev = cache.data.device
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev) != (9, 0):
        return "needs an sm_90 (Hopper) GPU"
    return None


@functools.lru_cache(maxsize=None)
def _tile_layouts(bits: int):
    """Shared layouts of the latent and rope tiles; a copy of fewer rows (one page) takes the same swizzle."""
    c = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 512], gl.float8e4nv if bits == 8 else gl.bfloat16)
    pe = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.float8e4nv if bits == 8 else gl.bfloat16)
    return c, pe


PARTS = {"value": 0}  # timing probes only (docs/scripts/mla_probes.py decode-wg --parts): 0 = the kernel


def launch(q_lat, q_pe, cache, page_table, seq_lens, mid_o, mid_l, sm_scale_log2: float, q_scale, num_splits: int,
           fp8: bool):
    """The split kernel over ``(head groups, batch, splits)``; ``mid_o [B, H, splits, rank]`` fp32 and
    ``mid_l [B, H, splits]`` as ``mla_decode``'s split kernel writes them."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from kvbench.kernels._fp8_split import split_rows

    lay = cache.layout
    cvt = not fp8 and lay.kv_dtype in ("fp8_e4m3", "fp8_e5m2")  # scores on the fp8 tile, P·c on its conversion
    split = cvt and q_lat.dtype == torch.bfloat16
    q_lo, qp_lo, q_inv = q_lat, q_pe, cache.k_scale  # placeholders unless split
    if split:  # bf16 queries as two e4m3 terms and the rows' inverse scales (kernels/_fp8_split.py)
        q_lat, q_lo, q_pe, qp_lo, q_inv = split_rows(q_lat, q_pe)
    b, h = q_lat.shape[:2]
    d = lay.kv_lora_rank + lay.rope_dim
    flat = cache.data.view(-1, d)
    c_lay, pe_lay = _tile_layouts(flat.element_size() * 8)
    rows = min(cache.page_size, BLOCK_N)  # rows per TMA copy: a page, or the whole tile
    c_desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, lay.kv_lora_rank], c_lay)
    pe_desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, lay.rope_dim], pe_lay)
    qs = q_scale if q_scale is not None else cache.k_scale
    _mla_decode_wg[(-(-h // BLOCK_H), b, num_splits)](
        c_desc, pe_desc, q_lat, q_pe, q_lo, qp_lo, q_inv, cache.k_scale, qs, page_table, seq_lens, mid_o, mid_l,
        float(sm_scale_log2),
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        h, num_splits,
        PAGE=cache.page_size, RANK=lay.kv_lora_rank, ROPE=lay.rope_dim,
        STAGES=STAGES[("split" if split else "e4m3") if cvt else fp8], FP8=fp8,
        PARTS=0 if cvt else PARTS["value"], CVT=cvt, SPLIT=split, num_warps=8,
    )

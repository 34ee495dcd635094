"""nvfp4 paged decode on Hopper with explicit register layouts (Gluon): the codes are dequantized straight
into the registers the tensor-core instruction reads.  The default nvfp4
decode on a CUDA GPU where it applies (``decode.paged_decode``; ``unsupported`` says where it does not).

Why: the Triton kernel (``decode.py``) loads a tile in one register layout and hands the dot another; the
conversion between them (shared-memory stores and ``ldmatrix`` loads, lane packing around the unpacking
PTX) made it issue-bound at about 5.6 instructions per code (docs/kernels.md, "Speed targets of issue 28").
Here each thread reads exactly the bytes whose values it holds in the ``mma.m16n8k16`` operand fragments,
and the contraction index is permuted to make that possible: a dot product does not depend on the order
of its terms, so the query (for the scores) and the output columns (for PV) take the same permutation.

Orientation: the scores are computed transposed, ``Sᵀ = K·Qᵀ``, and the output as ``Oᵀ = Vᵀ·Pᵀ``: the tokens
(and the head's 128 columns) are the 16-row side of the mma and the GQA group's query heads its 8-column side,
padded to 8 (16 above 8 heads).  With the heads on the 16-row side instead (``S = Q·Kᵀ``, tried first) a group
of 4 heads filled a quarter of every operand, the accumulator took 64 registers per thread and the softmax ran
on 16 rows; here half of the 8 columns are padding, the accumulator is 32 registers and the program fits four
times on an SM under a 128-register cap (docs/kernels.md has both measured).

Layout (one program per sequence × kv head × split, four warps, each warp its own 32 tokens of a
128-token tile and its own online softmax; the warps' partial results are merged once at the end):

* ``Sᵀ = K·Qᵀ``: the left fragment ``[tokens = 32, slots = 128]`` of a warp holds, in lane ``c + 4·g``
  (c < 4, g < 8), tokens ``g + 8·i`` and the contraction slots ``k = 32m + 16a + 8h + 2c + e``.  The 32 codes
  a thread needs per token are the token's bytes ``16c .. 16c + 15``: one 128-bit load.  Slot ``k`` holds
  element ``d = 32c + 8m + 4a + 2e + h`` (the order the unpacking produces), which ``k_to_d`` gives.
* ``Oᵀ = Vᵀ·Pᵀ``: the left fragment ``[columns = 128, tokens = 32]`` holds, in lane ``c + 4·g``, tokens
  ``2c + e + 8h + 16a`` and columns ``n = g + 8j + 64s``; column ``n`` is element
  ``d = 16g + 8s + 2(j mod 4) + j div 4`` (``col_to_d``): each thread reads 8 bytes per token, and its
  16 values of one token share one block scale.  ``Pᵀ`` comes from the ``Sᵀ`` accumulator by one in-warp
  layout conversion per tile.
* The unpacking (``UNPACK`` 1, the default): a nibble's bits are placed as the high byte of a float16, which
  is 2^-14 times its e2m1 value exactly, and a byte permute puts two of them over zero low bytes; the products
  with the block scales times 2^6 are 2^-8 times the values, exact in float16 (undone in the scores' scale and
  at the output).  ``UNPACK`` 0, the kernel before 2026-11-29: e4m3 bytes of 2^-6 times the values converted
  two at a time (``cvt.rn.f16x2.e4m3x2``).
* The loads (``STAGES`` 2, the default): each tile's code rows and block-scale rows go to shared memory by
  asynchronous copies (``cp.async``) one tile ahead, so the next tile's bytes are in flight while this one is
  unpacked; each thread then reads its fragment bytes from shared memory (K 16 bytes, V 8 bytes per token; V's
  rows swizzled so those reads hit 32 banks, ``_V_SMEM``).  The copies take the tile as 8 groups of 16 tokens
  that never straddle a page (pages of a multiple of 16 tokens, tiles 16-aligned, tokens before a sliding
  window's start zero-filled): one page lookup per group, shared by the code rows and the block-scale rows (the
  token strides are compile-time constants, so the offsets within a group are immediates; ``CPL`` 4), and a
  whole tile's copies and scores go unmasked.
  ``STAGES`` 0 loads straight into the registers (the kernel before; also ``DecodeOptions.prefetch``).
* The operands in halves (``HALVES``): the scores as two products over slots 0-63 and 64-127, P·V as two over
  columns 0-63 and 64-127, each half unpacked just before its product, V read after the softmax.

The module settings ``UNPACK``, ``STAGES``, ``VSWZ``, ``CPL`` and ``HALVES`` are read at launch; the defaults
are the fastest of ``docs/scripts/decode_probes.py nv4-unpack`` and ``nv4-sets`` on an H200 (docs/kernels.md,
"nvfp4 decode on the H200"), the others stay for those probes and the GPU tests.

Everything else is the Triton kernel's semantics: split bounds from ``seq_lens`` on the device, the sliding
window, sinks, the per-head global scales, and the same partial-result layout for the reduce kernel.
Gluon has no interpreter, so this runs on a GPU only (sm_80 or newer); ``decode.py`` is the path on the CPU
and the float64 reference checks cover both (``tools/kernel_check.py``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from kvbench.kernels import _gluon_compat as compat
from kvbench.kernels.config import DecodeOptions
from kvbench.kernels.formats import get_format

__all__ = ["K_TO_D", "COL_TO_D", "k_to_d", "col_to_d", "launch", "unsupported"]

LOG2E = gl.constexpr(1.4426950408889634)
TILE = 128  # tokens per program iteration: 4 warps x 32
# launch defaults from the H100 sweep (docs/kernels.md, "nvfp4 decode in the transposed orientation"): no
# register prefetch of the next tile, registers capped at 128 (168 uncapped; the cap spills a few words to the
# stack) so four programs fit on an SM, and as many splits as fill those slots once
PREFETCH = False
MAXNREG = 128
FILL = 4

_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]))
_W = [[1, 0, 0], [2, 0, 0]]
_W4 = [[1, 0, 0, 0], [2, 0, 0, 0]]
# e2m1 codes [s e1 e0 m] of a word: low nibbles -> bytes [s 0 0 e1 e0 m 0 0] of ``lo``, high nibbles -> ``hi``
# (e4m3 bytes of 2^-6 times the code's value)
def _spread(src: str, lo: str, hi: str) -> str:
    return (f"shl.b32 {lo}, {src}, 2; and.b32 {lo}, {lo}, 0x1C1C1C1C; shl.b32 t, {src}, 4; and.b32 t, t, 0x80808080;\n"
            f"or.b32 {lo}, {lo}, t; shr.b32 {hi}, {src}, 2; and.b32 {hi}, {hi}, 0x1C1C1C1C; and.b32 t, {src}, 0x80808080;\n"
            f"or.b32 {hi}, {hi}, t;\n")


# V: the same word of two tokens t ($8), u ($9) -> 8 f16x2 (t, u) pairs of nibbles 0,2,4,6,1,3,5,7, times $24
_V_ASM = gl.constexpr(
    "{\n.reg .b32 lo, hi, t, lu, hu, p0, p1, p2, p3, c<8>;\n.reg .b16 x<8>;\n"
    + _spread("$8", "lo", "hi") + _spread("$9", "lu", "hu")
    + "prmt.b32 p0, lo, lu, 0x5140; prmt.b32 p1, lo, lu, 0x7362;\n"
    "prmt.b32 p2, hi, hu, 0x5140; prmt.b32 p3, hi, hu, 0x7362;\n"
    "mov.b32 {x0, x1}, p0; mov.b32 {x2, x3}, p1; mov.b32 {x4, x5}, p2; mov.b32 {x6, x7}, p3;\n"
    "cvt.rn.f16x2.e4m3x2 c0, x0; cvt.rn.f16x2.e4m3x2 c1, x1; cvt.rn.f16x2.e4m3x2 c2, x2;\n"
    "cvt.rn.f16x2.e4m3x2 c3, x3; cvt.rn.f16x2.e4m3x2 c4, x4; cvt.rn.f16x2.e4m3x2 c5, x5;\n"
    "cvt.rn.f16x2.e4m3x2 c6, x6; cvt.rn.f16x2.e4m3x2 c7, x7;\n"
    "mul.rn.f16x2 $0, c0, $24; mul.rn.f16x2 $1, c1, $24; mul.rn.f16x2 $2, c2, $24; mul.rn.f16x2 $3, c3, $24;\n"
    "mul.rn.f16x2 $4, c4, $24; mul.rn.f16x2 $5, c5, $24; mul.rn.f16x2 $6, c6, $24; mul.rn.f16x2 $7, c7, $24;\n}")
# both unpackings: 8 f16x2 out; 16 words (two of them used) and 8 f16x2 scale pairs in
_PAIR_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 8 + ["r"] * 24))
E2M1_SCALE = gl.constexpr(64.0)


def k_to_d(k):
    """Element of the head held by contraction slot ``k`` of the scores (see the module docstring)."""
    c, m, a, h, e = (k >> 1) & 3, k >> 5, (k >> 4) & 1, (k >> 3) & 1, k & 1
    return 32 * c + 8 * m + 4 * a + 2 * e + h


def col_to_d(n):
    """Element of the head held by output column ``n`` of Oᵀ's rows (see the module docstring)."""
    g, j, s = n & 7, (n >> 3) & 7, n >> 6
    return 16 * g + 8 * s + 2 * (j & 3) + (j >> 2)


K_TO_D = [k_to_d(k) for k in range(128)]
COL_TO_D = [col_to_d(n) for n in range(128)]


@gluon.jit
def _k_to_d(k):
    return 32 * ((k >> 1) & 3) + 8 * (k >> 5) + 4 * ((k >> 4) & 1) + 2 * (k & 1) + ((k >> 3) & 1)


@gluon.jit
def _col_to_d(n):
    j = (n >> 3) & 7
    return 16 * (n & 7) + 8 * (n >> 6) + 2 * (j & 3) + (j >> 2)


@gluon.jit
def _scale_f16(sc):
    return sc.to(gl.float8e4nv, bitcast=True).to(gl.float16) * E2M1_SCALE


_AK = gl.constexpr(gl.DotOperandLayout(0, _MMA.value, 2))  # K [warp, 32 tokens, 128 slots]; also Vᵀ [warp, 128, 32]
_BQ = gl.constexpr(gl.DotOperandLayout(1, _MMA.value, 2))  # Qᵀ [warp, 128 slots, NH heads]; also Pᵀ [warp, 32, NH]
# Vᵀ values in the order the unpacking makes them: a token pair, then a word's 8 columns, then the word, then
# the token bits of the registers; the same registers as the Vᵀ operand in another order
_VA = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 8, 0], [0, 16, 0], [0, 32, 0], [0, 64, 0], [0, 0, 8], [0, 0, 16]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=_W, block_bases=[],
    shape=[4, 128, 32]))

# K: the same word of two tokens a ($8) and b ($10) -> 8 f16x2: (a, b) alternating over the nibble pairs
# 0,2 | 1,3 | 4,6 | 5,7, times the block scales $24 (a) and $25 (b)
_K_ASM = gl.constexpr(
    "{\n.reg .b32 lo, hi, t, lu, hu, c<8>;\n.reg .b16 a0, a1, b0, b1, x0, x1, y0, y1;\n"
    + _spread("$8", "lo", "hi") + _spread("$10", "lu", "hu")
    + "mov.b32 {a0, a1}, lo; mov.b32 {b0, b1}, hi; mov.b32 {x0, x1}, lu; mov.b32 {y0, y1}, hu;\n"
    "cvt.rn.f16x2.e4m3x2 c0, a0; cvt.rn.f16x2.e4m3x2 c1, x0; cvt.rn.f16x2.e4m3x2 c2, b0; cvt.rn.f16x2.e4m3x2 c3, y0;\n"
    "cvt.rn.f16x2.e4m3x2 c4, a1; cvt.rn.f16x2.e4m3x2 c5, x1; cvt.rn.f16x2.e4m3x2 c6, b1; cvt.rn.f16x2.e4m3x2 c7, y1;\n"
    "mul.rn.f16x2 $0, c0, $24; mul.rn.f16x2 $1, c1, $25; mul.rn.f16x2 $2, c2, $24; mul.rn.f16x2 $3, c3, $25;\n"
    "mul.rn.f16x2 $4, c4, $24; mul.rn.f16x2 $5, c5, $25; mul.rn.f16x2 $6, c6, $24; mul.rn.f16x2 $7, c7, $25;\n}")


# The unpacking without conversions (``UNPACK`` 1): a nibble's bits placed as the high byte of a float16 make
# 2^-14 times its e2m1 value, exactly (subnormal below 1, as e2m1's own subnormal): [s e1 e0 m] -> [s 0 0 0 e1
# e0 m 0]; a byte permute then puts two such bytes over zero low bytes.  The products with the block scales are
# 2^-8 times the values (``unpack_gain``), still exact in float16 (the smallest, 2^-18, is a multiple of 2^-24).
def _spread5(src: str, lo: str, hi: str) -> str:
    return (f"shl.b32 {lo}, {src}, 4; and.b32 {lo}, {lo}, 0x80808080; shl.b32 t, {src}, 1; and.b32 t, t, 0x0E0E0E0E;\n"
            f"or.b32 {lo}, {lo}, t; shr.b32 {hi}, {src}, 3; and.b32 {hi}, {hi}, 0x0E0E0E0E; and.b32 t, {src}, 0x80808080;\n"
            f"or.b32 {hi}, {hi}, t;\n")


def _expand(dst: str, src: str, upper: bool) -> str:
    return f"prmt.b32 {dst}, {src}, 0, {'0x3424' if upper else '0x1404'};\n"


_K_ASM_P = gl.constexpr(
    "{\n.reg .b32 lo, hi, t, lu, hu, c<8>;\n"
    + _spread5("$8", "lo", "hi") + _spread5("$10", "lu", "hu")
    + "".join(_expand(f"c{i}", r, i >= 4) for i, r in enumerate(("lo", "lu", "hi", "hu") * 2))
    + "mul.rn.f16x2 $0, c0, $24; mul.rn.f16x2 $1, c1, $25; mul.rn.f16x2 $2, c2, $24; mul.rn.f16x2 $3, c3, $25;\n"
    "mul.rn.f16x2 $4, c4, $24; mul.rn.f16x2 $5, c5, $25; mul.rn.f16x2 $6, c6, $24; mul.rn.f16x2 $7, c7, $25;\n}")
# V: the words of tokens t and u interleaved byte by byte first, so one spread makes (t, u) byte pairs
_V_ASM_P = gl.constexpr(
    "{\n.reg .b32 p0, p1, lo0, hi0, lo1, hi1, t, c<8>;\n"
    "prmt.b32 p0, $8, $9, 0x5140; prmt.b32 p1, $8, $9, 0x7362;\n"
    + _spread5("p0", "lo0", "hi0") + _spread5("p1", "lo1", "hi1")
    + "".join(_expand(f"c{i}", r, u) for i, (r, u) in enumerate(
        (("lo0", False), ("lo0", True), ("lo1", False), ("lo1", True), ("hi0", False), ("hi0", True), ("hi1", False),
         ("hi1", True))))
    + "mul.rn.f16x2 $0, c0, $24; mul.rn.f16x2 $1, c1, $24; mul.rn.f16x2 $2, c2, $24; mul.rn.f16x2 $3, c3, $24;\n"
    "mul.rn.f16x2 $4, c4, $24; mul.rn.f16x2 $5, c5, $24; mul.rn.f16x2 $6, c6, $24; mul.rn.f16x2 $7, c7, $24;\n}")
# timing probes only (``UNPACK`` 9): the words reinterpreted, no unpacking at all; the output is not attention
_NONE_ASM = gl.constexpr("mov.b32 $0, $8; mov.b32 $1, $9; mov.b32 $2, $10; mov.b32 $3, $11; mov.b32 $4, $12; "
                         "mov.b32 $5, $13; mov.b32 $6, $14; mov.b32 $7, $15;")
# unpacking: 0 the e4m3 route (cvt), 1 byte permutes (the default); 9 none (timing probes only).  A module setting
# read at launch, like ``STAGES`` and ``VSWZ`` (docs/kernels.md, "nvfp4 decode on the H200").
UNPACK = 1
# tile buffers in shared memory, one tile copied ahead (0: direct loads into registers, the kernel before
# 2026-11-29; ``DecodeOptions.prefetch`` also takes that path)
STAGES = 2
VSWZ = True  # V's rows swizzled in shared memory (``_V_SMEM``)
CPL = 4  # the copies' layout (``_CPW0`` ...; ``_issue``)
HALVES = True  # the operands in halves (``_tile_h``); with STAGES only


def unpack_gain(unpack: int) -> float:
    """What the unpacked values are multiplied by (undone in the scores' scale and at the output)."""
    return 2.0 ** -8 if unpack == 1 else 1.0


# Loads: a tile's 128 tokens are 8 groups of 16 (PAGE a multiple of 16 and the tiles
# 16-aligned, so a group never straddles a page); each thread looks up the pages of its 2 groups once and every
# K / V word and block scale address is that page's row plus an offset.
# K words [warp, 16 words, 2 groups, 16 tokens]: lane c + 4g holds words 4c .. 4c + 3 of tokens g, g + 8
_KW4 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 0, 8], [0, 0, 1, 0]],
    lane_bases=[[0, 4, 0, 0], [0, 8, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]], warp_bases=_W4, block_bases=[],
    shape=[4, 16, 2, 16]))
_KS4 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1, 0, 0], [0, 0, 0, 8], [0, 0, 1, 0]],
    lane_bases=[[0, 2, 0, 0], [0, 4, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]], warp_bases=_W4, block_bases=[],
    shape=[4, 8, 2, 16]))
# V words [warp, 2 groups, 16 tokens, 16 words]: lane c + 4g holds words 2g, 2g + 1 of tokens 2c + e + 8h
_VW4 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 8, 0], [0, 1, 0, 0]],
    lane_bases=[[0, 0, 2, 0], [0, 0, 4, 0], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 0, 8]], warp_bases=_W4, block_bases=[],
    shape=[4, 2, 16, 16]))
_VS4 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1, 0], [0, 0, 8, 0], [0, 1, 0, 0]],
    lane_bases=[[0, 0, 2, 0], [0, 0, 4, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]], warp_bases=_W4, block_bases=[],
    shape=[4, 2, 16, 8]))
_GK = gl.constexpr(gl.SliceLayout(1, gl.SliceLayout(3, _KW4)))  # [warp, group] as the K words see it


@gluon.jit
def _groups(pt_row, tok0, hi, PAGE: gl.constexpr):
    """First token [4, 2] of each of the thread's 16-token groups of the tile at ``tok0``, and its page."""
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, _GK))
    m = gl.arange(0, 2, layout=gl.SliceLayout(0, _GK))
    t16 = tok0 + w[:, None] * 32 + m[None, :] * 16
    page = gl.load(pt_row + t16 // PAGE, mask=t16 < hi, other=0).to(gl.int64)
    return t16, page


@gluon.jit
def _load_kv(KC, VC, KBS, VBS, t16, page, lo_tok, hi, kh_off, vh_off, kbh_off, vbh_off,
               s_page, s_tok, sb_page, sb_tok, PAGE: gl.constexpr):
    """K words [4, 16, 32], K scales [4, 8, 32], V words [4, 32, 16] and V scales [4, 32, 8] of a tile; tokens
    outside [lo_tok, hi) read as zeros."""
    rk = page * s_page + (t16 % PAGE) * s_tok
    rb = page * sb_page + (t16 % PAGE) * sb_tok
    # K words
    q = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, _KW4))))
    i = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, _KW4))))
    t = t16[:, None, :, None] + i[None, None, None, :]
    tm = (t < hi) & (t >= lo_tok)
    addr = rk[:, None, :, None] + kh_off + i[None, None, None, :] * s_tok + q[None, :, None, None]
    kw = gl.load(KC + addr, mask=tm, other=0)
    # K scales
    rbk = gl.convert_layout(rb, gl.SliceLayout(1, gl.SliceLayout(3, _KS4)), assert_trivial=True)
    t16s = gl.convert_layout(t16, gl.SliceLayout(1, gl.SliceLayout(3, _KS4)), assert_trivial=True)
    bq = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, _KS4))))
    bi = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, _KS4))))
    tb = t16s[:, None, :, None] + bi[None, None, None, :]
    ks = gl.load(KBS + rbk[:, None, :, None] + kbh_off + bi[None, None, None, :] * sb_tok + bq[None, :, None, None],
                 mask=(tb < hi) & (tb >= lo_tok), other=0)
    # V words
    rv = gl.convert_layout(rk, gl.SliceLayout(2, gl.SliceLayout(3, _VW4)), assert_trivial=True)
    t16v = gl.convert_layout(t16, gl.SliceLayout(2, gl.SliceLayout(3, _VW4)), assert_trivial=True)
    vi = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, _VW4))))
    vq = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, _VW4))))
    tv = t16v[:, :, None, None] + vi[None, None, :, None]
    vw = gl.load(VC + rv[:, :, None, None] + vh_off + vi[None, None, :, None] * s_tok + vq[None, None, None, :],
                 mask=(tv < hi) & (tv >= lo_tok), other=0)
    # V scales
    rbv = gl.convert_layout(rb, gl.SliceLayout(2, gl.SliceLayout(3, _VS4)), assert_trivial=True)
    t16w = gl.convert_layout(t16, gl.SliceLayout(2, gl.SliceLayout(3, _VS4)), assert_trivial=True)
    wi = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, _VS4))))
    wq = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, _VS4))))
    tw = t16w[:, :, None, None] + wi[None, None, :, None]
    vs = gl.load(VBS + rbv[:, :, None, None] + vbh_off + wi[None, None, :, None] * sb_tok + wq[None, None, None, :],
                 mask=(tw < hi) & (tw >= lo_tok), other=0)
    return (gl.reshape(kw, [4, 16, 32]), gl.reshape(ks, [4, 8, 32]), gl.reshape(vw, [4, 32, 16]),
            gl.reshape(vs, [4, 32, 8]))


@gluon.jit
def _unpack_k(words, sc, UNPACK: gl.constexpr):
    """K operand [4, 32 tokens, 128 slots] in float16 (slot k holds element ``k_to_d(k)``)."""
    x = gl.permute(gl.reshape(words, [4, 4, 2, 2, 32]), [0, 4, 2, 3, 1])  # [w, t, k64, k32, c]
    x = gl.reshape(x, [4, 32, 2, 2, 1, 1, 4, 1]).broadcast_to([4, 32, 2, 2, 2, 2, 4, 2])
    x = gl.convert_layout(gl.reshape(x, [4, 32, 128]), _AK, assert_trivial=True)
    s = _scale_f16(sc)  # [w, block 2c + k64, t]
    s = gl.permute(gl.reshape(s, [4, 4, 2, 32]), [0, 3, 2, 1])  # [w, t, k64, c]
    s = gl.reshape(s, [4, 32, 2, 1, 1, 1, 4, 1]).broadcast_to([4, 32, 2, 2, 2, 2, 4, 2])
    s = gl.convert_layout(gl.reshape(s, [4, 32, 128]), _AK, assert_trivial=True)
    return _unpacked(x, s, True, UNPACK)


@gluon.jit
def _unpack_v(words, sc, UNPACK: gl.constexpr):
    """Vᵀ operand [4, 128 columns, 32 tokens] in float16 (column n holds element ``col_to_d(n)``)."""
    x = gl.permute(gl.reshape(words, [4, 32, 8, 2]), [0, 3, 2, 1])  # [w, s, g, t]
    x = gl.reshape(x, [4, 2, 1, 8, 32]).broadcast_to([4, 2, 8, 8, 32])
    x = gl.convert_layout(gl.reshape(x, [4, 128, 32]), _VA, assert_trivial=True)
    s = gl.permute(_scale_f16(sc), [0, 2, 1])  # [w, block g, t]
    s = gl.reshape(s, [4, 1, 1, 8, 32]).broadcast_to([4, 2, 8, 8, 32])
    s = gl.convert_layout(gl.reshape(s, [4, 128, 32]), _VA, assert_trivial=True)
    return gl.convert_layout(_unpacked(x, s, False, UNPACK), _AK, assert_trivial=True)


# The operands in halves (``HALVES``): the scores as two products over slots 0-63 and 64-127 (a thread's words 0-1
# and 2-3 of a token) and P·V as two products over columns 0-63 and 64-127 (its even and odd V words), each half
# unpacked just before its product, so only half of each operand is live at a time.
_VA_H = gl.constexpr(gl.DistributedLinearLayout(  # _VA without the word bit (column 64)
    reg_bases=[[0, 0, 1], [0, 8, 0], [0, 16, 0], [0, 32, 0], [0, 0, 8], [0, 0, 16]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]], warp_bases=_W, block_bases=[],
    shape=[4, 64, 32]))


@gluon.jit
def _unpacked(x, s, IS_K: gl.constexpr, UNPACK: gl.constexpr):
    """The unpacking's inline PTX on packed words ``x`` and scales ``s`` (16 elements per call)."""
    if UNPACK == 9:
        asm: gl.constexpr = _NONE_ASM
    elif IS_K:
        asm: gl.constexpr = _K_ASM_P if UNPACK == 1 else _K_ASM
    else:
        asm: gl.constexpr = _V_ASM_P if UNPACK == 1 else _V_ASM
    return gl.inline_asm_elementwise(asm, _PAIR_CONSTRAINTS, [x, s], dtype=gl.float16, is_pure=True, pack=16)


@gluon.jit
def _k_half(words, sc):
    """K's packed words and scales [4, 32 tokens, 64 slots] of the two slot halves (local slot k' of half H holds
    element ``k_to_d(64 H + k')``), in the operand layout."""
    x0, x1 = gl.split(gl.permute(gl.reshape(words, [4, 4, 2, 2, 32]), [0, 4, 3, 1, 2]))  # [w, t, k32, c] each
    x0 = gl.reshape(x0, [4, 32, 2, 1, 1, 4, 1]).broadcast_to([4, 32, 2, 2, 2, 4, 2])
    x1 = gl.reshape(x1, [4, 32, 2, 1, 1, 4, 1]).broadcast_to([4, 32, 2, 2, 2, 4, 2])
    s0, s1 = gl.split(gl.permute(gl.reshape(_scale_f16(sc), [4, 4, 2, 32]), [0, 3, 1, 2]))  # [w, t, c] each
    s0 = gl.reshape(s0, [4, 32, 1, 1, 1, 4, 1]).broadcast_to([4, 32, 2, 2, 2, 4, 2])
    s1 = gl.reshape(s1, [4, 32, 1, 1, 1, 4, 1]).broadcast_to([4, 32, 2, 2, 2, 4, 2])
    return (gl.convert_layout(gl.reshape(x0, [4, 32, 64]), _AK, assert_trivial=True),
            gl.convert_layout(gl.reshape(s0, [4, 32, 64]), _AK, assert_trivial=True),
            gl.convert_layout(gl.reshape(x1, [4, 32, 64]), _AK, assert_trivial=True),
            gl.convert_layout(gl.reshape(s1, [4, 32, 64]), _AK, assert_trivial=True))


@gluon.jit
def _v_half(words, sc):
    """Vᵀ's packed words [4, 64 columns, 32 tokens] of the two column halves (local column n' of half S holds
    element ``col_to_d(64 S + n')``) and the scales both share, in the layout the unpacking reads."""
    x0, x1 = gl.split(gl.reshape(words, [4, 32, 8, 2]))  # [w, t, g] each
    x0 = gl.reshape(gl.permute(x0, [0, 2, 1]), [4, 1, 8, 32]).broadcast_to([4, 8, 8, 32])
    x1 = gl.reshape(gl.permute(x1, [0, 2, 1]), [4, 1, 8, 32]).broadcast_to([4, 8, 8, 32])
    s = gl.permute(_scale_f16(sc), [0, 2, 1])  # [w, block g, t]
    s = gl.reshape(s, [4, 1, 8, 32]).broadcast_to([4, 8, 8, 32])
    return (gl.convert_layout(gl.reshape(x0, [4, 64, 32]), _VA_H, assert_trivial=True),
            gl.convert_layout(gl.reshape(x1, [4, 64, 32]), _VA_H, assert_trivial=True),
            gl.convert_layout(gl.reshape(s, [4, 64, 32]), _VA_H, assert_trivial=True))


@gluon.jit
def _softmax(s, tok, j, hi, lo_tok, qk_scale, m_i, l_i):
    """A tile's online-softmax step on the scores ``Sᵀ`` [4, 32, NH]: the new maxima, the accumulators' factor,
    the new sums and ``Pᵀ`` as the PV product's right operand (tokens outside [lo_tok, hi) masked)."""
    if (j >= lo_tok) & (j + 128 <= hi):  # a whole tile: no masks
        s = s * qk_scale
    else:
        tt = j + tok
        tm = (tt < hi) & (tt >= lo_tok)
        s = gl.where(tm[:, :, None], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None, :])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    pt = gl.convert_layout(p.to(gl.float16), _BQ)
    return m_new, alpha, l_i, pt


@gluon.jit
def _tile_h(kw, ks, vbuf, vsbuf, q0, q1, tok, j, hi, lo_tok, qk_scale, m_i, l_i, acc0, acc1, NH: gl.constexpr,
            UNPACK: gl.constexpr):
    """``_tile`` with the operands in halves (``HALVES``); V is read from its stage after the softmax."""
    x0, s0, x1, s1 = _k_half(kw, ks)
    s = gl.nvidia.ampere.mma_v2(_unpacked(x0, s0, True, UNPACK), q0, gl.zeros([4, 32, NH], gl.float32, layout=_MMA))
    s = gl.nvidia.ampere.mma_v2(_unpacked(x1, s1, True, UNPACK), q1, s)
    m_new, alpha, l_i, pt = _softmax(s, tok, j, hi, lo_tok, qk_scale, m_i, l_i)
    vw, vs = _read_v(vbuf, vsbuf)
    v0, v1, sv = _v_half(vw, vs)
    acc0 = gl.nvidia.ampere.mma_v2(gl.convert_layout(_unpacked(v0, sv, False, UNPACK), _AK, assert_trivial=True), pt,
                                   acc0 * alpha[:, None, :])
    acc1 = gl.nvidia.ampere.mma_v2(gl.convert_layout(_unpacked(v1, sv, False, UNPACK), _AK, assert_trivial=True), pt,
                                   acc1 * alpha[:, None, :])
    return m_new, l_i, acc0, acc1


@gluon.jit
def _tile(kw, ks, vw, vs, qv, tok, j, hi, lo_tok, qk_scale, m_i, l_i, acc, NH: gl.constexpr, UNPACK: gl.constexpr):
    """One 128-token tile: the scores, the online softmax and ``P·V`` of each warp's 32 tokens (``tok``: the
    tile's token offsets [4, 32] in the scores' layout)."""
    kf = _unpack_k(kw, ks, UNPACK)
    s = gl.nvidia.ampere.mma_v2(kf, qv, gl.zeros([4, 32, NH], gl.float32, layout=_MMA))  # Sᵀ [w, t, h]
    m_new, alpha, l_i, pt = _softmax(s, tok, j, hi, lo_tok, qk_scale, m_i, l_i)
    vf = _unpack_v(vw, vs, UNPACK)
    acc = gl.nvidia.ampere.mma_v2(vf, pt, acc * alpha[:, None, :])
    return m_new, l_i, acc


# The pipelined loads (``STAGES`` >= 2): each tile's code rows [128 tokens, 16 words] and block-scale rows
# [128 tokens, 2 words] go to shared memory by asynchronous copies (``cp.async``) ``STAGES - 1`` tiles ahead, so
# the copies of the next tiles are in flight while a tile is unpacked; each thread then reads its fragment bytes
# from shared memory in the layouts of the direct loads above (``_KW4`` ... as [token, word] / [token, byte]).
_async_load, _NEW_SMEM_API, _sync = compat.async_load, compat.NEW_SMEM_API, compat.sync
# The copies (``CPL``): 4 (the default): the tile as 8 groups of 16 tokens, one page lookup per group for the code
# and scale rows alike, a warp's instruction covering 8 whole rows; 3: the same with separate lookups for the codes
# and the scales (the default until 2026-11-29 18:40); 0: the same coalescing, a page lookup and a mask per token; 2: each thread
# copies one whole token (one lookup, but a warp's instruction reads 16 bytes of each of 32 rows 64 bytes apart).
_CPW0 = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0]))
_CPS0 = gl.constexpr(gl.BlockedLayout([1, 1], [16, 2], [4, 1], [1, 0]))
_CPW3 = gl.constexpr(gl.DistributedLinearLayout(  # [8 groups of 16 tokens, 16 tokens, 16 words]
    reg_bases=[[0, 0, 1], [0, 0, 2], [0, 8, 0], [4, 0, 0]], lane_bases=[[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[8, 16, 16]))
_CPS3 = gl.constexpr(gl.DistributedLinearLayout(  # [8 groups, 16 tokens, 2 words]
    reg_bases=[[4, 0, 0]], lane_bases=[[0, 0, 1], [0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[8, 16, 2]))
_CPW2 = gl.constexpr(gl.BlockedLayout([1, 16], [32, 1], [4, 1], [1, 0]))
_CPS2 = gl.constexpr(gl.BlockedLayout([1, 2], [32, 1], [4, 1], [1, 0]))
_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
_SMEM2 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
_WARP2 = [[32, 0], [64, 0]]


# V's code rows in shared memory [128 tokens, 16 words] (each stage), swizzled so that the fragment reads (8 bytes
# of tokens 2c (+1, +8, ...) per lane) hit 32 different banks: word offset bits 0-4 are (w0, w1, w2, w3 ^ t1,
# t0 ^ t2) of word w and token t, the rest (t1, t2, t3 .. t6); 16-byte runs of a row stay contiguous for the
# copies.  Row-major, tokens 0, 2, 4 and 6 of a half-warp's read share banks 0-15 (4-way conflicts).
_V_SMEM = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [2, 8], [5, 0], [8, 0], [16, 0], [32, 0], [64, 0]]))
_K2 = gl.constexpr(gl.DistributedLinearLayout(  # _KW4 as [token, word]
    reg_bases=[[0, 1], [0, 2], [8, 0], [16, 0]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
    warp_bases=_WARP2, block_bases=[], shape=[128, 16]))
_V2 = gl.constexpr(gl.DistributedLinearLayout(  # _VW4 as [token, word]
    reg_bases=[[0, 1], [1, 0], [8, 0], [16, 0]], lane_bases=[[2, 0], [4, 0], [0, 2], [0, 4], [0, 8]],
    warp_bases=_WARP2, block_bases=[], shape=[128, 16]))
_KS2 = gl.constexpr(gl.DistributedLinearLayout(  # _KS4 as [token, byte]
    reg_bases=[[0, 1], [8, 0], [16, 0]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=_WARP2, block_bases=[], shape=[128, 8]))
_VS2 = gl.constexpr(gl.DistributedLinearLayout(  # _VS4 as [token, byte]
    reg_bases=[[1, 0], [8, 0], [16, 0]], lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
    warp_bases=_WARP2, block_bases=[], shape=[128, 8]))


@gluon.jit
def _issue(KC, VC, KBS, VBS, kbuf, vbuf, ksbuf, vsbuf, pt_row, t0, lo_tok, hi, kh_off, vh_off, kbh_off, vbh_off,
           s_page, s_tok, sb_page, sb_tok, PAGE: gl.constexpr, CPL: gl.constexpr):
    """Asynchronous copies of the tile at token ``t0`` into one stage; tokens outside [lo_tok, hi) are zero-filled.
    The scale strides and offsets are in 32-bit words here."""
    if CPL == 0:
        _issue_tokens(KC, VC, kbuf, vbuf, pt_row, t0, lo_tok, hi, kh_off, vh_off, s_page, s_tok, PAGE, 16, _CPW0)
        _issue_tokens(KBS, VBS, ksbuf, vsbuf, pt_row, t0, lo_tok, hi, kbh_off, vbh_off, sb_page, sb_tok, PAGE, 2, _CPS0)
    elif CPL == 3:
        _issue_groups(KC, VC, kbuf.reshape([8, 16, 16]), vbuf.reshape([8, 16, 16]), pt_row, t0, lo_tok, hi, kh_off,
                      vh_off, s_page, s_tok, PAGE, 16, _CPW3)
        _issue_groups(KBS, VBS, ksbuf.reshape([8, 16, 2]), vsbuf.reshape([8, 16, 2]), pt_row, t0, lo_tok, hi, kbh_off,
                      vbh_off, sb_page, sb_tok, PAGE, 2, _CPS3)
    elif CPL == 4:
        _issue_shared(KC, VC, KBS, VBS, kbuf, vbuf, ksbuf, vsbuf, pt_row, t0, lo_tok, hi, kh_off, vh_off, kbh_off,
                      vbh_off, s_page, s_tok, sb_page, sb_tok, PAGE)
    else:
        _issue_tokens(KC, VC, kbuf, vbuf, pt_row, t0, lo_tok, hi, kh_off, vh_off, s_page, s_tok, PAGE, 16, _CPW2)
        _issue_tokens(KBS, VBS, ksbuf, vsbuf, pt_row, t0, lo_tok, hi, kbh_off, vbh_off, sb_page, sb_tok, PAGE, 2, _CPS2)


@gluon.jit
def _issue_tokens(KC, VC, kbuf, vbuf, pt_row, t0, lo_tok, hi, kh_off, vh_off, s_page, s_tok, PAGE: gl.constexpr,
                  W: gl.constexpr, L: gl.constexpr):
    """The tile's rows of ``W`` words, a page lookup and a mask per token."""
    t = t0 + gl.arange(0, 128, layout=gl.SliceLayout(1, L))
    q = gl.arange(0, W, layout=gl.SliceLayout(0, L))
    ok = (t >= lo_tok) & (t < hi)
    row = gl.load(pt_row + t // PAGE, mask=ok, other=0).to(gl.int64) * s_page + (t % PAGE) * s_tok
    m = ok[:, None] & (q < W)[None, :]
    _async_load(kbuf, KC + (row + kh_off)[:, None] + q[None, :], mask=m)
    _async_load(vbuf, VC + (row + vh_off)[:, None] + q[None, :], mask=m)


@gluon.jit
def _issue_groups(KC, VC, kbuf, vbuf, pt_row, t0, lo_tok, hi, kh_off, vh_off, s_page, s_tok, PAGE: gl.constexpr,
                  W: gl.constexpr, L: gl.constexpr):
    """The tile as 8 groups of 16 tokens that never straddle a page: one page lookup per group."""
    g = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    i = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    q = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    t16 = t0 + g * 16
    off = (i * s_tok)[None, :, None] + q[None, None, :]
    if (t0 >= lo_tok) & (t0 + 128 <= hi):  # a whole tile: no masks
        base = gl.load(pt_row + t16 // PAGE).to(gl.int64) * s_page + (t16 % PAGE) * s_tok
        _async_load(kbuf, KC + (base + kh_off)[:, None, None] + off)
        _async_load(vbuf, VC + (base + vh_off)[:, None, None] + off)
    else:
        base = gl.load(pt_row + t16 // PAGE, mask=t16 < hi, other=0).to(gl.int64) * s_page + (t16 % PAGE) * s_tok
        t = t16[:, None] + i[None, :]
        m = ((t >= lo_tok) & (t < hi))[:, :, None] & (q < W)[None, None, :]
        _async_load(kbuf, KC + (base + kh_off)[:, None, None] + off, mask=m)
        _async_load(vbuf, VC + (base + vh_off)[:, None, None] + off, mask=m)


@gluon.jit
def _issue_shared(KC, VC, KBS, VBS, kbuf, vbuf, ksbuf, vsbuf, pt_row, t0, lo_tok, hi, kh_off, vh_off, kbh_off,
                  vbh_off, s_page, s_tok: gl.constexpr, sb_page, sb_tok: gl.constexpr, PAGE: gl.constexpr):
    """``CPL`` 4: the copies of ``CPL`` 3 with one page lookup per group for the code rows and the scale rows alike
    (the two layouts hold the same groups in the same threads), and the offsets within a group immediates."""
    g = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, _CPW3)))
    t16 = t0 + g * 16
    whole = (t0 >= lo_tok) & (t0 + 128 <= hi)
    if whole:
        page = gl.load(pt_row + t16 // PAGE).to(gl.int64)
    else:
        page = gl.load(pt_row + t16 // PAGE, mask=t16 < hi, other=0).to(gl.int64)
    rk = page * s_page + (t16 % PAGE) * s_tok
    rs = gl.convert_layout(page * sb_page + (t16 % PAGE) * sb_tok, gl.SliceLayout(1, gl.SliceLayout(2, _CPS3)),
                           assert_trivial=True)
    _copy_rows(KC, VC, kbuf.reshape([8, 16, 16]), vbuf.reshape([8, 16, 16]), rk, t0, lo_tok, hi, kh_off, vh_off,
               whole, s_tok, 16, _CPW3)
    _copy_rows(KBS, VBS, ksbuf.reshape([8, 16, 2]), vsbuf.reshape([8, 16, 2]), rs, t0, lo_tok, hi, kbh_off, vbh_off,
               whole, sb_tok, 2, _CPS3)


@gluon.jit
def _copy_rows(KC, VC, kbuf, vbuf, base, t0, lo_tok, hi, kh_off, vh_off, whole, s_tok: gl.constexpr, W: gl.constexpr,
               L: gl.constexpr):
    i = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    q = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    off = (i * s_tok)[None, :, None] + q[None, None, :]
    kp = KC + (base + kh_off)[:, None, None]
    vp = VC + (base + vh_off)[:, None, None]
    if whole:
        _async_load(kbuf, kp + off)
        _async_load(vbuf, vp + off)
    else:
        g = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        t = (t0 + g * 16)[:, None] + i[None, :]
        m = ((t >= lo_tok) & (t < hi))[:, :, None] & (q < W)[None, None, :]
        _async_load(kbuf, kp + off, mask=m)
        _async_load(vbuf, vp + off, mask=m)


@gluon.jit
def _bytes(buf):
    if _NEW_SMEM_API:
        return buf.reinterpret(gl.uint8, [128, 8], _SMEM2)
    else:
        return buf._reinterpret(gl.uint8, [128, 8], _SMEM2)


@gluon.jit
def _read(kbuf, vbuf, ksbuf, vsbuf):
    """A stage's words and scales in the registers and shapes of ``_load_kv``."""
    kw, ks = _read_k(kbuf, ksbuf)
    vw, vs = _read_v(vbuf, vsbuf)
    return kw, ks, vw, vs


@gluon.jit
def _read_k(kbuf, ksbuf):
    kw = gl.permute(gl.reshape(kbuf.load(_K2), [4, 2, 16, 16]), [0, 3, 1, 2])  # [w, word, group, token]
    ks = gl.permute(gl.reshape(_bytes(ksbuf).load(_KS2), [4, 2, 16, 8]), [0, 3, 1, 2])
    return gl.reshape(kw, [4, 16, 32]), gl.reshape(ks, [4, 8, 32])


@gluon.jit
def _read_v(vbuf, vsbuf):
    vw = gl.reshape(vbuf.load(_V2), [4, 2, 16, 16])  # [w, group, token, word]
    vs = gl.reshape(_bytes(vsbuf).load(_VS2), [4, 2, 16, 8])
    return gl.reshape(vw, [4, 32, 16]), gl.reshape(vs, [4, 32, 8])


@gluon.jit
def _decode_nv4_kernel(
    Q, KC, VC, KBS, VBS, K_SCALE, PT, SEQ_LENS, ACC, ML, OUT, V_SCALE, SINKS,
    sm_scale_log2,
    sq_b, sq_h, s_page, skc_h, svc_h, sb_page, skb_h, svb_h, spt_b,
    sacc_b, sacc_h, sacc_s, sml_b, sml_h, sml_s, so_b, so_h,
    window, num_splits,
    G: gl.constexpr, NH: gl.constexpr, PAGE: gl.constexpr, DIRECT: gl.constexpr, HAS_SINKS: gl.constexpr,
    s_tok: gl.constexpr, sb_tok: gl.constexpr,
    PREFETCH: gl.constexpr, UNPACK: gl.constexpr, STAGES: gl.constexpr, VSWZ: gl.constexpr, CPL: gl.constexpr, HALVES: gl.constexpr,
):
    b = gl.program_id(0)
    hk = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(SEQ_LENS + b)
    start = seq_len * 0
    if window > 0:
        start = gl.maximum(seq_len - window, 0)
    base = start - start % 16  # tiles start 16-aligned; tokens before ``start`` are masked
    per = gl.cdiv(gl.cdiv(seq_len - base, num_splits), 128) * 128
    lo = base + split * per
    hi = gl.minimum(lo + per, seq_len)
    lo_tok = gl.maximum(lo, start)
    qk_scale = sm_scale_log2 * gl.load(K_SCALE + hk)
    if UNPACK == 1:  # the unpacked values are 2^-8 times the dequantized ones (``unpack_gain``)
        qk_scale = qk_scale * 256.0
    pt_row = PT + b.to(gl.int64) * spt_b
    kh_off = hk.to(gl.int64) * skc_h
    vh_off = hk.to(gl.int64) * svc_h
    kbh_off = hk.to(gl.int64) * skb_h
    vbh_off = hk.to(gl.int64) * svb_h

    # Qᵀ in slot order: [4 (the same for every warp), 128 slots, NH heads] (two halves of 64 slots with HALVES)
    gq = gl.arange(0, NH, layout=gl.SliceLayout(0, gl.SliceLayout(1, _BQ)))
    wq = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, _BQ)))
    qrow = Q + b.to(gl.int64) * sq_b + (hk * G + gq)[None, None, :] * sq_h + 0 * wq[:, None, None]
    if HALVES:
        kq = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, _BQ)))
        qmask = (gq < G)[None, None, :] & (kq < 64)[None, :, None] & (wq >= 0)[:, None, None]
        q0 = gl.load(qrow + _k_to_d(kq)[None, :, None], mask=qmask, other=0.0).to(gl.float16)
        q1 = gl.load(qrow + _k_to_d(kq + 64)[None, :, None], mask=qmask, other=0.0).to(gl.float16)
        acc0 = gl.zeros([4, 64, NH], gl.float32, layout=_MMA)
        acc1 = gl.zeros([4, 64, NH], gl.float32, layout=_MMA)
    else:
        kq = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(2, _BQ)))
        qmask = (gq < G)[None, None, :] & (kq < 128)[None, :, None] & (wq >= 0)[:, None, None]
        qv = gl.load(qrow + _k_to_d(kq)[None, :, None], mask=qmask, other=0.0).to(gl.float16)
        acc = gl.zeros([4, 128, NH], gl.float32, layout=_MMA)

    m_i = gl.full([4, NH], -1.0e30, gl.float32, layout=gl.SliceLayout(1, _MMA))
    l_i = gl.zeros([4, NH], gl.float32, layout=gl.SliceLayout(1, _MMA))
    wt = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, _MMA)))
    nt = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, _MMA)))
    tok = wt[:, None] * 32 + nt[None, :]
    if STAGES > 0:
        kbuf = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 16], _SMEM2)
        if VSWZ:
            vbuf = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 16], _V_SMEM)
        else:
            vbuf = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 16], _SMEM2)
        ksbuf = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 2], _SMEM2)
        vsbuf = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 2], _SMEM2)
        for st in gl.static_range(STAGES - 1):
            _issue(KC, VC, KBS, VBS, kbuf.index(st), vbuf.index(st), ksbuf.index(st), vsbuf.index(st), pt_row,
                   lo + st * 128, lo_tok, hi, kh_off, vh_off, kbh_off, vbh_off, s_page, s_tok, sb_page, sb_tok, PAGE, CPL)
            async_copy.commit_group()
        for j in range(lo, hi, 128):
            it = (j - lo) // 128
            async_copy.wait_group(STAGES - 2)
            _sync()  # the tile's copies, every thread's, are in; the stage read last iteration is free
            nx = (it + STAGES - 1) % STAGES
            _issue(KC, VC, KBS, VBS, kbuf.index(nx), vbuf.index(nx), ksbuf.index(nx), vsbuf.index(nx), pt_row,
                   j + (STAGES - 1) * 128, lo_tok, hi, kh_off, vh_off, kbh_off, vbh_off, s_page, s_tok, sb_page,
                   sb_tok, PAGE, CPL)
            async_copy.commit_group()
            cs = it % STAGES
            if HALVES:
                kw, ks = _read_k(kbuf.index(cs), ksbuf.index(cs))
                m_i, l_i, acc0, acc1 = _tile_h(kw, ks, vbuf.index(cs), vsbuf.index(cs), q0, q1, tok, j, hi, lo_tok,
                                               qk_scale, m_i, l_i, acc0, acc1, NH, UNPACK)
            else:
                kw, ks, vw, vs = _read(kbuf.index(cs), vbuf.index(cs), ksbuf.index(cs), vsbuf.index(cs))
                m_i, l_i, acc = _tile(kw, ks, vw, vs, qv, tok, j, hi, lo_tok, qk_scale, m_i, l_i, acc, NH, UNPACK)
        async_copy.wait_group(0)
    else:
        if PREFETCH:
            t16, page = _groups(pt_row, lo, hi, PAGE)
            kw, ks, vw, vs = _load_kv(KC, VC, KBS, VBS, t16, page, lo_tok, hi, kh_off, vh_off, kbh_off, vbh_off,
                                      s_page, s_tok, sb_page, sb_tok, PAGE)
        for j in range(lo, hi, 128):
            if PREFETCH:
                t16, page = _groups(pt_row, j + 128, hi, PAGE)
                kw_n, ks_n, vw_n, vs_n = _load_kv(KC, VC, KBS, VBS, t16, page, lo_tok, hi, kh_off, vh_off, kbh_off,
                                                  vbh_off, s_page, s_tok, sb_page, sb_tok, PAGE)
            else:
                t16, page = _groups(pt_row, j, hi, PAGE)
                kw, ks, vw, vs = _load_kv(KC, VC, KBS, VBS, t16, page, lo_tok, hi, kh_off, vh_off, kbh_off, vbh_off,
                                          s_page, s_tok, sb_page, sb_tok, PAGE)
            m_i, l_i, acc = _tile(kw, ks, vw, vs, qv, tok, j, hi, lo_tok, qk_scale, m_i, l_i, acc, NH, UNPACK)
            if PREFETCH:
                kw, ks, vw, vs = kw_n, ks_n, vw_n, vs_n

    # merge the warps
    mx = gl.max(m_i, axis=0)  # [NH]
    wgt = gl.exp2(m_i - mx[None, :])
    l_t = gl.sum(l_i * wgt, axis=0)
    g1 = gl.arange(0, NH, layout=gl.SliceLayout(0, gl.SliceLayout(1, _MMA)))
    go = gl.arange(0, NH, layout=gl.SliceLayout(0, gl.SliceLayout(0, _MMA)))
    heads_o = hk * G + go
    f = l_t  # the output scale (DIRECT); the split results are stored unscaled
    if DIRECT:
        m2 = mx
        den = l_t * 0.0
        if HAS_SINKS:
            sink = gl.load(SINKS + hk * G + g1, mask=g1 < G, other=0.0).to(gl.float32) * LOG2E
            m2 = gl.maximum(m2, sink)
            den = gl.exp2(sink - m2)
        w2 = gl.exp2(mx - m2)
        den += l_t * w2
        f = gl.where(den > 0, w2 / den, 0.0) * gl.load(V_SCALE + hk)
        row = OUT + b.to(gl.int64) * so_b + heads_o[None, :] * so_h
    else:
        ml = ML + b.to(gl.int64) * sml_b + (hk * G + g1) * sml_h + split * sml_s
        gl.store(ml, mx, mask=g1 < G)
        gl.store(ml + 1, l_t, mask=g1 < G)
        row = ACC + b.to(gl.int64) * sacc_b + heads_o[None, :] * sacc_h + split * sacc_s
    if HALVES:
        _store_o(acc0, wgt, f, row, 0, 64, G, NH, DIRECT, UNPACK)
        _store_o(acc1, wgt, f, row, 64, 64, G, NH, DIRECT, UNPACK)
    else:
        _store_o(acc, wgt, f, row, 0, 128, G, NH, DIRECT, UNPACK)


@gluon.jit
def _store_o(acc, wgt, f, row, n0: gl.constexpr, N: gl.constexpr, G: gl.constexpr, NH: gl.constexpr,
             DIRECT: gl.constexpr, UNPACK: gl.constexpr):
    """The warps' accumulators merged and stored for columns ``n0 .. n0 + N`` (PV order) at their elements."""
    o = gl.sum(acc * wgt[:, None, :], axis=0)  # [N columns in PV order, NH]
    if UNPACK == 1:
        o = o * 256.0
    go = gl.arange(0, NH, layout=gl.SliceLayout(0, gl.SliceLayout(0, _MMA)))
    no = gl.arange(0, N, layout=gl.SliceLayout(1, gl.SliceLayout(0, _MMA)))
    dcol = _col_to_d(no + n0)
    om = (go < G)[None, :] & (no < N)[:, None]
    if DIRECT:
        fo = gl.convert_layout(f, gl.SliceLayout(0, gl.SliceLayout(0, _MMA)))
        gl.store(row + dcol[:, None], (o * fo[None, :]).to(row.dtype.element_ty), mask=om)
    else:
        gl.store(row + dcol[:, None], o, mask=om)


@functools.lru_cache(maxsize=None)
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def unsupported(q: torch.Tensor, kc, vc, g: int, q_scale, kv_format: str) -> str:
    """Why this kernel cannot take the call ('' when it can): an nvfp4 cache of head dim 128, at most 16 query
    heads per kv head, a float16/bfloat16 query on an sm_80+ GPU, codes whose rows start on 16-byte
    boundaries, pages of a multiple of 16 tokens."""
    if get_format(kv_format).name != "nvfp4":
        return f"the explicit-layout decode reads nvfp4 caches only, not {kv_format}"
    if q_scale is not None or q.dtype not in (torch.float16, torch.bfloat16):
        return f"the explicit-layout decode takes a float16 / bfloat16 query, not {q.dtype}"
    if q.shape[-1] != 128 or g > 16:
        return f"the explicit-layout decode needs head dim 128 and at most 16 query heads per kv head (got {q.shape[-1]}, {g})"
    if kc.page_size % 16:
        return f"the explicit-layout decode needs pages of a multiple of 16 tokens (got {kc.page_size})"
    if any(c.data.data_ptr() % 16 or c.page_stride % 16 or c.tok_stride % 16 or c.head_stride % 16 for c in (kc, vc)):
        return "the explicit-layout decode needs code rows on 16-byte boundaries"
    if not q.is_cuda:
        return "the explicit-layout decode (Gluon) runs on a CUDA GPU only"
    if _major(q.device.index if q.device.index is not None else torch.cuda.current_device()) < 8:
        return "the explicit-layout decode needs sm_80 or newer"
    return ""


def _scale_words(kc, vc) -> bool:
    """Whether both caches' block-scale rows can be read as 32-bit words (what the pipelined loads copy)."""
    return all(c.block_scale.stride(-1) == 1 and c.block_scale.shape[-1] % 4 == 0 and c.block_scale.data_ptr() % 4 == 0
               and c.bs_page_stride % 4 == 0 and c.bs_tok_stride % 4 == 0 and c.bs_head_stride % 4 == 0
               for c in (kc, vc))


def launch(q, kc, vc, page_table, seq_lens, out, *, sinks, scale: float, window, g: int, splits=None,
           opts: Optional[DecodeOptions] = None) -> None:
    """One launch over ``(batch, kv heads, num_splits)``; strides in the caches' own units (bytes for the
    codes, which the kernel reads as 32-bit words, so divided by 4).  ``splits``: ``(acc, ml, num_splits)``, the
    split buffers the kernel writes its partial results to; ``None``: one split, the output written directly.
    ``opts.prefetch`` loads the next tile into registers before computing this one; ``opts.maxnreg`` caps the
    registers per thread (0: no cap); ``None`` takes ``PREFETCH`` / ``MAXNREG``."""
    direct = splits is None
    acc, ml, num_splits = (out, out, 1) if direct else splits
    prefetch, maxnreg = (opts.prefetch, opts.maxnreg) if opts is not None else (None, None)
    bsz, hk = q.shape[0], kc.num_kv_heads
    kw, vw = kc.data.view(torch.int32), vc.data.view(torch.int32)
    kb, vb = kc.block_scale.view(torch.uint8), vc.block_scale.view(torch.uint8)
    sb = (kc.bs_page_stride, kc.bs_tok_stride, kc.bs_head_stride, vc.bs_head_stride)
    stages = STAGES if not prefetch else 0
    if stages and _scale_words(kc, vc):  # the pipelined loads copy the block scales as 32-bit words
        kb, vb = kb.view(torch.int32), vb.view(torch.int32)
        sb = tuple(x // 4 for x in sb)
    else:
        stages = 0
    maxnreg = MAXNREG if maxnreg is None else maxnreg
    _decode_nv4_kernel[(bsz, hk, num_splits)](
        q, kw, vw, kb, vb, kc.scale, page_table, seq_lens, acc, ml, out, vc.scale,
        sinks if sinks is not None else vc.scale, scale,
        q.stride(0), q.stride(1), kc.page_stride // 4, kc.head_stride // 4, vc.head_stride // 4,
        sb[0], sb[2], sb[3], page_table.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1), ml.stride(2),
        out.stride(0), out.stride(1), int(window or 0), num_splits,
        G=g, NH=8 if g <= 8 else 16, PAGE=kc.page_size, DIRECT=direct, HAS_SINKS=sinks is not None,
        s_tok=kc.tok_stride // 4, sb_tok=sb[1],
        PREFETCH=PREFETCH if prefetch is None else bool(prefetch), UNPACK=UNPACK, STAGES=stages, VSWZ=VSWZ, CPL=CPL,
        HALVES=bool(HALVES and stages), num_warps=4, **({"maxnreg": maxnreg} if maxnreg else {}),
    )

"""Exact split of bfloat16 values into two e4m3 terms, for fp8 tensor-core dots against an e4m3 cache.

A bfloat16 value has 8 significant bits and an e4m3 value 4.  Scale a row by a power of two so that its
largest magnitude lands in (128, 448]; then each element ``y`` rounds to an e4m3 ``hi``, and the remainder
``y − hi`` (at most half a unit in hi's last place, so at most 4 significant bits) is itself an e4m3 value
``lo``.  Hence ``hi + lo == y`` exactly for every element of magnitude at least 2^-2 after scaling; the
smaller ones (below 2^-9 of the row's maximum) fall on the e4m3 subnormal grid, an absolute error of at
most 2^-10 in scaled units, i.e. 2^-17 of the row's maximum.  Q·Kᵀ over an e4m3 K is then two fp8 dots,
``(hi·Kᵀ + lo·Kᵀ) · 2^-k`` with float32 accumulation, and the K tile never has to be converted.
``tests/test_fp8_split.py`` checks the claim for every bfloat16 value.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvbench.kernels._triton_utils import cast_fp8


@triton.jit
def pow2_scale(amax):
    """(2^k, 2^-k) per element of ``amax`` (float32 row maxima, ≥ 0) with amax·2^k in (128, 448] (k clamped to
    ±126, so both are normal floats; a zero maximum gets 2^126)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF  # biased exponent of the row maximum
    over = ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # its significand is above 1.75 (448 = 1.75 · 2^8)
    k = tl.minimum(tl.maximum(135 - e - over, -126), 126)  # 8 − (e − 127) − over
    s = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    return s, inv


@triton.jit
def pow2_row_scale(x):
    """Per row of float32 ``x`` [M, K]: ``pow2_scale`` of its largest magnitude."""
    return pow2_scale(tl.max(tl.abs(x), axis=1))


@triton.jit
def split_scaled(x, s, EXACT: tl.constexpr):
    """float32 ``x`` [M, K] times the rows' powers of two ``s`` [M] → e4m3 (hi, lo) with hi + lo == x·s (exact down
    to 2^-2 after scaling, see the module docstring)."""
    y = x * s[:, None]
    hi = cast_fp8(y, tl.float8e4nv, False, EXACT)
    lo = cast_fp8(y - hi.to(tl.float32), tl.float8e4nv, False, EXACT)
    return hi, lo


@triton.jit
def split_e4m3(x, EXACT: tl.constexpr):
    """float32 ``x`` [M, K] holding bfloat16 values → (hi, lo) float8e4nv [M, K] and the rows' inverse
    scales [M]: ``x == (hi + lo) · inv`` (see the module docstring).  ``EXACT``: round in float32 first
    (the CPU interpreter's float32→fp8 cast mis-rounds when rounding carries into the exponent)."""
    s, inv = pow2_row_scale(x)
    hi, lo = split_scaled(x, s, EXACT)
    return hi, lo, inv


@triton.jit
def _split_rows_kernel(X, P, HI, LO, HIP, LOP, INV, n_rows, H, sx_b, sx_h, sp_b, sp_h, W: tl.constexpr,
                       WP: tl.constexpr, R: tl.constexpr, EXACT: tl.constexpr):
    """``R`` rows of ``X [B, H, W]`` and ``P [B, H, WP]`` (row ``r`` = sequence ``r // H``, head ``r % H``), each row
    of both scaled by one power of two (the largest magnitude of the two into (128, 448]) and split into e4m3
    terms ``HI``/``LO`` ``[B, H, W]`` and ``HIP``/``LOP`` ``[B, H, WP]`` (contiguous); the inverse scales into
    ``INV [B, H]``."""
    r = tl.program_id(0) * R + tl.arange(0, R)
    rm = r < n_rows
    bb = (r // H).to(tl.int64)
    hh = (r % H).to(tl.int64)
    d = tl.arange(0, W)
    dp = tl.arange(0, WP)
    x = tl.load(X + (bb * sx_b + hh * sx_h)[:, None] + d[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
    xp = tl.load(P + (bb * sp_b + hh * sp_h)[:, None] + dp[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
    s, inv = pow2_scale(tl.maximum(tl.max(tl.abs(x), axis=1), tl.max(tl.abs(xp), axis=1)))
    hi, lo = split_scaled(x, s, EXACT)
    hip, lop = split_scaled(xp, s, EXACT)
    r64 = r.to(tl.int64)
    tl.store(HI + r64[:, None] * W + d[None, :], hi, mask=rm[:, None])
    tl.store(LO + r64[:, None] * W + d[None, :], lo, mask=rm[:, None])
    tl.store(HIP + r64[:, None] * WP + dp[None, :], hip, mask=rm[:, None])
    tl.store(LOP + r64[:, None] * WP + dp[None, :], lop, mask=rm[:, None])
    tl.store(INV + r64, inv, mask=rm)


def split_rows(q_lat, q_pe):
    """The exact split of bfloat16 absorbed queries ``q_lat [B, H, rank]`` and ``q_pe [B, H, rope]`` (last
    dimension contiguous, each width a power of two), one power-of-two scale per row of both:
    ``(hi_lat, lo_lat, hi_pe, lo_pe, inv)`` with the e4m3 terms contiguous ``[B, H, width]`` and ``inv [B, H]``
    float32, so that ``q_lat == (hi_lat + lo_lat) · inv`` and ``q_pe == (hi_pe + lo_pe) · inv`` (the module
    docstring's bound, against the largest magnitude of the row's two parts).  For kernels that stage the terms
    rather than split them in registers (``mla_decode_wg``)."""
    import torch

    from kvbench.kernels._triton_utils import interpreting

    b, h = q_lat.shape[:2]
    out = []
    for x in (q_lat, q_pe):
        w = x.shape[2]
        if x.dim() != 3 or x.shape[:2] != (b, h) or x.stride(2) != 1 or w & (w - 1):
            raise ValueError(f"split_rows needs [B, H, width] rows with a contiguous last dimension of a power-of-two "
                             f"width, got {tuple(x.shape)}")
        out += [torch.empty(b, h, w, dtype=torch.float8_e4m3fn, device=x.device) for _ in range(2)]
    inv = torch.empty(b, h, dtype=torch.float32, device=q_lat.device)
    n = b * h
    rows = max(1, min(16, 4096 // q_lat.shape[2]))
    if n:
        _split_rows_kernel[(triton.cdiv(n, rows),)](
            q_lat, q_pe, *out, inv, n, h, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
            W=q_lat.shape[2], WP=q_pe.shape[2], R=rows, EXACT=interpreting(), num_warps=4)
    return (*out, inv)

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
def pow2_row_scale(x):
    """Per row of float32 ``x`` [M, K]: (2^k, 2^-k) with the largest |x|·2^k in (128, 448] (k clamped to
    ±126, so both are normal floats; an all-zero row gets 2^126)."""
    amax = tl.max(tl.abs(x), axis=1)
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF  # biased exponent of the row maximum
    over = ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # its significand is above 1.75 (448 = 1.75 · 2^8)
    k = tl.minimum(tl.maximum(135 - e - over, -126), 126)  # 8 − (e − 127) − over
    s = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    return s, inv


@triton.jit
def split_e4m3(x, EXACT: tl.constexpr):
    """float32 ``x`` [M, K] holding bfloat16 values → (hi, lo) float8e4nv [M, K] and the rows' inverse
    scales [M]: ``x == (hi + lo) · inv`` (see the module docstring).  ``EXACT``: round in float32 first
    (the CPU interpreter's float32→fp8 cast mis-rounds when rounding carries into the exponent)."""
    s, inv = pow2_row_scale(x)
    y = x * s[:, None]
    hi = cast_fp8(y, tl.float8e4nv, False, EXACT)
    lo = cast_fp8(y - hi.to(tl.float32), tl.float8e4nv, False, EXACT)
    return hi, lo, inv

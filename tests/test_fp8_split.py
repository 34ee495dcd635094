"""The exact two-term e4m3 split of bfloat16 values (``kernels/_fp8_split.py``), run by the CPU
interpreter on every finite bfloat16 value: hi + lo reproduces the scaled value exactly down to 2^-2 after
scaling, within 2^-10 below; the row scales are powers of two that put each row's maximum in (128, 448]."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import triton
import triton.language as tl

from kvbench.kernels._fp8_split import split_e4m3


@triton.jit
def _split_kernel(X, HI, LO, INV, K: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, K)
    x = tl.load(X + r[:, None] * K + k[None, :])
    hi, lo, inv = split_e4m3(x, True)
    tl.store(HI + r[:, None] * K + k[None, :], hi)
    tl.store(LO + r[:, None] * K + k[None, :], lo)
    tl.store(INV + r, inv)


def _split(x: torch.Tensor, rows: int = 256):
    """float32 rows ``x`` [R, K] → (hi, lo, inv) as float64, outputs poisoned before the run."""
    n, k = x.shape
    x = torch.cat([x, x.new_zeros((-n) % rows, k)])  # whole blocks of rows (the padding is dropped below)
    hi = torch.full(x.shape, float("nan"), dtype=torch.float32).to(torch.float8_e4m3fn)
    lo = hi.clone()
    inv = torch.full((x.shape[0],), float("nan"))
    _split_kernel[(x.shape[0] // rows,)](x.contiguous(), hi, lo, inv, K=k, ROWS=rows)
    return hi[:n].double(), lo[:n].double(), inv[:n].double()


def _all_bf16() -> torch.Tensor:
    """Every finite bfloat16 value (both signs, zeros and subnormals included), as float32."""
    v = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return v[torch.isfinite(v)]


def _check(x: torch.Tensor):
    hi, lo, inv = _split(x)
    assert torch.isfinite(hi).all() and torch.isfinite(lo).all() and torch.isfinite(inv).all()
    s = 1.0 / inv
    assert torch.equal(torch.frexp(s)[0].abs(), torch.full_like(s, 0.5)), "scales must be powers of two"
    y = x.double() * s[:, None]  # exact: a bfloat16 value times a power of two
    amax = y.abs().amax(dim=1)
    unclamped = s < 2.0**126  # rows of bfloat16 subnormals take the largest scale, 2^126, and stay below 128
    assert (amax[unclamped] > 128).all() and (amax <= 448).all()
    err = (hi + lo - y).abs()
    big = y.abs() >= 0.25
    assert (err[big] == 0).all(), f"{int((err[big] != 0).sum())} inexact splits"
    assert (err <= 2.0**-10).all(), float(err.max())
    return hi, lo


def test_every_bfloat16_value_splits_exactly():
    # sorted rows of neighbouring magnitudes: each value lands high in its row's range
    v = _all_bf16()
    v = v[v.abs().argsort()]
    pad = (-len(v)) % 64
    x = torch.cat([v, v[-pad:]]).view(-1, 64)
    _check(x)
    # each value with a row maximum 2^0 .. 2^12 times larger beside it: down to the subnormal grid of lo
    vals = v[(v != 0) & (v.abs() < 2.0**100)]
    vals = vals[: (len(vals) // 63) * 63].view(-1, 63)
    rows = []
    for shift in range(0, 13):
        top = (vals.abs().amax(dim=1, keepdim=True) * 2.0**shift).to(torch.bfloat16).float()
        rows.append(torch.cat([vals, top], dim=1))
    _check(torch.cat(rows))


@pytest.mark.parametrize("special", ["zeros", "tiny", "huge"])
def test_edge_rows(special):
    x = {"zeros": torch.zeros(2, 32),
         "tiny": torch.full((2, 32), 2.0**-133) * torch.arange(1, 33),  # bfloat16 subnormals: scale clamped
         "huge": torch.full((2, 32), 3.0e38) / torch.arange(1, 33)}[special]
    x = x.to(torch.bfloat16).float()
    hi, lo, inv = _split(x, rows=2)
    assert torch.isfinite(hi).all() and torch.isfinite(lo).all() and (inv > 0).all()
    rebuilt = (hi + lo) * inv[:, None]
    assert torch.allclose(rebuilt, x.double(), rtol=2.0**-8, atol=2.0**-130)
    if special == "zeros":
        assert (hi == 0).all() and (lo == 0).all()


def test_split_rows_one_scale_per_row_of_both_parts():
    # the staging wrapper of the Hopper MLA decode: [B, H, width] latent and rope queries (strided) into
    # contiguous e4m3 terms and one inverse power-of-two scale per row of both parts; checked against the same
    # split done by torch in float64 (round to nearest even), outputs poisoned first
    from kvbench.kernels import _fp8_split

    g = torch.Generator().manual_seed(5)
    b, h = 3, 5
    q_lat = (torch.randn(b, h + 2, 512, generator=g) * torch.rand(b, h + 2, 1, generator=g) * 40).to(torch.bfloat16)[:, :h]
    q_pe = (torch.randn(b, h, 64, generator=g) * 0.01).to(torch.bfloat16)
    q_pe[0, 1] *= 1e5  # a row whose maximum is in the rope part
    q_lat[1, 2] = 0
    q_pe[1, 2] = 0  # an all-zero row
    real_empty = torch.empty
    poisoned = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))  # noqa: E731
    try:
        torch.empty = poisoned
        hi_l, lo_l, hi_p, lo_p, inv = _fp8_split.split_rows(q_lat, q_pe)
    finally:
        torch.empty = real_empty
    assert hi_l.shape == lo_l.shape == (b, h, 512) and hi_p.shape == lo_p.shape == (b, h, 64) and inv.shape == (b, h)
    assert hi_l.is_contiguous() and lo_p.is_contiguous() and torch.isfinite(inv).all()
    amax = torch.maximum(q_lat.double().abs().amax(-1), q_pe.double().abs().amax(-1))
    s = 1.0 / inv.double()
    assert torch.equal(torch.frexp(s)[0].abs(), torch.full_like(s, 0.5)), "scales must be powers of two"
    live = amax > 0
    assert ((amax * s)[live] > 128).all() and ((amax * s) <= 448).all()
    for x, hi, lo in ((q_lat, hi_l, lo_l), (q_pe, hi_p, lo_p)):
        y = x.double() * s[..., None]
        want_hi = y.to(torch.float8_e4m3fn)
        assert torch.equal(hi.view(torch.uint8), want_hi.view(torch.uint8))
        assert torch.equal(lo.view(torch.uint8), (y - want_hi.double()).to(torch.float8_e4m3fn).view(torch.uint8))
        err = (hi.double() + lo.double() - y).abs()
        assert (err[y.abs() >= 0.25] == 0).all() and (err <= 2.0**-10).all()
    with pytest.raises(ValueError, match="power-of-two"):
        _fp8_split.split_rows(q_lat[..., :500], q_pe)

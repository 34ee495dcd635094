"""KV format numerics (docs/design.md §4), checked against brute-force references built from the grids."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.kernels.formats import (
    E2M1_VALUES,
    FORMAT_NAMES,
    NVFP4_BLOCK,
    dequantize_e2m1,
    get_format,
    pack_nibbles,
    quantize_e2m1,
    scale_from_amax,
    unpack_nibbles,
)


def fp8_grid(dtype):
    """All finite values of an fp8 type with their codes, from the bit patterns (independent of casts)."""
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(dtype).float()
    ok = torch.isfinite(vals)
    return vals[ok].double(), codes[ok].long()


def nearest_even(x: torch.Tensor, grid_vals: torch.Tensor, grid_codes: torch.Tensor) -> torch.Tensor:
    """Round each x to the nearest grid value; ties to the value whose code is even (RNE)."""
    d = (x.double()[:, None] - grid_vals[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = d == best
    # among tied candidates prefer an even code, then the larger magnitude never matters (ties have two)
    score = cand.double() * 2 + (cand & (grid_codes[None, :] % 2 == 0)).double()
    return grid_vals[score.argmax(dim=1)]


# ------------------------------------------------------------------------------------ registry
def test_registry_bytes_per_element():
    assert FORMAT_NAMES == ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4")
    bpe = {n: get_format(n).bytes_per_element for n in FORMAT_NAMES}
    assert bpe == {"bf16": 2.0, "fp16": 2.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "nvfp4": 0.5625}
    with pytest.raises(ValueError, match="supported: bf16"):
        get_format("int4")


# ------------------------------------------------------------------------------------------ e2m1
def test_e2m1_exhaustive_grid_roundtrip():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = dequantize_e2m1(codes)
    assert vals[:8].tolist() == list(E2M1_VALUES)
    assert vals[8:].tolist() == [-v for v in E2M1_VALUES]
    back = quantize_e2m1(vals)
    expected = codes.clone()
    expected[8] = 0  # -0 is stored as +0 (same value)
    assert torch.equal(back, expected)


def test_e2m1_ties_round_to_even():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert torch.equal(dequantize_e2m1(quantize_e2m1(mids)), want)
    assert torch.equal(dequantize_e2m1(quantize_e2m1(-mids)), -want)


def test_e2m1_nearest_on_dense_sweep():
    x = torch.linspace(-8, 8, 20001)
    grid = torch.tensor(sorted(set(E2M1_VALUES) | {-v for v in E2M1_VALUES}), dtype=torch.float64)
    got = dequantize_e2m1(quantize_e2m1(x)).double()
    clipped = x.double().clamp(-6, 6)
    err = (got - clipped).abs()
    best = (clipped[:, None] - grid[None, :]).abs().min(dim=1).values
    assert torch.all(err <= best + 1e-12)


def test_e2m1_saturates():
    assert dequantize_e2m1(quantize_e2m1(torch.tensor([7.0, 1e30, -9.0]))).tolist() == [6.0, 6.0, -6.0]


def test_pack_order_low_nibble_first():
    codes = torch.tensor([7, 2, 0, 15], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [0x27, 0xF0]
    assert torch.equal(unpack_nibbles(packed), codes)


# --------------------------------------------------------------------------------------- fp8
@pytest.mark.parametrize("name,dtype,maxv", [("fp8_e4m3", torch.float8_e4m3fn, 448.0), ("fp8_e5m2", torch.float8_e5m2, 57344.0)])
def test_fp8_rne_against_grid(name, dtype, maxv):
    fmt = get_format(name)
    gv, gc = fp8_grid(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.cat([
        torch.randn(4000, generator=g) * 30,
        torch.randn(1000, generator=g) * 1e-3,  # subnormals
        (gv[gv.abs() < maxv][:-1] + gv[gv.abs() < maxv][1:]).float() / 2,  # exact midpoints: ties
    ])
    scale = torch.tensor(0.5)
    q = fmt.quantize(x, scale)
    assert q.data.dtype == dtype and q.block_scale is None
    ref = nearest_even(x.double().div(0.5).clamp(-maxv, maxv), gv, gc)
    assert torch.equal(q.data.double(), ref)
    assert torch.equal(fmt.dequantize(q, scale), (ref * 0.5).float())


@pytest.mark.parametrize("name,maxv", [("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
def test_fp8_saturates(name, maxv):
    fmt = get_format(name)
    x = torch.tensor([1e9, -1e9, maxv * 2.0, float("inf")])
    out = fmt.roundtrip(x, torch.tensor(2.0))
    assert out.tolist() == [maxv * 2, -maxv * 2, maxv * 2, maxv * 2]


def test_fp8_per_head_scale_broadcast_and_no_mutation():
    fmt = get_format("fp8_e4m3")
    x = torch.randn(5, 3, 8)
    x0 = x.clone()
    s = torch.tensor([0.01, 0.1, 1.0])
    q = fmt.quantize(x, s)
    assert torch.equal(x, x0)
    for h in range(3):
        assert torch.equal(q.data[:, h].float(), fmt.quantize(x[:, h], s[h]).data.float())


# ------------------------------------------------------------------------------------- nvfp4
def nvfp4_reference(x: torch.Tensor, g: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(e2m1 element values, e4m3 block scales) from first principles, float64, one block at a time."""
    e4_vals, e4_codes = fp8_grid(torch.float8_e4m3fn)
    grid = torch.tensor(sorted(set(E2M1_VALUES) | {-v for v in E2M1_VALUES}), dtype=torch.float64)
    codes = torch.tensor([E2M1_VALUES.index(abs(v)) for v in grid.tolist()])
    xb = x.double().reshape(-1, NVFP4_BLOCK)
    elems = torch.empty_like(xb)
    scales = torch.empty(xb.shape[0], dtype=torch.float64)
    for i, blk in enumerate(xb):
        s = min(max(float(blk.abs().max()) / 6.0 / g, 2.0**-6), 448.0)
        s8 = float(nearest_even(torch.tensor([s]), e4_vals, e4_codes)[0])
        y = (blk / (s8 * g)).clamp(-6, 6)
        elems[i] = nearest_even(y, grid, codes)
        scales[i] = s8
    return elems.reshape(x.shape), scales.reshape(*x.shape[:-1], -1)


def test_nvfp4_matches_first_principles():
    fmt = get_format("nvfp4")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 64, generator=g) * torch.logspace(-3, 2, 6)[:, None]
    x[0, :16] = 0.0  # an all-zero block
    x[1, 5] = 40.0  # an outlier
    glob = 0.01
    q = fmt.quantize(x, torch.tensor(glob))
    elems, scales = nvfp4_reference(x, glob)
    got = dequantize_e2m1(unpack_nibbles(q.data)).double()
    assert torch.equal(got.abs(), elems.abs()) and torch.equal(got[elems != 0], elems[elems != 0])
    assert torch.equal(q.block_scale.double(), scales)
    deq = fmt.dequantize(q, torch.tensor(glob)).double()
    want = elems * scales.repeat_interleave(NVFP4_BLOCK, dim=-1) * glob
    assert torch.allclose(deq, want, rtol=2e-7, atol=0)


def test_nvfp4_block_scales_never_zero_and_saturation():
    fmt = get_format("nvfp4")
    x = torch.zeros(2, 32)
    x[1, 16:] = 1e4  # huge block: s clamps to 448, elements saturate at ±6
    x[1, 17] = -1e4
    q = fmt.quantize(x, torch.tensor(1.0))
    bs = q.block_scale.float()
    assert q.block_scale.dtype == torch.float8_e4m3fn and q.data.dtype == torch.uint8
    assert q.data.shape == (2, 16) and q.block_scale.shape == (2, 2)
    assert torch.all(bs > 0)
    assert bs[0, 0] == 2.0**-6 and bs[1, 1] == 448.0
    deq = fmt.dequantize(q, torch.tensor(1.0))
    assert deq[1, 16] == 6 * 448 and deq[1, 17] == -6 * 448
    assert torch.all(deq[0] == 0)


def test_nvfp4_rejects_bad_head_dim():
    with pytest.raises(ValueError, match="divisible by 16"):
        get_format("nvfp4").quantize(torch.randn(2, 24), torch.tensor(1.0))


# ------------------------------------------------------------------------------ error bounds
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_random_roundtrip_error_within_bound(name):
    fmt = get_format(name)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 4, 64, generator=g) * 3
    amax = x.abs().amax()
    scale = scale_from_amax(fmt, amax)
    out = fmt.roundtrip(x, scale)
    err = (out - x).abs()
    if name in ("bf16", "fp16"):
        rel = 2.0**-8 if name == "bf16" else 2.0**-11
        assert torch.all(err <= x.abs() * rel + 1e-30)
    elif name.startswith("fp8"):
        mant = 3 if name == "fp8_e4m3" else 2
        sub = (2.0**-9 if name == "fp8_e4m3" else 2.0**-16) * scale  # half the smallest subnormal step
        assert torch.all(err <= x.abs() * 2.0 ** -(mant + 1) + sub)
    else:
        q = fmt.quantize(x, scale)
        s = q.block_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1) * scale
        assert torch.all(err <= s * 1.0 + 1e-12)  # largest half-gap of the e2m1 grid is 1.0
    rel = ((out - x).norm() / x.norm()).item()
    assert rel < {"bf16": 3e-3, "fp16": 5e-4, "fp8_e4m3": 0.04, "fp8_e5m2": 0.08, "nvfp4": 0.12}[name]


# ------------------------------------------------------------------------- property tests
@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["fp8_e4m3", "fp8_e5m2", "nvfp4"]),
    rows=st.integers(1, 5),
    heads=st.integers(1, 3),
    blocks=st.integers(1, 4),
    log_mag=st.floats(-30, 20),
    log_scale=st.floats(-12, 6),
    seed=st.integers(0, 2**16),
)
def test_property_roundtrip_finite_and_bounded(name, rows, heads, blocks, log_mag, log_scale, seed):
    fmt = get_format(name)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, heads, blocks * 16, generator=g) * (10.0**log_mag)
    scale = torch.full((heads,), 10.0**log_scale)
    q = fmt.quantize(x, scale)
    out = fmt.dequantize(q, scale)
    assert out.shape == x.shape and torch.isfinite(out).all()
    if name == "nvfp4":
        assert torch.all(q.block_scale.float() > 0)
        s = q.block_scale.float().repeat_interleave(16, dim=-1) * scale[:, None]
        # within one grid step unless the block scale saturated at 448 (then elements clip at 6·s)
        clipped = x.abs() > 6 * s
        assert torch.all(((out - x).abs() <= s * 1.0 * (1 + 1e-6)) | clipped)
    else:
        maxv = fmt.max_value
        y = (x / scale[:, None]).clamp(-maxv, maxv)
        mant = 3 if name == "fp8_e4m3" else 2
        sub = 2.0**-9 if name == "fp8_e4m3" else 2.0**-16
        bound = (y.abs() * 2.0 ** -(mant + 1) + sub) * scale[:, None]
        assert torch.all((out - y * scale[:, None]).abs() <= bound * (1 + 1e-6))


def test_scale_from_amax():
    assert scale_from_amax("fp8_e4m3", torch.tensor(448.0 * 3)).item() == 3.0
    assert scale_from_amax("fp8_e5m2", torch.tensor(57344.0)).item() == 1.0
    assert math.isclose(scale_from_amax("nvfp4", torch.tensor(6 * 448.0 * 0.5)).item(), 0.5)
    assert scale_from_amax("bf16", torch.tensor(5.0)).item() == 1.0
    assert scale_from_amax("fp8_e4m3", torch.tensor(0.0)).item() == 1.0  # nothing observed


def test_nvfp4_host_table_equals_the_arithmetic_decode():
    """The CPU path reads packed bytes through a 256-entry table; it must give dequantize_e2m1's values for
    every byte (both nibbles, signs, zero and ±6), and the whole nvfp4 dequant must not change."""
    from kvbench.kernels.formats import _e2m1_values, dequantize_e2m1, unpack_nibbles

    every = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(_e2m1_values(every), dequantize_e2m1(unpack_nibbles(every)))
    fmt = get_format("nvfp4")
    x = torch.randn(9, 3, 64) * 4
    q = fmt.quantize(x, torch.tensor(0.02))
    arithmetic = dequantize_e2m1(unpack_nibbles(q.data)).reshape(9, 3, 4, 16)
    want = (arithmetic * q.block_scale.float().unsqueeze(-1) * torch.tensor(0.02)).reshape(9, 3, 64)
    assert torch.equal(fmt.dequantize(q, torch.tensor(0.02)), want)

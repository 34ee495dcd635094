"""Fused MLA RoPE + quantize + append (Triton, CPU interpreter) and the unfused torch path.

The CPU interpreter's float32→bf16/fp8 casts are not the GPU's (docs/design.md §12), so stored codes are
compared within one step of the format's grid (plus the interpreter's known halving at a power-of-two
round-up); the bit-exact comparison against kernels/formats.py runs on the GPU (tools/mla_check.py).  fp16
storage and the nvfp4 element codes (given the kernel's own block scale) are compared exactly.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_mla_helpers import FORMATS, make_cache  # noqa: E402
from kvbench.kernels.formats import dequantize_e2m1, quantize_e2m1, unpack_nibbles  # noqa: E402
from kvbench.kernels.mla import rope_cos_sin_cache  # noqa: E402
from kvbench.kernels.mla_append import mla_append, mla_append_unfused  # noqa: E402
from kvbench.kernels.mla_reference import ref_append_rows, ref_rope  # noqa: E402

H, RANK, ROPE, PAGE, PAGES = 3, 64, 32, 4, 12
MAG = {torch.bfloat16: 0x7FFF, torch.float16: 0x7FFF, torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7F}
INT = {1: torch.uint8, 2: torch.int16}


def _codes(x):
    return x.view(INT[x.element_size()]).long() & (0xFFFF if x.element_size() == 2 else 0xFF)


def assert_codes_close(got, ref, exact_cols=None, max_frac=0.1):
    """Same code, or a neighbouring one, or the interpreter's halving of a power of two (ref/2)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    g, r = _codes(got), _codes(ref)
    mask = MAG[got.dtype]
    same_sign = (g & ~mask) == (r & ~mask)
    gm, rm = g & mask, r & mask
    near = ((gm - rm).abs() <= 1) & (same_sign | (rm <= 1))
    halved = (got.float() * 2 == ref.float()) & (ref.float().abs().log2().frac() == 0)
    ok = (g == r) | near | halved
    assert ok.all(), f"{(~ok).sum().item()} values off by more than one grid step"
    frac = (g != r).float().mean().item()
    assert frac <= max_frac, f"{frac:.3f} of values differ"
    if exact_cols is not None:
        assert torch.equal(g[:, exact_cols], r[:, exact_cols])


def _inputs(seed, t=11, amp=3.0):
    gen = torch.Generator().manual_seed(seed)
    c = torch.randn(t, RANK, generator=gen) * amp
    k = torch.randn(t, ROPE, generator=gen) * amp
    q = torch.randn(t, H, ROPE, generator=gen)
    pos = torch.randint(0, 200, (t,), generator=gen)
    slots = torch.randperm(PAGES * PAGE, generator=gen)[:t]
    slots[2] = -1
    slots[7] = -1
    return c, k, q, pos, slots


def _stored(cache, slots):
    lay = cache.layout
    d = cache.data.view(-1, lay.packed_dim)[slots.long()]
    bs = None if cache.block_scale is None else cache.block_scale.view(-1, lay.head_dim // 16)[slots.long()]
    return d, bs


def _check_untouched(cache, slots):
    written = set(slots[slots >= 0].tolist())
    rows = cache.data.view(-1, cache.layout.packed_dim)
    other = torch.tensor([s for s in range(rows.shape[0]) if s not in written])
    assert (rows[other].view(torch.uint8) == 0xFF).all(), "append wrote outside its slots"


@pytest.mark.parametrize("kv_dtype", FORMATS + ("fp16",))
@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_fused_append_matches_spec(kv_dtype, style):
    seed = FORMATS.index(kv_dtype) if kv_dtype in FORMATS else 9
    c, k, q, pos, slots = _inputs(seed + (10 if style == "neox" else 20))
    cs = rope_cos_sin_cache(256, ROPE, base=500.0)
    cache = make_cache(kv_dtype, RANK, ROPE, PAGES, PAGE, k_scale=None if kv_dtype != "nvfp4" else 0.01)
    q_before, c_before = q.clone(), c.clone()
    q_rot, k_rot, q8 = mla_append(c, k, q, pos, cs, slots, cache, rope_style=style)
    assert q8 is None and torch.equal(q, q_before) and torch.equal(c, c_before)
    # RoPE outputs against float64.
    assert torch.allclose(q_rot.double(), ref_rope(q, pos, cs, style), atol=2e-6, rtol=0)
    assert torch.allclose(k_rot.double(), ref_rope(k, pos, cs, style), atol=1e-5, rtol=0)
    keep = slots >= 0
    _check_untouched(cache, slots)
    _, ref = ref_append_rows(c[keep], k[keep], pos[keep], cs, kv_dtype, cache.k_scale[0], style)
    got, got_bs = _stored(cache, slots[keep])
    if kv_dtype == "nvfp4":
        assert_codes_close(got_bs, ref.block_scale, max_frac=0.2)
        # Element codes, given the kernel's own block scales: exact on the latent, near on the rope part.
        rows = torch.cat((c[keep], ref_rope(k[keep], pos[keep], cs, style).float()), dim=-1)
        den = (got_bs.float() * cache.k_scale[0]).repeat_interleave(16, dim=-1)
        want = quantize_e2m1(rows / den)
        have = unpack_nibbles(got)
        assert torch.equal(have[:, :RANK], want[:, :RANK])
        dv = (dequantize_e2m1(have[:, RANK:]) - dequantize_e2m1(want[:, RANK:])).abs()
        assert (dv <= 1.0).all() and (dv > 0).float().mean() < 0.05
    elif kv_dtype == "fp16":
        assert torch.equal(_codes(got[:, :RANK]), _codes(ref.data[:, :RANK]))
        assert_codes_close(got, ref.data, max_frac=0.05)
    else:
        # bf16: the interpreter truncates, so about half the values sit one step below RNE.
        assert_codes_close(got, ref.data, max_frac=0.75 if kv_dtype == "bf16" else 0.1)


def test_fused_append_emits_fp8_query():
    c, k, q, pos, slots = _inputs(31)
    cs = rope_cos_sin_cache(256, ROPE)
    q_lat = torch.randn(q.shape[0], H, RANK)
    qs = torch.tensor([0.01])
    cache = make_cache("fp8_e4m3", RANK, ROPE, PAGES, PAGE)
    _, _, q8 = mla_append(c, k, q, pos, cs, slots, cache, q_lat=q_lat, q_scale=qs)
    want = torch.cat((q_lat, ref_rope(q, pos, cs).float()), dim=-1)
    want = (want / qs).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert q8.shape == (q.shape[0], H, RANK + ROPE)
    assert_codes_close(q8.reshape(-1, RANK + ROPE), want.reshape(-1, RANK + ROPE))


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_unfused_append_matches_spec(kv_dtype):
    c, k, q, pos, slots = _inputs(40 + FORMATS.index(kv_dtype))
    cs = rope_cos_sin_cache(256, ROPE)
    cache = make_cache(kv_dtype, RANK, ROPE, PAGES, PAGE)
    q_rot, k_rot, _ = mla_append_unfused(c, k, q, pos, cs, slots, cache)
    _check_untouched(cache, slots)
    keep = slots >= 0
    _, ref = ref_append_rows(c[keep], k[keep], pos[keep], cs, kv_dtype, cache.k_scale[0])
    got, got_bs = _stored(cache, slots[keep])
    # torch quantizes exactly as the spec: the latent part is bit-exact, the rope part within a step
    # (float32 RoPE against float64).
    latent_bytes = RANK // 2 if kv_dtype == "nvfp4" else RANK
    assert torch.equal(got[:, :latent_bytes].view(torch.uint8), ref.data[:, :latent_bytes].view(torch.uint8))
    if got_bs is not None:
        assert torch.equal(got_bs[:, : RANK // 16].view(torch.uint8), ref.block_scale[:, : RANK // 16].view(torch.uint8))
    else:
        assert_codes_close(got, ref.data, max_frac=0.02)
    assert torch.allclose(q_rot.double(), ref_rope(q, pos, cs), atol=2e-6, rtol=0)


def test_append_rejects_bad_input():
    c, k, q, pos, slots = _inputs(50)
    cs = rope_cos_sin_cache(256, ROPE)
    cache = make_cache("fp8_e4m3", RANK, ROPE, PAGES, PAGE)
    with pytest.raises(ValueError, match="c_kv"):
        mla_append(c[:, :32], k, q, pos, cs, slots, cache)
    with pytest.raises(ValueError, match="k_pe"):
        mla_append(c, k[:-1], q, pos, cs, slots, cache)
    with pytest.raises(ValueError, match="rope_style"):
        mla_append(c, k, q, pos, cs, slots, cache, rope_style="yarn")
    with pytest.raises(ValueError, match="integer"):
        mla_append(c, k, q, pos.float(), cs, slots, cache)
    with pytest.raises(ValueError, match="q_scale"):
        mla_append(c, k, q, pos, cs, slots, cache, q_lat=torch.randn(q.shape[0], H, RANK))
    bad = make_cache("fp8_e4m3", RANK, ROPE, PAGES, PAGE)
    bad.data = bad.data.view(torch.uint8)
    with pytest.raises(ValueError, match="latent cache"):
        mla_append(c, k, q, pos, cs, slots, bad)

"""GPU: the Triton kernels against float64 references at small and medium shapes, with the check functions
of ``kvbench.tools.kernel_check`` / ``mla_check`` (outputs poisoned with NaN first, ‖out−ref‖/‖ref‖ within
the checks' tolerances, NaN never passes; the append kernels bit for bit).  Run with ``pytest -m gpu`` on a
CUDA device; skipped elsewhere (tests/conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.tools.common import kernel_formats, mla_formats
from kvbench.tools.kernel_check import TOL, Case, check_append, check_decode, check_prefill, check_prefill_q_split

pytestmark = pytest.mark.gpu

FORMATS = kernel_formats()
G32 = (32, 8, 128, 16)  # H_q, H_kv, head_dim, page
G64 = (64, 8, 64, 64)
RAGGED = [1, 17, 300, 1000, 2049, 4097, 63, 512]


@pytest.fixture(autouse=True)
def _free_memory():
    yield
    torch.cuda.empty_cache()


def _ok(case: Case) -> None:
    assert math.isfinite(case.err) and case.ok, case.line()


def test_a_nan_output_never_passes():
    assert not Case("decode", "nan", float("nan"), 1.0).ok and not Case("decode", "inf", float("inf"), 1.0).ok
    from kvbench.tools.kernel_check import rel_err

    ref = torch.ones(4, device="cuda")
    assert rel_err(torch.tensor([1.0, float("nan"), 1.0, 1.0], device="cuda"), ref) == float("inf")


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode(fmt):
    _ok(check_decode(fmt, RAGGED, *G32, layout="HND", seed=1))
    _ok(check_decode(fmt, [4097, 17, 2000, 1], *G32, window=1000, sinks=True, layout="HND", seed=2))
    _ok(check_decode(fmt, RAGGED, *G32, q_fp8=True, layout="HND", seed=3))
    _ok(check_decode(fmt, [700, 1, 1500], *G64, layout="NHD", seed=4))


def test_decode_nvfp4_explicit_layouts():
    """The Gluon nvfp4 decode (kernels/decode_nv4.py, ``gluon=True``; it raises rather than fall back), at its
    defaults and with the register prefetch / caps of the launch sweep, pages of 16-64 tokens, windows that
    start off a 16-token boundary, 1-16 query heads per kv head."""
    _ok(check_decode("nvfp4", RAGGED, *G32, layout="HND", seed=11, gluon=True))
    _ok(check_decode("nvfp4", [4097, 17, 2000, 1], *G32, window=1000, sinks=True, layout="HND", seed=12, gluon=True))
    _ok(check_decode("nvfp4", [700, 1, 1500], 16, 16, 128, 32, dtype=torch.float16, seed=13, gluon=True))
    _ok(check_decode("nvfp4", [3000, 4096], 64, 4, 128, 16, sinks=True, num_splits=5, seed=14, gluon=True))
    _ok(check_decode("nvfp4", [3000, 4096, 129], *G32, num_splits=1, seed=15, gluon=True))
    _ok(check_decode("nvfp4", [2000, 37, 4099], 48, 8, 128, 64, window=1021, layout="HND", seed=16, gluon=True,
                     prefetch=True, maxnreg=0))
    _ok(check_decode("nvfp4", [2000, 37, 4099], *G32, window=333, num_splits=3, seed=17, gluon=True,
                     prefetch=True, maxnreg=168))
    _ok(check_decode("nvfp4", [5000, 1], 8, 1, 128, 32, sinks=True, seed=18, gluon=True, prefetch=False, maxnreg=0))


@pytest.mark.parametrize("unpack,stages,vswz,cpl", [(0, 0, False, 4), (1, 0, False, 4), (0, 2, True, 4),
                                                    (1, 2, False, 4), (1, 4, True, 4), (1, 2, True, 3),
                                                    (1, 2, True, 0)])
def test_decode_nvfp4_unpackings_and_pipelines(monkeypatch, unpack, stages, vswz, cpl):
    """decode_nv4's module settings besides the defaults (byte permutes, two stages, swizzled V, copies with one
    page lookup per group for codes and scales): the e4m3 conversions, direct register loads (the kernel before
    2026-11-29), row-major V, four stages, the copies of ``CPL`` 3 and 0."""
    from kvbench.kernels import decode_nv4

    for name, value in (("UNPACK", unpack), ("STAGES", stages), ("VSWZ", vswz), ("CPL", cpl)):
        monkeypatch.setattr(decode_nv4, name, value)
    _ok(check_decode("nvfp4", RAGGED, *G32, layout="HND", seed=31, gluon=True))
    _ok(check_decode("nvfp4", [4097, 17, 2000, 1], *G32, window=1000, sinks=True, seed=32, gluon=True))
    _ok(check_decode("nvfp4", [3000, 4096], 64, 4, 128, 16, sinks=True, num_splits=5, seed=33, gluon=True))


def test_decode_nvfp4_default_is_the_explicit_layout_kernel_where_it_applies(monkeypatch):
    """nvfp4 decode on the GPU runs decode_nv4 by default where it applies and the Triton kernel otherwise (a
    Triton launch option, pages of 8 tokens, head dim 64, an fp8 query); the Triton kernel stays checked."""
    from kvbench.kernels import decode_nv4

    calls = []
    real = decode_nv4.launch
    monkeypatch.setattr(decode_nv4, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    _ok(check_decode("nvfp4", RAGGED, *G32, layout="HND", seed=21))
    assert len(calls) == 1
    _ok(check_decode("nvfp4", RAGGED, *G32, layout="HND", seed=22, block_n=64))
    _ok(check_decode("nvfp4", RAGGED, *G32, layout="HND", seed=23, gluon=False))
    _ok(check_decode("nvfp4", [4097, 17, 2000, 1], 32, 8, 128, 8, window=1000, sinks=True, seed=24))
    _ok(check_decode("nvfp4", [700, 1, 1500], *G64, seed=25))
    _ok(check_decode("nvfp4", RAGGED, *G32, q_fp8=True, layout="HND", seed=26))
    assert len(calls) == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill(fmt):
    _ok(check_prefill(fmt, [256, 1, 77, 300], [0, 500, 1000, 31], *G32, layout="HND", seed=5))
    _ok(check_prefill(fmt, [200, 1, 64], [1000, 64, 0], *G32, window=300, sinks=True, q_fp8=True, layout="HND", seed=6))
    # prompts only, said so (max_prefix_len 0): nvfp4 takes the plain path, the cache unread
    _ok(check_prefill(fmt, [256, 1, 77], [0, 0, 0], *G32, window=100, layout="HND", seed=38, max_prefix_len=0))


def test_prefill_wgmma():
    """The Hopper kernel (``prefill_wg``, ``wgmma=True``) against the float64 reference
    (``kernel_check.check_prefill_wgmma``: prefixes, prompts, pages of 16 / 32 / 64, both layouts, head dims 128 and
    64, bf16 and float16, groups of 4, 8 and 1; fp8_e4m3, fp8_e5m2 and nvfp4 prefixes through a workspace of q's
    dtype), and the calls it refuses (every call, on a GPU other than sm_90)."""
    from kvbench.tools.kernel_check import check_prefill_wgmma

    if torch.cuda.get_device_capability() != (9, 0):
        with pytest.raises(ValueError, match="wgmma=True: needs an sm_90"):
            check_prefill_wgmma()
        return

    cases = check_prefill_wgmma()
    assert len(cases) == 21
    for case in cases:
        _ok(case)
    # a quantized prefix without max_prefix_len (no workspace plan), fp8 queries, a window
    for fmt, kw in (("fp8_e4m3", {}), ("fp8_e4m3", dict(q_fp8=True, max_prefix_len=32)), ("bf16", dict(window=100))):
        with pytest.raises(ValueError, match="wgmma=True: "):
            check_prefill(fmt, [16], [32], *G32, wgmma=True, **kw)


def test_prefill_fp8_query_split_and_pointer_loads():
    """A bf16 q over an e4m3 prefix (q split into two e4m3 terms) against converted K tiles, and the prefill's
    pointer loads (``tma=False``) against the reference."""
    _ok(check_prefill_q_split([256, 1, 300], [0, 1000, 31], *G32, window=300, sinks=True, seed=7))
    _ok(check_prefill("bf16", [256, 1, 300], [0, 1000, 31], *G32, tma=False, layout="HND", seed=8))
    assert TOL[torch.bfloat16] == 2e-2


@pytest.mark.parametrize("fmt", FORMATS)
def test_append_bit_exact(fmt):
    """Fused and unfused RoPE + quantize + store, bit for bit against the reference (``exact=True``)."""
    _ok(check_append(fmt, 100, 32, 8, 128, 16, fused=True, q_fp8=True, layout="HND", seed=9))
    _ok(check_append(fmt, 100, 32, 8, 128, 16, fused=False, q_fp8=True, layout="HND", seed=10))
    _ok(check_append(fmt, 33, 64, 8, 64, 64, rot=32, style="interleaved", fused=True, seed=11))


G256 = (8, 2, 256, 16)  # head_dim 256 (Gemma 3; the real 270M has 4 query heads over 1 kv head)


@pytest.mark.parametrize("fmt", FORMATS)
def test_head_dim_256(fmt):
    """head_dim 256 on the compiled kernels (twice the registers per row of 128): decode, prefill over a prefix
    and the append, with windows as Gemma's sliding layers use them, in both cache layouts."""
    _ok(check_decode(fmt, [700, 1, 1500, 33], *G256, layout="HND", seed=31))
    _ok(check_decode(fmt, [4097, 17, 600], 4, 1, 256, 16, window=512, layout="HND", seed=32))
    _ok(check_decode(fmt, [900, 5], *G256, layout="NHD", seed=33))
    _ok(check_prefill(fmt, [256, 1, 77], [0, 500, 31], *G256, layout="HND", seed=34))
    _ok(check_prefill(fmt, [200, 1, 64], [1000, 64, 0], 4, 1, 256, 16, window=512, layout="HND", seed=35))
    _ok(check_prefill(fmt, [700, 3], [0, 0], *G256, layout="HND", seed=39, max_prefix_len=0))
    _ok(check_append(fmt, 100, 8, 2, 256, 16, fused=True, layout="HND", seed=36))
    _ok(check_append(fmt, 100, 8, 2, 256, 16, fused=False, layout="HND", seed=37))


# ------------------------------------------------------------------------------------------------ MLA
@pytest.fixture(scope="module")
def mla_gen():
    return torch.Generator().manual_seed(25)


def _mla_ok(res: dict) -> None:
    assert res.get("pass") is True, res
    if "rel_err" in res:
        assert math.isfinite(res["rel_err"]) and res["rel_err"] < 2e-2, res


@pytest.mark.parametrize("fmt", mla_formats())
def test_mla_append(fmt, mla_gen):
    from kvbench.tools.mla_check import check_append as mla_append_check

    res = mla_append_check(fmt, torch.device("cuda"), mla_gen)
    assert res["latent_bit_exact"] and res["skipped_slots_untouched"], res
    _mla_ok(res)


@pytest.mark.parametrize("fmt", mla_formats())
def test_mla_decode(fmt, mla_gen):
    from kvbench.tools.mla_check import check_decode as mla_decode_check, check_decode_fp8_query

    dev = torch.device("cuda")
    _mla_ok(mla_decode_check(fmt, dev, mla_gen, lens=(1, 100, 4097)))
    _mla_ok(mla_decode_check(fmt, dev, mla_gen, lens=(1, 100, 4097), heads=16, units16=False))
    _mla_ok(check_decode_fp8_query(fmt, dev, mla_gen, lens=(1, 100, 4097), heads=16))


@pytest.mark.parametrize("fmt", mla_formats())
def test_mla_decode_wgmma(fmt, mla_gen, monkeypatch):
    """The Hopper decode kernel (above 32 heads by default: a bf16 latent with bf16 queries; an e4m3 latent with
    bf16 queries split into two e4m3 terms or with e4m3 queries, an e5m2 latent with the split bf16 queries, the
    scores on the stored tile and P·c on its float16 conversion; ``fp8_pv``) against the float64 reference, with head counts, split counts, sequence ends around its
    64-token tiles and pages of 64, 16 and 8; counted, so it must have run where it applies and not elsewhere;
    ``fp8_pv`` refused for every other format.  On a GPU other than sm_90 the same checks run on the Triton kernel,
    which must then have run alone, and an explicit request must be refused."""
    from kvbench.kernels import mla_decode_wg
    from kvbench.tools.mla_check import check_decode as mla_decode_check, check_decode_fp8_query

    dev = torch.device("cuda")
    hopper = torch.cuda.get_device_capability(dev) == (9, 0)
    calls = []
    real = mla_decode_wg.launch
    monkeypatch.setattr(mla_decode_wg, "launch", lambda *a, **k: (calls.append(a[0].shape), real(*a, **k))[1])
    _mla_ok(mla_decode_check(fmt, dev, mla_gen, lens=(1, 100, 4097)))  # 128 heads, the defaults
    _mla_ok(mla_decode_check(fmt, dev, mla_gen, lens=(64, 65, 127, 128, 129, 0, 2), heads=96, num_splits=7))
    _mla_ok(mla_decode_check(fmt, dev, mla_gen, lens=(1, 100, 4097, 15, 16, 17), page=16))  # four copies per tile
    _mla_ok(mla_decode_check(fmt, dev, mla_gen, lens=(1, 100, 33), page=8, num_splits=2))
    _mla_ok(mla_decode_check(fmt, dev, mla_gen, lens=(1, 100, 4097), wgmma=False))
    wg_formats = ("bf16", "fp8_e4m3", "fp8_e5m2")
    assert len(calls) == (4 if hopper and fmt in wg_formats else 0), calls
    if not hopper:
        with pytest.raises(ValueError, match="needs an sm_90"):
            mla_decode_check("bf16", dev, mla_gen, lens=(1, 100), wgmma=True)
        if fmt == "fp8_e4m3":
            with pytest.raises(ValueError, match="fp8_pv: needs an sm_90"):
                check_decode_fp8_query(fmt, dev, mla_gen, lens=(1, 100), fp8_pv=True)
        return
    if fmt == "bf16":
        _mla_ok(mla_decode_check(fmt, dev, mla_gen, lens=(1, 100, 4097), heads=16, wgmma=True))
        assert len(calls) == 5, calls
    if fmt in ("fp8_e4m3", "fp8_e5m2"):
        # the split query against the Triton kernel on the same inputs (P in float16 in both).  The split's scores
        # are fp8 MMAs, whose accumulation on Hopper is not a full float32 one; over e4m3 the Triton kernel's are
        # too (1.03x on an H200, 2026-11-29), over e5m2 it scores in float16 (1.19x: 2.1e-3 against 1.8e-3)
        errs = {wg: mla_decode_check(fmt, dev, torch.Generator().manual_seed(11), lens=(1, 100, 4097, 129, 32768),
                                     wgmma=wg)["rel_err"] for wg in (None, False)}
        assert errs[None] <= (1.1 if fmt == "fp8_e4m3" else 1.25) * errs[False] + 1e-4, errs
        assert len(calls) == 5, calls
    if fmt == "fp8_e4m3":
        _mla_ok(mla_decode_check(fmt, dev, mla_gen, lens=(1, 100, 4097), heads=16, wgmma=True))
        # e4m3 queries: by default above 32 heads; at 16 with wgmma
        _mla_ok(check_decode_fp8_query(fmt, dev, mla_gen, lens=(1, 100, 4097, 64, 65)))
        _mla_ok(check_decode_fp8_query(fmt, dev, mla_gen, lens=(1, 100, 4097, 17), page=16))
        _mla_ok(check_decode_fp8_query(fmt, dev, mla_gen, lens=(1, 100, 4097), heads=16, wgmma=True, num_splits=3))
        assert len(calls) == 9, calls
        _mla_ok(check_decode_fp8_query(fmt, dev, mla_gen, lens=(1, 100, 4097, 64, 65), fp8_pv=True))
        _mla_ok(check_decode_fp8_query(fmt, dev, mla_gen, lens=(1, 100, 4097), heads=16, fp8_pv=True, num_splits=3))
        _mla_ok(check_decode_fp8_query(fmt, dev, mla_gen, lens=(1, 100, 4097, 17), fp8_pv=True, page=16))
        assert len(calls) == 12, calls
        with pytest.raises(ValueError, match="fp8_scores"):  # the scores on a converted tile: the Triton kernel's
            check_decode_fp8_query(fmt, dev, mla_gen, lens=(1, 100), wgmma=True, fp8_scores=False)
    elif fmt != "bf16":
        with pytest.raises(ValueError, match="fp8_pv"):
            check_decode_fp8_query(fmt, dev, mla_gen, lens=(1, 100), fp8_pv=True)


@pytest.mark.parametrize("fmt", mla_formats())
def test_mla_prefill(fmt, mla_gen):
    from kvbench.tools.mla_check import check_prefill as mla_prefill_check

    dev = torch.device("cuda")
    _mla_ok(mla_prefill_check(fmt, dev, mla_gen))
    _mla_ok(mla_prefill_check(fmt, dev, mla_gen, fp8_query=True))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e5m2", "fp8_e4m3"])
def test_prefill_prefix_workspace(fmt):
    from kvbench.tools.kernel_check import check_prefill_workspace

    _ok(check_prefill_workspace(fmt, [300, 1, 517], [1000, 4095, 33], *G32, window=None, sinks=True, seed=3,
                                layout="HND"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_rms_norm_and_silu_mul_match_torch(dtype):
    # the decoder's fused norm (with the residual add) and SiLU · up against the torch code they replace,
    # at Llama-3-8B widths; outputs poisoned (fresh torch.empty is not zeroed, so NaN must not leak through)
    from kvbench.kernels.fused_ops import rms_norm, rms_norm_torch, silu_mul, silu_mul_torch

    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(64, 4096, device="cuda", generator=g) * 2).to(dtype)
    r = (torch.randn(64, 4096, device="cuda", generator=g) * 2).to(dtype)
    w = (1 + 0.1 * torch.randn(4096, device="cuda", generator=g)).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    for res in (None, r):
        got = rms_norm(x, w, 1e-5, res)
        want = rms_norm_torch(x, w, 1e-5, res)
        if res is not None:
            assert torch.equal(got[1], want[1])
            got, want = got[0], want[0]
        assert not got.isnan().any()
        assert ((got.double() - want.double()).norm() / want.double().norm()).item() <= tol
    q = torch.randn(64, 48 * 128, device="cuda", generator=g).to(dtype)[:, : 32 * 128].reshape(64, 32, 128)
    wq = torch.ones(128, device="cuda", dtype=dtype)
    got = rms_norm(q, wq, 1e-6)
    assert ((got.double() - rms_norm_torch(q, wq, 1e-6).double()).norm() / got.double().norm()).item() <= tol
    gu = (torch.randn(64, 2 * 14336, device="cuda", generator=g) * 3).to(dtype)
    got = silu_mul(gu)
    want = silu_mul_torch(gu)
    assert not got.isnan().any()
    assert ((got.double() - want.double()).norm() / want.double().norm()).item() <= tol


@pytest.mark.parametrize("m", [1, 16, 64])
def test_skinny_gemm_against_float64(m):
    """The few-row GEMM at Llama-3-8B's projection shapes (K-major weights, bias), with its default tiling, tensor
    descriptors, and K split in 2 / 8 parts: within 1.05× cuBLAS's own error against float64, output poisoned first,
    the same bits on a second run."""
    from kvbench.kernels import skinny_gemm as S

    g = torch.Generator(device="cuda").manual_seed(m)
    for n, k in [(6144, 4096), (4096, 14336), (28672, 4096), (1000, 4096)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = (torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=g) / 64).t()
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = x.double() @ w.double().t() + b.double()
        blas = ((torch.nn.functional.linear(x, w, b).double() - ref).norm() / ref.norm()).item()
        base = S.plan(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
        for p in [None, S.Plan(base.bm, 128, 128, 2, tma=True), S.Plan(base.bm, 64, 64, 8, stages=3)]:
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            S.linear(x, w, b, p=p, out=out)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert math.isfinite(err) and err <= 1.05 * blas + 1e-6, (n, k, p, err, blas)
            assert torch.equal(S.linear(x, w, b, p=p), out)

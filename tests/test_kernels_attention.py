"""Paged decode and prefill kernels (Triton, CPU interpreter) against the float64 references, at small
shapes: every KV format, GQA, ragged lengths, several pages per tile and several splits, sliding
window, sinks and fp8 queries.  Outputs are poisoned with NaN before each run."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvbench.tools import kernel_check as C
from kvbench.kernels.config import AttentionParams, DecodeOptions, PagedKV, PrefillOptions
from kvbench.kernels.decode import default_num_splits, paged_decode
from kvbench.kernels.formats import FORMAT_NAMES
from kvbench.kernels.prefill import paged_prefill

FEATURES = [
    # sliding window, sinks, fp8 q, compute dtype
    (None, False, False, torch.float32),
    (21, True, False, torch.bfloat16),
    (None, False, True, torch.float16),
]


# decode kernel variants: with and without the hand prefetch of the next tile, and with 8/4-bit tiles read
# as bytes instead of 16-bit units (fp8 / nvfp4 with a float16 dot; the other formats ignore it)
VARIANTS = [dict(prefetch=False), dict(prefetch=True), dict(units16=False)]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("window,sinks,q8,dtype", FEATURES)
@pytest.mark.parametrize("variant", VARIANTS, ids=["plain", "prefetch", "bytes"])
def test_decode_matches_reference(fmt, window, sinks, q8, dtype, variant):
    case = C.check_decode(fmt, [1, 45, 70, 16], 8, 2, 32, 8, dtype=dtype, window=window, sinks=sinks, q_fp8=q8,
                          device="cpu", seed=len(fmt) * 7 + (window or 0), block_n=16, num_splits=3, **variant)
    tol = C.TOL[torch.float32] if dtype == torch.float32 else C.TOL[torch.bfloat16]
    assert case.err <= tol, case.line()


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("window,sinks,q8,dtype", FEATURES)
@pytest.mark.parametrize("split_reduce", [False, True], ids=["direct", "reduce"])
def test_decode_one_split(fmt, window, sinks, q8, dtype, split_reduce):
    # one split: the split kernel finishes the softmax (sinks, v_scale) and writes the output itself,
    # or (split_reduce) leaves it to the reduce kernel as with several splits
    case = C.check_decode(fmt, [1, 45, 70, 16], 8, 2, 32, 8, dtype=dtype, window=window, sinks=sinks, q_fp8=q8,
                          device="cpu", seed=len(fmt) * 3 + (window or 0), block_n=32, num_splits=1,
                          split_reduce=split_reduce)
    tol = C.TOL[torch.float32] if dtype == torch.float32 else C.TOL[torch.bfloat16]
    assert case.err <= tol, case.line()


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("window,sinks,q8,dtype", FEATURES)
def test_prefill_matches_reference(fmt, window, sinks, q8, dtype):
    case = C.check_prefill(fmt, [5, 40, 1], [0, 23, 50], 4, 2, 32, 8, dtype=dtype, window=window, sinks=sinks,
                           q_fp8=q8, device="cpu", seed=len(fmt) * 5 + (window or 0), block_m=16, block_n=16)
    tol = C.TOL[torch.float32] if dtype == torch.float32 else C.TOL[torch.bfloat16]
    assert case.err <= tol, case.line()


@pytest.mark.parametrize("fmt,prefetch", [("nvfp4", False), ("nvfp4", True), ("fp8_e5m2", True)])
def test_decode_head_dim_64_one_split_larger_group(fmt, prefetch):
    case = C.check_decode(fmt, [3, 64], 8, 1, 64, 16, dtype=torch.float32, device="cpu", seed=1, block_n=32,
                          num_splits=1, prefetch=prefetch)
    assert case.err <= C.TOL[torch.float32], case.line()


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_per_format_defaults(fmt, dtype):
    # no launch arguments: the per-format block_n / splits / warps / prefetch defaults (float16: the
    # 16-bit unit path for fp8 and nvfp4)
    case = C.check_decode(fmt, [300, 7], 8, 2, 32, 16, dtype=dtype, device="cpu", seed=3)
    assert case.err <= C.TOL[torch.float32 if dtype == torch.float32 else torch.bfloat16], case.line()


def test_decode_rejects_bad_launch_arguments():
    gen = torch.Generator().manual_seed(0)
    kv, table = C._attn_inputs("fp8_e4m3", [20, 9], 2, 32, 8, "cpu", gen)
    q = torch.randn(2, 4, 32, generator=gen)
    seq = torch.tensor([20, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_n"):
        paged_decode(q, PagedKV("fp8_e4m3", **kv), table, seq, opts=DecodeOptions(block_n=24))
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode(q, PagedKV("fp8_e4m3", **kv), table, seq, opts=DecodeOptions(num_splits=0))


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("prefix_full,bnp", [(True, 16), (True, 32), (False, 16)],
                         ids=["full-tiles-unmasked", "prefix-tile-32", "all-masked"])
def test_prefill_prefix_whole_and_partial_tiles(fmt, prefix_full, bnp):
    # prefixes of whole tiles only (32, 48 at tile 16), a partial one (7) and none: the unmasked loop over
    # whole tiles, the masked remainder, and the all-masked path kept for comparison; prefix tiles of 32
    # keys with 16-key tiles over the new tokens
    case = C.check_prefill(fmt, [9, 20, 3, 16], [32, 48, 7, 0], 4, 2, 32, 8, dtype=torch.float32, device="cpu",
                           seed=11, block_m=16, block_n=16, block_n_prefix=bnp, prefix_full=prefix_full)
    assert case.err <= C.TOL[torch.float32], case.line()


@pytest.mark.parametrize("d,window,sinks", [(32, None, False), (64, 21, True)])
def test_prefill_split_query_matches_converted_k(d, window, sinks):
    # a bf16 q over an e4m3 prefix (the default path): q split exactly into two e4m3 terms per row, the
    # scores as fp8 dots on the stored K; it must agree with converting each K tile (fp8_qk=False) far more
    # closely than the reference tolerance (dropping the low term gives ~2e-2 here)
    case = C.check_prefill_q_split([9, 40, 1], [32, 23, 50], 4, 2, d, 8, window=window, sinks=sinks, device="cpu",
                                   seed=d + (window or 0), block_m=16, block_n=16)
    assert case.err <= 1e-3, case.line()
    ref = C.check_prefill("fp8_e4m3", [9, 40, 1], [32, 23, 50], 4, 2, d, 8, window=window, sinks=sinks, device="cpu",
                          seed=d + (window or 0), block_m=16, block_n=16)
    assert ref.err <= C.TOL[torch.bfloat16], ref.line()


@pytest.mark.parametrize("workspace", [False, True])
def test_prefill_zero_and_negative_v_scales(workspace):
    # the per-head V scale multiplies the prefix's contribution whatever its sign or size, in registers and over the
    # workspace (the Hopper kernel's check, kernel_check.check_prefill_wgmma, has the same case on a GPU)
    case = C.check_prefill("fp8_e4m3", [33, 1, 7], [0, 50, 100], 8, 2, 64, 16, layout="HND", seed=5, device="cpu",
                           max_prefix_len=100, prefix_workspace=workspace, v_scale_factors=[0.0, -1.0])
    assert case.err <= C.TOL[torch.bfloat16] and "v_scale x [0.0, -1.0]" in case.line(), case.line()


def test_prefill_block_shapes_and_pure_prefill():
    case = C.check_prefill("fp8_e4m3", [33, 17], [0, 0], 2, 2, 32, 16, dtype=torch.float32, device="cpu", seed=2,
                           block_m=32, block_n=16)
    assert case.err <= C.TOL[torch.float32], case.line()


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("window,sinks,q8,dtype", FEATURES)
def test_prefill_tma_matches_reference(fmt, window, sinks, q8, dtype):
    # q and the new tokens' k / v through tensor descriptors (the GPU default): tiles that run past a
    # sequence into the next one (q_len 5, 40, 1) or past the last token (16 + the tail), over prefixes
    case = C.check_prefill(fmt, [5, 40, 1, 19], [0, 23, 50, 32], 4, 2, 32, 8, dtype=dtype, window=window,
                           sinks=sinks, q_fp8=q8, device="cpu", seed=len(fmt) * 3 + (window or 1), block_m=16,
                           block_n=16, tma=True)
    tol = C.TOL[torch.float32] if dtype == torch.float32 else C.TOL[torch.bfloat16]
    assert case.err <= tol, case.line()


def test_prefill_tma_eligibility():
    from kvbench.kernels.prefill import tma_ok

    x = torch.randn(10, 4, 32)
    assert tma_ok(x) and tma_ok(x.to(torch.float8_e4m3fn))
    fused = torch.randn(10, 12, 32)  # q / k / v slices of one fused projection: rows strided, heads packed
    assert tma_ok(fused[:, 4:8]) and tma_ok(fused[:, :4])
    assert not tma_ok(torch.randn(10, 4, 48))  # head dim not a power of two
    assert not tma_ok(torch.randn(10, 4, 8).to(torch.float8_e4m3fn))  # rows of 8 bytes
    assert not tma_ok(torch.randn(10, 8, 32)[:, ::2])  # heads not packed along the row
    assert not tma_ok(torch.randn(10 * 4 * 32 + 1)[1:].view(10, 4, 32))  # start not 16-byte aligned
    assert not tma_ok(torch.randn(10, 4, 512))  # a box spans at most 256 elements
    gen = torch.Generator().manual_seed(0)
    kv, table = C._attn_inputs("nvfp4", [12], 2, 32, 8, "cpu", gen)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    sl = torch.tensor([12], dtype=torch.int32)
    k = torch.randn(4, 2, 32)
    with pytest.raises(ValueError, match="tma=True"):
        paged_prefill(torch.randn(4, 4, 32), k, k, cu, 4, PagedKV("nvfp4", **kv), table, sl,
                      opts=PrefillOptions(tma=True))
    kv, table = C._attn_inputs("bf16", [12], 2, 32, 8, "cpu", gen)
    with pytest.raises(ValueError, match=r"not met by q\)"):  # the message names the tensor that cannot be read
        paged_prefill(torch.randn(4, 8, 32)[:, ::2], k, k, cu, 4, PagedKV("bf16", **kv), table, sl,
                      opts=PrefillOptions(tma=True))
    with pytest.raises(ValueError, match="at most 256 rows"):
        paged_prefill(torch.randn(4, 4, 32), k, k, cu, 4, PagedKV("bf16", **kv), table, sl,
                      opts=PrefillOptions(tma=True, block_m=512))


def test_checker_fails_on_nan_and_wrong_values():
    ref = torch.randn(4, 8, dtype=torch.float64)
    assert C.rel_err(ref.float(), ref) < 1e-6
    bad = ref.clone()
    bad[0, 0] = float("nan")
    assert not C.Case("x", "nan", C.rel_err(bad, ref), 1.0).ok
    assert not C.Case("x", "off", C.rel_err(ref * 1.05, ref), 1e-2).ok


def test_decode_detects_a_wrong_scale():
    # the same run with a scale the kernel does not see must fail the tolerance
    gen = torch.Generator().manual_seed(0)
    kv, table = C._attn_inputs("fp8_e4m3", [20, 9], 2, 32, 8, "cpu", gen)
    q = torch.randn(2, 4, 32, generator=gen)
    seq = torch.tensor([20, 9], dtype=torch.int32)
    out = paged_decode(q, PagedKV("fp8_e4m3", **kv), table, seq, opts=DecodeOptions(block_n=16))
    kv2 = dict(kv, v_scale=kv["v_scale"] * 1.1)
    from kvbench.kernels.reference import decode_reference

    assert C.rel_err(out, decode_reference(q, PagedKV("fp8_e4m3", **kv), table, seq)) < 1e-3
    assert C.rel_err(out, decode_reference(q, PagedKV("fp8_e4m3", **kv2), table, seq)) > 5e-2


def test_default_num_splits():
    assert default_num_splits(64, 8, 8192, 132) == 1
    assert default_num_splits(1, 8, 32768, 132) == 33
    assert default_num_splits(1, 8, 16, 132) == 1
    assert default_num_splits(64, 8, 8192, 132, block_n=128, programs_per_sm=30) == 8
    assert default_num_splits(64, 8, 8192, 132, block_n=4096, programs_per_sm=30) == 2  # never more than tiles
    # nvfp4 fills its 4 resident programs per SM once (rounded down): 8 x 32768 at 8 kv heads takes 8 splits
    assert default_num_splits(8, 8, 32768, 132, block_n=128, fill=4) == 8
    assert default_num_splits(64, 8, 8192, 132, block_n=128, fill=4) == 1
    assert default_num_splits(1, 8, 1 << 20, 132, block_n=128, fill=4) == 64  # capped


def test_bad_input_is_rejected():
    gen = torch.Generator().manual_seed(0)
    kv, table = C._attn_inputs("bf16", [5], 2, 32, 8, "cpu", gen)
    q = torch.randn(1, 3, 32)
    seq = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode(q, PagedKV("bf16", **kv), table, seq)
    with pytest.raises(ValueError, match="int32"):
        paged_decode(torch.randn(1, 4, 32), PagedKV("bf16", **kv), table.long(), seq)
    with pytest.raises(ValueError, match="q_scale"):
        paged_decode(torch.randn(1, 4, 32).to(torch.float8_e4m3fn), PagedKV("bf16", **kv), table, seq)
    with pytest.raises(ValueError, match="int32"):
        cu = torch.tensor([0, 5])
        paged_prefill(torch.randn(5, 4, 32), torch.randn(5, 2, 32), torch.randn(5, 2, 32), cu, 5,
                      PagedKV("bf16", **kv), table, seq)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode(torch.randn(1, 4, 32), PagedKV("bf16", **kv), table, seq, attn=AttentionParams(sinks=torch.zeros(3)))
    with pytest.raises(ValueError, match="sm_scale must be positive"):
        cu = torch.tensor([0, 5], dtype=torch.int32)
        paged_prefill(torch.randn(5, 4, 32), torch.randn(5, 2, 32), torch.randn(5, 2, 32), cu, 5,
                      PagedKV("bf16", **kv), table, seq, attn=AttentionParams(sm_scale=0.0))


def test_prefill_launch_defaults_pick_the_prefix_tile(monkeypatch):
    # the GPU defaults use a larger key tile over the cached prefix than over the new tokens, except when the
    # caller says there is no prefix; an explicit block_n tiles both phases alike
    import kvbench.kernels.prefill as P

    seen = []

    class Capture:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_NP"], kw["num_warps"]))

    gpu = P.launch_defaults
    monkeypatch.setattr(P, "launch_defaults", lambda dev, d, *a: gpu("cuda", 128, *a))
    monkeypatch.setattr(P, "interpreting", lambda: False)
    monkeypatch.setattr(P, "_prefill_kernel", Capture())
    gen = torch.Generator().manual_seed(0)
    kv, table = C._attn_inputs("bf16", [40], 2, 32, 8, "cpu", gen)
    q, k = torch.randn(8, 4, 32), torch.randn(8, 2, 32)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    sl = torch.tensor([40], dtype=torch.int32)
    for kw in (dict(), dict(max_prefix_len=32), dict(max_prefix_len=0), dict(block_n=32)):
        paged_prefill(q, k, k, cu, 8, PagedKV("bf16", **kv), table, sl, opts=PrefillOptions(**kw))
    pre, plain = P._GPU_DEFAULTS[128]["prefix"], P._GPU_DEFAULTS[128]["plain"]
    bm, bn, bnp, nw = pre[:4]
    assert seen == [(bm, bn, bnp, nw), (bm, bn, bnp, nw), plain[:2] + plain[1:2] + plain[3:4], (bm, 32, 32, nw)]
    assert bnp > bn
    for bad in (dict(block_n_prefix=48), dict(block_m=8), dict(block_n=0)):
        with pytest.raises(ValueError, match="power of two"):
            paged_prefill(q, k, k, cu, 8, PagedKV("bf16", **kv), table, sl, opts=PrefillOptions(**bad))
    assert len(seen) == 4


def test_prefill_default_tiles_shrink_where_shared_memory_runs_out(monkeypatch):
    """Default tiles that a GPU cannot fit (Triton's OutOfResources at launch: head_dim 256 in float32, smaller
    GPUs) are retried smaller (a stage, then the prefix tile, ...) and remembered; the output is the
    reference's.  Tiles the caller chose are not changed: the error reaches the caller."""
    from triton.runtime.errors import OutOfResources

    import kvbench.kernels.prefill as P

    real, tried = P._launch_prefill, []

    def launch(*a):
        common = a[9]
        tried.append((common["num_stages"], common["BLOCK_NP"]))
        if common["num_stages"] > 1 or common["BLOCK_NP"] > 32:  # "this GPU" fits one stage of 32-key tiles
            raise OutOfResources(300000, 232448, "shared memory")
        return real(*a)

    monkeypatch.setattr(P, "_launch_prefill", launch)
    monkeypatch.setattr(P, "_SHRUNK", {})
    gen = torch.Generator().manual_seed(3)
    kv, table = C._attn_inputs("bf16", [40, 21], 2, 32, 8, "cpu", gen)
    q, k, v = torch.randn(9, 4, 32), torch.randn(9, 2, 32), torch.randn(9, 2, 32)
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    sl = torch.tensor([40, 21], dtype=torch.int32)
    out = paged_prefill(q, k, v, cu, 5, PagedKV("bf16", **kv), table, sl)
    ref = C.R.prefill_reference(q, k, v, cu, PagedKV("bf16", **kv), table, sl, AttentionParams())
    assert C.rel_err(out, ref) < 1e-3
    first = P.launch_defaults("cpu", 32)
    assert tried == [(first["num_stages"], first["block_n_prefix"]), (1, first["block_n_prefix"]), (1, 32)]
    assert len(P._SHRUNK) == 1
    tried.clear()
    paged_prefill(q, k, v, cu, 5, PagedKV("bf16", **kv), table, sl)
    assert tried == [(1, 32)]  # remembered: no failed launch the second time
    with pytest.raises(OutOfResources):
        paged_prefill(q, k, v, cu, 5, PagedKV("bf16", **kv), table, sl, opts=PrefillOptions(num_stages=2))


def test_prefill_nvfp4_prompts_only_take_the_plain_path(monkeypatch):
    """Prompts over an nvfp4 cache with ``max_prefix_len=0`` (the engine knows it): no cached value is read, so
    the kernel runs the plain path (no half-head split; phase 1 not compiled) and matches the reference; with the
    prefix unknown (None) the split path runs, as before.  Windows and a sliding first block included."""
    import kvbench.kernels.prefill as P

    seen, real = [], P._launch_prefill

    def spy(*a):
        seen.append((a[-1]["NO_PREFIX"], a[-2]))  # (the extra constexprs, the kernel's format code)
        return real(*a)

    monkeypatch.setattr(P, "_launch_prefill", spy)
    for launch in (dict(max_prefix_len=0), {}):
        case = C.check_prefill("nvfp4", [70, 1, 17], [0, 0, 0], 4, 2, 32, 8, device="cpu", seed=41, **launch)
        assert case.ok, case.line()
        case = C.check_prefill("nvfp4", [70, 9], [0, 0], 4, 2, 32, 8, window=20, sinks=True, device="cpu", seed=42,
                               **launch)
        assert case.ok, case.line()
    assert seen == [(True, 0), (True, 0), (False, 2), (False, 2)]


def test_prefill_launch_defaults_by_case(monkeypatch):
    # prompts read through tensor descriptors take 128-key tiles when long and 64-row blocks when short;
    # without descriptors (nvfp4, odd strides) or with a prefix the tables' other rows apply; the CPU
    # (interpreter) always gets the small tiles
    import kvbench.kernels.prefill as P

    monkeypatch.setattr(P, "interpreting", lambda: False)
    tab = {d: {c: dict(zip(P._LAUNCH, v)) for c, v in P._GPU_DEFAULTS[d].items()} for d in (64, 128)}
    assert P.launch_defaults("cuda", 128, 0, 8192, True) == tab[128]["tma"]
    assert P.launch_defaults("cuda", 128, 0, P._SHORT - 1, True) == tab[128]["tma_short"]
    assert P.launch_defaults("cuda", 128, 0, 8192, False) == tab[128]["plain"]
    assert P.launch_defaults("cuda", 128, None, 8192, True) == tab[128]["prefix_tma"]
    assert P.launch_defaults("cuda", 128, 7168, 1024, True) == tab[128]["prefix_tma"]
    assert P.launch_defaults("cuda", 128, 7168, 1024, False) == tab[128]["prefix"]
    assert tab[128]["prefix_tma"] == tab[128]["tma"] and tab[128]["prefix"]["block_n_prefix"] == 128
    assert P.launch_defaults("cuda", 64, 0, 4096, True) == tab[64]["tma"]
    assert P.launch_defaults("cpu", 128, 0, 8192, True) == dict(zip(P._LAUNCH, P._CPU_DEFAULTS))
    assert tab[128]["tma"]["block_n"] > tab[128]["prefix"]["block_n"]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "nvfp4"])
@pytest.mark.parametrize("window,sinks,q8,dtype", FEATURES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_prefill_prefix_workspace_matches_reference(fmt, window, sinks, q8, dtype, layout):
    # the prefix dequantized once into a float16 workspace: ragged prefixes (none, partial pages, whole
    # tiles), the workspace's pages of the cache's size, the same per-head scales as in registers
    case = C.check_prefill_workspace(fmt, [5, 40, 1, 19], [0, 23, 50, 32], 4, 2, 32, 8, dtype=dtype, window=window,
                                     sinks=sinks, q_fp8=q8, device="cpu", seed=len(fmt) * 13 + (window or 3),
                                     layout=layout, block_m=16, block_n=16)
    tol = C.TOL[torch.float32] if dtype == torch.float32 else C.TOL[torch.bfloat16]
    assert case.err <= tol, case.line()
    # both paths see the same dot operands, so they agree far more closely than either does with the reference
    ws_vs_reg = float(case.detail.rsplit(" ", 1)[1].rstrip(")"))
    assert ws_vs_reg <= tol / 4, case.line()


def test_prefill_prefix_workspace_in_sequence_groups(monkeypatch):
    # a cap below the batch's workspace: the extend runs in groups of sequences (here 2 + 2 + 1), one
    # workspace reused; a cap below one sequence's prefix keeps it in registers (auto) or is refused (forced)
    from kvbench.kernels import prefill as P

    per_seq = 7 * 8 * 2 * 32 * 2 * 2  # 7 pages of 8 tokens (max prefix 50), 2 kv heads, D 32, float16, K and V
    monkeypatch.setattr(P, "WORKSPACE_CAP_BYTES", 2 * per_seq + 1)
    assert P.workspace_plan(2, False, 50, 64, 5, 2, 32, 8, True).group == 2
    case = C.check_prefill_workspace("nvfp4", [5, 40, 1, 19, 7], [0, 23, 50, 32, 9], 4, 2, 32, 8,
                                     dtype=torch.float32, window=21, sinks=True, device="cpu", seed=5,
                                     block_m=16, block_n=16)
    assert case.err <= C.TOL[torch.float32], case.line()
    monkeypatch.setattr(P, "WORKSPACE_CAP_BYTES", per_seq - 1)
    assert P.workspace_plan(2, False, 50, 4096, 5, 2, 32, 8, None) is None
    assert P.workspace_plan(2, False, 50, 4096, 5, 2, 32, 8, True) is None
    with pytest.raises(ValueError, match="prefix_workspace=True"):
        C.check_prefill_workspace("nvfp4", [5, 40], [0, 50], 4, 2, 32, 8, dtype=torch.float32, device="cpu",
                                  block_m=16, block_n=16)


def test_prefill_workspace_plan_auto_rules(monkeypatch):
    from kvbench.kernels import prefill as P

    monkeypatch.setattr(P, "WORKSPACE_MIN_Q", {2: 256, 1: 1024})
    plan = P.workspace_plan
    assert plan(2, False, 7168, 1024, 4, 8, 128, 16, None).npp == 448  # nvfp4, enough new tokens
    assert plan(2, False, 7168, 255, 4, 8, 128, 16, None) is None  # too few new tokens: in registers
    assert plan(2, False, 7168, 16, 4, 8, 128, 16, True) is not None  # forced
    assert plan(2, False, None, 1024, 4, 8, 128, 16, None) is None  # unknown prefix: no workspace
    assert plan(2, False, 0, 1024, 4, 8, 128, 16, None) is None  # prompts only
    assert plan(1, True, 7168, 1024, 4, 8, 128, 16, None) is None  # e4m3 scores on the stored K
    assert plan(1, False, 7168, 1024, 4, 8, 128, 16, None) is not None  # fp8 converted per tile otherwise
    assert plan(1, False, 7168, 512, 4, 8, 128, 16, None) is None  # ... from 1024 new tokens
    assert plan(0, False, 7168, 1024, 4, 8, 128, 16, True) is None  # bf16: nothing to dequantize
    assert plan(2, False, 7168, 1024, 4, 8, 128, 16, False) is None

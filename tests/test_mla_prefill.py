"""MLA prefill/extend (Triton, CPU interpreter) against the non-absorbed float64 reference."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_mla_helpers import FORMATS, fill_cache, make_cache, mla_weights, poison, random_pages, rel_err  # noqa: E402
from kvbench.kernels.config import MLAPrefillOptions  # noqa: E402
from kvbench.kernels.mla import absorb_query, unabsorb_output  # noqa: E402
from kvbench.kernels.mla_prefill import mla_prefill  # noqa: E402
from kvbench.kernels.mla_reference import quantize_absorbed_query, ref_prefill  # noqa: E402

H, NOPE, VD = 4, 16, 16


def _run(kv_dtype, prefix, new, seed, rank=64, rope=32, page=4, dtype=torch.float32, block_m=16, heads_per_block=4, block_n=16,
         q_fp8=False, **launch):
    gen = torch.Generator().manual_seed(seed)
    lens = [p + n for p, n in zip(prefix, new)]
    cache = make_cache(kv_dtype, rank, rope, num_pages=sum(math.ceil(max(n, 1) / page) for n in lens) + 2, page_size=page)
    pt = random_pages(lens, page, cache.num_pages, gen)
    fill_cache(cache, pt, prefix, gen)  # only the prefix is cached: the kernel must not read new slots
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.zeros(len(new) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(new), 0)
    t = int(cu[-1])
    w_uk, w_uv = mla_weights(H, NOPE, VD, rank, gen)
    q_nope = torch.randn(t, H, NOPE, generator=gen)
    q_pe = torch.randn(t, H, rope, generator=gen)
    c_new = torch.randn(t, rank, generator=gen) * 2
    k_new = torch.randn(t, rope, generator=gen) * 2
    sm = 1.0 / math.sqrt(NOPE + rope)
    opts = MLAPrefillOptions(block_m=block_m, heads_per_block=heads_per_block, block_n=block_n, **launch)
    if q_fp8:  # e4m3 absorbed query; the reference runs in latent space on the same (dequantized) query
        ql8, qp8, qs = quantize_absorbed_query(absorb_query(q_nope, w_uk), q_pe)
        out = poison(torch.empty(t, H, rank, dtype=torch.bfloat16))
        o_lat = mla_prefill(ql8, qp8, c_new.to(dtype), k_new.to(dtype), cache, pt, seq_lens, cu, sm, q_scale=qs,
                            out=out, opts=opts)
        eye = torch.eye(rank)[None].expand(H, rank, rank)
        ref = ref_prefill(ql8.double() * qs.double(), qp8.double() * qs.double(), c_new.to(dtype), k_new.to(dtype), cache,
                          pt, seq_lens, cu, eye, eye, sm)
        return rel_err(o_lat, ref)
    out = poison(torch.empty(t, H, rank, dtype=dtype))
    o_lat = mla_prefill(absorb_query(q_nope, w_uk).to(dtype), q_pe.to(dtype), c_new.to(dtype), k_new.to(dtype), cache, pt,
                        seq_lens, cu, sm, out=out, opts=opts)
    got = unabsorb_output(o_lat.double(), w_uv.double())
    ref = ref_prefill(q_nope, q_pe, c_new.to(dtype), k_new.to(dtype), cache, pt, seq_lens, cu, w_uk, w_uv, sm)
    return rel_err(got, ref)


@pytest.mark.parametrize("workspace", [False, None])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_extend_ragged_matches_reference(kv_dtype, workspace):
    # Extend over a quantized prefix; a sequence with no new tokens; a fresh prefill; unaligned sizes.  The prefix in
    # registers, and the default (the prefix workspace for fp8 / nvfp4).
    err = _run(kv_dtype, prefix=[13, 8, 0, 21], new=[7, 0, 19, 1], seed=60 + FORMATS.index(kv_dtype),
               prefix_workspace=workspace)
    assert err < 1e-5, err


class _CountLaunches:
    """Stands in for a jitted kernel: counts launches (with their grids) and runs the real one."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "nvfp4"])
def test_prefix_workspace_in_groups(kv_dtype, monkeypatch):
    """The prefix dequantized once into the workspace, a few sequences at a time (a small ``workspace_bytes``), and
    when it is used: by default whenever a sequence's rows fit the budget; not when asked not to."""
    import kvbench.kernels.mla_prefill as P

    counter = _CountLaunches(P._dequant_prefix)
    monkeypatch.setattr(P, "_dequant_prefix", counter)
    prefix, new = [13, 8, 0, 21, 30], [7, 2, 19, 1, 16]
    # 32-bit compute, rank 64 + rope 32: 384 bytes per row; a sequence's rows: the page table's width in tokens
    seq = max(math.ceil((p + n) / 4) for p, n in zip(prefix, new)) * 4 * 96 * 4
    assert _run(kv_dtype, prefix, new, seed=90, prefix_workspace=True, workspace_bytes=2 * seq + 5) < 1e-5
    assert [g[0] for g in counter.grids] == [2, 2, 1]  # three fills of at most two sequences
    counter.grids.clear()
    assert _run(kv_dtype, prefix, new, seed=91) < 1e-5  # default: one fill
    assert [g[0] for g in counter.grids] == [5]
    counter.grids.clear()
    assert _run(kv_dtype, prefix, [1, 1, 1, 1, 1], seed=92) < 1e-5  # one new token each: still the workspace
    assert [g[0] for g in counter.grids] == [5]
    counter.grids.clear()
    assert _run(kv_dtype, prefix, new, seed=93, prefix_workspace=False) < 1e-5
    assert _run(kv_dtype, prefix, new, seed=93, workspace_bytes=seq - 1) < 1e-5  # a sequence does not fit: registers
    assert counter.grids == []
    with pytest.raises(ValueError, match="exceeds workspace_bytes"):
        _run(kv_dtype, prefix, new, seed=94, prefix_workspace=True, workspace_bytes=seq - 1)


def test_prefix_workspace_refusals():
    with pytest.raises(ValueError, match="fp8 / nvfp4 caches"):
        _run("bf16", [5], [3], seed=95, prefix_workspace=True)
    with pytest.raises(ValueError, match="exclude each other"):
        _run("fp8_e4m3", [5], [3], seed=96, q_fp8=True, prefix_workspace=True, fp8_scores=True)


def test_prefill_head_grouping_variants():
    # Rows = tokens x heads: one head per row block, and all heads with many tokens.
    assert _run("fp8_e4m3", [5, 17], [9, 12], seed=70, block_m=16, heads_per_block=1) < 1e-5
    assert _run("nvfp4", [5, 17], [9, 12], seed=71, block_m=32, heads_per_block=8) < 1e-5


@pytest.mark.parametrize("workspace", [False, True])
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "nvfp4", "fp8_e5m2"])
def test_prefill_fp8_query(kv_dtype, workspace):
    """e4m3 queries with q_scale (converted to half precision before the launch): against the float64
    latent-space prefill of the same query; the own-token keys stay in float32.  Prefix in registers or in the
    workspace."""
    assert _run(kv_dtype, [13, 0, 21], [7, 19, 1], seed=75, q_fp8=True, prefix_workspace=workspace) < 5e-3


def test_prefill_default_launch_and_tiles_across_pages():
    """The per-format defaults (64-token tiles over 4-token pages here) and explicit 128-token tiles, which an
    nvfp4 latent refuses (wrong on the GPU with Triton 3.6, docs/mla.md)."""
    for i, f in enumerate(("bf16", "fp8_e4m3", "nvfp4")):  # float32 compute
        assert _run(f, [70, 5], [9, 40], seed=76 + i, block_m=None, heads_per_block=None, block_n=None) < 1e-5
        if f == "nvfp4":  # refused in registers; the workspace is read as a 16-bit cache
            with pytest.raises(ValueError, match="block_n above 64"):
                _run(f, [300, 70], [9, 40], seed=79 + i, block_n=128, prefix_workspace=False)
            assert _run(f, [300, 70], [9, 40], seed=79 + i, block_n=128) < 1e-5
        else:
            assert _run(f, [300, 70], [9, 40], seed=79 + i, block_n=128) < 1e-5


def test_prefill_fp8_scores_on_the_stored_prefix():
    """e4m3 queries over an e4m3 prefix: the scores as fp8 dots on the stored tiles (the default at 64-row
    tiles, or asked at 16 rows) and the converted path, against the float64 latent-space reference."""
    args = ("fp8_e4m3", [13, 0, 70], [7, 19, 9])
    for kw in (dict(block_m=64, prefix_workspace=False), dict(fp8_scores=True), dict(fp8_scores=False, prefix_workspace=False)):
        assert _run(*args, seed=84, q_fp8=True, **kw) < 5e-3, kw
    with pytest.raises(ValueError, match="fp8_scores"):
        _run("fp8_e4m3", [5], [3], seed=85, fp8_scores=True)
    with pytest.raises(ValueError, match="fp8_scores"):
        _run("fp8_e5m2", [5], [3], seed=85, q_fp8=True, fp8_scores=True)


@pytest.mark.parametrize("workspace", [False, True])
def test_prefill_deepseek_latent_dims_half(workspace):
    assert _run("fp8_e5m2", [20], [11], seed=72, rank=512, rope=64, page=16, dtype=torch.float16,
                prefix_workspace=workspace) < 5e-3


def test_prefill_rejects_bad_input():
    cache = make_cache("bf16")
    pt = torch.zeros(1, 4, dtype=torch.int32)
    sl = torch.tensor([5], dtype=torch.int32)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    ql, qp, c, k = torch.randn(3, H, 64), torch.randn(3, H, 32), torch.randn(3, 64), torch.randn(3, 32)
    with pytest.raises(ValueError, match="c_kv"):
        mla_prefill(ql, qp, c[:2], k, cache, pt, sl, cu, 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        mla_prefill(ql, qp, c, k, cache, pt, sl, cu.long(), 0.1)
    with pytest.raises(ValueError, match="q_pe"):
        mla_prefill(ql, qp.double(), c, k, cache, pt, sl, cu, 0.1)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_prefix_split_matches_reference(kv_dtype, monkeypatch):
    """The prefix split over programs, partial outputs merged by log-sum-exp: 2, 3 and 7 splits (so some
    splits see no prefix key: the 8-token prefix, the sequence with none), in registers and through the
    workspace; the merge runs once per call."""
    import kvbench.kernels.mla_prefill as P
    from kvbench.kernels import mla_decode as D

    merges = _CountLaunches(D._mla_decode_merge)
    monkeypatch.setattr(D, "_mla_decode_merge", merges)
    prefix, new = [13, 8, 0, 70], [7, 2, 19, 1]
    for i, splits in enumerate((2, 3, 7)):
        for ws in ((False,) if kv_dtype == "bf16" else (False, True)):
            err = _run(kv_dtype, prefix, new, seed=100 + i, num_splits=splits, prefix_workspace=ws)
            assert err < 1e-5, (splits, ws, err)
    assert len(merges.grids) == 3 * (1 if kv_dtype == "bf16" else 2)
    assert P.default_num_splits(8, 16384, 64, 132, 1 << 20) == 16  # few programs: about one per SM
    assert P.default_num_splits(200, 16384, 64, 132, 1 << 20) == 1
    assert P.default_num_splits(1, 300, 64, 132, 1 << 20) == 1  # never splits shorter than four tiles
    assert P.default_num_splits(1, 1 << 20, 64, 132, 200 << 20) == 1  # the partial outputs' memory bound


def test_prefix_split_with_fp8_queries_and_workspace_groups():
    """e4m3 queries (fp8 score dots on the stored prefix, or the workspace in fill groups) with the prefix split."""
    for kw in (dict(fp8_scores=True), dict(prefix_workspace=True, workspace_bytes=2 * 6 * 4 * 96 * 4 + 1)):
        assert _run("fp8_e4m3", [13, 0, 21], [7, 19, 1], seed=110, q_fp8=True, num_splits=3, **kw) < 5e-3, kw
    with pytest.raises(ValueError, match="num_splits"):
        _run("fp8_e4m3", [5], [3], seed=111, num_splits=0)

"""Absorbed MLA decode (Triton, CPU interpreter) against the non-absorbed float64 reference."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_mla_helpers import FORMATS, fill_cache, make_cache, mla_weights, poison, random_pages, rel_err
from kvbench.kernels.config import MLADecodeOptions
from kvbench.kernels.mla import absorb_query, unabsorb_output
from kvbench.kernels.mla_decode import mla_decode
from kvbench.kernels.mla_reference import ref_decode

H, NOPE, VD = 4, 16, 16


def _run(kv_dtype, lens, seed, rank=64, rope=32, page=4, num_splits=None, dtype=torch.float32, q_fp8=False, block_n=16,
         **launch):
    gen = torch.Generator().manual_seed(seed)
    cache = make_cache(kv_dtype, rank, rope, num_pages=sum(math.ceil(n / page) for n in lens) + 3, page_size=page)
    pt = random_pages(lens, page, cache.num_pages, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    fill_cache(cache, pt, lens, gen)
    w_uk, w_uv = mla_weights(H, NOPE, VD, rank, gen)
    b = len(lens)
    q_nope = torch.randn(b, H, NOPE, generator=gen)
    q_pe = torch.randn(b, H, rope, generator=gen)
    sm = 1.0 / math.sqrt(NOPE + rope)
    q_lat = absorb_query(q_nope, w_uk)
    kw = dict(launch)
    q_scale = None
    if q_fp8:
        qs = torch.tensor([0.05])
        ql8 = (q_lat / qs).clamp(-448, 448).to(torch.float8_e4m3fn)
        qp8 = (q_pe / qs).clamp(-448, 448).to(torch.float8_e4m3fn)
        # The reference sees exactly the fp8 query the kernel sees (fp8 Q is lossy on purpose).
        q_lat_in, q_pe_in = ql8, qp8
        q_scale = qs
        q_pe = qp8.float() * qs
        q_lat = ql8.float() * qs
    else:
        q_lat_in, q_pe_in = q_lat.to(dtype), q_pe.to(dtype)
    out = poison(torch.empty(b, H, rank, dtype=torch.bfloat16 if q_fp8 else dtype))
    o_lat = mla_decode(q_lat_in, q_pe_in, cache, pt, seq_lens, sm, q_scale=q_scale, out=out,
                       opts=MLADecodeOptions(num_splits=num_splits, block_n=block_n, **kw))
    assert o_lat.data_ptr() == out.data_ptr()
    got = unabsorb_output(o_lat.double(), w_uv.double())
    # Non-absorbed reference on the query the kernel received, expressed back in nope space is not
    # possible (W_UK is not invertible), so the reference takes q_nope and the absorbed q_lat is checked
    # to equal W_UKᵀ q_nope (it does by construction above); for fp8 queries the reference runs in the
    # latent space directly with identity up-projections.
    if q_fp8:
        eye = torch.eye(rank)[None].expand(H, rank, rank)
        ref_lat = ref_decode(q_lat, q_pe, cache, pt, seq_lens, eye, eye, sm)
        return rel_err(o_lat, ref_lat)
    ref = ref_decode(q_nope, q_pe, cache, pt, seq_lens, w_uk, w_uv, sm)
    return rel_err(got, ref)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_decode_matches_reference_ragged(kv_dtype):
    # Ragged batch: page-aligned, unaligned, a 1-token sequence; more splits than some need.
    err = _run(kv_dtype, [37, 1, 70, 16], seed=FORMATS.index(kv_dtype), num_splits=3)
    assert err < 1e-5, err


def test_decode_default_splits_and_single_split():
    for splits in (None, 1):
        assert _run("fp8_e4m3", [50, 9], seed=7, num_splits=splits) < 1e-5
    # 11 splits of 32 tokens: the merge takes them 8 at a time (a full block and a partial one); the
    # 300-token sequence fills 10 of them, the 9-token one a single split
    assert _run("fp8_e4m3", [300, 9], seed=8, num_splits=11) < 1e-5
    # more than 64 splits (the merge's fixed maximum width): 70 asked, the last ones see no tokens
    assert _run("fp8_e4m3", [1100, 9], seed=9, num_splits=70) < 1e-5  # 69 of them hold tokens
    with pytest.raises(ValueError, match="num_splits"):
        _run("fp8_e4m3", [30], seed=10, num_splits=0)


def test_decode_deepseek_latent_dims():
    # kv_lora_rank 512 + rope 64 (the real 576-wide row, latent and rope tiled separately).
    assert _run("nvfp4", [21, 40], seed=3, rank=512, rope=64, page=16, num_splits=2, block_n=16) < 1e-5
    assert _run("bf16", [33], seed=4, rank=512, rope=64, page=16, num_splits=2, block_n=16) < 1e-5


def test_decode_half_compute():
    # fp16 queries and probabilities, fp16-level agreement.  (bf16 compute is checked on the GPU by
    # kvbench.tools.mla_check: the triton 3.9 interpreter's tl.dot multiplies bf16 operands' raw bits.)
    assert _run("fp8_e4m3", [45, 12], seed=11, dtype=torch.float16) < 5e-3
    assert _run("nvfp4", [20], seed=13, dtype=torch.float16) < 5e-3


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_decode_fp8_units_in_column_chunks(chunks):
    # The fp8 latent as 16-bit units, loaded and used in 1 / 2 / 4 column chunks, on tiles that lie in one
    # page (one page-table entry per tile, two tiles per page) and on tiles that span pages; unused pages are NaN-poisoned.
    for page, block_n, lens in ((32, 16, [37, 5, 64]), (8, 16, [29, 70])):
        err = _run("fp8_e4m3", lens, seed=20 + chunks + page, rank=512, rope=64, page=page, num_splits=2,
                   block_n=block_n, dtype=torch.float16, units16=True, chunks=chunks)
        assert err < 5e-3, (chunks, page, err)


def test_decode_rejects_bad_chunks():
    with pytest.raises(ValueError, match="chunks"):
        _run("fp8_e4m3", [5], seed=1, dtype=torch.float16, chunks=3)


def test_decode_fp8_query():
    assert _run("fp8_e4m3", [30, 18], seed=12, q_fp8=True) < 3e-2


def test_decode_rejects_bad_input():
    cache = make_cache("fp8_e4m3")
    pt = torch.zeros(2, 4, dtype=torch.int32)
    sl = torch.tensor([3, 4], dtype=torch.int32)
    q = torch.randn(2, H, 64)
    qp = torch.randn(2, H, 32)
    with pytest.raises(ValueError, match="q_lat"):
        mla_decode(torch.randn(2, H, 48), qp, cache, pt, sl, 0.1)
    with pytest.raises(ValueError, match="q_pe"):
        mla_decode(q, torch.randn(2, H, 16), cache, pt, sl, 0.1)
    with pytest.raises(ValueError, match="page_table"):
        mla_decode(q, qp, cache, pt.long(), sl, 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        mla_decode(q, qp, cache, pt, sl[:1], 0.1)
    with pytest.raises(ValueError, match="fp8 queries"):
        mla_decode(q.to(torch.float8_e4m3fn), qp.to(torch.float8_e4m3fn), cache, pt, sl, 0.1)


def test_wgmma_kernel_applicability_and_refusals():
    """The Hopper kernel's conditions, each reason on its own (on the CPU every one but the device can be
    checked); by default ``mla_decode`` falls back to the Triton kernel where it does not apply (the tests above
    at 40 heads), and an explicit request raises with the reason."""
    from kvbench.kernels import mla_decode_wg as wg

    c = make_cache("bf16", rank=512, rope=64, num_pages=2, page_size=64)
    c8 = make_cache("fp8_e4m3", rank=512, rope=64, num_pages=2, page_size=64)
    qb, qpb = torch.randn(2, 64, 512).bfloat16(), torch.randn(2, 64, 64).bfloat16()
    q8, qp8 = qb.to(torch.float8_e4m3fn), qpb.to(torch.float8_e4m3fn)
    assert wg.unsupported(c, qb, False) == "needs an sm_90 (Hopper) GPU"
    assert wg.unsupported(c8, q8, True) == "needs an sm_90 (Hopper) GPU"
    assert "fp8_e5m2 latent with bf16 queries" in wg.unsupported(c, q8, False)
    # an e4m3 latent takes bf16 queries (split into two e4m3 terms) or e4m3 queries, not fp16 ones; an e5m2
    # latent the split bf16 queries only
    assert wg.unsupported(c8, qb, False) == wg.unsupported(c8, q8, False) == "needs an sm_90 (Hopper) GPU"
    assert "bf16 or e4m3 queries" in wg.unsupported(c8, qb.half(), False)
    c5 = make_cache("fp8_e5m2", rank=512, rope=64, num_pages=2, page_size=64)
    assert wg.unsupported(c5, qb, False) == "needs an sm_90 (Hopper) GPU"
    assert "fp8_e5m2 latent with bf16 queries" in wg.unsupported(c5, q8, False)
    assert "needs an fp8_e4m3 latent" in wg.unsupported(make_cache("nvfp4", rank=512, rope=64, num_pages=2,
                                                                   page_size=64), qb, True)
    assert "latent with bf16 queries" in wg.unsupported(make_cache("nvfp4", rank=512, rope=64, num_pages=2,
                                                                   page_size=64), qb, False)
    assert "fp8_e4m3 latent and e4m3 queries" in wg.unsupported(c, qb, True)
    assert "fp8_e4m3 latent and e4m3 queries" in wg.unsupported(c8, qb, True)
    assert "rank 512 and rope 64" in wg.unsupported(make_cache("bf16"), qb, False)
    assert "pages of 8, 16 or 32 tokens or a multiple of 64" in wg.unsupported(
        make_cache("bf16", rank=512, rope=64, page_size=4), qb, False)
    assert "pages of" in wg.unsupported(make_cache("bf16", rank=512, rope=64, num_pages=2, page_size=96), qb, False)
    for page in (8, 16, 32, 128):
        assert wg.unsupported(make_cache("bf16", rank=512, rope=64, num_pages=2, page_size=page), qb, False) == \
            "needs an sm_90 (Hopper) GPU"
    pt = torch.tensor([[0], [1]], dtype=torch.int32)
    sl = torch.tensor([5, 64], dtype=torch.int32)
    qs = torch.ones(1)
    with pytest.raises(ValueError, match="wgmma: needs an sm_90"):
        mla_decode(qb, qpb, c, pt, sl, 0.1, opts=MLADecodeOptions(wgmma=True))
    with pytest.raises(ValueError, match="fp8_pv needs e4m3 queries"):
        mla_decode(qb, qpb, c, pt, sl, 0.1, opts=MLADecodeOptions(fp8_pv=True))
    with pytest.raises(ValueError, match="fp8_pv needs e4m3 queries"):
        mla_decode(q8, qp8, c, pt, sl, 0.1, q_scale=qs, opts=MLADecodeOptions(fp8_pv=True))
    with pytest.raises(ValueError, match="fp8_pv runs the wgmma kernel"):
        mla_decode(q8, qp8, c8, pt, sl, 0.1, q_scale=qs, opts=MLADecodeOptions(fp8_pv=True, wgmma=False))
    with pytest.raises(ValueError, match="fp8_pv runs the wgmma kernel"):
        mla_decode(q8, qp8, c8, pt, sl, 0.1, q_scale=qs, opts=MLADecodeOptions(fp8_pv=True, fp8_scores=False))
    with pytest.raises(ValueError, match="fp8_pv: needs an sm_90"):
        mla_decode(q8, qp8, c8, pt, sl, 0.1, q_scale=qs, opts=MLADecodeOptions(fp8_pv=True))
    # the Triton kernel's tile options select it: asking for the Hopper kernel with one of them is an error
    with pytest.raises(ValueError, match="takes none of the Triton kernel's options: block_n, num_stages"):
        mla_decode(qb, qpb, c, pt, sl, 0.1, opts=MLADecodeOptions(wgmma=True, block_n=32, num_stages=2))
    with pytest.raises(ValueError, match="fp8_pv runs the Hopper kernel, which takes none .*: units16"):
        mla_decode(q8, qp8, c8, pt, sl, 0.1, q_scale=qs, opts=MLADecodeOptions(fp8_pv=True, units16=False))
    # the scores on a converted tile (q_split / fp8_scores off) are the Triton kernel's alone
    with pytest.raises(ValueError, match="takes none of the Triton kernel's options: q_split"):
        mla_decode(qb, qpb, c8, pt, sl, 0.1, opts=MLADecodeOptions(wgmma=True, q_split=False))
    with pytest.raises(ValueError, match="takes none of the Triton kernel's options: fp8_scores"):
        mla_decode(q8, qp8, c8, pt, sl, 0.1, q_scale=qs, opts=MLADecodeOptions(wgmma=True, fp8_scores=False))
    with pytest.raises(ValueError, match="wgmma: needs an sm_90"):  # the split query is the Hopper kernel's too
        mla_decode(qb, qpb, c8, pt, sl, 0.1, opts=MLADecodeOptions(wgmma=True, q_split=True))


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "nvfp4"])
@pytest.mark.parametrize("units16", [True, False], ids=["units", "bytes"])
def test_decode_latent_as_16bit_units_or_stored_type(kv_dtype, units16):
    # fp8 read as int16 pairs (even / odd tiles), nvfp4 as int16 units of four codes (quarter tiles), or
    # the tiles in their stored type; the DeepSeek row (512 + 64) and a small one; fp16 compute
    assert _run(kv_dtype, [21, 40, 1], seed=5, rank=512, rope=64, page=16, num_splits=2, block_n=16,
                dtype=torch.float16, units16=units16) < 5e-3
    assert _run(kv_dtype, [37, 9], seed=6, dtype=torch.float16, num_splits=3, units16=units16) < 5e-3
    # fp8 queries take the same paths
    assert _run(kv_dtype, [30, 7], seed=8, q_fp8=True, num_splits=2, units16=units16) < 2e-2


def test_default_num_splits_and_head_regimes():
    from kvbench.kernels.mla_decode import _defaults, default_num_splits

    assert default_num_splits(64, 1, 8192, 64, 132, per_sm=4) == 8  # 16 heads: ~4 programs per SM
    assert default_num_splits(64, 2, 8192, 64, 132, per_sm=3) == 3  # 128 heads in two 64-head groups
    assert default_num_splits(1, 1, 1024, 64, 132, per_sm=4) == 4  # never splits shorter than four tiles
    assert default_num_splits(256, 2, 8192, 64, 132) == 1
    assert default_num_splits(1, 1, 131072, 64, 132, per_sm=2) == 128  # one program row: up to 128 splits
    assert default_num_splits(2, 1, 131072, 64, 132, per_sm=2) == 64
    assert default_num_splits(1, 2, 131072, 64, 132, per_sm=3) == 64
    assert _defaults(1, 16)[0] and _defaults(2, 128)[0] and not _defaults(0, 16)[0]
    assert _defaults(0, 16)[1] == 16 and _defaults(0, 128)[1] == 64


def test_decode_defaults_many_heads_half_compute():
    # more than 32 heads: the 64-head tiles and the 16-bit-unit latent for fp8 / nvfp4 (no launch arguments)
    global H
    saved = H
    H = 40
    try:
        for i, kv_dtype in enumerate(("fp8_e4m3", "nvfp4", "bf16")):
            assert _run(kv_dtype, [33, 5], seed=20 + i, dtype=torch.float16, num_splits=None, block_n=None) < 5e-3
    finally:
        H = saved


def test_bench_mla_command_parses_its_options_and_needs_a_gpu():
    from typer.testing import CliRunner

    from kvbench.harness.cli import app

    r = CliRunner().invoke(app, ["bench", "mla", "--heads", "16", "--no-sweep", "--quick"])
    assert r.exit_code == 2 and "needs a CUDA device" in r.output, r.output  # options parsed; no GPU here
    r = CliRunner().invoke(app, ["bench", "mla", "--targets"])
    assert r.exit_code == 2 and "needs a CUDA device" in r.output, r.output
    r = CliRunner().invoke(app, ["bench", "mla", "--targets", "--stages"])
    assert r.exit_code == 2 and "give one" in r.output, r.output


def test_bench_mla_targets_option_runs_the_flashinfer_table(monkeypatch):
    """``kvbench bench mla --targets`` is ``mla_check --flashinfer`` (the 64 x 8192 table and the speed targets)."""
    from typer.testing import CliRunner

    from kvbench.harness.cli import app
    from kvbench.tools import mla_check

    seen = []
    monkeypatch.setattr(mla_check, "main", lambda argv: seen.append(argv) or 0)
    r = CliRunner().invoke(app, ["bench", "mla", "--targets", "--heads", "16,128", "--out", "d"])
    assert r.exit_code == 0, r.output
    assert seen == [["--out", "d", "--heads", "16,128", "--flashinfer"]]


def test_decode_query_split_over_e4m3_latent():
    """bf16 queries over an e4m3 latent at more than 32 heads: by default the scores are two fp8 dots of an
    exact split of each query row on the stored latent; against the reference, and against the
    converted-latent path (``q_split=False``) on the same inputs."""
    global H
    saved = H
    H = 40
    try:
        split = _run("fp8_e4m3", [33, 5, 70], seed=31, dtype=torch.bfloat16, block_n=None)
        conv = _run("fp8_e4m3", [33, 5, 70], seed=31, dtype=torch.bfloat16, block_n=None, q_split=False)
        assert split < 1e-2 and conv < 1e-2, (split, conv)
        assert abs(split - conv) < 2e-3, (split, conv)
        H = 4  # explicit split at few heads
        assert _run("fp8_e4m3", [19, 40], seed=32, dtype=torch.bfloat16, q_split=True, num_splits=2) < 1e-2
        with pytest.raises(ValueError, match="q_split"):
            _run("fp8_e5m2", [19], seed=33, dtype=torch.bfloat16, q_split=True)
        with pytest.raises(ValueError, match="q_split"):
            _run("fp8_e4m3", [19], seed=34, dtype=torch.float16, q_split=True)
    finally:
        H = saved


def test_decode_units_request_keeps_the_units_path_at_many_heads():
    global H
    saved = H
    H = 40
    try:  # an explicit units16 keeps the 16-bit-unit path (no split); both together are refused
        assert _run("fp8_e4m3", [33, 5], seed=35, dtype=torch.bfloat16, block_n=None, units16=True) < 1e-2
        with pytest.raises(ValueError, match="excludes units16"):
            _run("fp8_e4m3", [33], seed=36, dtype=torch.bfloat16, units16=True, q_split=True)
    finally:
        H = saved


def test_decode_fp8_query_scores_as_fp8_dots():
    """e4m3 queries over an e4m3 latent: ``fp8_scores`` (the default above 32 heads) computes the scores as
    fp8 dots on the stored tile; same result as the converted path, within float32 summation order."""
    global H
    saved = H
    H = 40
    try:
        dots = _run("fp8_e4m3", [33, 5, 70], seed=41, q_fp8=True, block_n=None)
        conv = _run("fp8_e4m3", [33, 5, 70], seed=41, q_fp8=True, block_n=None, fp8_scores=False)
        assert dots < 1e-2 and conv < 1e-2, (dots, conv)
        assert abs(dots - conv) < 1e-3, (dots, conv)
        H = 4  # explicit at few heads, over two splits
        assert _run("fp8_e4m3", [19, 40], seed=42, q_fp8=True, fp8_scores=True, num_splits=2) < 1e-2
        with pytest.raises(ValueError, match="fp8_scores"):
            _run("fp8_e5m2", [19], seed=43, q_fp8=True, fp8_scores=True)
        with pytest.raises(ValueError, match="fp8_scores"):
            _run("fp8_e4m3", [19], seed=44, dtype=torch.bfloat16, fp8_scores=True)
        with pytest.raises(ValueError, match="excludes units16"):
            _run("fp8_e4m3", [19], seed=45, q_fp8=True, fp8_scores=True, units16=True)
    finally:
        H = saved


@pytest.mark.parametrize("kv_dtype", ["fp8_e5m2", "nvfp4"])
def test_decode_fp8_query_other_formats(kv_dtype):
    """e4m3 queries over the other formats take the converted path (queries in half precision).  A bf16
    latent makes the dots bf16, which the CPU interpreter computes wrongly (docs/mla.md); the GPU check
    (``mla_check``, "decode fp8 q") covers it."""
    assert _run(kv_dtype, [30, 18, 3], seed=46, q_fp8=True) < 3e-2


def test_latent_space_reference_and_fp8_query_table():
    """The GPU check's float64 latent-space decode (``ref_decode_latent``) equals the non-absorbed reference
    with identity up-projections; the report renders the e4m3-query rows against bf16."""
    from kvbench.tools import mla_check as MC
    from kvbench.tools.mla_report import report_md
    from kvbench.kernels.mla_reference import quantize_absorbed_query, ref_decode_latent

    gen = torch.Generator().manual_seed(47)
    lens, rank, rope = [9, 70], 64, 32
    cache = make_cache("fp8_e4m3", rank, rope, num_pages=sum(math.ceil(n / MC.PAGE) for n in lens) + 2, page_size=MC.PAGE)
    pt = random_pages(lens, MC.PAGE, cache.num_pages, gen)
    fill_cache(cache, pt, lens, gen)
    sl = torch.tensor(lens, dtype=torch.int32)
    ql, qp = torch.randn(2, 3, rank, generator=gen), torch.randn(2, 3, rope, generator=gen)
    eye = torch.eye(rank)[None].expand(3, rank, rank)
    got = ref_decode_latent(ql, qp, cache, pt, sl, 0.1)
    assert rel_err(got, ref_decode(ql, qp, cache, pt, sl, eye, eye, 0.1)) < 1e-12
    ql8, qp8, qs = quantize_absorbed_query(ql, qp)
    assert ql8.dtype == torch.float8_e4m3fn and float(torch.cat((ql8, qp8), -1).float().abs().max()) == 448.0
    row = dict(heads=128, batch=64, ctx=8192, GBps=1000.0, TFLOPs=100.0)
    rep = {"device": "d", "torch": "t", "triton": "tr", "date": "x", "copy_GBps": 2000.0, "checks": {}, "tuning": {},
           "append": [], "decode": [dict(row, format="bf16", us=610.0, graph_us=600.0, query="bf16"),
                                    dict(row, format="fp8_e4m3", us=490.0, graph_us=480.0, query="e4m3")]}
    md = report_md(rep)
    assert "| bf16 | 128 | 64 | 8192 | 610.0 | 600.0 | 1000 | 50% | 100 |" in md, md
    assert "| fp8_e4m3 | 128 | 64 | 8192 | 490.0 | 480.0 | 1000 | 50% | 100 | 1.25x |" in md, md
    assert md.count("| fp8_e4m3 | 128 |") == 1  # not in the bf16-query table
    rep["prefill"] = [dict(format="nvfp4", query="e4m3", heads=16, batch=2, prefix=8192, new=256, us=1000.0, graph_us=900.0,
                           TFLOPs=150.0, prefix_read="workspace")]
    assert "| nvfp4 | e4m3 | workspace | 16 | 2 | 8192 | 256 | 1000.0 | 900.0 | 150 |" in report_md(rep)


def test_decode_pipeline_depth_defaults(monkeypatch):
    """The launch the defaults choose (the interpreter ignores stages, so the launch itself is recorded):
    fp8 at 16 heads and the paths that read the e4m3 latent as stored at many heads run five stages (two
    tile buffers, tests/test_kernels_compile.py); bf16 keeps its table entry; an explicit value wins."""
    from kvbench.kernels import mla_decode as D

    seen = []

    class Rec:
        def __getitem__(self, grid):
            return lambda *a, **k: seen.append(k)

    monkeypatch.setattr(D, "_mla_decode_split", Rec())
    monkeypatch.setattr(D, "_mla_decode_merge", Rec())

    def launch(kv_dtype, heads, q_dtype=torch.bfloat16, **kw):
        seen.clear()
        cache = make_cache(kv_dtype, 512, 64, num_pages=4, page_size=16)  # DeepSeek's latent: four column chunks
        pt = torch.arange(4, dtype=torch.int32)[None]
        q = torch.zeros(1, heads, 512, dtype=q_dtype), torch.zeros(1, heads, 64, dtype=q_dtype)
        qs = torch.ones(1) if q_dtype == torch.float8_e4m3fn else None
        D.mla_decode(*q, cache, pt, torch.tensor([40], dtype=torch.int32), 0.1, q_scale=qs, opts=MLADecodeOptions(**kw))
        return seen[0]

    k = launch("fp8_e4m3", 16)
    assert k["num_stages"] == 5 and k["UNITS"] == 1 and k["CHUNKS"] == 4
    k = launch("fp8_e4m3", 64)
    assert k["Q_SPLIT"] and k["num_stages"] == D._STORED_FP8_STAGES == 5
    k = launch("fp8_e4m3", 64, q_dtype=torch.float8_e4m3fn)
    assert k["FP8_SCORES"] and k["num_stages"] == 5
    k = launch("fp8_e4m3", 64, units16=True)
    assert not k["Q_SPLIT"] and k["num_stages"] == D._defaults(1, 64)[4]
    assert launch("bf16", 16)["num_stages"] == D._defaults(0, 16)[4]
    assert launch("fp8_e4m3", 16, num_stages=2)["num_stages"] == 2


def test_stages_table_and_command():
    from typer.testing import CliRunner

    from kvbench.harness.cli import app
    from kvbench.tools.mla_report import stages_md

    rows = [{"format": "fp8_e4m3", "query": "bf16", "heads": 16, "stages": "default", "graph_us": 112.04, "diff": 0.0},
            {"format": "fp8_e4m3", "query": "bf16", "heads": 16, "stages": 3, "graph_us": 123.2, "diff": 2e-2},
            {"format": "bf16", "query": "bf16", "heads": 128, "stages": 3,
             "error": "OutOfResources: out of resource: shared memory"}]
    md = stages_md(rows).splitlines()
    assert md[0] == "| heads | format | query | default | 3 stages |"
    assert md[2] == "| 16 | fp8_e4m3 | bf16 | 112.0 | 123.2 (diff 2e-02) |"
    assert md[3] == "| 128 | bf16 | bf16 |  | OutOfResources |"
    r = CliRunner().invoke(app, ["bench", "mla", "--stages", "--heads", "16"])
    assert r.exit_code == 2 and "needs a CUDA device" in r.output, r.output


def test_sweep_stages_plumbing_on_cpu(monkeypatch):
    """``mla_check --stages`` end to end at a tiny shape under the interpreter (graph timing stubbed: no CUDA
    here): a row per case and depth, each output compared with the defaults', failures recorded as rows."""
    from kvbench.tools import mla_bench as M

    monkeypatch.setattr(M, "graph_time_us", lambda fn, ms=100: 2.0)
    rows = M.sweep_stages(torch.device("cpu"), torch.Generator().manual_seed(0), heads=(16,), stages=(3,), batch=1, ctx=32)
    assert [(r["format"], r["query"], r["stages"]) for r in rows] == [
        (f, "e4m3" if q8 else "bf16", s) for f, q8 in M.STAGE_CASES for s in ("default", 3)]
    assert all(r["diff"] < 1e-6 and r["graph_us"] == 2.0 for r in rows), rows
    real = M.mla_decode

    def refuse_three(*a, opts=MLADecodeOptions(), **k):
        if opts.num_stages == 3:
            raise RuntimeError("out of resource: shared memory")
        return real(*a, opts=opts, **k)

    monkeypatch.setattr(M, "mla_decode", refuse_three)
    rows = M.sweep_stages(torch.device("cpu"), torch.Generator().manual_seed(0), heads=(16,), stages=(3,), batch=1, ctx=32)
    assert all(("error" in r) == (r["stages"] == 3) for r in rows), rows

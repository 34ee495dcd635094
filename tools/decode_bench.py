"""Decode rows of ``kvbench bench kernels`` (``kernel_bench.py``): the Triton paged decode per format (tuned
over launch configurations, and at its defaults in the other page layout), against flashinfer's paged
decode (bf16 and fp8 KV, both layouts, when importable) and torch's ``scaled_dot_product_attention`` on
the dense bf16 problem of the same shape.  Each function is a generator of ``Row``: a row is printed as
soon as it is measured.  Decode bytes = KV read (block scales included) + q + out."""

from __future__ import annotations

from typing import Iterator, Optional

from kvbench.tools.common import Row, bench_formats, bench_us, fi_kv, is_plain, speedup

__all__ = ["BenchResults", "decode_case", "decode_rows", "flashinfer_decode_rows", "sdpa_decode_rows",
           "flashinfer_error", "sweep_decode", "check_variants", "TUNE_CONFIGS"]

# the launch configurations tried for every decode row (besides the defaults)
TUNE_CONFIGS = [dict(block_n=bn, num_splits=ns, num_warps=nw) for bn in (32, 64, 128, 256)
                for ns in (1, 2, 4, 8, 16) for nw in (4, 8)]


LONG_DECODE = (8, 32768)  # (batch, context) of the long-context decode rows (issue 28's second shape)


class BenchResults:
    """What the rows measured so far, for the anchors' speed-ups and the target table: copy bandwidth
    (GB/s); decode µs per (format, layout) (``dec``: the tuned rows of the chosen layout); the triton decode
    rows of that layout; flashinfer's best decode µs per format; prefill results; append results."""

    def __init__(self) -> None:
        self.copy = float("nan")
        self.dec: dict = {}
        self.dec_layout: dict = {}
        self.dec_rows: list = []
        self.dec_long: dict = {}  # format → % of copy bandwidth at the long shape (LONG_DECODE)
        # the chosen launch replayed from a CUDA graph (as the engine runs decode): format → % of copy at the
        # main shape / at the long shape, and µs at the main shape
        self.dec_graph: dict = {}
        self.dec_graph_us: dict = {}
        self.dec_long_graph: dict = {}
        self.fi: dict = {}
        self.pre: dict = {}
        self.app: dict = {}


def decode_case(fmt, batch, ctx, hq, hk, d, page, gen, layout="NHD"):
    """Random caches of ``batch`` sequences of ``ctx`` tokens in ``layout`` → (q, page table, seq lens,
    kv kwargs, bytes one decode step reads and writes)."""
    import torch

    from kvbench.tools.kernel_check import make_cache, random_page_table

    lens = [ctx] * batch
    num_pages = batch * (ctx // page) + 2
    kc, kbs, ks, _ = make_cache(fmt, num_pages, page, hk, d, "cuda", gen, layout)
    vc, vbs, vs, _ = make_cache(fmt, num_pages, page, hk, d, "cuda", gen, layout)
    table = random_page_table(lens, page, num_pages, gen, "cuda")
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kv = dict(k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs, k_block_scale=kbs, v_block_scale=vbs)
    nbytes = sum(t.numel() * t.element_size() for t in (kc, vc, kbs, vbs) if t is not None) * (
        batch * ctx / ((num_pages + 1) * page)) + 2 * q.numel() * 2
    return q, table, seq, kv, nbytes


def _shape(batch, ctx, hq, hk, d, page) -> str:
    return f"B{batch}x{ctx} {hq}/{hk} D{d} p{page}"


def decode_rows(res: BenchResults, fmt: str, *, batch=64, ctx=8192, hq=32, hk=8, d=128, page=16, tune=True,
                layout="HND", main=True, seed=0) -> Iterator[Row]:
    """The Triton decode of ``fmt``: the fastest of the defaults and ``TUNE_CONFIGS`` (``tune``), or the
    defaults.  ``main``: a row of the chosen layout (kept for the targets)."""
    import torch

    from kvbench.kernels import DecodeOptions, PagedKV
    from kvbench.kernels import paged_decode

    gen = torch.Generator().manual_seed(seed)
    q, table, seq, kv, nbytes = decode_case(fmt, batch, ctx, hq, hk, d, page, gen, layout)
    pkv = PagedKV(fmt, **kv)
    out = torch.empty_like(q)
    timed, failed = [], 0
    for cfg in [dict()] + (TUNE_CONFIGS if tune else []):
        opts = DecodeOptions(**cfg)
        try:
            t = bench_us(lambda: paged_decode(q, pkv, table, seq, out=out, opts=opts))
            timed.append((t, cfg))
        except Exception:  # noqa: BLE001 - a config that does not compile (registers, shared memory) is skipped
            failed += 1
    name = f"decode triton {fmt} {_shape(batch, ctx, hq, hk, d, page)} {layout}"
    if not timed:
        del kv
        yield Row(f"{name} (every config failed)", float("nan"))
        return
    t, cfg = min(timed, key=lambda x: x[0])
    # the same launch from a CUDA graph: the kernels' time without the host's launch work, which an eager
    # timing includes wherever the host takes longer per call than the GPU (small or split launches)
    opts = DecodeOptions(**cfg)
    tg = bench_us(lambda: paged_decode(q, pkv, table, seq, out=out, opts=opts), graph=True)
    del kv, pkv
    torch.cuda.empty_cache()
    gb = nbytes / (t * 1e-6) / 1e9
    pct_g = 100 * nbytes / (tg * 1e-6) / 1e9 / res.copy
    dflt = [td for td, c in timed if not c]
    note = (f"best of {len(timed)}: {cfg or 'defaults'}" + (f"; defaults {dflt[0]:.1f} us" if dflt else "")
            + (f"; {failed} configs did not compile" if failed else "")) if tune else "defaults"
    if fmt == "nvfp4" and d == 128 and page % 16 == 0 and hq // hk <= 16:
        note += " (defaults: the explicit-layout kernel, kernels/decode_nv4.py)"
    note += f"; graph replays {tg:.1f} us, {pct_g:.0f}% of copy"
    row = Row(name, t, gb, 100 * gb / res.copy, note=note)
    if (batch, ctx) == LONG_DECODE and not main:  # the long shape's own record: not an anchor's comparison
        res.dec_long[fmt] = 100 * gb / res.copy
        res.dec_long_graph[fmt] = pct_g
        yield row
        return
    res.dec_layout[(fmt, layout)] = t
    if main:
        res.dec[fmt] = t
        res.dec_graph[fmt] = pct_g
        res.dec_graph_us[fmt] = tg
        res.dec_rows.append(row)
    yield row


def flashinfer_error() -> Optional[str]:
    """Why flashinfer cannot be an anchor here (None when it imports)."""
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: no anchor
        return f"{type(e).__name__}: {e}"[:100]
    return None


def flashinfer_decode_rows(res: BenchResults, fmt: str, layout: str, *, batch=64, ctx=8192, hq=32, hk=8, d=128,
                           page=16) -> Iterator[Row]:
    """flashinfer's paged decode on the same problem as ``decode_rows`` (without and with tensor cores);
    the kvbench column against the Triton row of the same format and layout."""
    import flashinfer
    import torch

    gen = torch.Generator().manual_seed(1)
    q, table, seq, kv, nbytes = decode_case(fmt, batch, ctx, hq, hk, d, page, gen, layout)
    npg = ctx // page
    indptr = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * npg
    indices = table[:, :npg].reshape(-1).contiguous()
    last = torch.full((batch,), page, dtype=torch.int32, device="cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    kvt = fi_kv(kv["k_cache"], kv["v_cache"], layout)
    ours = res.dec_layout.get((fmt, layout))
    for tc in (False, True):
        name = f"decode flashinfer {fmt} tc={tc} {_shape(batch, ctx, hq, hk, d, page)} {layout}"
        try:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, layout, use_tensor_cores=tc)
            w.plan(indptr, indices, last, hq, hk, d, page, q_data_type=torch.bfloat16,
                   kv_data_type=kv["k_cache"].dtype)
            ks, vs = float(kv["k_scale"][0]), float(kv["v_scale"][0])
            if is_plain(fmt):
                fn = lambda: w.run(q, kvt)  # noqa: E731
            else:
                fn = lambda: w.run(q, kvt, k_scale=ks, v_scale=vs)  # noqa: E731
            t = bench_us(fn)
        except Exception as e:  # noqa: BLE001 - no kernel for these dtypes: reported as a row
            yield Row(f"{name} (failed)", float("nan"), note=f"{type(e).__name__}: {str(e)[:100]}")
            continue
        gb = nbytes / (t * 1e-6) / 1e9
        res.fi[fmt] = min(res.fi.get(fmt, float("inf")), t)
        yield Row(name, t, gb, 100 * gb / res.copy, kvbench_x=speedup(t, ours))
    del kv, kvt
    torch.cuda.empty_cache()


def sdpa_decode_rows(res: BenchResults, *, batch=64, ctx=8192, hq=32, hk=8, d=128) -> Iterator[Row]:
    """torch SDPA on the dense bf16 problem of the decode rows (one query per sequence over ``ctx`` keys of
    ``hk`` heads, GQA through ``enable_gqa``, or K/V repeated to ``hq`` heads where that is refused); bytes
    counted as for the paged rows (the ``hk``-head cache read once).  kvbench column: the Triton bf16 row of
    the chosen layout."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, hk, ctx, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    nbytes = 2 * k.numel() * 2 + 2 * q.numel() * 2
    try:
        fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        fn()
        how = "enable_gqa"
    except (TypeError, RuntimeError):
        ke, ve = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
        fn = lambda: F.scaled_dot_product_attention(q, ke, ve)  # noqa: E731
        how = f"K/V repeated to {hq} heads"
    t = bench_us(fn)
    gb = nbytes / (t * 1e-6) / 1e9
    del q, k, v
    torch.cuda.empty_cache()
    yield Row(f"decode torch SDPA bf16 B{batch}x{ctx} {hq}/{hk} D{d} (dense)", t, gb, 100 * gb / res.copy,
              note=how, kvbench_x=speedup(t, res.dec.get("bf16")))


# ---------------------------------------------------------------------------- launch sweep
def _sweep_configs(fmt):
    """Launch configurations tried by ``sweep_decode`` for one format."""
    c = lambda bn, ns, pf=False, nw=4, st=2: dict(block_n=bn, num_splits=ns, prefetch=pf, num_warps=nw,  # noqa: E731
                                                 num_stages=st)
    if is_plain(fmt):
        return [c(64, ns) for ns in (1, 2, 4)] + [c(64, 1, st=3)]
    pfs = (False, True)
    return [c(bn, ns, pf) for bn in (64, 128) for ns in (4, 8, 16) for pf in pfs] + [
        c(128, 8, st=3), c(256, 8), c(128, 8, nw=8)]


def check_variants(formats=None) -> bool:
    """The decode check's hard cases at several launch configurations (the GPU check runs the defaults);
    each case's line printed as it runs."""
    from triton.runtime.errors import OutOfResources

    from kvbench.tools.common import kernel_formats, plain_and_quantized
    from kvbench.tools.kernel_check import check_decode

    ok = True
    for fmt in formats or plain_and_quantized(kernel_formats()):
        for pf, bn, ns in ((False, 128, 8), (True, 64, 4), (False, 64, 3), (True, 128, 16)):
            kw = dict(prefetch=pf, block_n=bn, num_splits=ns)
            try:
                cases = [check_decode(fmt, [4000, 1, 17, 2500] * 4, 32, 8, 128, 16, seed=ns, **kw)]
            except OutOfResources as e:  # a tile that does not fit is not a launch configuration
                print(f"skipped {fmt} {kw}: {str(e)[:60]}", flush=True)
                continue
            cases.append(check_decode(fmt, [32768, 17, 1000], 32, 8, 128, 16, window=1000, sinks=True, seed=bn, **kw))
            cases.append(check_decode(fmt, [1020, 3, 600], 64, 8, 64, 64, q_fp8=True, seed=7, **kw))
            for case in cases:
                print(case.line(), kw, flush=True)
                ok &= case.ok
    return ok


def sweep_decode(copy_gbps, formats=None, batch=64, ctx=8192, hq=32, hk=8, d=128, page=16, layout="HND"):
    """Every configuration of ``_sweep_configs`` plus the defaults, each printed as it is timed; returns the
    rows (fastest first per format).  Used to choose ``decode._DEFAULTS``."""
    import torch

    from kvbench.kernels import DecodeOptions, PagedKV
    from kvbench.kernels import paged_decode

    gen = torch.Generator().manual_seed(0)
    rows = []
    for fmt in formats or bench_formats():
        q, table, seq, kv, nbytes = decode_case(fmt, batch, ctx, hq, hk, d, page, gen, layout)
        pkv = PagedKV(fmt, **kv)
        out = torch.empty_like(q)
        timed = []
        for cfg in [dict()] + _sweep_configs(fmt):
            try:
                opts = DecodeOptions(**cfg)
                t = bench_us(lambda: paged_decode(q, pkv, table, seq, out=out, opts=opts))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported and skipped
                print(f"  sweep {fmt} {cfg}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                continue
            gb = nbytes / (t * 1e-6) / 1e9
            timed.append(Row(f"sweep {fmt}", t, gb, 100 * gb / copy_gbps, note=str(cfg or "defaults")))
            print(timed[-1].line(), flush=True)
        rows += sorted(timed, key=lambda r: r.us)
        del kv, pkv
        torch.cuda.empty_cache()
    return rows

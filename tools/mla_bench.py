"""Benchmarks of the MLA kernels (``mla_check.py`` runs them): a launch-configuration sweep of the decode,
decode µs / GB/s at batch × context, the pipeline-depth table, prefill / extend, fused vs unfused append.
Each ``iter_*`` is a generator of row dicts (the row is printed the moment it is measured); the
``bench_*`` / ``tune_decode`` / ``sweep_stages`` wrappers return the whole list."""

from __future__ import annotations

from typing import Iterator

import torch

from kvbench.core import is_quantized
from kvbench.kernels import MLADecodeOptions, MLAPrefillOptions
from kvbench.kernels import LatentCache, LatentLayout, rope_cos_sin_cache
from kvbench.kernels import mla_append_unfused
from kvbench.kernels.mla_append import mla_append
from kvbench.kernels.mla_decode import mla_decode
from kvbench.kernels.mla_prefill import mla_prefill
from kvbench.kernels import quantize_absorbed_query
from kvbench.tools.mla_common import (H, PAGE, RANK, ROPE, SM, cache_for, decode_setup, fill_cache, graph_time_us,
                                      rel_err, time_us)

__all__ = ["DECODE_CONFIGS", "PREFILL_CASES", "STAGE_CASES", "iter_tune_decode", "tune_decode", "iter_decode",
           "bench_decode", "iter_prefill", "bench_prefill", "iter_stages", "sweep_stages", "iter_append",
           "bench_append", "iter_vs_flashinfer", "mla_speed_targets"]

DECODE_CONFIGS = {  # heads regime -> (block_h, block_n, num_warps, num_stages, num_splits or None = default)
    "many": [(64, 32, 4, 2, None), (64, 32, 8, 2, None), (64, 64, 8, 2, None), (64, 16, 4, 3, None),
             (32, 32, 4, 2, None), (32, 64, 4, 2, None), (16, 64, 4, 2, None)],
    "few": [(16, 32, 4, 2, None), (16, 32, 8, 2, None), (16, 64, 4, 2, None), (16, 64, 8, 2, None),
            (16, 64, 8, 3, None), (16, 128, 8, 2, None), (16, 64, 8, 2, 8), (16, 64, 8, 2, 16)],
}
# (batch, cached prefix, new tokens): extends of a few to many tokens over a long prefix, and a fresh prefill
PREFILL_CASES = ((2, 8192, 4), (2, 8192, 16), (2, 8192, 256), (16, 4096, 64), (1, 0, 2048))
STAGE_CASES = (("bf16", False), ("fp8_e4m3", False), ("fp8_e4m3", True), ("nvfp4", False))


def _decode_fn(ql, qp, cache, pt, sl, kw: dict):
    """``mla_decode`` as a thunk: ``kw`` holds the query's ``q_scale`` (if any) and launch options
    (``MLADecodeOptions``), built once here rather than in every timed call."""
    kw = dict(kw)
    q_scale = kw.pop("q_scale", None)
    opts = MLADecodeOptions(**kw)
    return lambda: mla_decode(ql, qp, cache, pt, sl, SM, q_scale=q_scale, opts=opts)


def iter_tune_decode(kv_dtype, dev, gen, batch=64, ctx=8192, heads=H) -> Iterator[dict]:
    """Every launch configuration of ``DECODE_CONFIGS`` (and the defaults, ``{}``) at ``batch`` × ``ctx``: a
    row per configuration, ``error`` where it does not compile."""
    cache, pt, ql, qp, sl, nbytes = decode_setup(kv_dtype, batch, ctx, dev, gen, heads)
    configs = [dict(block_h=bh, block_n=bn, num_warps=nw, num_stages=ns, **({"num_splits": sp} if sp else {}))
               for bh, bn, nw, ns, sp in DECODE_CONFIGS["many" if heads > 32 else "few"]]
    configs = [{}] + configs  # {} = mla_decode's own defaults for this format and head count
    if is_quantized(kv_dtype):
        configs += [dict(c, units16=u) for c in configs for u in (True, False)]
    for cfg in configs:
        kw = dict(cfg, max_seq_len=ctx)
        try:
            us = time_us(_decode_fn(ql, qp, cache, pt, sl, kw))
        except Exception as e:  # out of shared memory / registers for this tile: record and go on
            yield {"format": kv_dtype, "config": kw, "heads": heads, "error": f"{type(e).__name__}: {str(e)[:120]}"}
            continue
        yield {"format": kv_dtype, "config": kw, "heads": heads, "us": us, "GBps": nbytes / (us * 1e-6) / 1e9}
    del cache


def tune_decode(kv_dtype, dev, gen, batch=64, ctx=8192, heads=H) -> tuple[dict, list]:
    """→ (the fastest configuration, every row)."""
    rows = list(iter_tune_decode(kv_dtype, dev, gen, batch, ctx, heads))
    timed = [r for r in rows if "us" in r]
    best = min(timed, key=lambda r: r["us"])["config"] if timed else dict(max_seq_len=ctx)
    return best, rows


def iter_decode(kv_dtype, cfg, dev, gen, batches, ctxs, heads=H, fp8_query=False) -> Iterator[dict]:
    """Decode at every batch × context (``cfg``: launch options, ``{}`` = the defaults); ``fp8_query``: e4m3
    queries with ``q_scale`` (``quantize_query``) instead of bf16."""
    for b in batches:
        for ctx in ctxs:
            cache, pt, ql, qp, sl, nbytes = decode_setup(kv_dtype, b, ctx, dev, gen, heads)
            kw = dict(cfg, max_seq_len=ctx)
            if fp8_query:
                ql, qp, kw["q_scale"] = quantize_absorbed_query(ql, qp)
            us = time_us(_decode_fn(ql, qp, cache, pt, sl, kw), ms=100)
            g_us = graph_time_us(_decode_fn(ql, qp, cache, pt, sl, kw))
            flops = 2 * b * heads * ctx * (2 * RANK + ROPE)
            del cache
            yield {"format": kv_dtype, "heads": heads, "batch": b, "ctx": ctx, "us": us, "graph_us": g_us,
                   "GBps": nbytes / (g_us * 1e-6) / 1e9, "TFLOPs": flops / (g_us * 1e-6) / 1e12,
                   "query": "e4m3" if fp8_query else "bf16"}


def bench_decode(*a, **k) -> list:
    return list(iter_decode(*a, **k))


def iter_prefill(kv_dtype, dev, gen, heads=H, cases=((2, 8192, 256), (1, 0, 2048)), fp8_query=False,
                 prefix_workspace=None) -> Iterator[dict]:
    """Prefill/extend at mla_prefill's defaults: ``(batch, cached prefix, new tokens)`` per case; ``prefix_workspace``
    as in ``mla_prefill`` (None: its default)."""
    for b, prefix, new in cases:
        lens = [prefix + new] * b
        cache, pt = cache_for(kv_dtype, lens, gen, dev)
        fill_cache(cache, pt, [prefix] * b, gen, dev)
        t = b * new
        cu = torch.arange(0, t + 1, new, dtype=torch.int32, device=dev)
        ql = torch.randn(t, heads, RANK, device=dev, dtype=torch.bfloat16)
        qp = torch.randn(t, heads, ROPE, device=dev, dtype=torch.bfloat16)
        cn = torch.randn(t, RANK, device=dev, dtype=torch.bfloat16)
        kn = torch.randn(t, ROPE, device=dev, dtype=torch.bfloat16)
        sl = torch.tensor(lens, dtype=torch.int32, device=dev)
        kw = {}
        if fp8_query:
            ql, qp, kw["q_scale"] = quantize_absorbed_query(ql, qp)
        opts = MLAPrefillOptions(max_q_len=new, prefix_workspace=prefix_workspace)
        fn = lambda: mla_prefill(ql, qp, cn, kn, cache, pt, sl, cu, SM, q_scale=kw.get("q_scale"), opts=opts)  # noqa: E731
        us = time_us(fn, ms=100)
        graph = graph_time_us(fn)
        flops = 2 * heads * (2 * RANK + ROPE) * b * (new * prefix + new * (new + 1) // 2)  # visible keys per new token
        read = "as stored" if not is_quantized(kv_dtype) else "registers" if prefix_workspace is False else "workspace"
        del cache
        yield {"format": kv_dtype, "heads": heads, "batch": b, "prefix": prefix, "new": new, "us": us, "graph_us": graph,
               "TFLOPs": flops / (graph * 1e-6) / 1e12, "query": "e4m3" if fp8_query else "bf16", "prefix_read": read}


def bench_prefill(*a, **k) -> list:
    return list(iter_prefill(*a, **k))


def iter_stages(dev, gen, heads=(16, 128), stages=(2, 3, 4, 5, 6), batch=64, ctx=8192) -> Iterator[dict]:
    """Decode at the defaults' tiles with only the pipeline depth varied (CUDA-graph replays), e4m3 queries
    included: below five stages Triton gives the tile loads one shared-memory buffer (docs/mla.md, "Pipeline
    depth").  Each row's ``diff`` is its output against the defaults' on the same inputs."""
    for nh in heads:
        for fmt, q8 in STAGE_CASES:
            cache, pt, ql, qp, sl, nbytes = decode_setup(fmt, batch, ctx, dev, gen, nh)
            kw = dict(max_seq_len=ctx)
            if q8:
                ql, qp, kw["q_scale"] = quantize_absorbed_query(ql, qp)
            ref = _decode_fn(ql, qp, cache, pt, sl, kw)().double()
            for ns in (None,) + tuple(stages):
                row = {"format": fmt, "query": "e4m3" if q8 else "bf16", "heads": nh, "stages": ns or "default"}
                try:
                    fn = _decode_fn(ql, qp, cache, pt, sl, dict(kw, num_stages=ns))
                    row["diff"] = rel_err(fn(), ref)
                    row["graph_us"] = graph_time_us(fn)
                    row["GBps"] = nbytes / (row["graph_us"] * 1e-6) / 1e9
                except Exception as e:  # out of shared memory at this depth: recorded, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
                yield row
            del cache
            torch.cuda.empty_cache()


def sweep_stages(*a, **k) -> list:
    return list(iter_stages(*a, **k))


def iter_append(kv_dtype, dev, gen, tokens=(64, 4096)) -> Iterator[dict]:
    """Fused Triton append against the unfused torch path (RoPE, formats.quantize, indexed store)."""
    lay = LatentLayout(RANK, ROPE, kv_dtype)
    cs = rope_cos_sin_cache(32768, ROPE, device=dev)
    for t in tokens:
        c = torch.randn(t, RANK, device=dev, dtype=torch.bfloat16)
        k = torch.randn(t, ROPE, device=dev, dtype=torch.bfloat16)
        q = torch.randn(t, H, ROPE, device=dev, dtype=torch.bfloat16)
        pos = torch.randint(0, 30000, (t,), device=dev)
        slots = torch.randperm(t, device=dev)
        cache = LatentCache.allocate(lay, t // PAGE + 2, PAGE, device=dev, k_scale=0.01)
        fu = time_us(lambda: mla_append(c, k, q, pos, cs, slots, cache), ms=100)
        un = time_us(lambda: mla_append_unfused(c, k, q, pos, cs, slots, cache), ms=100)
        yield {"format": kv_dtype, "tokens": t, "fused_us": fu, "unfused_us": un, "ratio": fu / un}


def bench_append(*a, **k) -> list:
    return list(iter_append(*a, **k))


def _flashinfer_mla(cache, pt, ql, qp, sl, ctx, heads, backend):
    """flashinfer's paged MLA decode (``BatchMLAPagedAttentionWrapper``, bf16 latent) on kvbench's pages: the
    latent and rope parts split into its two caches → (µs, output)."""
    import flashinfer

    b = ql.shape[0]
    npg = -(-ctx // PAGE)
    ckv = cache.data[:, :, 0, :RANK].contiguous()
    kpe = cache.data[:, :, 0, RANK:].contiguous()
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=ql.device)
    w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend=backend)
    i32 = dict(dtype=torch.int32, device=ql.device)
    w.plan(torch.arange(b + 1, **i32), torch.arange(b + 1, **i32) * npg, pt[:, :npg].reshape(-1).contiguous(),
           sl.to(torch.int32), heads, RANK, ROPE, PAGE, False, SM, ql.dtype, ckv.dtype)
    out = w.run(ql, qp, ckv, kpe)
    us = time_us(lambda: w.run(ql, qp, ckv, kpe), ms=100)
    return us, out


def iter_vs_flashinfer(dev, gen, heads=(128,), formats=("bf16", "fp8_e4m3", "nvfp4"), batch=64, ctx=8192,
                       backends=("fa2", "fa3")) -> Iterator[dict]:
    """MLA decode at ``batch`` × ``ctx``: kvbench's kernel at its launch defaults per format (bf16 queries), and
    over an fp8_e4m3 latent also with e4m3 queries (``quantize_query``: the scores as fp8 MMAs) and with e4m3
    queries and ``fp8_pv`` (P·c as an fp8 MMA too, P rounded to e4m3); then flashinfer's paged MLA decode on
    the same bf16 pages per backend (its output compared with kvbench's: the anchor computes the same
    attention), each row with TFLOP/s and, for flashinfer, kvbench's speed over it.  ``query`` names the
    kvbench variant."""
    for nh in heads:
        ours = {}
        outs = {}
        for fmt in formats:
            variants = [("bf16", {})]
            if fmt == "fp8_e4m3":
                variants += [("e4m3", {}), ("e4m3, fp8 P", {"fp8_pv": True})]
            cache, pt, ql0, qp0, sl, nbytes = decode_setup(fmt, batch, ctx, dev, gen, nh)
            for query, extra in variants:
                kw = dict(max_seq_len=ctx, **extra)
                ql, qp = ql0, qp0
                if query != "bf16":
                    ql, qp, kw["q_scale"] = quantize_absorbed_query(ql0, qp0)
                try:
                    fn = _decode_fn(ql, qp, cache, pt, sl, kw)
                    us = time_us(fn, ms=100)
                    g_us = graph_time_us(fn)
                except Exception as e:  # noqa: BLE001 - e.g. fp8_pv where its kernel does not apply (not sm_90)
                    yield {"who": "kvbench", "format": fmt, "query": query, "heads": nh, "batch": batch, "ctx": ctx,
                           "error": f"{type(e).__name__}: {' '.join(str(e).split())[:150]}"}
                    continue
                flops = 2 * batch * nh * ctx * (2 * RANK + ROPE)
                if fmt == "bf16":
                    ours["bf16"] = us
                    outs["bf16"] = (cache, pt, ql, qp, sl, fn())
                yield {"who": "kvbench", "format": fmt, "query": query, "heads": nh, "batch": batch, "ctx": ctx,
                       "us": us, "TFLOPs": flops / (us * 1e-6) / 1e12, "GBps": nbytes / (us * 1e-6) / 1e9,
                       "graph_us": g_us, "graph_TFLOPs": flops / (g_us * 1e-6) / 1e12}
            if fmt != "bf16":
                del cache
        if "bf16" not in outs:
            continue
        cache, pt, ql, qp, sl, ref = outs.pop("bf16")
        flops = 2 * batch * nh * ctx * (2 * RANK + ROPE)
        for be in backends:
            try:
                us, out = _flashinfer_mla(cache, pt, ql, qp, sl, ctx, nh, be)
            except Exception as e:  # noqa: BLE001 - not importable, no kernel for this GPU, JIT failure
                yield {"who": f"flashinfer {be}", "format": "bf16", "heads": nh, "batch": batch, "ctx": ctx,
                       "error": f"{type(e).__name__}: {' '.join(str(e).split())[:150]}"}
                continue
            yield {"who": f"flashinfer {be}", "format": "bf16", "heads": nh, "batch": batch, "ctx": ctx, "us": us,
                   "TFLOPs": flops / (us * 1e-6) / 1e12, "kvbench_x": us / ours["bf16"],
                   "rel_err_vs_kvbench": rel_err(out.float(), ref.double())}
        del cache


def mla_speed_targets(rows: list) -> list:
    """Issue 44's MLA targets from ``iter_vs_flashinfer`` rows (64 x 8192) → (name, met, value): at 128 heads,
    bf16 >= 400 TFLOP/s (held), fp8 with the exact bf16-query path at least as fast as bf16, and fp8 with e4m3
    queries faster than that path (the lossy ``e4m3, fp8 P`` path is opt-in and reported, not a target); at 16
    heads, fp8 >= 1.7x bf16's speed.  Judged on CUDA-graph replays where the rows have them (the runtime replays
    its decode steps as graphs; at 16 heads ``do_bench`` times the host's Python between launches as much as the
    kernel: docs/mla.md, "An e4m3 latent on the Hopper kernel")."""
    ours = {}
    for r in rows:
        if r.get("who") == "kvbench" and "us" in r:
            ours[(r["heads"], r["format"], r.get("query", "bf16"))] = dict(
                r, us=r.get("graph_us", r["us"]), TFLOPs=r.get("graph_TFLOPs", r["TFLOPs"]))
    out = []
    bf = ours.get((128, "bf16", "bf16"))
    exact = ours.get((128, "fp8_e4m3", "bf16"))
    q8 = ours.get((128, "fp8_e4m3", "e4m3"))
    if bf:
        t = bf["TFLOPs"]
        out.append(("MLA decode bf16 >= 400 TFLOP/s (128 heads, 64 x 8192)", t >= 400, f"{t:.0f} TFLOP/s"))
    if bf and exact:
        r = bf["us"] / exact["us"]
        out.append(("MLA decode fp8 >= 1.0x bf16 (128 heads; bf16 queries, exact)", r >= 1.0, f"{r:.2f}x"))
    if exact and q8:
        r = exact["us"] / q8["us"]
        out.append(("MLA decode fp8 with e4m3 queries faster than with bf16 queries (128 heads)", r > 1.0,
                    f"{r:.2f}x" + (f"; {bf['us'] / q8['us']:.2f}x bf16" if bf else "")))
    bf16, fp8 = ours.get((16, "bf16", "bf16")), ours.get((16, "fp8_e4m3", "bf16"))
    if bf16 and fp8:
        r = bf16["us"] / fp8["us"]
        out.append(("MLA decode fp8 >= 1.7x bf16 (16 heads, 64 x 8192)", r >= 1.7, f"{r:.2f}x"))
    return out

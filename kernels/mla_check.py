"""GPU check and benchmarks of the MLA kernels: ``python -m kvbench.kernels.mla_check [--out DIR] [--quick]``.

1. Measured copy bandwidth (device-to-device clone, bytes read + written).
2. Checks at DeepSeek-V3 attention shapes (128 heads, kv_lora_rank 512, rope 64, nope 128, v 128) for
   every cache format: fused append bit-exact against kernels/formats.py on the latent part (the RoPE
   part computed in float32 may differ from float64 RoPE by an ulp, so a tiny fraction of its codes may
   sit one step away) and identical to the unfused path; decode and prefill/extend of ragged batches
   (contexts to 32k) against the non-absorbed float64 reference (‖out−ref‖/‖ref‖, outputs poisoned);
   decode also at 16 heads, and with the latent read both as 16-bit units and in its stored type.
3. Benchmarks at ``--heads`` (default 16 and 128): a launch-configuration sweep at batch 64 × 8192,
   decode µs and GB/s at batch 1–128 × 1k–32k with ``mla_decode``'s defaults, fused vs unfused append.  Prints Markdown tables; with ``--out`` writes ``mla_check.json`` and
   ``mla_check.md`` there.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
import traceback

import torch

from kvbench.harness.store import atomic_write_text
from kvbench.kernels.bench import graph_us
from kvbench.kernels.formats import get_format
from kvbench.kernels.mla import LatentCache, LatentLayout, absorb_query, rope_cos_sin_cache, unabsorb_output
from kvbench.kernels.mla_append import mla_append, mla_append_unfused
from kvbench.kernels.mla_decode import mla_decode
from kvbench.kernels.mla_prefill import mla_prefill
from kvbench.kernels.mla_reference import (quantize_absorbed_query, ref_append_rows, ref_decode, ref_decode_latent,
                                           ref_prefill, sequence_slots)

H, RANK, ROPE, NOPE, VD, PAGE = 128, 512, 64, 128, 128, 64
FORMATS = ("bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4")
SM = (NOPE + ROPE) ** -0.5


def _bench(fn, ms: int = 200) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=ms, return_mode="median")) * 1e3  # µs


def _bench_graph(fn, ms: int = 100) -> float:
    """Median µs of ``fn`` replayed as a CUDA graph (``kernels.bench.graph_us``; the runtime replays decode
    steps as graphs)."""
    return graph_us(fn, rep=ms)


def copy_bandwidth(dev) -> float:
    x = torch.empty(1 << 29, dtype=torch.uint8, device=dev).random_()  # 512 MiB
    y = torch.empty_like(x)
    us = _bench(lambda: y.copy_(x))
    return 2 * x.numel() / (us * 1e-6) / 1e9


def _cache_for(kv_dtype, lens, gen, dev, k_scale=0.02):
    lay = LatentLayout(RANK, ROPE, kv_dtype)
    pages = [math.ceil(n / PAGE) for n in lens]
    cache = LatentCache.allocate(lay, sum(pages) + 1, PAGE, device=dev, k_scale=1.0 if kv_dtype == "bf16" else k_scale)
    cache.data.view(torch.uint8).fill_(0xFF)  # NaN everywhere a kernel should not read
    if cache.block_scale is not None:
        cache.block_scale.view(torch.uint8).fill_(0xFF)
    perm = torch.randperm(sum(pages), generator=gen).int()
    pt = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    off = 0
    for i, k in enumerate(pages):
        pt[i, :k] = perm[off : off + k]
        off += k
    return cache, pt.to(dev)


def _fill(cache, pt, lens, gen, dev):
    fmt = get_format(cache.layout.kv_dtype)
    for b, n in enumerate(lens):
        if n:
            slots = sequence_slots(pt[b], n, PAGE)
            q = fmt.quantize(torch.randn(n, RANK + ROPE, generator=gen).to(dev) * 2, cache.k_scale[0])
            cache.data.view(-1, cache.layout.packed_dim)[slots] = q.data
            if q.block_scale is not None:
                cache.block_scale.view(-1, (RANK + ROPE) // 16)[slots] = q.block_scale


def _weights(gen, dev, heads=H):
    w_uk = (torch.randn(heads, NOPE, RANK, generator=gen) / math.sqrt(RANK)).to(dev)
    w_uv = (torch.randn(heads, VD, RANK, generator=gen) / math.sqrt(RANK)).to(dev)
    return w_uk, w_uv


def _rel(out, ref) -> float:
    out = out.double()
    if torch.isnan(out).any():
        return float("nan")
    return ((out - ref).norm() / ref.norm()).item()


def check_append(kv_dtype, dev, gen) -> dict:
    t = 4096
    lay = LatentLayout(RANK, ROPE, kv_dtype)
    c = (torch.randn(t, RANK, generator=gen) * 3).to(dev, torch.bfloat16)
    k = (torch.randn(t, ROPE, generator=gen) * 3).to(dev, torch.bfloat16)
    q = torch.randn(t, H, ROPE, generator=gen).to(dev, torch.bfloat16)
    pos = torch.randint(0, 30000, (t,), generator=gen).to(dev)
    cs = rope_cos_sin_cache(32768, ROPE, device=dev)
    slots = torch.randperm(t + 100, generator=gen)[:t].to(dev)
    slots[::17] = -1
    res = {}
    caches = []
    for fn in (mla_append, mla_append_unfused):
        cache = LatentCache.allocate(lay, (t + 100) // PAGE + 2, PAGE, device=dev, k_scale=0.01 if kv_dtype != "bf16" else 1.0)
        cache.data.view(torch.uint8).fill_(0xFF)
        if cache.block_scale is not None:
            cache.block_scale.view(torch.uint8).fill_(0xFF)
        fn(c, k, q, pos, cs, slots, cache, rope_style="interleaved")
        caches.append(cache)
    keep = slots >= 0
    _, ref = ref_append_rows(c[keep].float(), k[keep].float(), pos[keep], cs, kv_dtype, caches[0].k_scale[0], "interleaved")
    got = caches[0].data.view(-1, lay.packed_dim)[slots[keep]].view(torch.uint8)
    rd = ref.data.view(torch.uint8)
    lb = RANK // 2 if kv_dtype == "nvfp4" else RANK * (2 if kv_dtype == "bf16" else 1)
    gb = got.reshape(got.shape[0], -1)
    rb = rd.reshape(rd.shape[0], -1)
    res["latent_bit_exact"] = bool(torch.equal(gb[:, :lb], rb[:, :lb]))
    res["rope_bytes_differing"] = float((gb[:, lb:] != rb[:, lb:]).float().mean().item())
    if ref.block_scale is not None:
        gs = caches[0].block_scale.view(-1, (RANK + ROPE) // 16)[slots[keep]].view(torch.uint8)
        res["latent_block_scales_bit_exact"] = bool(torch.equal(gs[:, : RANK // 16], ref.block_scale.view(torch.uint8)[:, : RANK // 16]))
    untouched = torch.ones(caches[0].data.view(-1, lay.packed_dim).shape[0], dtype=torch.bool, device=dev)
    untouched[slots[keep]] = False
    res["skipped_slots_untouched"] = bool((caches[0].data.view(-1, lay.packed_dim)[untouched].view(torch.uint8) == 0xFF).all())
    res["fused_equals_unfused_frac"] = float((caches[0].data.view(torch.uint8) == caches[1].data.view(torch.uint8)).float().mean().item())
    res["pass"] = (res["latent_bit_exact"] and res["rope_bytes_differing"] < 1e-3 and res["skipped_slots_untouched"]
                   and res.get("latent_block_scales_bit_exact", True))
    return res


def check_decode(kv_dtype, dev, gen, lens=(1, 100, 4097, 32768), heads=H, **launch) -> dict:
    lens = list(lens)
    cache, pt = _cache_for(kv_dtype, lens, gen, dev)
    _fill(cache, pt, lens, gen, dev)
    w_uk, w_uv = _weights(gen, dev, heads)
    b = len(lens)
    qn = torch.randn(b, heads, NOPE, generator=gen).to(dev)
    qp = torch.randn(b, heads, ROPE, generator=gen).to(dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    ql = absorb_query(qn, w_uk).bfloat16()
    out = torch.full((b, heads, RANK), float("nan"), dtype=torch.bfloat16, device=dev)
    o = mla_decode(ql, qp.bfloat16(), cache, pt, sl, SM, out=out, **launch)
    ref = ref_decode(qn, qp.bfloat16().double(), cache, pt, sl, w_uk, w_uv, SM)
    err = _rel(unabsorb_output(o.double(), w_uv.double()), ref)
    return {"rel_err": err, "pass": bool(err < 2e-2)}


def check_decode_fp8_query(kv_dtype, dev, gen, lens=(1, 100, 4097, 32768), heads=H, **launch) -> dict:
    """e4m3 queries with ``q_scale`` (``quantize_query``): against the float64 latent-space decode of the same
    (dequantized) query, so the query's own rounding is not counted."""
    lens = list(lens)
    cache, pt = _cache_for(kv_dtype, lens, gen, dev)
    _fill(cache, pt, lens, gen, dev)
    b = len(lens)
    ql8, qp8, qs = quantize_absorbed_query((torch.randn(b, heads, RANK, generator=gen) * 0.5).to(dev),
                                   torch.randn(b, heads, ROPE, generator=gen).to(dev))
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    out = torch.full((b, heads, RANK), float("nan"), dtype=torch.bfloat16, device=dev)
    o = mla_decode(ql8, qp8, cache, pt, sl, SM, q_scale=qs, out=out, **launch)
    err = _rel(o, ref_decode_latent(ql8.float() * qs, qp8.float() * qs, cache, pt, sl, SM))
    return {"rel_err": err, "pass": bool(err < 2e-2)}


def check_prefill(kv_dtype, dev, gen, prefix=(0, 1000, 5000, 16), new=(300, 64, 17, 1), fp8_query=False,
                  **launch) -> dict:
    """bf16 queries against the non-absorbed float64 reference; ``fp8_query``: e4m3 queries with ``q_scale``
    against the float64 prefill in latent space (identity up-projections) of the same dequantized query."""
    lens = [p + n for p, n in zip(prefix, new)]
    cache, pt = _cache_for(kv_dtype, lens, gen, dev)
    _fill(cache, pt, list(prefix), gen, dev)
    w_uk, w_uv = _weights(gen, dev)
    t = sum(new)
    cu = torch.zeros(len(new) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(new), 0)
    cu = cu.to(dev)
    qn = torch.randn(t, H, NOPE, generator=gen).to(dev)
    qp = torch.randn(t, H, ROPE, generator=gen).to(dev).bfloat16()
    cn = (torch.randn(t, RANK, generator=gen) * 2).to(dev).bfloat16()
    kn = (torch.randn(t, ROPE, generator=gen) * 2).to(dev).bfloat16()
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    out = torch.full((t, H, RANK), float("nan"), dtype=torch.bfloat16, device=dev)
    if fp8_query:
        ql8, qp8, qs = quantize_absorbed_query(absorb_query(qn, w_uk), qp)
        o = mla_prefill(ql8, qp8, cn, kn, cache, pt, sl, cu, SM, q_scale=qs, out=out, **launch)
        eye = torch.eye(RANK, dtype=torch.float64, device=dev)[None].expand(H, RANK, RANK)
        ref = ref_prefill(ql8.double() * qs.double(), qp8.double() * qs.double(), cn, kn, cache, pt, sl, cu, eye, eye, SM)
        err = _rel(o, ref)
    else:
        o = mla_prefill(absorb_query(qn, w_uk).bfloat16(), qp, cn, kn, cache, pt, sl, cu, SM, out=out, **launch)
        ref = ref_prefill(qn, qp, cn, kn, cache, pt, sl, cu, w_uk, w_uv, SM)
        err = _rel(unabsorb_output(o.double(), w_uv.double()), ref)
    return {"rel_err": err, "pass": bool(err < 2e-2)}


# (batch, cached prefix, new tokens): extends of a few to many tokens over a long prefix, and a fresh prefill
PREFILL_CASES = ((2, 8192, 4), (2, 8192, 16), (2, 8192, 256), (16, 4096, 64), (1, 0, 2048))


def bench_prefill(kv_dtype, dev, gen, heads=H, cases=((2, 8192, 256), (1, 0, 2048)), fp8_query=False,
                  prefix_workspace=None) -> list:
    """Prefill/extend at mla_prefill's defaults: ``(batch, cached prefix, new tokens)`` per case; ``prefix_workspace``
    as in ``mla_prefill`` (None: its default)."""
    out = []
    for b, prefix, new in cases:
        lens = [prefix + new] * b
        cache, pt = _cache_for(kv_dtype, lens, gen, dev)
        _fill(cache, pt, [prefix] * b, gen, dev)
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
        fn = lambda: mla_prefill(ql, qp, cn, kn, cache, pt, sl, cu, SM, max_q_len=new, prefix_workspace=prefix_workspace, **kw)
        us = _bench(fn, ms=100)
        graph = _bench_graph(fn)
        flops = 2 * heads * (2 * RANK + ROPE) * b * (new * prefix + new * (new + 1) // 2)  # visible keys per new token
        read = "as stored" if kv_dtype in ("bf16", "fp16") else "registers" if prefix_workspace is False else "workspace"
        out.append({"format": kv_dtype, "heads": heads, "batch": b, "prefix": prefix, "new": new, "us": us, "graph_us": graph,
                    "TFLOPs": flops / (graph * 1e-6) / 1e12, "query": "e4m3" if fp8_query else "bf16", "prefix_read": read})
        del cache
    return out


def _decode_setup(kv_dtype, batch, ctx, dev, gen, heads=H):
    lens = [ctx] * batch
    cache, pt = _cache_for(kv_dtype, lens, gen, dev)
    fmt = get_format(kv_dtype)
    rows = fmt.quantize(torch.randn(1024, RANK + ROPE, device=dev) * 2, cache.k_scale[0])  # real-looking bytes
    n = cache.data.shape[0] * PAGE
    idx = torch.arange(n, device=dev) % 1024
    cache.data.view(-1, cache.layout.packed_dim).copy_(rows.data[idx])
    if rows.block_scale is not None:
        cache.block_scale.view(-1, (RANK + ROPE) // 16).copy_(rows.block_scale[idx])
    ql = torch.randn(batch, heads, RANK, device=dev, dtype=torch.bfloat16)
    qp = torch.randn(batch, heads, ROPE, device=dev, dtype=torch.bfloat16)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    bytes_read = batch * ctx * (RANK + ROPE) * fmt.bytes_per_element
    return cache, pt, ql, qp, sl, bytes_read


DECODE_CONFIGS = {  # heads regime -> (block_h, block_n, num_warps, num_stages, num_splits or None = default)
    "many": [(64, 32, 4, 2, None), (64, 32, 8, 2, None), (64, 64, 8, 2, None), (64, 16, 4, 3, None),
             (32, 32, 4, 2, None), (32, 64, 4, 2, None), (16, 64, 4, 2, None)],
    "few": [(16, 32, 4, 2, None), (16, 32, 8, 2, None), (16, 64, 4, 2, None), (16, 64, 8, 2, None),
            (16, 64, 8, 3, None), (16, 128, 8, 2, None), (16, 64, 8, 2, 8), (16, 64, 8, 2, 16)],
}


def tune_decode(kv_dtype, dev, gen, batch=64, ctx=8192, heads=H) -> tuple[dict, list]:
    cache, pt, ql, qp, sl, nbytes = _decode_setup(kv_dtype, batch, ctx, dev, gen, heads)
    rows, best = [], None
    configs = [dict(block_h=bh, block_n=bn, num_warps=nw, num_stages=ns, **({"num_splits": sp} if sp else {}))
               for bh, bn, nw, ns, sp in DECODE_CONFIGS["many" if heads > 32 else "few"]]
    configs = [{}] + configs  # {} = mla_decode's own defaults for this format and head count
    if kv_dtype != "bf16":
        configs += [dict(c, units16=u) for c in configs for u in (True, False)]
    for cfg in configs:
        kw = dict(cfg, max_seq_len=ctx)
        try:
            us = _bench(lambda: mla_decode(ql, qp, cache, pt, sl, SM, **kw))
        except Exception as e:  # out of shared memory / registers for this tile: record and go on
            rows.append({"config": kw, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        rows.append({"config": kw, "heads": heads, "us": us, "GBps": nbytes / (us * 1e-6) / 1e9})
        if best is None or us < best[1]:
            best = (kw, us)
    del cache
    return (best[0] if best else dict(max_seq_len=ctx)), rows


def bench_decode(kv_dtype, cfg, dev, gen, batches, ctxs, heads=H, fp8_query=False) -> list:
    """``fp8_query``: e4m3 queries with ``q_scale`` (``quantize_query``) instead of bf16."""
    out = []
    for b in batches:
        for ctx in ctxs:
            cache, pt, ql, qp, sl, nbytes = _decode_setup(kv_dtype, b, ctx, dev, gen, heads)
            kw = dict(cfg, max_seq_len=ctx)
            if fp8_query:
                ql, qp, kw["q_scale"] = quantize_absorbed_query(ql, qp)
            us = _bench(lambda: mla_decode(ql, qp, cache, pt, sl, SM, **kw), ms=100)
            g_us = _bench_graph(lambda: mla_decode(ql, qp, cache, pt, sl, SM, **kw))
            flops = 2 * b * heads * ctx * (2 * RANK + ROPE)
            out.append({"format": kv_dtype, "heads": heads, "batch": b, "ctx": ctx, "us": us, "graph_us": g_us,
                        "GBps": nbytes / (g_us * 1e-6) / 1e9, "TFLOPs": flops / (g_us * 1e-6) / 1e12,
                        "query": "e4m3" if fp8_query else "bf16"})
            del cache
    return out


STAGE_CASES = (("bf16", False), ("fp8_e4m3", False), ("fp8_e4m3", True), ("nvfp4", False))


def sweep_stages(dev, gen, heads=(16, 128), stages=(2, 3, 4, 5, 6), batch=64, ctx=8192) -> list:
    """Decode at the defaults' tiles with only the pipeline depth varied (CUDA-graph replays), e4m3 queries
    included: below five stages Triton gives the tile loads one shared-memory buffer (docs/mla.md, "Pipeline
    depth").  Each row's ``diff`` is its output against the defaults' on the same inputs."""
    rows = []
    for nh in heads:
        for fmt, q8 in STAGE_CASES:
            cache, pt, ql, qp, sl, nbytes = _decode_setup(fmt, batch, ctx, dev, gen, nh)
            kw = dict(max_seq_len=ctx)
            if q8:
                ql, qp, kw["q_scale"] = quantize_absorbed_query(ql, qp)
            ref = mla_decode(ql, qp, cache, pt, sl, SM, **kw).double()
            for ns in (None,) + tuple(stages):
                row = {"format": fmt, "query": "e4m3" if q8 else "bf16", "heads": nh, "stages": ns or "default"}
                try:
                    fn = lambda: mla_decode(ql, qp, cache, pt, sl, SM, num_stages=ns, **kw)  # noqa: E731
                    row["diff"] = _rel(fn(), ref)
                    row["graph_us"] = _bench_graph(fn)
                    row["GBps"] = nbytes / (row["graph_us"] * 1e-6) / 1e9
                except Exception as e:  # out of shared memory at this depth: recorded, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
                rows.append(row)
            del cache
            torch.cuda.empty_cache()
    return rows


def _stages_md(rows: list) -> str:
    cols = list(dict.fromkeys(r["stages"] for r in rows))
    lines = [f"| heads | format | query | {' | '.join(f'{c} stages' if c != 'default' else c for c in cols)} |",
             "|---|---|---|" + "---|" * len(cols)]
    for key in dict.fromkeys((r["heads"], r["format"], r["query"]) for r in rows):
        cells = {r["stages"]: r for r in rows if (r["heads"], r["format"], r["query"]) == key}
        out = []
        for c in cols:
            r = cells.get(c)
            if r is None:
                out.append("")
            elif "error" in r:
                out.append(r["error"].split(":")[0])
            else:
                out.append(f"{r['graph_us']:.1f}" + ("" if r["diff"] < 1e-3 else f" (diff {r['diff']:.0e})"))
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {' | '.join(out)} |")
    return "\n".join(lines) + "\n"


def bench_append(kv_dtype, dev, gen, tokens=(64, 4096)) -> list:
    out = []
    lay = LatentLayout(RANK, ROPE, kv_dtype)
    cs = rope_cos_sin_cache(32768, ROPE, device=dev)
    for t in tokens:
        c = torch.randn(t, RANK, device=dev, dtype=torch.bfloat16)
        k = torch.randn(t, ROPE, device=dev, dtype=torch.bfloat16)
        q = torch.randn(t, H, ROPE, device=dev, dtype=torch.bfloat16)
        pos = torch.randint(0, 30000, (t,), device=dev)
        slots = torch.randperm(t, device=dev)
        cache = LatentCache.allocate(lay, t // PAGE + 2, PAGE, device=dev, k_scale=0.01)
        fu = _bench(lambda: mla_append(c, k, q, pos, cs, slots, cache), ms=100)
        un = _bench(lambda: mla_append_unfused(c, k, q, pos, cs, slots, cache), ms=100)
        out.append({"format": kv_dtype, "tokens": t, "fused_us": fu, "unfused_us": un, "ratio": fu / un})
    return out


def _decode_row(r: dict, copy_gbps: float) -> str:
    g = f"{r['graph_us']:.1f}" if "graph_us" in r else "–"
    return (f"| {r['format']} | {r['heads']} | {r['batch']} | {r['ctx']} | {r['us']:.1f} | {g} | {r['GBps']:.0f} | "
            f"{100 * r['GBps'] / copy_gbps:.0f}% | {r['TFLOPs']:.0f} |")


def _md(report: dict) -> str:
    L = [f"Device: {report['device']}; torch {report['torch']}, triton {report['triton']}; {report['date']}.",
         f"Copy bandwidth (read + write): {report['copy_GBps']:.0f} GB/s.", "",
         "| check | " + " | ".join(FORMATS) + " |", "|---|" + "---|" * len(FORMATS)]
    for name in ("append", "decode", "decode H=16", "decode H=16 bytes", "decode H=128 units", "decode fp8 q",
                 "decode fp8 q H=16", "decode bytes 128-token tiles", "prefill", "prefill fp8 q", "prefill 128-token tiles",
                 "prefill in registers", "prefill fp8 q in registers", "prefill 128-token tiles in registers",
                 "prefill split prefix", "prefill split prefix in registers"):
        cells = []
        for f in FORMATS:
            r = report["checks"].get(f, {}).get(name, {})
            if "error" in r:
                cells.append("ERROR")
            elif "refused" in r:
                cells.append("refused")
            elif "rel_err" in r:
                cells.append(f"{'pass' if r['pass'] else 'FAIL'} ({r['rel_err']:.1e})")
            else:
                cells.append(("pass" if r.get("pass") else "FAIL") + (f" (rope bytes off {r['rope_bytes_differing']:.1e})" if r else ""))
        L.append(f"| {name} | " + " | ".join(cells) + " |")
    L += ["", "Decode (absorbed, bf16 q, latent 512+64, page 64, mla_decode's defaults).  µs: `do_bench` (launches "
          "from Python, the host's gaps included); graph µs: the same call replayed as a CUDA graph (the kernels' own "
          "time); GB/s = cache bytes read / graph time, % of copy bandwidth, TFLOP/s from the graph time:", "",
          "| format | heads | batch | context | µs | graph µs | GB/s | % copy | TFLOP/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["decode"]:
        if r.get("query", "bf16") != "bf16":
            continue
        L.append(_decode_row(r, report["copy_GBps"]))
    q8 = [r for r in report["decode"] if r.get("query", "bf16") != "bf16"]
    if q8:
        base = {(r["heads"], r["batch"], r["ctx"]): r.get("graph_us", r["us"]) for r in report["decode"]
                if r["format"] == "bf16" and r.get("query", "bf16") == "bf16"}
        L += ["", "Decode with e4m3 queries (`quantize_query`; the runtime's `--quantize-query`), same shapes and columns; "
              "speed-up (graph times) against the bf16 cache with bf16 queries:", "",
              "| format | heads | batch | context | µs | graph µs | GB/s | % copy | TFLOP/s | vs bf16 |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for r in q8:
            ref = base.get((r["heads"], r["batch"], r["ctx"]))
            L.append(_decode_row(r, report["copy_GBps"]) + (f" {ref / r.get('graph_us', r['us']):.2f}x |" if ref else " |"))
    if report["tuning"]:
        L += ["", "Launch-configuration sweep at batch 64 x 8192 ({} = the defaults):", "",
              "| format | config | µs | GB/s | % copy |", "|---|---|---|---|---|"]
        for name, rows in report["tuning"].items():
            for r in rows:
                cfg = {k: v for k, v in r.get("config", {}).items() if k != "max_seq_len"}
                if "us" in r:
                    L.append(f"| {name} | {cfg} | {r['us']:.1f} | {r['GBps']:.0f} | {100 * r['GBps'] / report['copy_GBps']:.0f}% |")
                else:
                    L.append(f"| {name} | {cfg} | {r.get('error', 'error')[:60]} | | |")
    if report.get("prefill"):
        L += ["", "Prefill/extend (absorbed, mla_prefill's defaults: a few new tokens split the prefix over programs); "
              "the cached prefix read as stored (16-bit), through the prefix workspace (dequantized once; the default) "
              "or dequantized in registers by every program.  µs: `do_bench` (the host's launches included: several "
              "per call); graph µs: replayed as a CUDA graph; TFLOP/s over the visible keys of each new token, from "
              "the graph time:",
              "", "| format | query | prefix read | heads | batch | cached prefix | new tokens | µs | graph µs | TFLOP/s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["prefill"]:
            g = r.get("graph_us")
            L.append(f"| {r['format']} | {r['query']} | {r.get('prefix_read', '')} | {r['heads']} | {r['batch']} | "
                     f"{r['prefix']} | {r['new']} | {r['us']:.1f} | {'' if g is None else f'{g:.1f}'} | {r['TFLOPs']:.0f} |")
    L += ["", "Append (H=128 q_pe heads): fused Triton vs unfused torch (RoPE, formats.quantize, indexed store):", "",
          "| format | tokens | fused µs | unfused µs | fused / unfused |", "|---|---|---|---|---|"]
    for r in report["append"]:
        L.append(f"| {r['format']} | {r['tokens']} | {r['fused_us']:.1f} | {r['unfused_us']:.1f} | {r['ratio']:.2f} |")
    return "\n".join(L) + "\n"


def _guard(fn, *a, **k):
    try:
        return fn(*a, **k)
    except Exception as e:
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:300], "pass": False}


def _refused(fn, *a, **k):
    """A launch the kernel must refuse with a ValueError (a configuration known to compute wrongly)."""
    try:
        fn(*a, **k)
    except ValueError as e:
        return {"refused": str(e)[:200], "pass": True}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:300], "pass": False}
    return {"error": "not refused", "pass": False}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbench.kernels.mla_check", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for mla_check.json and mla_check.md")
    ap.add_argument("--quick", action="store_true", help="smaller benchmark grid")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--heads", default="16,128", help="query head counts for the decode benchmark (comma list): "
                    "16 = DeepSeek-V2-Lite, or V3 at tensor-parallel 8; 128 = V3 on one GPU")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep at 64 x 8192")
    ap.add_argument("--stages", action="store_true", help="only the decode's pipeline-depth table at 64 x 8192 "
                    "(graph replays; writes mla_stages.json / .md)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("mla_check needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    if args.stages:
        rows = sweep_stages(dev, gen, heads=[int(x) for x in args.heads.split(",") if x])
        md = (f"{torch.cuda.get_device_name(dev)}, triton {triton.__version__}, {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} "
              f"UTC, copy {copy_bandwidth(dev):.0f} GB/s; batch 64 x 8192, graph replay µs\n\n" + _stages_md(rows))
        print(md)
        if args.out:
            atomic_write_text(os.path.join(args.out, "mla_stages.json"), json.dumps(rows, indent=1))
            atomic_write_text(os.path.join(args.out, "mla_stages.md"), md)
        return 0
    report = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
              "date": _dt.date.today().isoformat(), "checks": {}, "decode": [], "tuning": {}, "append": [], "prefill": []}
    report["copy_GBps"] = copy_bandwidth(dev)
    print(f"copy bandwidth {report['copy_GBps']:.0f} GB/s", flush=True)
    ok = True
    if not args.skip_checks:
        for f in FORMATS:
            r = {"append": _guard(check_append, f, dev, gen), "decode": _guard(check_decode, f, dev, gen),
                 "decode H=16": _guard(check_decode, f, dev, gen, heads=16),
                 "decode H=16 bytes": _guard(check_decode, f, dev, gen, heads=16, units16=False),
                 "decode H=128 units": _guard(check_decode, f, dev, gen, units16=True),
                 "decode fp8 q": _guard(check_decode_fp8_query, f, dev, gen),
                 "decode fp8 q H=16": _guard(check_decode_fp8_query, f, dev, gen, heads=16),
                 "prefill": _guard(check_prefill, f, dev, gen),
                 "prefill fp8 q": _guard(check_prefill, f, dev, gen, fp8_query=True),
                 "prefill 128-token tiles": _guard(check_prefill, f, dev, gen, block_n=128, num_stages=1),
                 "prefill in registers": _guard(check_prefill, f, dev, gen, prefix_workspace=False),
                 "prefill split prefix": _guard(check_prefill, f, dev, gen, num_splits=5),
                 "prefill split prefix in registers": _guard(check_prefill, f, dev, gen, num_splits=5, prefix_workspace=False),
                 "prefill fp8 q in registers": _guard(check_prefill, f, dev, gen, fp8_query=True, prefix_workspace=False),
                 "prefill 128-token tiles in registers": (
                     _guard(check_prefill, f, dev, gen, block_n=128, num_stages=1, prefix_workspace=False) if f != "nvfp4"
                     else _refused(check_prefill, f, dev, gen, block_n=128, num_stages=1, prefix_workspace=False)),
                 "decode bytes 128-token tiles": _guard(check_decode, f, dev, gen, heads=16, units16=False, block_n=128,
                                                        num_stages=1)}
            report["checks"][f] = r
            ok &= all(x.get("pass") for x in r.values())
            print(f, json.dumps(r), flush=True)
            torch.cuda.empty_cache()
    batches = (1, 64, 128) if args.quick else (1, 8, 32, 64, 128)
    ctxs = (1024, 8192, 32768) if args.quick else (1024, 4096, 8192, 32768)
    heads = [int(x) for x in args.heads.split(",") if x]
    for f in ("bf16", "fp8_e4m3", "nvfp4"):
        for nh in heads:
            if not args.no_sweep:
                tuned = _guard(tune_decode, f, dev, gen, heads=nh)
                rows = tuned[1] if isinstance(tuned, tuple) else [tuned]
                report["tuning"][f"{f} H={nh}"] = rows
                print("tuning", f, nh, json.dumps(rows), flush=True)
            # the table uses mla_decode's defaults (what the runtime runs); the sweep shows the alternatives
            res = _guard(bench_decode, f, {}, dev, gen, batches, ctxs, heads=nh)
            if isinstance(res, list):
                report["decode"] += res
            res = _guard(bench_decode, f, {}, dev, gen, (64, 128), (8192, 32768), heads=nh, fp8_query=True)
            if isinstance(res, list):
                report["decode"] += res
            torch.cuda.empty_cache()
        for nh in heads:
            for q8 in (False, True):
                for ws in ((None,) if f == "bf16" else (None, False)):  # quantized: the default and the prefix in registers
                    res = _guard(bench_prefill, f, dev, gen, heads=nh, fp8_query=q8, prefix_workspace=ws,
                                 cases=PREFILL_CASES)
                    if isinstance(res, list):
                        report["prefill"] += res
                    torch.cuda.empty_cache()
        res = _guard(bench_append, f, dev, gen)
        if isinstance(res, list):
            report["append"] += res
    md = _md(report)
    print(md)
    if args.out:
        atomic_write_text(os.path.join(args.out, "mla_check.json"), json.dumps(report, indent=1))
        atomic_write_text(os.path.join(args.out, "mla_check.md"), md)
    return 0 if ok else 1



if __name__ == "__main__":
    sys.exit(main())

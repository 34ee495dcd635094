"""GPU check and benchmarks of the MLA kernels: ``python -m kvbench.tools.mla_check [--out DIR] [--quick]``
(also ``kvbench bench mla``).

1. Measured copy bandwidth (device-to-device clone, bytes read + written).
2. Checks at DeepSeek-V3 attention shapes (128 heads, kv_lora_rank 512, rope 64, nope 128, v 128) for
   the bf16 cache and every quantized format (``common.mla_formats``): fused append bit-exact against
   kernels/formats.py on the latent part (the RoPE part computed in float32 may differ from float64 RoPE by
   an ulp, so a tiny fraction of its codes may sit one step away) and identical to the unfused path; decode
   and prefill/extend of ragged batches (contexts to 32k) against the non-absorbed float64 reference
   (‖out−ref‖/‖ref‖, outputs poisoned); decode also at 16 heads, and with the latent read both as 16-bit
   units and in its stored type.
3. Benchmarks at ``--heads`` (default 16 and 128): a launch-configuration sweep at batch 64 × 8192,
   decode µs and GB/s at batch 1–128 × 1k–32k with ``mla_decode``'s defaults, prefill / extend, fused vs
   unfused append (``mla_bench.py``).

Each check and timing is printed as one line the moment it is measured (progress on stderr), then the
Markdown tables (``mla_report.py``); with ``--out`` writes ``mla_check.json`` and ``mla_check.md`` there.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import traceback

import torch

from kvbench.core import get_spec, is_quantized
from kvbench.core import atomic_write_text
from kvbench.kernels import LatentCache, LatentLayout, absorb_query, rope_cos_sin_cache, unabsorb_output
from kvbench.kernels import mla_append_unfused
from kvbench.kernels.mla_append import mla_append
from kvbench.kernels import MLADecodeOptions, MLAPrefillOptions
from kvbench.kernels.mla_decode import mla_decode
from kvbench.kernels.mla_prefill import mla_prefill
from kvbench.kernels import quantize_absorbed_query, ref_append_rows, ref_decode, ref_decode_latent, ref_prefill
from kvbench.tools.common import bench_formats, mla_formats
from kvbench.tools.mla_common import (H, NOPE, PAGE, RANK, ROPE, SM, VD, cache_for, copy_bandwidth, fill_cache,
                                      random_weights, rel_err)

__all__ = ["H", "RANK", "ROPE", "NOPE", "VD", "PAGE", "SM", "check_append", "check_decode", "check_decode_fp8_query",
           "check_prefill", "format_checks", "main"]


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
        cache = LatentCache.allocate(lay, (t + 100) // PAGE + 2, PAGE, device=dev, k_scale=0.01 if is_quantized(kv_dtype) else 1.0)
        cache.data.view(torch.uint8).fill_(0xFF)
        if cache.block_scale is not None:
            cache.block_scale.view(torch.uint8).fill_(0xFF)
        fn(c, k, q, pos, cs, slots, cache, rope_style="interleaved")
        caches.append(cache)
    keep = slots >= 0
    _, ref = ref_append_rows(c[keep].float(), k[keep].float(), pos[keep], cs, kv_dtype, caches[0].k_scale[0], "interleaved")
    got = caches[0].data.view(-1, lay.packed_dim)[slots[keep]].view(torch.uint8)
    rd = ref.data.view(torch.uint8)
    lb = RANK * get_spec(kv_dtype).element_bits // 8  # bytes of the latent part of a row
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


def check_decode(kv_dtype, dev, gen, lens=(1, 100, 4097, 32768), heads=H, page=PAGE, **launch) -> dict:
    lens = list(lens)
    cache, pt = cache_for(kv_dtype, lens, gen, dev, page=page)
    fill_cache(cache, pt, lens, gen, dev)
    w_uk, w_uv = random_weights(gen, dev, heads)
    b = len(lens)
    qn = torch.randn(b, heads, NOPE, generator=gen).to(dev)
    qp = torch.randn(b, heads, ROPE, generator=gen).to(dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    ql = absorb_query(qn, w_uk).bfloat16()
    out = torch.full((b, heads, RANK), float("nan"), dtype=torch.bfloat16, device=dev)
    o = mla_decode(ql, qp.bfloat16(), cache, pt, sl, SM, out=out, opts=MLADecodeOptions(**launch))
    ref = ref_decode(qn, qp.bfloat16().double(), cache, pt, sl, w_uk, w_uv, SM)
    err = rel_err(unabsorb_output(o.double(), w_uv.double()), ref)
    return {"rel_err": err, "pass": bool(err < 2e-2)}


def check_decode_fp8_query(kv_dtype, dev, gen, lens=(1, 100, 4097, 32768), heads=H, page=PAGE, **launch) -> dict:
    """e4m3 queries with ``q_scale`` (``quantize_query``): against the float64 latent-space decode of the same
    (dequantized) query, so the query's own rounding is not counted."""
    lens = list(lens)
    cache, pt = cache_for(kv_dtype, lens, gen, dev, page=page)
    fill_cache(cache, pt, lens, gen, dev)
    b = len(lens)
    ql8, qp8, qs = quantize_absorbed_query((torch.randn(b, heads, RANK, generator=gen) * 0.5).to(dev),
                                   torch.randn(b, heads, ROPE, generator=gen).to(dev))
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    out = torch.full((b, heads, RANK), float("nan"), dtype=torch.bfloat16, device=dev)
    o = mla_decode(ql8, qp8, cache, pt, sl, SM, q_scale=qs, out=out, opts=MLADecodeOptions(**launch))
    err = rel_err(o, ref_decode_latent(ql8.float() * qs, qp8.float() * qs, cache, pt, sl, SM))
    return {"rel_err": err, "pass": bool(err < 2e-2)}


def check_prefill(kv_dtype, dev, gen, prefix=(0, 1000, 5000, 16), new=(300, 64, 17, 1), fp8_query=False,
                  **launch) -> dict:
    """bf16 queries against the non-absorbed float64 reference; ``fp8_query``: e4m3 queries with ``q_scale``
    against the float64 prefill in latent space (identity up-projections) of the same dequantized query."""
    lens = [p + n for p, n in zip(prefix, new)]
    cache, pt = cache_for(kv_dtype, lens, gen, dev)
    fill_cache(cache, pt, list(prefix), gen, dev)
    w_uk, w_uv = random_weights(gen, dev)
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
        o = mla_prefill(ql8, qp8, cn, kn, cache, pt, sl, cu, SM, q_scale=qs, out=out, opts=MLAPrefillOptions(**launch))
        eye = torch.eye(RANK, dtype=torch.float64, device=dev)[None].expand(H, RANK, RANK)
        ref = ref_prefill(ql8.double() * qs.double(), qp8.double() * qs.double(), cn, kn, cache, pt, sl, cu, eye, eye, SM)
        err = rel_err(o, ref)
    else:
        o = mla_prefill(absorb_query(qn, w_uk).bfloat16(), qp, cn, kn, cache, pt, sl, cu, SM, out=out,
                        opts=MLAPrefillOptions(**launch))
        ref = ref_prefill(qn, qp, cn, kn, cache, pt, sl, cu, w_uk, w_uv, SM)
        err = rel_err(unabsorb_output(o.double(), w_uv.double()), ref)
    return {"rel_err": err, "pass": bool(err < 2e-2)}


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


def format_checks(f, dev, gen) -> list:
    """The checks of format ``f`` as ``(name, thunk)`` in the order they run (``mla_report.CHECK_NAMES`` is
    the table's order); each thunk returns a result dict with ``pass``."""
    g = lambda fn, *a, **k: (lambda: _guard(fn, *a, **k))  # noqa: E731
    return [
        ("append", g(check_append, f, dev, gen)),
        ("decode", g(check_decode, f, dev, gen)),
        ("decode H=16", g(check_decode, f, dev, gen, heads=16)),
        ("decode H=16 bytes", g(check_decode, f, dev, gen, heads=16, units16=False)),
        ("decode H=128 units", g(check_decode, f, dev, gen, units16=True)),
        ("decode fp8 q", g(check_decode_fp8_query, f, dev, gen)),
        ("decode fp8 q H=16", g(check_decode_fp8_query, f, dev, gen, heads=16)),
        # the Triton kernel where the Hopper wgmma kernel is the default (bf16 above 32 heads), and the
        # wgmma kernel with odd head counts, split counts and sequence ends around its 64-token tiles
        ("decode H=128 triton", g(check_decode, f, dev, gen, wgmma=False)),
        ("decode H=96 7 splits", g(check_decode, f, dev, gen, heads=96, num_splits=7)),
        ("decode tile ends", g(check_decode, f, dev, gen, lens=(64, 65, 127, 128, 129, 0, 2))),
        ("decode pages of 16", g(check_decode, f, dev, gen, lens=(1, 100, 4097, 15, 16, 17), page=16)),
        # e4m3 queries and P (lossy), the wgmma kernel only: every other format must refuse it
        ("decode fp8 P", g(check_decode_fp8_query, f, dev, gen, fp8_pv=True) if f == "fp8_e4m3"
         else (lambda: _refused(check_decode_fp8_query, f, dev, gen, fp8_pv=True))),
        ("prefill", g(check_prefill, f, dev, gen)),
        ("prefill fp8 q", g(check_prefill, f, dev, gen, fp8_query=True)),
        ("prefill 128-token tiles", g(check_prefill, f, dev, gen, block_n=128, num_stages=1)),
        ("prefill in registers", g(check_prefill, f, dev, gen, prefix_workspace=False)),
        ("prefill split prefix", g(check_prefill, f, dev, gen, num_splits=5)),
        ("prefill split prefix in registers", g(check_prefill, f, dev, gen, num_splits=5, prefix_workspace=False)),
        ("prefill fp8 q in registers", g(check_prefill, f, dev, gen, fp8_query=True, prefix_workspace=False)),
        # nvfp4 at 128-token tiles with the prefix in registers computes wrongly: the kernel must refuse it
        ("prefill 128-token tiles in registers",
         g(check_prefill, f, dev, gen, block_n=128, num_stages=1, prefix_workspace=False) if f != "nvfp4"
         else (lambda: _refused(check_prefill, f, dev, gen, block_n=128, num_stages=1, prefix_workspace=False))),
        ("decode bytes 128-token tiles", g(check_decode, f, dev, gen, heads=16, units16=False, block_n=128, num_stages=1)),
    ]


def _steps(args, report, dev, gen) -> list:
    """Every measurement of the run, in order, as ``streaming.Step`` yielding ``(kind, row)``; results are
    recorded in ``report`` as they come."""
    from kvbench.tools import mla_bench as B
    from kvbench.tools.streaming import Step

    def copy():
        report["copy_GBps"] = copy_bandwidth(dev)
        return ("copy", {"GBps": report["copy_GBps"]})

    def check(f, name, thunk):
        r = thunk()
        report["checks"].setdefault(f, {})[name] = r
        torch.cuda.empty_cache()
        return ("check", {"format": f, "name": name, "result": r})

    def rows(kind, it, key=None):
        for r in it:
            if key is not None:
                key.append(r)
            yield (kind, r)
        torch.cuda.empty_cache()

    steps = [Step("copy bandwidth", copy)]
    if not args.skip_checks:
        for f in report["formats"]:
            steps += [Step(f"check {f} {name}", lambda f=f, name=name, t=t: check(f, name, t))
                      for name, t in format_checks(f, dev, gen)]
    batches = (1, 64, 128) if args.quick else (1, 8, 32, 64, 128)
    ctxs = (1024, 8192, 32768) if args.quick else (1024, 4096, 8192, 32768)
    heads = [int(x) for x in args.heads.split(",") if x]
    for f in bench_formats():
        for nh in heads:
            if not args.no_sweep:
                steps.append(Step(f"tune decode {f} H={nh} B=64 L=8192", lambda f=f, nh=nh: rows(
                    "tune", B.iter_tune_decode(f, dev, gen, heads=nh), report["tuning"].setdefault(f"{f} H={nh}", []))))
            # the table uses mla_decode's defaults (what the runtime runs); the sweep shows the alternatives
            steps.append(Step(f"decode {f} H={nh} B<={max(batches)} L<={max(ctxs)}", lambda f=f, nh=nh: rows(
                "decode", B.iter_decode(f, {}, dev, gen, batches, ctxs, heads=nh), report["decode"])))
            steps.append(Step(f"decode {f} H={nh} e4m3 q", lambda f=f, nh=nh: rows(
                "decode", B.iter_decode(f, {}, dev, gen, (64, 128), (8192, 32768), heads=nh, fp8_query=True),
                report["decode"])))
        for nh in heads:
            for q8 in (False, True):
                for ws in ((None, False) if is_quantized(f) else (None,)):  # quantized: also the prefix in registers
                    steps.append(Step(f"prefill {f} H={nh}{' e4m3 q' if q8 else ''}{' in registers' if ws is False else ''}",
                                      lambda f=f, nh=nh, q8=q8, ws=ws: rows("prefill", B.iter_prefill(
                                          f, dev, gen, heads=nh, fp8_query=q8, prefix_workspace=ws,
                                          cases=B.PREFILL_CASES), report["prefill"])))
        steps.append(Step(f"append {f}", lambda f=f: rows("append", B.iter_append(f, dev, gen), report["append"])))
    return steps


def _error_row(step, e):
    traceback.print_exc()
    return ("error", {"format": "", "step": step.label, "error": f"{type(e).__name__}: {e}"[:300]})


def _vs_flashinfer(args) -> int:
    """``--flashinfer``: the table of ``mla_bench.iter_vs_flashinfer`` and the targets, printed as measured."""
    import triton

    from kvbench.tools.mla_bench import iter_vs_flashinfer, mla_speed_targets

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    heads = tuple(int(x) for x in args.heads.split(",") if x)
    head = (f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}, "
            f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC; MLA decode 64 x 8192, rank 512 + rope 64, "
            f"page {PAGE}; medians of triton.testing.do_bench (L2 flushed before each call) and, for kvbench, of "
            f"CUDA-graph replays (the targets' figures)")
    print(head, flush=True)
    lines = ["| who | KV | query | heads | µs | TFLOP/s | GB/s | graph µs | graph TFLOP/s | kvbench × | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for r in iter_vs_flashinfer(dev, gen, heads=heads, formats=tuple(mla_formats())):
        rows.append(r)
        note = r.get("error", "") or (f"output vs kvbench's {r['rel_err_vs_kvbench']:.1e}" if "rel_err_vs_kvbench" in r else "")
        fx = lambda k, f: format(r[k], f) if k in r else ""  # noqa: E731
        lines.append(f"| {r['who']} | {r['format']} | {r.get('query', 'bf16')} | {r['heads']} | {fx('us', '.1f')} | {fx('TFLOPs', '.0f')} | "
                     f"{fx('GBps', '.0f')} | {fx('graph_us', '.1f')} | {fx('graph_TFLOPs', '.0f')} | {fx('kvbench_x', '.2f')} | "
                     f"{note} |")
        print(lines[-1], flush=True)
    tg = mla_speed_targets(rows)
    md = head + "\n\n" + "\n".join(lines) + "\n\n" + "\n".join(
        f"- {'MET' if ok else 'MISS'} {name}: {val}" for name, ok, val in tg) + "\n"
    print("\n".join(f"{'MET ' if ok else 'MISS'}  {name:<55} {val}" for name, ok, val in tg))
    if args.out:
        atomic_write_text(os.path.join(args.out, "mla_flashinfer.json"),
                          json.dumps(dict(header=head, rows=rows, targets=tg), indent=1))
        atomic_write_text(os.path.join(args.out, "mla_flashinfer.md"), md)
    return 0


def main(argv=None) -> int:
    from kvbench.tools.mla_bench import iter_stages
    from kvbench.tools.mla_report import ROW_HEADER, report_md, row_line, stages_md
    from kvbench.tools.streaming import Step, run_steps

    ap = argparse.ArgumentParser(prog="python -m kvbench.tools.mla_check", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for mla_check.json and mla_check.md")
    ap.add_argument("--quick", action="store_true", help="smaller benchmark grid")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--heads", default="16,128", help="query head counts for the decode benchmark (comma list): "
                    "16 = DeepSeek-V2-Lite, or V3 at tensor-parallel 8; 128 = V3 on one GPU")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-configuration sweep at 64 x 8192")
    ap.add_argument("--stages", action="store_true", help="only the decode's pipeline-depth table at 64 x 8192 "
                    "(graph replays; writes mla_stages.json / .md)")
    ap.add_argument("--flashinfer", action="store_true", help="only kvbench's decode per format against flashinfer's "
                    "paged MLA decode (fa2, fa3) at 64 x 8192 for each of --heads, with the speed targets "
                    "(writes mla_flashinfer.json / .md)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("mla_check needs a CUDA device", file=sys.stderr)
        return 2
    if args.flashinfer:
        return _vs_flashinfer(args)
    import triton

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    line = lambda kr: row_line(*kr)  # noqa: E731
    if args.stages:
        heads = [int(x) for x in args.heads.split(",") if x]
        rows = [r for _, r in run_steps([Step(f"stages H={nh}", lambda nh=nh: (("stages", r) for r in iter_stages(
            dev, gen, heads=(nh,)))) for nh in heads], fmt=line, header=ROW_HEADER)]
        md = (f"{torch.cuda.get_device_name(dev)}, triton {triton.__version__}, {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} "
              f"UTC, copy {copy_bandwidth(dev):.0f} GB/s; batch 64 x 8192, graph replay µs\n\n" + stages_md(rows))
        print(md)
        if args.out:
            atomic_write_text(os.path.join(args.out, "mla_stages.json"), json.dumps(rows, indent=1))
            atomic_write_text(os.path.join(args.out, "mla_stages.md"), md)
        return 0
    report = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
              "date": _dt.date.today().isoformat(), "formats": list(mla_formats()), "checks": {}, "decode": [],
              "tuning": {}, "append": [], "prefill": [], "errors": []}
    for kind, r in run_steps(_steps(args, report, dev, gen), fmt=line, header=ROW_HEADER, on_error=_error_row):
        if kind == "error":
            report["errors"].append(r)
    ok = all(x.get("pass") for per in report["checks"].values() for x in per.values())
    md = report_md(report)
    print(md)
    if args.out:
        atomic_write_text(os.path.join(args.out, "mla_check.json"), json.dumps(report, indent=1))
        atomic_write_text(os.path.join(args.out, "mla_check.md"), md)
    if not args.quick:  # the speed targets close the full run (the table of --flashinfer)
        print("\n## targets (decode at 64 x 8192; `--flashinfer` runs this table alone)", flush=True)
        _vs_flashinfer(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""GPU probes behind issue 28's tuning choices (docs/kernels.md, "Speed targets of issue 28", and docs/performance.md);
the figures cited there came from this code on an H100 (2026-11-24 as throw-away copies, since 2026-11-25 from
the committed script).

Subcommands (each prints its rows as it measures them; CUDA graph replays for the append, ``do_bench`` medians
for the decode):

- ``append-shapes``: the fused append over heads per program 1-8 × warps 1-8 × kv blocks first or last, against
  the unfused pair and the plain bf16 store, each at its own best launch shape; 1 / 16 / 128 / 512 tokens, 32/8
  heads, D 128, HND pages.  Where ``append.launch_shape`` comes from.
- ``packed-stores``: nvfp4's fused append with its codes and block scales stored as 32-bit words against byte
  stores (best of 16 launch shapes each), after checking every nvfp4 append case of the GPU grid bit for bit with
  the word stores forced.  Where ``append.packed_stores`` comes from.
- ``append-variants``: the fused append, the unfused pair and the plain bf16 store with the append kernel's
  flags off and on (``hoist``: v and the scales loaded before the RoPE, not after the slot's test; ``bitcode``:
  e2m1 codes from the float's bits, not seven threshold comparisons; both on by default); the ``--check``
  variants first checked bit for bit on the GPU grid's append cases; 1 / 16 / 128 / 512 tokens, the variants
  interleaved over three rounds, medians.
- ``decode-sweep``: nvfp4 paged decode over tiles × warps × register caps × stages × prefetch at 64 × 8192, and
  with 8 / 16 / 32 splits at 8 × 32768.  Where ``decode._FILL`` comes from.
- ``nv4-layouts [--shapes 64x8192,8x32768,64x2048]``: the explicit-layout nvfp4 decode's launch options against the
  Triton nvfp4 decode and bf16 (graph replays); 64x2048 is the engine step's shape.
- ``nv4-check``: the explicit-layout and Triton nvfp4 decodes against the float64 reference (60 cases).
- ``gemm-layouts``: the Llama-3-8B step's weight GEMMs at 64 / 256 / 2048 / 8192 rows with row-major [N, K] and
  K-major weights (``llama.k_major``).  Where the engine's K-major weights on the GPU come from
  (docs/performance.md).
- ``ncu-decode FMT`` / ``ncu-append FMT T``: three launches of one kernel at the benchmark's shape, for
  ``ncu --kernel-name regex:_decode_split --launch-skip 2 --launch-count 1 --set full python ... ncu-decode nvfp4``
  (and ``regex:_append_kernel`` for the append).
"""

from __future__ import annotations

import argparse
import itertools
import sys

HQ, HK, D, PAGE, LAYOUT = 32, 8, 128, 16, "HND"


def _append_inputs(fmt: str, t: int, gen):
    import torch

    from kvbench.kernels.config import PagedKV
    from kvbench.kernels.reference import build_cos_sin_cache
    from kvbench.tools.kernel_check import make_cache

    cs = build_cos_sin_cache(8192, D, device="cuda")
    q = torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, HK, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (t,), device="cuda")
    slots = torch.randperm(64 * PAGE, device="cuda")[:t]
    kc, kbs, ks, _ = make_cache(fmt, 64, PAGE, HK, D, "cuda", gen, LAYOUT)
    vc, vbs, vs, _ = make_cache(fmt, 64, PAGE, HK, D, "cuda", gen, LAYOUT)
    return q, k, v, pos, slots, cs, PagedKV(fmt, kc, vc, ks, vs, kbs, vbs)


def _sweep(fn, kv_firsts=(True,), extra=None) -> list:
    """``fn`` timed at every (heads per program, warps[, kv blocks first]) → sorted (µs, kv_first, hb, warps)."""
    from kvbench.kernels import append as A
    from kvbench.tools.common import bench_us

    out = []
    try:
        for kvf, hb, nw in itertools.product(kv_firsts, (8, 4, 2, 1), (1, 2, 4, 8)):
            A._TUNE.clear()
            A._TUNE.update(hb=hb, num_warps=nw, kv_first=kvf, **(extra or {}))
            out.append((bench_us(fn, graph=True), kvf, hb, nw))
    finally:
        A._TUNE.clear()
    return sorted(out)


def append_shapes() -> None:
    import torch

    from kvbench.kernels import append as A
    from kvbench.tools.common import bench_us

    gen = torch.Generator().manual_seed(0)
    for t in (1, 16, 128, 512):
        q, k, v, pos, slots, cs, kvb = _append_inputs("bf16", t, gen)
        plain = lambda: A.quantize_store(k, v, slots, kvb)  # noqa: E731
        pl_default, pl = bench_us(plain, graph=True), _sweep(plain)[0]
        print(f"T={t:4d} plain store: default {pl_default:.1f} us, best {pl[0]:.1f} (hb={pl[2]} warps={pl[3]})",
              flush=True)
        plain_us = min(pl_default, pl[0])
        for fmt in ("bf16", "fp8_e4m3", "nvfp4"):
            args = _append_inputs(fmt, t, gen)
            unf = lambda: A.unfused_rope_quant_append(*args)  # noqa: E731
            fus = lambda: A.fused_rope_quant_append(*args)  # noqa: E731
            u_default, f_default = bench_us(unf, graph=True), bench_us(fus, graph=True)
            ub = _sweep(unf)[0]
            fb = _sweep(fus, (False, True))
            u_us, b = min(u_default, ub[0]), fb[0]
            print(f"T={t:4d} {fmt:9s} unfused default {u_default:.1f} best {ub[0]:.1f} | fused default {f_default:.1f} "
                  f"best {b[0]:.1f} (kv_first={b[1]} hb={b[2]} warps={b[3]}): {b[0] / u_us:.2f}x the best unfused, "
                  f"{b[0] / plain_us:.2f}x the best plain store; next "
                  + " ".join(f"{r[0]:.1f}/{int(r[1])}/{r[2]}/{r[3]}" for r in fb[1:6]), flush=True)


def _check_grid(prefix: str) -> tuple:
    """The GPU grid's cases whose labels start with ``prefix``, run → (cases, failures); failures printed."""
    from kvbench.tools.kernel_check_grid import gpu_cases

    n = bad = 0
    for label, thunk in gpu_cases():
        if label.startswith(prefix):
            case = thunk()
            n += 1
            if not case.ok:
                bad += 1
                print("FAIL", case.line(), flush=True)
    return n, bad


def packed_stores() -> int:
    import torch

    from kvbench.kernels import append as A

    A._TUNE.clear()
    A._TUNE["packed"] = True
    try:
        n, bad = _check_grid("append nvfp4")
    finally:
        A._TUNE.clear()
    print(f"nvfp4 append cases with word stores: {n - bad}/{n} bit-exact", flush=True)
    gen = torch.Generator().manual_seed(0)
    for t in (1, 16, 128, 512):
        args = _append_inputs("nvfp4", t, gen)
        fus = lambda: A.fused_rope_quant_append(*args)  # noqa: E731
        best = {p: _sweep(fus, extra={"packed": p})[0] for p in (False, True)}
        print(f"T={t}: byte stores {best[False][0]:.2f} us (hb={best[False][2]} warps={best[False][3]}), "
              f"word stores {best[True][0]:.2f} us (hb={best[True][2]} warps={best[True][3]})", flush=True)
    return 1 if bad else 0


APPEND_VARIANTS = {  # append._TUNE flags; "default" is the kernel as shipped
    "before": {"hoist": False, "bitcode": False},
    "hoist": {"hoist": True, "bitcode": False},
    "bitcode": {"hoist": False, "bitcode": True},
    "default": {},
}


def append_variants(names=tuple(APPEND_VARIANTS), check=("before",), rounds: int = 3) -> int:
    import statistics

    import torch

    from kvbench.kernels import append as A
    from kvbench.tools.common import bench_us

    def flags(name):
        A._TUNE.clear()
        A._TUNE.update(APPEND_VARIANTS[name])

    bad = 0
    try:
        for name in check:
            flags(name)
            n, nbad = _check_grid("append")
            print(f"{name}: {n - nbad}/{n} append cases bit-exact", flush=True)
            bad += nbad
        gen = torch.Generator().manual_seed(0)
        for t in (1, 16, 128, 512):
            for fmt in ("bf16", "fp8_e4m3", "nvfp4"):
                args = _append_inputs(fmt, t, gen)
                q, k, v, pos, slots, cs, _ = args
                kvb = _append_inputs("bf16", t, gen)[6]
                fns = {"fused": lambda: A.fused_rope_quant_append(*args),
                       "unfused": lambda: A.unfused_rope_quant_append(*args),
                       "plain": lambda: A.quantize_store(k, v, slots, kvb)}
                times = {(nm, part): [] for nm in names for part in fns}
                for _ in range(rounds):
                    for nm in names:
                        flags(nm)
                        for part, fn in fns.items():
                            times[(nm, part)].append(bench_us(fn, graph=True))
                for nm in names:
                    f, u, pl = (statistics.median(times[(nm, part)]) for part in ("fused", "unfused", "plain"))
                    print(f"T={t:4d} {fmt:9s} {nm:22s} fused {f:5.2f} unfused {u:5.2f} plain {pl:5.2f} us: "
                          f"{f / u:.3f}x unfused, {f / pl:.3f}x plain", flush=True)
    finally:
        A._TUNE.clear()
    return 1 if bad else 0


def decode_sweep() -> None:
    import torch

    from kvbench.kernels.config import DecodeOptions, PagedKV
    from kvbench.kernels.decode import paged_decode
    from kvbench.tools.common import bench_us, copy_bandwidth
    from kvbench.tools.decode_bench import decode_case

    copy = copy_bandwidth()
    for b, ctx in ((64, 8192), (8, 32768)):
        q, table, seq, kv, nbytes = decode_case("nvfp4", b, ctx, HQ, HK, D, PAGE, torch.Generator().manual_seed(0),
                                                LAYOUT)
        out = torch.empty_like(q)
        pkv = PagedKV("nvfp4", **kv)

        def run(**cfg):
            opts = DecodeOptions(**cfg)
            return bench_us(lambda: paged_decode(q, pkv, table, seq, out=out, opts=opts))

        pct = lambda us: 100 * nbytes / (us * 1e-6) / 1e9 / copy  # noqa: E731
        default = run()
        configs = list(itertools.product((64, 128), (4, 8), (None, 128, 168, 232), (2, 3), (False, True)))
        if b == 8:  # the long shape: every other configuration, with explicit split counts
            configs = [c + (s,) for c in configs[::2] for s in (8, 16, 32)]
        timed = []
        for c in configs:
            cfg = dict(block_n=c[0], num_warps=c[1], maxnreg=c[2], num_stages=c[3], prefetch=c[4])
            if len(c) > 5:
                cfg["num_splits"] = c[5]
            try:
                timed.append((run(**cfg), cfg))
            except Exception:  # noqa: BLE001 - a configuration that does not compile is left out
                continue
        timed.sort(key=lambda x: x[0])
        print(f"B={b} L={ctx}: defaults {default:.1f} us ({pct(default):.0f}% of copy, {copy:.0f} GB/s); "
              f"best of {len(timed)}:", flush=True)
        for us, cfg in timed[:6]:
            print(f"   {us:.1f} us ({pct(us):.0f}%) {cfg}", flush=True)


def nv4_layouts(shapes=("64x8192", "8x32768")) -> None:
    """bf16, the Triton nvfp4 decode (``gluon=False``) and the explicit-layout (Gluon) nvfp4 decode at the
    given shapes (64x8192, 8x32768, and 64x2048, the engine step's), graph replays: the Gluon kernel's register
    prefetch on / off, register caps and split counts."""
    import torch

    from kvbench.kernels.config import DecodeOptions, PagedKV
    from kvbench.kernels.decode import paged_decode
    from kvbench.tools.common import bench_us, copy_bandwidth
    from kvbench.tools.decode_bench import decode_case

    copy = copy_bandwidth()
    print(f"copy {copy:.0f} GB/s", flush=True)
    g = {"gluon": True}
    v64 = [("bf16", {}), ("nvfp4", {"gluon": False}), ("nvfp4", {})]
    v64 += [("nvfp4", {**g, "prefetch": p, "maxnreg": r}) for p in (False, True) for r in (0, 128, 168)]
    v64 += [("nvfp4", {**g, "num_splits": 2}), ("nvfp4", {**g, "prefetch": False, "maxnreg": 0, "num_splits": 2})]
    v8 = [("bf16", {}), ("nvfp4", {"gluon": False}), ("nvfp4", {})]
    v8 += [("nvfp4", {**g, "num_splits": s}) for s in (4, 6, 12, 16)]
    v8 += [("nvfp4", {**g, "prefetch": False, "maxnreg": 0, "num_splits": s}) for s in (4, 6, 8, 12)]
    v8 += [("nvfp4", {**g, "prefetch": True, "maxnreg": 0, "num_splits": s}) for s in (4, 8)]
    v2k = [("bf16", {}), ("nvfp4", {"gluon": False}), ("nvfp4", {})]  # the engine step's shape (64 x 2048)
    v2k += [("nvfp4", {**g, "prefetch": p, "maxnreg": r}) for p in (False, True) for r in (0, 168)]
    v2k += [("nvfp4", {**g, "num_splits": 2})]
    groups = {"64x8192": (64, 8192, v64), "8x32768": (8, 32768, v8), "64x2048": (64, 2048, v2k)}
    for b, ctx, variants in (groups[k] for k in shapes):
        cases = {}
        for fmt, kw in variants:
            if fmt not in cases:
                cases.clear()
                torch.cuda.empty_cache()
                cases[fmt] = decode_case(fmt, b, ctx, HQ, HK, D, PAGE, torch.Generator().manual_seed(0), LAYOUT)
            q, table, seq, kv, nbytes = cases[fmt]
            out = torch.empty_like(q)
            pkv, opts = PagedKV(fmt, **kv), DecodeOptions(**kw)
            us = bench_us(lambda: paged_decode(q, pkv, table, seq, out=out, opts=opts), graph=True)
            print(f"B={b} L={ctx} {fmt} {kw or 'defaults'}: {us:.1f} us "
                  f"({100 * nbytes / (us * 1e-6) / 1e9 / copy:.0f}% of copy)", flush=True)


def nv4_cases(torch) -> list:
    """The nvfp4 decode's check cases: (lens, query heads, kv heads, page, options)."""
    return [
        ([1, 7, 128, 129, 300, 1000], 32, 8, 16, {}),
        ([5, 64, 257, 700], 32, 8, 16, {"layout": "HND"}),
        ([33, 400, 1025], 16, 16, 16, {}),
        ([900, 2000], 64, 4, 16, {"layout": "HND"}),
        ([17, 333, 1500], 32, 8, 32, {"window": 100}),
        ([17, 333, 1500], 32, 8, 16, {"sinks": True}),
        ([1, 2000], 8, 1, 16, {"sinks": True, "window": 700}),
        ([4000, 20], 32, 8, 16, {"dtype": torch.float16}),
        ([3000, 3001, 4096], 32, 8, 16, {"num_splits": 1}),
        ([3000, 3001, 4096], 32, 8, 16, {"num_splits": 7, "sinks": True}),
        ([3000, 3001, 4096], 32, 8, 16, {"num_splits": 1, "sinks": True, "layout": "HND"}),
        ([2000, 37, 4099], 32, 8, 16, {"window": 333, "num_splits": 3, "layout": "HND"}),
        ([2000, 37, 4099], 48, 8, 64, {"window": 1021, "prefetch": True}),
        ([2000, 37, 4099], 32, 8, 16, {"prefetch": True, "maxnreg": 128, "num_splits": 2}),
        ([2000, 37, 4099], 32, 8, 16, {"maxnreg": 128}),
    ]


def nv4_check() -> int:
    """The explicit-layout nvfp4 decode and the Triton one against the float64 reference: 15 cases x 2 seeds
    each (GQA 1-16, pages 16 / 32 / 64, NHD / HND, windows, sinks, fp16 queries, 1-7 splits, the launch
    sweep's prefetch and register caps).  Exit 1 if any case fails."""
    import torch

    from kvbench.tools.kernel_check import check_decode

    cases = nv4_cases(torch)
    ok = n = 0
    for lens, hq, hk, page, kw in cases:
        for seed in (0, 1):
            for gluon in (True, False):
                c = check_decode("nvfp4", lens, hq, hk, D, page, seed=seed, gluon=gluon, **kw)
                n += 1
                ok += bool(c.ok)
                print(f"{'ok  ' if c.ok else 'FAIL'} gluon={gluon} {c.label} {kw} seed={seed}: rel err {c.err:.2e} "
                      f"(tol {c.tol})", flush=True)
    print(f"{ok}/{n} passed", flush=True)
    return 0 if ok == n else 1


def gemm_layouts() -> None:
    """The decode step's weight GEMMs (synthetic Llama-3-8B) at 64 and 256 rows (decode batches) and 2048 and
    8192 (prefill chunks; the logits only at 64 and 256: a prefill computes them for its sampled rows), the weight stored [N, K] (``F.linear`` on a row-major weight) or K-major (``F.linear`` on
    ``llama.k_major``'s view of a [K, N] tensor, what the engine does on a GPU), and the logits' float32 output
    as a cast after the GEMM or from the GEMM (``out_dtype``): graph replays of R launches over R weight copies
    (more bytes than L2 holds), µs per launch, GB/s of weight bytes and TFLOP/s."""
    import torch
    import torch.nn.functional as F

    from kvbench.runtime.models.llama import k_major
    from kvbench.tools.common import copy_bandwidth

    copy = copy_bandwidth()
    print(f"copy {copy:.0f} GB/s", flush=True)

    def timed(fns) -> float:
        for f in fns:
            f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        g.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) * 1e3 / 10 / len(fns)

    for m in (64, 256, 2048, 8192):
        x = torch.randn(m, 14336, dtype=torch.bfloat16, device="cuda")
        for name, n, k in (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
                           ("lm_head", 128256, 4096)):
            if name == "lm_head" and m > 256:
                continue
            r = max(2, -(-400_000_000 // (n * k * 2))) if m <= 256 else 2
            ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(r)]
            xi = x[:, :k].contiguous()
            rows = {"[N,K]": [lambda w=w: F.linear(xi, w) for w in ws]}
            kms = [k_major(w) for w in ws]
            rows["K-major"] = [lambda w=w: F.linear(xi, w) for w in kms]
            if name == "lm_head":
                rows["[N,K] + float()"] = [lambda w=w: F.linear(xi, w).float() for w in ws]
                rows["K-major + float()"] = [lambda w=w: F.linear(xi, w).float() for w in kms]
                rows["K-major, out_dtype=float32"] = [lambda w=w: torch.mm(xi, w.t(), out_dtype=torch.float32) for w in kms]
            for label, fns in rows.items():
                try:
                    us = timed(fns)
                except Exception as e:  # noqa: BLE001 - e.g. no out_dtype in this torch
                    print(f"M={m} {name} {label}: failed ({type(e).__name__}: {str(e)[:200]})", flush=True)
                    continue
                gbs = n * k * 2 / (us * 1e-6) / 1e9
                print(f"M={m} {name} ({n} x {k}) {label}: {us:.1f} us, {gbs:.0f} GB/s ({100 * gbs / copy:.0f}% of copy), "
                      f"{2 * m * n * k / (us * 1e-6) / 1e12:.0f} TFLOP/s", flush=True)
            del ws, kms, rows
            torch.cuda.empty_cache()


def ncu_decode(fmt: str) -> None:
    import torch

    from kvbench.kernels.config import PagedKV
    from kvbench.kernels.decode import paged_decode
    from kvbench.tools.decode_bench import decode_case

    q, table, seq, kv, _ = decode_case(fmt, 64, 8192, HQ, HK, D, PAGE, torch.Generator().manual_seed(0), LAYOUT)
    out = torch.empty_like(q)
    for _ in range(3):
        paged_decode(q, PagedKV(fmt, **kv), table, seq, out=out)
    torch.cuda.synchronize()


def ncu_append(fmt: str, t: int) -> None:
    import torch

    from kvbench.kernels.append import fused_rope_quant_append

    args = _append_inputs(fmt, t, torch.Generator().manual_seed(0))
    for _ in range(3):
        fused_rope_quant_append(*args)
    torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python docs/scripts/speed_probes.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("append-shapes", help="the fused append's launch-shape sweep")
    sub.add_parser("packed-stores", help="nvfp4 word stores: bit-exactness on the GPU grid, then timing")
    p = sub.add_parser("append-variants", help="the append kernel's variant flags: bit-exactness, then timing")
    p.add_argument("--variants", default=",".join(APPEND_VARIANTS), help="comma list of " + ", ".join(APPEND_VARIANTS))
    p.add_argument("--check", default="before", help="variants checked bit for bit first (the default's cases are "
                   "kernel_check's)")
    sub.add_parser("decode-sweep", help="nvfp4 decode launch sweep at 64 x 8192 and 8 x 32768")
    p = sub.add_parser("nv4-layouts", help="the explicit-layout nvfp4 decode against the Triton one and bf16")
    p.add_argument("--shapes", default="64x8192,8x32768", help="comma list of 64x8192, 8x32768, 64x2048")
    sub.add_parser("nv4-check", help="the explicit-layout and Triton nvfp4 decodes against the float64 reference")
    sub.add_parser("gemm-layouts", help="the decode step's weight GEMMs with [N, K] or [K, N] weights")
    p = sub.add_parser("ncu-decode", help="three decode launches at 64 x 8192 (for Nsight Compute)")
    p.add_argument("fmt")
    p = sub.add_parser("ncu-append", help="three fused-append launches (for Nsight Compute)")
    p.add_argument("fmt")
    p.add_argument("tokens", type=int)
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("speed_probes needs a CUDA device", file=sys.stderr)
        return 2
    if a.cmd == "append-shapes":
        append_shapes()
    elif a.cmd == "packed-stores":
        return packed_stores()
    elif a.cmd == "append-variants":
        return append_variants(tuple(a.variants.split(",")), tuple(filter(None, a.check.split(","))))
    elif a.cmd == "decode-sweep":
        decode_sweep()
    elif a.cmd == "nv4-layouts":
        nv4_layouts(tuple(a.shapes.split(",")))
    elif a.cmd == "nv4-check":
        return nv4_check()
    elif a.cmd == "gemm-layouts":
        gemm_layouts()
    elif a.cmd == "ncu-decode":
        ncu_decode(a.fmt)
    else:
        ncu_append(a.fmt, a.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())

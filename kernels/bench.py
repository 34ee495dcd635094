"""Kernel benchmarks (``kvbench bench kernels``): the Triton KV kernels against the device's copy
bandwidth and against anchors measured in the same run — flashinfer's paged decode / prefill (bf16 and
fp8 KV, when importable) and torch's ``scaled_dot_product_attention`` on the dense problem.

Timings are medians (``triton.testing.do_bench``; the append kernels, a few microseconds each, are
timed as CUDA-graph replays).  Decode bytes = KV read (block scales included) + q + out.  The target
table of issue 3 is evaluated at the end; ``main`` returns 0 when the run completed (targets missed
are reported, not errors) and writes ``--out`` (JSON) atomically.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

__all__ = ["Row", "graph_us", "main"]


@dataclass
class Row:
    name: str
    us: float
    gbps: Optional[float] = None
    pct_copy: Optional[float] = None
    tflops: Optional[float] = None
    note: str = ""

    def line(self) -> str:
        parts = [f"{self.name:<52} {self.us:9.1f} us"]
        if self.gbps is not None:
            parts.append(f"{self.gbps:7.0f} GB/s ({self.pct_copy:4.0f}% of copy)")
        if self.tflops is not None:
            parts.append(f"{self.tflops:6.0f} TFLOP/s")
        if self.note:
            parts.append(self.note)
        return "  ".join(parts)


def graph_us(fn: Callable, rep: int = 50) -> float:
    """Median µs of ``fn`` replayed as a CUDA graph: the kernels' own time, without the host's launch gaps.
    The first call compiles outside the capture; then this stream is drained, because triton's
    ``do_bench_cudagraph`` replays on a stream of its own that does not wait for it (inputs still being
    written, sequence lengths among them, were read half-made: an illegal address on an H100)."""
    import torch
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    return 1e3 * tt.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def _bench(fn: Callable, graph: bool = False) -> float:
    """Median time of ``fn`` in microseconds (``graph``: ``graph_us``)."""
    import triton.testing as tt

    if graph:
        return graph_us(fn)
    fn()
    return 1e3 * tt.do_bench(fn, warmup=50, rep=300, return_mode="median")


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy (bytes read + bytes written)."""
    import torch

    n = 1 << 30
    a = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    t = _bench(lambda: b.copy_(a))
    del a, b
    return 2 * 2 * n / (t * 1e-6) / 1e9


# ------------------------------------------------------------------------------------ decode
def _decode_case(fmt, batch, ctx, hq, hk, d, page, gen, layout="NHD"):
    import torch

    from kvbench.kernels.check import make_cache, random_page_table

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


def bench_decode(copy_gbps, batch=64, ctx=8192, hq=32, hk=8, d=128, page=16, formats=("bf16", "fp8_e4m3", "nvfp4"),
                 tune=True, layout="HND"):
    import torch

    from kvbench.kernels.decode import paged_decode

    gen = torch.Generator().manual_seed(0)
    rows, best = [], {}
    configs = [dict()] + [dict(block_n=bn, num_splits=ns, num_warps=nw) for bn in (32, 64, 128, 256)
                          for ns in (1, 2, 4, 8, 16) for nw in (4, 8)] if tune else [dict()]
    for fmt in formats:
        q, table, seq, kv, nbytes = _decode_case(fmt, batch, ctx, hq, hk, d, page, gen, layout)
        out = torch.empty_like(q)
        timed = []
        for cfg in configs:
            try:
                t = _bench(lambda: paged_decode(q, page_table=table, seq_lens=seq, kv_format=fmt, out=out, **kv, **cfg))
                timed.append((t, cfg))
            except Exception as e:  # a config that does not compile (registers, shared memory) is skipped
                print(f"  decode {fmt} {cfg}: {type(e).__name__}: {str(e)[:80]}")
        if not timed:
            rows.append(Row(f"decode triton {fmt} (every config failed)", float("nan")))
            continue
        t, cfg = min(timed, key=lambda x: x[0])
        gb = nbytes / (t * 1e-6) / 1e9
        best[fmt] = t
        dflt = [td for td, c in timed if not c]
        note = f"best of {len(timed)}: {cfg or 'defaults'}" + (f"; defaults {dflt[0]:.1f} us" if dflt else "")
        rows.append(Row(f"decode triton {fmt} B{batch}x{ctx} {hq}/{hk} D{d} p{page} {layout}", t, gb,
                        100 * gb / copy_gbps, note=note))
        del kv
        torch.cuda.empty_cache()
    return rows, best


def fi_kv(kc, vc, layout):
    """The cache planes as flashinfer takes them: NHD as stored, HND as the contiguous [P, H, page, D]."""
    return (kc, vc) if layout == "NHD" else (kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3))


def bench_flashinfer_decode(copy_gbps, batch=64, ctx=8192, hq=32, hk=8, d=128, page=16, layouts=("NHD", "HND")):
    import torch

    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - any import failure means: no anchor
        return [Row("decode flashinfer (not importable)", float("nan"), note=str(e)[:80])], {}
    gen = torch.Generator().manual_seed(1)
    rows, best = [], {}
    for fmt in ("bf16", "fp8_e4m3"):
        for layout in layouts:
            q, table, seq, kv, nbytes = _decode_case(fmt, batch, ctx, hq, hk, d, page, gen, layout)
            npg = ctx // page
            indptr = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * npg
            indices = table[:, :npg].reshape(-1).contiguous()
            last = torch.full((batch,), page, dtype=torch.int32, device="cuda")
            ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            kvt = fi_kv(kv["k_cache"], kv["v_cache"], layout)
            for tc in (False, True):
                try:
                    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, layout, use_tensor_cores=tc)
                    w.plan(indptr, indices, last, hq, hk, d, page, q_data_type=torch.bfloat16,
                           kv_data_type=kv["k_cache"].dtype)
                    ks, vs = float(kv["k_scale"][0]), float(kv["v_scale"][0])
                    if fmt == "bf16":
                        fn = lambda: w.run(q, kvt)  # noqa: E731
                    else:
                        fn = lambda: w.run(q, kvt, k_scale=ks, v_scale=vs)  # noqa: E731
                    t = _bench(fn)
                except Exception as e:  # noqa: BLE001
                    rows.append(Row(f"decode flashinfer {fmt} tc={tc} {layout} (failed)", float("nan"),
                                    note=str(e)[:100]))
                    continue
                gb = nbytes / (t * 1e-6) / 1e9
                rows.append(Row(f"decode flashinfer {fmt} tc={tc} {layout}", t, gb, 100 * gb / copy_gbps))
                best[fmt] = min(best.get(fmt, float("inf")), t)
            del kv, kvt
            torch.cuda.empty_cache()
    return rows, best


def _sweep_configs(fmt):
    """Launch configurations tried by ``sweep_decode`` for one format."""
    c = lambda bn, ns, pf=False, nw=4, st=2: dict(block_n=bn, num_splits=ns, prefetch=pf, num_warps=nw,  # noqa: E731
                                                 num_stages=st)
    if fmt == "bf16":
        return [c(64, ns) for ns in (1, 2, 4)] + [c(64, 1, st=3)]
    pfs = (False, True)
    return [c(bn, ns, pf) for bn in (64, 128) for ns in (4, 8, 16) for pf in pfs] + [
        c(128, 8, st=3), c(256, 8), c(128, 8, nw=8)]


def check_variants(formats=("bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4")):
    """The decode check's hard cases at several launch configurations (the GPU check runs the defaults)."""
    from triton.runtime.errors import OutOfResources

    from kvbench.kernels.check import check_decode

    cases = []
    for fmt in formats:
        for pf, bn, ns in ((False, 128, 8), (True, 64, 4), (False, 64, 3), (True, 128, 16)):
            kw = dict(prefetch=pf, block_n=bn, num_splits=ns)
            try:
                cases.append((kw, check_decode(fmt, [4000, 1, 17, 2500] * 4, 32, 8, 128, 16, seed=ns, **kw)))
            except OutOfResources as e:  # a tile that does not fit is not a launch configuration
                print(f"skipped {fmt} {kw}: {str(e)[:60]}")
                continue
            cases.append((kw, check_decode(fmt, [32768, 17, 1000], 32, 8, 128, 16, window=1000, sinks=True, seed=bn,
                                           **kw)))
            cases.append((kw, check_decode(fmt, [1020, 3, 600], 64, 8, 64, 64, q_fp8=True, seed=7, **kw)))
    for kw, case in cases:
        print(case.line(), kw, flush=True)
    return all(case.ok for _, case in cases)


def sweep_decode(copy_gbps, formats=("bf16", "fp8_e4m3", "nvfp4"), batch=64, ctx=8192, hq=32, hk=8, d=128,
                 page=16, layout="HND"):
    """Every configuration of ``_sweep_configs`` plus the defaults, each printed; returns the rows (fastest
    first per format).  Used to choose ``decode._DEFAULTS``."""
    import torch

    from kvbench.kernels.decode import paged_decode

    gen = torch.Generator().manual_seed(0)
    rows = []
    for fmt in formats:
        q, table, seq, kv, nbytes = _decode_case(fmt, batch, ctx, hq, hk, d, page, gen, layout)
        out = torch.empty_like(q)
        timed = []
        for cfg in [dict()] + _sweep_configs(fmt):
            try:
                t = _bench(lambda: paged_decode(q, page_table=table, seq_lens=seq, kv_format=fmt, out=out, **kv, **cfg))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported and skipped
                print(f"  sweep {fmt} {cfg}: {type(e).__name__}: {str(e)[:80]}")
                continue
            gb = nbytes / (t * 1e-6) / 1e9
            timed.append(Row(f"sweep {fmt}", t, gb, 100 * gb / copy_gbps, note=str(cfg or "defaults")))
            print(timed[-1].line(), flush=True)
        rows += sorted(timed, key=lambda r: r.us)
        del kv
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------- append
def append_bytes(t: int, hq: int, hk: int, d: int, cache_bytes_per_row: float) -> tuple[int, int]:
    """Global-memory bytes of the fused and the unfused append of ``t`` bf16 tokens: both read q, k, v
    and write the rotated q and k (returned) and the cache rows; the unfused path also reads the rotated
    k back in its second launch."""
    q, k, v = t * hq * d * 2, t * hk * d * 2, t * hk * d * 2
    fused = 2 * q + 2 * k + v + int(2 * t * hk * cache_bytes_per_row)  # q, k: read + rotated copy written
    return fused, fused + k


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _empty_kernel(X):
        if tl.program_id(0) < 0:  # never true: the launch does no work
            tl.store(X, 0.0)
except ImportError:  # no triton (not Linux): the timings cannot run, the host-side helpers still import
    _empty_kernel = None


def launch_floor() -> tuple[float, float]:
    """CUDA-graph replay time of one and of two empty Triton launches (µs): the floor under any
    kernel timed this way, and the launch a fused kernel saves."""
    import torch

    x = torch.zeros(1, device="cuda")

    def two():
        _empty_kernel[(1,)](x)
        _empty_kernel[(1,)](x)

    return _bench(lambda: _empty_kernel[(1,)](x), graph=True), _bench(two, graph=True)


def bench_append(tokens=(1, 16, 128, 512), hq=32, hk=8, d=128, page=16, layout="HND"):
    import torch

    from kvbench.kernels.append import fused_rope_quant_append, quantize_store, unfused_rope_quant_append
    from kvbench.kernels.check import make_cache
    from kvbench.kernels.formats import get_format
    from kvbench.kernels.reference import build_cos_sin_cache

    gen = torch.Generator().manual_seed(3)
    rows, res = [], {}
    one, two = launch_floor()
    rows.append(Row("launch floor: one empty kernel (graph replay)", one))
    rows.append(Row("launch floor: two empty kernels (graph replay)", two,
                    note=f"a launch-bound fused append can reach {one / two:.2f}x of a two-launch one"))
    cs = build_cos_sin_cache(8192, d, device="cuda")
    for t in tokens:
        q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
        pos = torch.randint(0, 8192, (t,), device="cuda")
        npg = 64
        slots = torch.randperm(npg * page, device="cuda")[:t]
        kcb, _, _, _ = make_cache("bf16", npg, page, hk, d, "cuda", gen, layout)
        vcb, _, _, _ = make_cache("bf16", npg, page, hk, d, "cuda", gen, layout)
        plain = _bench(lambda: quantize_store(k, v, slots, kcb, vcb, kv_format="bf16"), graph=True)
        rows.append(Row(f"append plain bf16 store T={t} {layout}", plain))
        for fmt in ("bf16", "fp8_e4m3", "nvfp4"):
            kc, kbs, ks, _ = make_cache(fmt, npg, page, hk, d, "cuda", gen, layout)
            vc, vbs, vs, _ = make_cache(fmt, npg, page, hk, d, "cuda", gen, layout)
            args = (q, k, v, pos, slots, cs, kc, vc, ks, vs)
            kw = dict(kv_format=fmt, k_block_scale=kbs, v_block_scale=vbs)
            tf = _bench(lambda: fused_rope_quant_append(*args, **kw), graph=True)
            tu = _bench(lambda: unfused_rope_quant_append(*args, **kw), graph=True)
            res[(t, fmt)] = (tf, tu, plain)
            bf, bu = append_bytes(t, hq, hk, d, get_format(fmt).bytes_per_element * d)  # block scales included
            rows.append(Row(f"append fused {fmt} T={t} {layout}", tf, note=f"unfused {tu:.1f} us -> {tf / tu:.2f}x; "
                                                                  f"{tf / plain:.2f}x plain store; "
                                                                  f"bytes {bf / 1e6:.2f} / {bu / 1e6:.2f} MB"))
    return rows, res


# ------------------------------------------------------------------------------------ targets
def _targets(copy_gbps, dec_rows, dec, fi, pre, app):
    res = []
    pct = {r.name.split()[2]: r.pct_copy for r in dec_rows}
    if "bf16" in pct:
        res.append(("decode bf16 >= 90% of copy bandwidth", pct["bf16"] >= 90, f"{pct['bf16']:.0f}%"))
    if "fp8_e4m3" in pct:
        res.append(("decode fp8 >= 80% of copy bandwidth", pct["fp8_e4m3"] >= 80, f"{pct['fp8_e4m3']:.0f}%"))
    if "bf16" in dec and "fp8_e4m3" in dec:
        r = dec["bf16"] / dec["fp8_e4m3"]
        res.append(("decode fp8 >= 1.8x faster than bf16", r >= 1.8, f"{r:.2f}x"))
    if "bf16" in dec and "nvfp4" in dec:
        r = dec["bf16"] / dec["nvfp4"]
        res.append(("decode nvfp4 >= 2.5x faster than bf16", r >= 2.5, f"{r:.2f}x"))
    if "bf16" in fi and "bf16" in dec:
        r = fi["bf16"] / dec["bf16"]
        res.append(("decode bf16 at least as fast as flashinfer bf16", r >= 1.0, f"{r:.2f}x flashinfer's speed"))
    if "fp8_e4m3" in fi and "fp8_e4m3" in dec:
        r = fi["fp8_e4m3"] / dec["fp8_e4m3"]
        res.append(("decode fp8 >= 2x faster than flashinfer fp8", r >= 2.0, f"{r:.2f}x"))
    if app:
        worst_u = max(tf / tu for tf, tu, _ in app.values())
        res.append(("append fused <= 0.6x unfused (1-512 tokens)", worst_u <= 0.6, f"worst {worst_u:.2f}x"))
        worst_p = max(tf / p for (t, f), (tf, tu, p) in app.items() if f == "bf16")
        res.append(("append fused bf16 within 1.3x of a plain bf16 store", worst_p <= 1.3, f"worst {worst_p:.2f}x"))
    if "sdpa" in pre and "triton" in pre:
        r = pre["triton"] / pre["sdpa"]
        res.append(("prefill bf16 >= 0.8x SDPA TFLOP/s", r >= 0.8, f"{r:.2f}x"))
    if "extend_bf16" in pre and "extend_fp8_e4m3" in pre:
        r = pre["extend_bf16"] / pre["extend_fp8_e4m3"]
        labels = {"extend_fp8_e4m3_converted_K": "converted K tiles", "extend_fp8_e4m3_fp8_q": "with fp8 queries"}
        others = [f"{lab}: {pre['extend_bf16'] / pre[k]:.2f}x" for k, lab in labels.items() if k in pre]
        extra = f" ({'; '.join(others)})" if others else ""
        res.append(("prefill fp8 prefix >= 0.9x its bf16 speed", r >= 0.9, f"{r:.2f}x{extra}"))
    return res


PARTS = ("decode", "prefill", "append", "mla")


def parse_parts(parts: str) -> list:
    """``decode,prefill,append,mla`` → the names in that order; an unknown (or empty) name is a ValueError."""
    names = [p.strip() for p in parts.split(",")]
    bad = [p for p in names if p not in PARTS]
    if bad:
        raise ValueError(f"unknown part(s) {bad}: choose from {', '.join(PARTS)}")
    return names


def mla_argv(check: bool, quick: bool, out: Optional[str]) -> list:
    """The ``mla`` part's arguments to ``kvbench.kernels.mla_check``: its checks only with ``check``, the smaller
    grid and no launch sweep with ``quick``; its tables next to ``out`` (``<out without .json>_mla/``)."""
    argv = ([] if check else ["--skip-checks"]) + (["--quick", "--no-sweep"] if quick else [])
    if out:
        argv += ["--out", os.path.splitext(out)[0] + "_mla"]
    return argv


def main(check: bool = False, quick: bool = False, out: Optional[str] = None, flashinfer: bool = True,
         parts: str = "decode,prefill,append,mla", sweep: bool = False, layout: str = "HND") -> int:
    """Run the kernel benchmarks on the CUDA device (``check`` first runs the correctness check;
    ``sweep`` runs only the decode launch-configuration sweep).  ``layout``: the page layout of the
    caches (HND, the runtime's default, or NHD); the targets are evaluated on it, and the decode rows of
    the other layout (launch defaults) follow for comparison.  ``parts``: a comma list of ``PARTS``; ``mla``
    runs the MLA latent-cache benchmarks (``kvbench.kernels.mla_check``: decode µs and GB/s against copy
    bandwidth for bf16 / fp8 / nvfp4 at batch 1–128 × context 1k–32k, prefill, fused vs unfused append)."""
    import torch

    want = set(parse_parts(parts))
    if not torch.cuda.is_available():
        print("kvbench bench kernels needs a CUDA device")
        return 2
    if sweep:
        ok = check_variants()
        print(f"decode variants check: {'all passed' if ok else 'FAILURES'}", flush=True)
        rows = sweep_decode(copy_bandwidth(), layout=layout)
        print(f"\n## decode sweep — {torch.cuda.get_device_name()}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, fastest first")
        for r in rows:
            print(r.line())
        return 0 if ok else 1
    if check and want - {"mla"}:  # the MLA part runs its own checks
        from kvbench.kernels.check import main as check_main

        rc = check_main(["--quick"] if quick else [])
        if rc:
            return rc
    if want == {"mla"}:
        return _mla_part(check, quick, out)
    dev = torch.cuda.get_device_name()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    copy = copy_bandwidth()
    rows = [Row("device-to-device copy (2 GiB)", 2 * 2 * (1 << 30) / copy / 1e3, copy, 100.0)]
    dec_rows, dec, fi, pre, app = [], {}, {}, {}, {}
    if "decode" in want:
        dec_rows, dec = bench_decode(copy, tune=not quick, layout=layout)
        rows += dec_rows
        other = "NHD" if layout == "HND" else "HND"
        rows += bench_decode(copy, tune=False, layout=other)[0]
        if flashinfer:
            fr, fi = bench_flashinfer_decode(copy)  # both layouts; the anchor is its faster one
            rows += fr
    if "prefill" in want:
        from kvbench.kernels.bench_prefill import bench_prefill

        pr, pre = bench_prefill(flashinfer=flashinfer, layout=layout)
        rows += pr
    if "append" in want:
        ar, app = bench_append(layout=layout)
        rows += ar
    tg = _targets(copy, dec_rows, dec, fi, pre, app)
    print(f"\n## kernel benchmarks — {dev}, torch {torch.__version__}, {stamp}, page layout {layout}")
    for r in rows:
        print(r.line())
    print("\n## targets")
    for name, ok, detail in tg:
        print(f"{'MET ' if ok else 'MISS'}  {name:<55} {detail}")
    if out:
        doc = dict(device=dev, date=stamp, torch=torch.__version__, layout=layout, rows=[asdict(r) for r in rows],
                   targets=[dict(name=n, met=ok, value=v) for n, ok, v in tg])
        with open(out + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(out + ".tmp", out)
    return _mla_part(check, quick, out) if "mla" in want else 0


def _mla_part(check: bool, quick: bool, out: Optional[str]) -> int:
    from kvbench.kernels.mla_check import main as mla_main

    print("\n## MLA latent-cache kernels (kvbench.kernels.mla_check)", flush=True)
    return mla_main(mla_argv(check, quick, out)) or 0


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m kvbench.kernels.bench")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--out")
    ap.add_argument("--decode-sweep", action="store_true", help="only the decode configuration sweep")
    ap.add_argument("--layout", default="HND", choices=("HND", "NHD"), help="page layout of the caches")
    a = ap.parse_args()
    sys.exit(main(a.check, a.quick, a.out, not a.no_flashinfer, a.parts, a.decode_sweep, a.layout))

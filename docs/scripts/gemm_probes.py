"""torch's linear layers and kvbench's few-row Triton GEMM at Llama-3-8B's projection shapes on a CUDA GPU.

Each row: one projection ``x @ w.T`` with ``x`` [M, K] and ``w`` [N, K] stored K-major (as the engine stores
them, ``runtime/models/llama.py``), replayed as a CUDA graph over enough weight copies (400 MB) that no copy is
read from L2 twice in a row, as in a decode step; µs per call, % of copy bandwidth for the weight's bytes,
TFLOP/s.  ``--libs`` names torch's BLAS libraries (``cublas``, ``cublaslt``) and ``triton`` (``kernels/
skinny_gemm.py`` with its default plan); ``--sweep`` also times the Triton kernel over a grid of tilings
(``--grid``) and prints each shape's best, after checking every tiling's output against a float64 product
(NaN-poisoned output, fresh inputs).  The tables behind ``EngineConfig.gemm_library`` (docs/performance.md,
"cuBLAS or cuBLASLt for the projections", "A Triton GEMM for the decode step's projections").
"""

from __future__ import annotations

import argparse
import itertools
import sys

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
GRID = "bn=64,128,256;bk=64,128,256;split=1,2,4,8;stages=3,4,6;warps=4;tma=0,1"


def parse_grid(text: str) -> dict:
    """``"bn=64,128;bk=128;..."`` → {key: [ints]} over the keys of ``skinny_gemm.Plan`` (not ``bm``)."""
    keys = ("bn", "bk", "split", "stages", "warps", "tma")
    grid = {k: [] for k in keys}
    for part in filter(None, (s.strip() for s in text.split(";"))):
        key, _, vals = part.partition("=")
        if key.strip() not in keys:
            raise ValueError(f"unknown grid key {key.strip()!r}; choose from {', '.join(keys)}")
        grid[key.strip()] = [int(v) for v in vals.split(",") if v.strip()]
    missing = [k for k, v in grid.items() if not v]
    if missing:
        raise ValueError(f"grid needs values for {', '.join(missing)}")
    return grid


def plans(grid: dict, m: int, n: int, k: int, sms: int) -> list:
    """The grid's tilings that make sense for one shape: 1/2 to 8 programs per SM, parts at least 2 tiles deep."""
    from kvbench.kernels.skinny_gemm import Plan, next_pow2

    out = []
    for bn, bk, split, stages, warps, tma in itertools.product(*grid.values()):
        progs = -(-n // bn) * split
        if sms // 2 <= progs <= 8 * sms and k // split >= 2 * bk:
            out.append(Plan(max(16, next_pow2(m)), bn, bk, split, warps, stages, bool(tma)))
    return out


def _weights(n, k, m):
    import torch

    copies = max(2, int(400e6 // (n * k * 2)) + 1) if m < 1024 else 2
    return [(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64).t().contiguous().t() for _ in range(copies)]


def _row(tag, name, m, n, k, us, copy):
    print(f"{tag:28s} {name:8s} M={m} N={n} K={k}: {us:.2f} us, {100 * n * k * 2 / (us * 1e-6) / 1e9 / copy:.0f}% "
          f"of copy, {2 * m * n * k / (us * 1e-6) / 1e12:.0f} TFLOP/s", flush=True)


def check(p, m, n, k) -> float:
    """‖out − ref‖/‖ref‖ of one tiling against a float64 product (with a bias), output poisoned first."""
    import torch

    from kvbench.kernels.skinny_gemm import linear

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64).t().contiguous().t()
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    linear(x, w, b, p=p, out=out)
    ref = x.double() @ w.double().t() + b.double()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    return err if err == err else float("inf")


def chain(ms, shapes, prefetches) -> None:
    """Each projection after an RMSNorm of its input (as in a decoder layer: the norm's kernel, then the GEMM),
    replayed as a graph over the weight copies: cuBLAS, the Triton GEMM launched plainly, and launched as a
    programmatic dependent of the norm prefetching 0, 2, 4 ... of its weight tiles into L2 before it waits."""
    import dataclasses

    import torch
    import torch.nn.functional as F

    from kvbench.kernels import skinny_gemm as S
    from kvbench.kernels.fused_ops import rms_norm
    from kvbench.tools.common import copy_bandwidth, graph_us

    copy = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.backends.cuda.preferred_blas_library("cublas")
    for m in ms:
        for name in shapes:
            n, k = SHAPES[name]
            x, ws = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), _weights(n, k, m)
            g = torch.ones(k, device="cuda", dtype=torch.bfloat16)
            base = S.plan(m, n, k, sms)
            arms = [("cublas", None), ("triton", base)] + [
                (f"triton pdl prefetch {f}", dataclasses.replace(base, pdl=True, prefetch=f)) for f in prefetches]
            for tag, p in arms:
                if p is None:
                    fn = lambda: [F.linear(rms_norm(x, g, 1e-5), w) for w in ws]  # noqa: E731
                else:
                    fn = lambda: [S.linear(rms_norm(x, g, 1e-5), w, p=p) for w in ws]  # noqa: E731,B023
                _row(tag, name, m, n, k, graph_us(fn) / len(ws), copy)
            del ws
            torch.cuda.empty_cache()


def run(ms, libs, shapes, grid=None) -> None:
    import torch
    import torch.nn.functional as F

    from kvbench.kernels import skinny_gemm as S
    from kvbench.tools.common import copy_bandwidth, graph_us

    copy = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy {copy:.0f} GB/s, {sms} SMs", flush=True)
    for m in ms:
        x = torch.randn(m, 16384, device="cuda", dtype=torch.bfloat16)
        for name in shapes:
            n, k = SHAPES[name]
            xs, ws = x[:, :k], _weights(n, k, m)
            for lib in libs:
                if lib == "triton":
                    if m > S.MAX_ROWS:
                        continue
                    fn = lambda: [S.linear(xs, w) for w in ws]  # noqa: E731
                else:
                    torch.backends.cuda.preferred_blas_library(lib)
                    fn = lambda: [F.linear(xs, w) for w in ws]  # noqa: E731
                _row(lib, name, m, n, k, graph_us(fn) / len(ws), copy)
            if grid and m <= S.MAX_ROWS:
                _sweep(S, grid, m, n, k, sms, xs, ws, name, copy, graph_us)
            del ws
            torch.cuda.empty_cache()


def _sweep(S, grid, m, n, k, sms, xs, ws, name, copy, graph_us) -> None:
    best = []
    for p in plans(grid, m, n, k, sms):
        try:
            err = check(p, m, n, k)
        except Exception as e:  # a tiling over the shared memory or registers of this GPU
            print(f"skip {p}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if not err < 4e-3:
            print(f"FAIL {p}: rel err {err:.2e}", flush=True)
            continue
        us = graph_us(lambda: [S.linear(xs, w, p=p) for w in ws]) / len(ws)
        best.append((us, p, err))
    best.sort(key=lambda r: r[0])
    for us, p, err in best[:5]:
        _row(f"  bn{p.bn} bk{p.bk} s{p.split} st{p.stages} w{p.warps} t{int(p.tma)}", name, m, n, k, us, copy)
    if best:
        print(f"  {len(best)} tilings checked against float64 (max rel err {max(r[2] for r in best):.2e})", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", default="1,16,64,128,256,8192", help="row counts M (comma list)")
    p.add_argument("--libs", default="cublas,cublaslt,triton", help="cublas, cublaslt, triton (comma list)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)} (comma list)")
    p.add_argument("--sweep", action="store_true", help="time the Triton kernel over --grid's tilings too")
    p.add_argument("--grid", default=GRID, help=f"tilings for --sweep (default {GRID!r})")
    p.add_argument("--chain", default="", help="prefetch depths (comma list): time each projection after an RMSNorm "
                                               "instead, cuBLAS against the Triton GEMM plain and as a dependent launch")
    a = p.parse_args(argv)
    grid = parse_grid(a.grid)
    import torch

    if not torch.cuda.is_available():
        print("gemm_probes needs a CUDA device", file=sys.stderr)
        return 2
    ms = [int(x) for x in a.ms.split(",")]
    if a.chain:
        chain(ms, a.shapes.split(","), [int(x) for x in a.chain.split(",")])
    else:
        run(ms, a.libs.split(","), a.shapes.split(","), grid if a.sweep else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

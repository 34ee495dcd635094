"""torch's linear layers at Llama-3-8B's projection shapes on a CUDA GPU, through cuBLAS and cuBLASLt.

Each row: one projection ``F.linear(x, w)`` with ``x`` [M, K] and ``w`` [N, K] stored K-major (as the engine
stores them, ``runtime/models/llama.py``), replayed as a CUDA graph over enough weight copies (400 MB) that no
copy is read from L2 twice in a row, as in a decode step; µs per call, % of copy bandwidth for the weight's
bytes, TFLOP/s.  The table behind ``EngineConfig.gemm_library`` (docs/performance.md, "cuBLAS or cuBLASLt for
the projections").
"""

from __future__ import annotations

import argparse
import sys

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def run(ms, libs) -> None:
    import torch
    import torch.nn.functional as F

    from kvbench.tools.common import copy_bandwidth, graph_us

    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy {copy:.0f} GB/s", flush=True)
    for m in ms:
        for lib in libs:
            torch.backends.cuda.preferred_blas_library(lib)
            for name, (n, k) in SHAPES.items():
                copies = max(2, int(400e6 // (n * k * 2)) + 1) if m < 1024 else 2
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ws = [(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64).t().contiguous().t()
                      for _ in range(copies)]
                us = graph_us(lambda: [F.linear(x, w) for w in ws]) / copies
                print(f"{lib:9s} {name:8s} M={m} N={n} K={k}: {us:.2f} us, "
                      f"{100 * n * k * 2 / (us * 1e-6) / 1e9 / copy:.0f}% of copy, "
                      f"{2 * m * n * k / (us * 1e-6) / 1e12:.0f} TFLOP/s", flush=True)
                del ws
                torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", default="1,16,64,128,256,8192", help="row counts M (comma list)")
    p.add_argument("--libs", default="cublas,cublaslt", help="torch BLAS libraries (comma list)")
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gemm_probes needs a CUDA device", file=sys.stderr)
        return 2
    run([int(x) for x in a.ms.split(",")], a.libs.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The library behind the engine's linear layers on a CUDA GPU (``EngineConfig.gemm_library``).

``cublas`` (the default, torch's own) or ``cublaslt``: torch's BLAS library.  Neither is faster everywhere: on an
H200 at decode batch 64, cuBLASLt runs Llama-3-8B's gate/up and down projections at 96% / 83% of copy bandwidth
against 92% / 77% and the graphed decode step 0.21-0.23 ms faster (2.7-3.6%), but its down projection is slower
at 16 and 128 rows (34.8 against 32.2 µs, 42.1 against 37.8) and prefill is the same (docs/performance.md,
"cuBLAS or cuBLASLt for the projections").  ``triton``: the projections of the decode steps captured in CUDA
graphs run ``kernels/skinny_gemm.py`` where it ran ahead of cuBLAS (``skinny_gemm.ahead_of_blas``: up to 16 and
from 33 to 64 rows), launched as programmatic dependents of the kernel before them (they prefetch their first
weight tiles while it finishes); the step's other Triton kernels (RMSNorm, SiLU·up, the fused append, the paged
decode and its reduce) are launched as programmatic dependents too (``kernels/_triton_utils.set_pdl``).
Everything else runs cuBLAS: prefill (more rows), 17-32 rows, and eager calls, where a Triton launch costs tens
of µs of Python, more than the kernel saves (the logits of a graphed step are such a call).

torch keeps its BLAS choice process-wide, and so does this module, so the engine sets it when it is built and
again before each step: two engines of one process with different choices each run their own steps with
theirs (a decode graph keeps the kernels it was captured with).  On a CPU nothing is set and ``linear`` is
torch's.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F

_TRITON = [False]  # whether ``linear`` takes the Triton kernel (set by ``apply`` for a CUDA device)


def apply(choice: str, device: torch.device) -> None:
    """Make ``choice`` the library of ``linear`` when ``device`` is a CUDA device (a cheap call: the engine
    makes it before every step).  ``triton`` keeps cuBLAS as torch's library for what the kernel does not take."""
    if device.type != "cuda":
        return
    _TRITON[0] = choice == "triton"
    pdl = False
    if _TRITON[0]:  # the partial-sum buffer, before any capture (a dict lookup once it exists)
        from kvbench.kernels.skinny_gemm import hopper, reserve

        reserve(device)
        pdl = hopper(device)  # programmatic dependent launches need compute capability 9
    utils = sys.modules.get("kvbench.kernels._triton_utils")  # not loaded: no kernel launched yet, PDL still off
    if utils is not None:
        utils.set_pdl(pdl)
    blas = "cublas" if choice == "triton" else choice
    if torch.backends.cuda.preferred_blas_library().name.lower() != blas:
        torch.backends.cuda.preferred_blas_library(blas)


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, w, b)``, through ``kernels/skinny_gemm.py`` when the library is ``triton``, a CUDA graph is
    being captured, and the kernel takes the operands (2-D) at a row count where it runs ahead of cuBLAS."""
    if _TRITON[0] and x.is_cuda and x.dim() == 2 and torch.cuda.is_current_stream_capturing():
        from kvbench.kernels import skinny_gemm

        if (skinny_gemm.ahead_of_blas(x.shape[0]) and skinny_gemm.supported(x, w)
                and (b is None or b.dtype == x.dtype)):
            (m, k), n = x.shape, w.shape[0]
            p = skinny_gemm.plan(m, n, k, skinny_gemm.sm_count(x.device), w.stride(0) == 1, pdl=True)
            return skinny_gemm.linear(x, w, b, p=p)
    return F.linear(x, w, b)

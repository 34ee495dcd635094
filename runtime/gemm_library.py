"""torch's BLAS library for the engine's linear layers on a CUDA GPU (``EngineConfig.gemm_library``).

``cublas`` (the default, torch's own) or ``cublaslt``.  Neither is faster everywhere: on an H200 at decode batch
64, cuBLASLt runs Llama-3-8B's gate/up and down projections at 96% / 83% of copy bandwidth against 92% / 77% and
the graphed decode step 0.21-0.23 ms faster (2.7-3.6%), but its down projection is slower at 16 and 128 rows
(34.8 against 32.2 µs, 42.1 against 37.8) and prefill is the same (docs/performance.md, "cuBLAS or cuBLASLt for
the projections").  torch keeps the choice process-wide, so the engine sets it when it is built and again before
each step: two engines of one process with different choices each run their own steps with theirs (a decode
graph keeps the kernels of the library it was captured under).  On a CPU nothing is set.
"""

from __future__ import annotations

import torch


def apply(choice: str, device: torch.device) -> None:
    """Make ``choice`` torch's preferred BLAS library when ``device`` is a CUDA device (a cheap call: the engine
    makes it before every step)."""
    if device.type != "cuda":
        return
    if torch.backends.cuda.preferred_blas_library().name.lower() != choice:
        torch.backends.cuda.preferred_blas_library(choice)

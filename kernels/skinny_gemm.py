"""A linear layer for few rows, ``x @ w.T (+ b)``, as one Triton kernel: the decode step's projections.

At decode a projection multiplies a few rows (the batch) by a weight matrix read once from memory, so it is
bound by the weight's bytes, not by its FLOPs.  Each program takes a strip of ``BN`` output columns for all the
rows and streams the weight's ``[K, BN]`` strip through shared memory in ``BK``-deep tiles (``STAGES`` of them in
flight), multiplying on the tensor cores with a float32 accumulator.  When the strips are too few to keep every
SM streaming (``split`` > 1), the K range is split among programs as well: each writes its float32 partial sum,
and the last program of a strip to finish (an atomic counter per strip, reset by that program) adds the partials
in split order and stores the result.  The sum's order is fixed, so the output is the same on every run, and it
is one launch (a CUDA graph holds one node per projection, as with cuBLAS).

The weight may be stored K-major (``[K, N]`` contiguous, ``w`` its transposed view, as the engine stores its
projections on a GPU: ``runtime/models/llama.py``) or row-major; ``TMA`` reads a K-major weight's tiles and the
rows through tensor descriptors (Hopper's bulk copies).  Numerics: float32 products and sums of the bf16 / fp16
operands, the bias added in float32, one rounding to the output dtype (round to nearest even), as a cuBLAS GEMM
with a float32 accumulator; only the order of the sum differs.  ``runtime/gemm_library.py`` routes the engine's
linear layers here under ``EngineConfig.gemm_library = "triton"``; tests/test_skinny_gemm.py checks it against a
float64 product on the CPU (Triton's interpreter) and ``pytest -m gpu`` on the GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch
import triton
import triton.language as tl

from kvbench.kernels._triton_utils import cast_rne, gdc_available, interpreting, next_pow2, pdl_launch

__all__ = ["MAX_ROWS", "Plan", "ahead_of_blas", "hopper", "linear", "plan", "reserve", "sm_count", "supported"]

MAX_ROWS = 64  # rows above this go to the BLAS library: past it the GEMM starts to be bound by its FLOPs
_MAX_STRIPS = 4096  # counters per device: strips of a split launch
PREFETCH = 2  # tiles of the weight a programmatic dependent launch prefetches into L2 before its wait


@dataclass(frozen=True)
class Plan:
    """One launch's tiling: ``bm`` rows (all of them), ``bn`` columns and ``bk`` deep per tile, the K range in
    ``split`` parts, ``warps`` and pipeline ``stages``, tensor descriptors (``tma``)."""

    bm: int
    bn: int
    bk: int
    split: int
    warps: int = 4
    stages: int = 4
    tma: bool = False
    pdl: bool = False  # launched as a programmatic dependent (see ``_skinny_kernel``)
    prefetch: int = 0  # with ``pdl``: tiles of the weight prefetched into L2 before the wait


def ahead_of_blas(m: int) -> bool:
    """Whether the default tiling ran ahead of cuBLAS at ``m`` rows on the H200 (docs/performance.md, "A Triton
    GEMM for the decode step's projections"): up to 16 rows and from 33 to ``MAX_ROWS``.  From 17 to 32 rows its
    q/k/v and output projections ran slower than cuBLAS with every tiling tried (16.6 against 15.9 µs for q/k/v
    at 32 rows at best), so the engine keeps cuBLAS there."""
    return 0 < m <= 16 or 32 < m <= MAX_ROWS


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The multiprocessors ``plan`` fills (an H200's 132 off a CUDA device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@functools.lru_cache(maxsize=None)
def hopper(device: torch.device) -> bool:
    """Whether ``device`` has Hopper's tensor memory accelerator and programmatic dependent launch (compute
    capability 9 or above): without them a plan's ``tma`` and ``pdl`` are not used."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def plan(m: int, n: int, k: int, sms: int = 132, kmajor: bool = True, pdl: bool = False) -> Plan:
    """The default tiling for ``m`` rows of an ``[n, k]`` weight on a GPU with ``sms`` multiprocessors, from the
    sweeps of ``docs/scripts/gemm_probes.py`` on an H200 at 64 rows (docs/performance.md, "A Triton GEMM for
    the decode step's projections"):

    - strips of 256 columns in 64-deep tiles, 4 in flight, where they give at least 3/4 of the SMs a strip
      (Llama-3-8B's gate/up projection, the logits);
    - else, where strips of 64 columns would leave half the SMs idle: for a long K (≥ 8192, the down projection)
      such strips with K split in two; for a shorter one (the output projection) strips of 32 columns, 6 tiles
      in flight;
    - else strips of 64 columns in 128-deep tiles, 5 in flight (q/k/v).

    Weights through tensor descriptors when stored K-major.  ``pdl``: launched as a programmatic dependent that
    prefetches its first ``PREFETCH`` tiles into L2."""
    bm = 16 if m <= 16 else 64  # the engine sends it up to 16 rows and 33 to 64 (``ahead_of_blas``)
    extra = dict(warps=4, tma=kmajor, pdl=pdl, prefetch=PREFETCH if pdl else 0)
    if 4 * triton.cdiv(n, 256) >= 3 * sms:
        return Plan(bm, 256, 64, 1, stages=4, **extra)
    if 2 * triton.cdiv(n, 64) <= sms:
        if k >= 8192:
            return Plan(bm, 64, 128, 2, stages=5, **extra)
        return Plan(bm, 32, 128, 1, stages=6, **extra)
    return Plan(bm, 64, 128, 1, stages=5, **extra)


@triton.jit
def _prefetch_l2(ptr):
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _skinny_kernel(X, W, WP, B, OUT, PART, LOCK, M, N, K, k_per, s_xm, s_wk, s_wn, s_om,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                   HAS_B: tl.constexpr, TMA: tl.constexpr, F32_DOT: tl.constexpr, EXACT: tl.constexpr,
                   PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0):
    """Program (strip ``pid_n``, part ``pid_k``): rows 0..M-1 × columns of the strip over its ``k_per`` keys.
    ``F32_DOT``: the CPU interpreter, whose bf16 ``tl.dot`` is wrong, multiplies in float32 (the same
    products: bf16 values are exact in float32).  ``PDL``: launched as a programmatic dependent of the kernel
    before it, the program may start while that kernel still runs; it touches nothing that kernel writes or
    reads (the rows, the output, the partials) before ``gdc_wait``, which returns once that kernel is done and
    its writes are visible.  Before the wait it only prefetches the first ``PREFETCH`` tiles of its weight
    strip into L2 (through ``WP``, the weight's pointer, which ``W`` is also without ``TMA``): the weights do not
    depend on the kernel before."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k0 = pid_k * k_per
    k1 = tl.minimum(k0 + k_per, K)
    if PDL:
        if PREFETCH > 0:  # one prefetch per 128-byte line of the strip's first PREFETCH tiles (K-major rows)
            pk = tl.minimum(k0 + tl.arange(0, PREFETCH * BK), K - 1).to(tl.int64)
            pn = tl.minimum(pid_n * BN + tl.arange(0, BN // 64) * 64, N - 1)
            _prefetch_l2(WP + pk[:, None] * s_wk + pn[None, :])
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(k0, k1, BK):
        if TMA:
            x = X.load([0, kk])
            w = W.load([kk, pid_n * BN])
        else:
            ks = kk + rk
            x = tl.load(X + rm[:, None] * s_xm + ks[None, :], mask=(rm[:, None] < M) & (ks[None, :] < k1), other=0.0)
            w = tl.load(W + ks[:, None].to(tl.int64) * s_wk + rn[None, :] * s_wn,
                        mask=(ks[:, None] < k1) & (rn[None, :] < N), other=0.0)
        if F32_DOT:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc)
        else:
            acc = tl.dot(x, w, acc)
    omask = (rm[:, None] < M) & (rn[None, :] < N)
    optr = OUT + rm[:, None] * s_om + rn[None, :]
    if SPLIT == 1:
        if HAS_B:
            acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(optr, cast_rne(acc, OUT.dtype.element_ty, EXACT), mask=omask)
    else:
        part = PART + rm[:, None] * N + rn[None, :]
        tl.store(part + pid_k * M * N, acc, mask=omask)
        tl.debug_barrier()  # every thread's partial written before the counter moves (release at GPU scope)
        done = tl.atomic_add(LOCK + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:  # the last part of this strip: add the parts in order, store, reset the counter
            tl.debug_barrier()
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(part + s * M * N, mask=omask, other=0.0, cache_modifier=".cg")
            if HAS_B:
                total += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(optr, cast_rne(total, OUT.dtype.element_ty, EXACT), mask=omask)
            tl.atomic_xchg(LOCK + pid_n, 0, sem="relaxed", scope="gpu")


_BUFFERS: dict = {}  # device → (counters int32 [_MAX_STRIPS], partials float32 [...])
_RETIRED: list = []  # partial buffers replaced by larger ones: kept, since a captured graph may still use them


def _key(device: torch.device) -> tuple:
    """``cuda`` and ``cuda:N`` of the current device are one device (the engine may name it either way)."""
    if device.type == "cuda" and device.index is None:
        return ("cuda", torch.cuda.current_device())
    return (device.type, device.index)


def reserve(device: torch.device, partial_elems: int = 0):
    """The device's counters and a partial-sum buffer of at least ``partial_elems`` float32 (grown here, never
    while a CUDA graph is being captured: a graph keeps the buffer its kernels were captured with, so the
    engine warms its steps eagerly first).  Kernels on one stream run one after another, so every launch of a
    device shares them; counters are left at zero by the program that last used them."""
    key = _key(device)
    locks, part = _BUFFERS.get(key, (None, None))
    if locks is None or part.numel() < partial_elems:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"skinny_gemm: the partial-sum buffer ({partial_elems} float32) must be reserved "
                               "before CUDA-graph capture; run the step eagerly once first")
        if locks is None:
            locks = torch.zeros(_MAX_STRIPS, dtype=torch.int32, device=device)
        else:
            _RETIRED.append(part)
        part = torch.empty(max(partial_elems, 1 << 20), dtype=torch.float32, device=device)
        _BUFFERS[key] = (locks, part)
    return _BUFFERS[key]


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``linear`` takes these operands: 2-D bf16 / fp16 of one dtype on one device, at most
    ``MAX_ROWS`` rows, unit stride along K for ``x`` and along one dim of ``w``."""
    return (x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == w.shape[1] and x.stride(1) == 1
            and (w.stride(0) == 1 or w.stride(1) == 1) and x.device == w.device)


def _tma_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    es = x.element_size()
    return (w.stride(0) == 1 and (w.stride(1) * es) % 16 == 0 and (x.stride(0) * es) % 16 == 0
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and not interpreting())


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           p: Optional[Plan] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` [M, K] @ ``w`` [N, K]ᵀ (+ ``bias`` [N]) → [M, N] in ``x``'s dtype (``supported`` operands);
    ``p`` a tiling (default ``plan``)."""
    if not supported(x, w):
        raise ValueError(f"skinny_gemm.linear: x {tuple(x.shape)} {x.dtype} stride {x.stride()}, w {tuple(w.shape)} "
                         f"{w.dtype} stride {w.stride()}: needs 2-D bf16/fp16 operands of one dtype, 1..{MAX_ROWS} "
                         "rows, unit stride along K for x and along one dim of w")
    m, k = x.shape
    n = w.shape[0]
    kmajor = w.stride(0) == 1
    p = p or plan(m, n, k, sm_count(x.device), kmajor)
    if p.bm < m:
        p = replace(p, bm=max(16, next_pow2(m)))  # a tiling planned for fewer rows
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    strips = triton.cdiv(n, p.bn)
    k_per = triton.cdiv(triton.cdiv(k, p.split), p.bk) * p.bk
    split = triton.cdiv(k, k_per)
    if split > 1 and strips > _MAX_STRIPS:
        raise ValueError(f"skinny_gemm.linear: {strips} strips of a split launch exceed {_MAX_STRIPS}")
    locks, part = reserve(x.device, split * m * n if split > 1 else 0)
    xa, wa = x, w
    tma = p.tma and _tma_ok(x, w) and hopper(x.device)
    pdl = p.pdl and gdc_available() and hopper(x.device)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xa = TensorDescriptor(x, [m, k], [x.stride(0), 1], [p.bm, p.bk])
        wa = TensorDescriptor(w.t(), [k, n], [w.stride(1), 1], [p.bk, p.bn])
    _skinny_kernel[(strips, split)](
        xa, wa, w, bias if bias is not None else out, out, part, locks, m, n, k, k_per, x.stride(0), w.stride(1),
        w.stride(0), out.stride(0), BM=p.bm, BN=p.bn, BK=p.bk, SPLIT=split, HAS_B=bias is not None, TMA=tma,
        F32_DOT=interpreting(), EXACT=interpreting(), PDL=pdl, PREFETCH=p.prefetch if pdl and kmajor and p.bn >= 64 else 0,
        num_warps=p.warps, num_stages=p.stages, **pdl_launch(pdl))
    return out

"""Append rows of ``kvbench bench kernels`` (``kernel_bench.py``): the fused RoPE + quantize + store append
against the unfused two-launch path and a plain bf16 store, timed as CUDA-graph replays (a few µs each),
with the launch floor of empty Triton kernels.  Generators of ``Row``: printed as measured."""

from __future__ import annotations

from typing import Iterator

from kvbench.tools.common import Row, bench_formats, bench_us
from kvbench.tools.decode_bench import BenchResults

__all__ = ["append_bytes", "launch_floor", "launch_floor_rows", "append_rows", "APPEND_TOKENS"]

APPEND_TOKENS = (1, 16, 128, 512)


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

    return bench_us(lambda: _empty_kernel[(1,)](x), graph=True), bench_us(two, graph=True)


def launch_floor_rows() -> Iterator[Row]:
    one, two = launch_floor()
    yield Row("launch floor: one empty kernel (graph replay)", one)
    yield Row("launch floor: two empty kernels (graph replay)", two,
              note=f"a launch-bound fused append can reach {one / two:.2f}x of a two-launch one")


def append_rows(res: BenchResults, t: int, *, hq=32, hk=8, d=128, page=16, layout="HND", formats=None,
                seed=3) -> Iterator[Row]:
    """``t`` tokens: the plain bf16 store, then the fused append per format (the unfused time and the bytes
    in its note); ``res.app[(t, fmt)] = (fused, unfused, plain)`` µs for the targets."""
    import torch

    from kvbench.core import get_spec
    from kvbench.kernels import fused_rope_quant_append, quantize_store, unfused_rope_quant_append
    from kvbench.kernels import PagedKV
    from kvbench.kernels import build_cos_sin_cache
    from kvbench.tools.kernel_check import make_cache

    gen = torch.Generator().manual_seed(seed + t)
    cs = build_cos_sin_cache(8192, d, device="cuda")
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (t,), device="cuda")
    npg = 64
    slots = torch.randperm(npg * page, device="cuda")[:t]
    kcb, _, _, _ = make_cache("bf16", npg, page, hk, d, "cuda", gen, layout)
    vcb, _, _, _ = make_cache("bf16", npg, page, hk, d, "cuda", gen, layout)
    plain_kv = PagedKV("bf16", kcb, vcb)
    plain = bench_us(lambda: quantize_store(k, v, slots, plain_kv), graph=True)
    yield Row(f"append plain bf16 store T={t} {layout}", plain)
    for fmt in formats or bench_formats():
        kc, kbs, ks, _ = make_cache(fmt, npg, page, hk, d, "cuda", gen, layout)
        vc, vbs, vs, _ = make_cache(fmt, npg, page, hk, d, "cuda", gen, layout)
        args = (q, k, v, pos, slots, cs, PagedKV(fmt, kc, vc, ks, vs, kbs, vbs))
        tf = bench_us(lambda: fused_rope_quant_append(*args), graph=True)
        tu = bench_us(lambda: unfused_rope_quant_append(*args), graph=True)
        res.app[(t, fmt)] = (tf, tu, plain)
        bf, bu = append_bytes(t, hq, hk, d, get_spec(fmt).bytes_per_element * d)  # block scales included
        yield Row(f"append fused {fmt} T={t} {layout}", tf, note=f"unfused {tu:.1f} us -> {tf / tu:.2f}x; "
                                                               f"{tf / plain:.2f}x plain store; "
                                                               f"bytes {bf / 1e6:.2f} / {bu / 1e6:.2f} MB")

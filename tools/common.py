"""What the kernel checks and benchmarks share: the formats they cover (from the ground floor's tables),
the benchmark row and its table, and the timing helpers (medians of ``triton.testing``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from kvbench.core import supported_formats
from kvbench.core import get_spec

__all__ = ["kernel_formats", "plain_and_quantized", "mla_formats", "is_plain", "bench_formats", "Row", "ROW_HEADER", "causal_name", "speedup", "bench_us", "graph_us",
           "copy_bandwidth", "fi_kv"]


def kernel_formats() -> tuple[str, ...]:
    """Every registered format the Triton kernels implement, in table order."""
    return supported_formats("triton")


def plain_and_quantized(names) -> tuple[str, ...]:
    """The first 16-bit format of ``names`` and every quantized one (table order): the second 16-bit
    format runs the same code as the first."""
    plain = [n for n in names if not get_spec(n).quantized][:1]
    return tuple(plain + [n for n in names if get_spec(n).quantized])


def mla_formats() -> tuple[str, ...]:
    """The MLA checks' formats: ``plain_and_quantized`` of the formats the MLA kernels run."""
    return plain_and_quantized(supported_formats("triton", mla=True))


def is_plain(fmt: str) -> bool:
    """A 16-bit format stored as is (no scales)."""
    return not get_spec(fmt).quantized


def bench_formats() -> tuple[str, ...]:
    """One format per element width the Triton kernels run (table order: bf16, fp8_e4m3, nvfp4): the
    benchmarks' default rows."""
    seen, out = set(), []
    for n in kernel_formats():
        bits = get_spec(n).element_bits
        if bits not in seen:
            seen.add(bits)
            out.append(n)
    return tuple(out)


# ---------------------------------------------------------------------------------------- rows
NAME_W = 72
# "kvbench": on an anchor's row (flashinfer, torch SDPA), kvbench's speed on the same problem as a multiple of it
ROW_HEADER = f"{'case':<{NAME_W}} {'us':>10} {'GB/s':>7} {'% copy':>7} {'TFLOP/s':>8} {'kvbench':>8}  note"


@dataclass
class Row:
    """One benchmark row.  ``kvbench_x`` (anchor rows: flashinfer, torch SDPA): kvbench's speed on the same
    problem as a multiple of this row's (the anchor's time / kvbench's time; above 1: kvbench is faster)."""

    name: str
    us: float
    gbps: Optional[float] = None
    pct_copy: Optional[float] = None
    tflops: Optional[float] = None
    note: str = ""
    kvbench_x: Optional[float] = None

    def line(self) -> str:
        def num(v, spec, w):
            return f"{'' if v is None else format(v, spec):>{w}}"

        x = None if self.kvbench_x is None else f"{self.kvbench_x:.2f}x"
        return (f"{self.name:<{NAME_W}} {num(self.us, '.1f', 10)} {num(self.gbps, '.0f', 7)} "
                f"{num(self.pct_copy, '.0f', 7)} {num(self.tflops, '.0f', 8)} {num(x, '', 8)}  {self.note}").rstrip()


def causal_name(who: str, n: int, length: int, hq: int, hk: int, d: int) -> str:
    """A causal prompt problem's row name: one prompt of ``length`` tokens, or ``n`` of them."""
    shape = str(length) if n == 1 else f"{n}x{length}"
    return f"prefill {who} causal {shape} {hq}/{hk} D{d}"


def speedup(anchor_us: float, ours_us: Optional[float]) -> Optional[float]:
    """kvbench's speed as a multiple of the anchor's (None when either is missing or not a number)."""
    if ours_us is None or not (ours_us == ours_us) or not (anchor_us == anchor_us) or ours_us <= 0:
        return None
    return anchor_us / ours_us


# ------------------------------------------------------------------------------------- timing
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


def graph_note(pre: dict, key: str, fn: Callable) -> str:
    """``fn`` (a row's call) timed as CUDA-graph replays too, recorded as ``pre[key + "_graph"]`` (the extend
    targets are judged on them, ``kernel_bench._extend_ratio``) → text for the row's note; a call that cannot be
    captured says why."""
    try:
        pre[key + "_graph"] = graph_us(fn)
    except Exception as e:  # noqa: BLE001 - no replay: the targets fall back to the calls' timing
        return f"; graph replay failed: {type(e).__name__}: {' '.join(str(e).split())[:80]}"
    return f"; graph replay {pre[key + '_graph']:.1f} us"


def bench_us(fn: Callable, graph: bool = False) -> float:
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
    t = bench_us(lambda: b.copy_(a))
    del a, b
    return 2 * 2 * n / (t * 1e-6) / 1e9


def fi_kv(kc, vc, layout):
    """The cache planes as flashinfer takes them: NHD as stored, HND as the contiguous [P, H, page, D]."""
    return (kc, vc) if layout == "NHD" else (kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3))

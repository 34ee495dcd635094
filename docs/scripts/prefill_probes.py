"""GPU probes of the paged prefill / extend kernels against FlashAttention 3 (issue 44's extend row; docs/kernels.md,
"The extend against vLLM's FlashAttention 3").  The figures cited there for the Hopper kernel came from this script.

``python docs/scripts/prefill_probes.py wg [--check] [--stages 3,4,5] [--page 16]``: the Triton kernel (``prefill.py``, launch
defaults) against the Hopper kernel (``prefill_wg.py``, at each ``STAGES`` given: its refill early and late, and
the warp-specialized variant), on the problems of ``kvbench
bench kernels``' prefill part (``tools/prefill_bench.py``): one causal prompt of 8192, 8 prompts of 1024 (the
engine's prefill step under the serving load) and the bf16 extend of 4 x (7168 cached + 1024 new); 32 / 8 heads, D
128, pages of 16 (``--page``), HND.  Each row: µs (``do_bench`` median), TFLOP/s and the speed over vLLM's FA3 on the same
problem where its library is found (``tools/vllm_fa3.py``).  ``--check`` first runs both Hopper kernels against the
float64 reference (``kernel_check.check_prefill``) at the GPU test shapes, and stops on a failure.

``python docs/scripts/prefill_probes.py shapes``: the bf16 extend at five (batch, cached, new) shapes, the Triton kernel
against the warp-specialized Hopper kernel (where ``prefill.WGMMA_DEFAULT``'s rule comes from).

``python docs/scripts/prefill_probes.py ncu causal|extend``: three launches of the Hopper kernel on one problem, for
Nsight Compute (``--launch-skip 2 --launch-count 1``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace


def _problems(pb):
    """(name, flops, run(opts), FA3 closure or None) for the bf16 problems of ``PrefillBench`` ``pb``."""
    from kvbench.kernels import PagedKV, paged_prefill
    from kvbench.tools import vllm_fa3

    fa3 = vllm_fa3.available()
    out = []
    for n, length in ((1, pb.seq), pb.prompts):
        x = pb.causal_inputs(n, length)
        kv, o = PagedKV("bf16", x["kc"], x["vc"]), x["q"].clone()

        def run(opts, x=x, kv=kv, o=o, length=length):
            return paged_prefill(x["q"], x["kn"], x["vn"], x["cu"], length, kv, x["table"], x["lens"], out=o,
                                 opts=replace(opts, max_prefix_len=0))

        ref = (lambda x=x, length=length: vllm_fa3.PagedFA3(x["q"], x["kc"], x["vc"], x["cu"], length, x["table"],
                                                            x["lens"], length)) if fa3 else None
        out.append((f"causal {n}x{length}", n * 4 * pb.hq * pb.d * length * length / 2, run, ref))
    x = pb.extend_inputs("bf16")
    kv, o = PagedKV("bf16", x["kc"], x["vc"]), x["qx"].clone()

    def run(opts):
        return paged_prefill(x["qx"], x["knx"], x["vnx"], x["cux"], pb.new, kv, x["table"], x["lx"], out=o,
                             opts=replace(opts, max_prefix_len=pb.pre))

    ref = (lambda: vllm_fa3.PagedFA3(x["qx"], x["kc"], x["vc"], x["cux"], pb.new, x["table"], x["lx"], pb.seq)) \
        if fa3 else None
    out.append((f"extend bf16 {pb.b}x({pb.pre}+{pb.new})", pb.fl, run, ref))
    return out


def check() -> int:
    """The Hopper kernel against the float64 reference (``kernel_check.check_prefill_wgmma``); failures counted."""
    from kvbench.tools.kernel_check import check_prefill_wgmma

    cases = check_prefill_wgmma()
    for case in cases:
        print(case.line(), flush=True)
    return sum(not c.ok for c in cases)


def wg(stages: list[int], do_check: bool, page: int = 16) -> int:
    import torch

    from kvbench.kernels import PrefillOptions
    from kvbench.kernels import prefill_wg
    from kvbench.tools.common import bench_us
    from kvbench.tools.decode_bench import BenchResults
    from kvbench.tools.prefill_bench import PrefillBench

    keep = prefill_wg.STAGES, prefill_wg.LATE_REFILL, prefill_wg.WARP_SPECIALIZE
    if do_check:
        for ws in (False, True):  # both kernels
            prefill_wg.WARP_SPECIALIZE = ws
            print(f"## float64 checks, {'warp-specialized' if ws else 'one partition'}", flush=True)
            bad = check()
            prefill_wg.WARP_SPECIALIZE = keep[2]
            if bad:
                return 1
    print(f"## prefill: Triton kernel against the Hopper kernel — {torch.cuda.get_device_name()}", flush=True)
    pb = PrefillBench(BenchResults(), flashinfer=False, formats=("bf16",), page=page)
    print(f"pages of {page} tokens", flush=True)
    for name, flops, run, ref in _problems(pb):
        t_ref = bench_us(ref()) if ref else None
        rows = [("vLLM FA3", t_ref)] if t_ref else []
        rows.append(("triton (defaults)", bench_us(lambda: run(PrefillOptions(wgmma=False)))))
        for n in stages:
            for late, ws in ((False, False), (True, False), (True, True)):
                prefill_wg.STAGES, prefill_wg.LATE_REFILL, prefill_wg.WARP_SPECIALIZE = n, late, ws
                rows.append((f"wgmma, {n} stages" + (", warp-specialized" if ws else ", late refill" if late else ""),
                             bench_us(lambda: run(PrefillOptions(wgmma=True)))))
        prefill_wg.STAGES, prefill_wg.LATE_REFILL, prefill_wg.WARP_SPECIALIZE = keep
        for who, t in rows:
            x = f"  {t_ref / t:.2f}x FA3" if t_ref else ""
            print(f"{name:<26} {who:<30} {t:8.1f} us {flops / t / 1e6:6.0f} TFLOP/s{x}", flush=True)
        torch.cuda.empty_cache()
    return 0


SHAPES = ((4, 2048, 1024), (8, 1024, 512), (16, 8192, 128), (2, 16384, 2048), (8, 512, 1024))


def shapes() -> int:
    """The bf16 extend at ``SHAPES`` (batch, cached, new), Triton kernel against the warp-specialized Hopper kernel:
    where ``prefill.WGMMA_DEFAULT``'s rule (extends with a cached prefix) comes from."""
    import torch

    from kvbench.kernels import PagedKV, PrefillOptions, paged_prefill, prefill_wg
    from kvbench.tools.common import bench_us
    from kvbench.tools.decode_bench import BenchResults
    from kvbench.tools.prefill_bench import PrefillBench

    keep = prefill_wg.WARP_SPECIALIZE
    for b, pre, new in SHAPES:
        pb = PrefillBench(BenchResults(), flashinfer=False, formats=("bf16",), seq=pre + new, new=new, batch=b)
        x = pb.extend_inputs("bf16")
        kv, o = PagedKV("bf16", x["kc"], x["vc"]), x["qx"].clone()

        def run(w, x=x, kv=kv, o=o, pre=pre, new=new):
            return paged_prefill(x["qx"], x["knx"], x["vnx"], x["cux"], new, kv, x["table"], x["lx"], out=o,
                                 opts=PrefillOptions(max_prefix_len=pre, wgmma=w))

        prefill_wg.WARP_SPECIALIZE = True
        t0, t1 = bench_us(lambda: run(False)), bench_us(lambda: run(True))
        print(f"extend bf16 {b}x({pre}+{new}): triton {t0:.1f} us, warp-specialized {t1:.1f} us, {t0 / t1:.2f}x",
              flush=True)
        del pb, x, kv, o
        torch.cuda.empty_cache()
    prefill_wg.WARP_SPECIALIZE = keep
    return 0


def ncu(problem: str) -> int:
    """Three launches of the Hopper kernel on one problem (``causal`` 8 x 1024 or ``extend``), for
    ``ncu --kernel-name regex:_prefill_wg --launch-skip 2 --launch-count 1 ... python prefill_probes.py ncu extend``."""
    import torch

    from kvbench.kernels import PrefillOptions
    from kvbench.tools.decode_bench import BenchResults
    from kvbench.tools.prefill_bench import PrefillBench

    pb = PrefillBench(BenchResults(), flashinfer=False, formats=("bf16",))
    probs = {p[0].split()[0]: p for p in _problems(pb)[1:]}  # causal 8 x 1024, extend
    run = probs[problem][2]
    for _ in range(3):
        run(PrefillOptions(wgmma=True))
    torch.cuda.synchronize()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python docs/scripts/prefill_probes.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("wg", help="the Triton kernel against the Hopper kernel, and vLLM's FA3")
    p.add_argument("--stages", default="4", help="comma list of prefill_wg.STAGES to time")
    p.add_argument("--check", action="store_true", help="the Hopper kernel against the float64 reference first")
    p.add_argument("--page", type=int, default=16, help="tokens per page (16, the engine's default)")
    n = sub.add_parser("ncu", help="three launches of the Hopper kernel, for Nsight Compute")
    n.add_argument("problem", choices=("causal", "extend"))
    sub.add_parser("shapes", help="the bf16 extend at SHAPES, Triton against the warp-specialized Hopper kernel")
    a = ap.parse_args(argv)
    if a.cmd == "shapes":
        return shapes()
    return wg([int(x) for x in a.stages.split(",")], a.check, a.page) if a.cmd == "wg" else ncu(a.problem)


if __name__ == "__main__":
    sys.exit(main())

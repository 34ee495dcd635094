"""GPU probes of the paged prefill / extend kernels against FlashAttention 3 (issue 44's extend row; docs/kernels.md,
"The extend against vLLM's FlashAttention 3").  The figures cited there for the Hopper kernel came from this script.

``python docs/scripts/prefill_probes.py wg [--check] [--stages 4] [--ws 128:3,64:4] [--page 16]``: the Triton kernel
(``prefill.py``, launch defaults) against the Hopper kernel (``prefill_wg.py``): the one-partition kernel at each
``STAGES`` given (its refill early and late) and the warp-specialized kernel at each ``--ws`` variant (keys per tile
: stages), on the problems of ``kvbench bench kernels``' prefill part (``tools/prefill_bench.py``): one causal
prompt of 8192, 8 prompts of 1024 (the engine's prefill step under the serving load) and the bf16 extend of 4 x
(7168 cached + 1024 new); 32 / 8 heads, D 128, pages of 16 (``--page``), HND.  Each row: µs (``do_bench`` median),
TFLOP/s and the speed over vLLM's FA3 on the same problem where its library is found (``tools/vllm_fa3.py``).
``--check`` first runs each warp-specialized variant against the float64 reference
(``kernel_check.check_prefill_wgmma``) at the GPU test shapes, and stops on a failure.

``python docs/scripts/prefill_probes.py shapes``: the bf16 extend and prompts alone at eleven (batch, cached, new)
shapes, the Triton kernel against the warp-specialized Hopper kernel (where ``prefill.WGMMA_DEFAULT``'s rule comes
from).

``python docs/scripts/prefill_probes.py quant``: extends over fp8_e4m3 / fp8_e5m2 / nvfp4 prefixes, 4 x (7168 + 64 ..
1024), the Triton kernel against the Hopper kernel over a bf16 workspace, each beside the bf16 extend (where
``prefill.WGMMA_WORKSPACE_MIN_Q`` comes from).

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


_SWITCHES = ("STAGES", "LATE_REFILL", "WARP_SPECIALIZE", "WS_BLOCK_N", "WS_STAGES", "WS_REGS")


def _ws_variants(spec: str) -> list[tuple[str, dict]]:
    """``"128:3,64:4"`` (keys per tile : stages) → (label, prefill_wg switches) per variant."""
    out = []
    for v in filter(None, spec.split(",")):
        bn, st = (int(x) for x in v.split(":"))
        out.append((f"warp-specialized, {bn} keys, {st} stages",
                    dict(WARP_SPECIALIZE=True, WS_BLOCK_N=bn, WS_STAGES=st, WS_REGS=240 if bn == 128 else 232)))
    return out


def wg(stages: list[int], do_check: bool, page: int = 16, ws: str = "128:3,64:4") -> int:
    import torch

    from kvbench.kernels import PrefillOptions
    from kvbench.kernels import prefill_wg
    from kvbench.tools.common import bench_us
    from kvbench.tools.decode_bench import BenchResults
    from kvbench.tools.prefill_bench import PrefillBench

    keep = {k: getattr(prefill_wg, k) for k in _SWITCHES}
    variants = [(f"one partition, {n} stages" + (", late refill" if late else ""),
                 dict(WARP_SPECIALIZE=False, STAGES=n, LATE_REFILL=late)) for n in stages for late in (False, True)]
    variants += _ws_variants(ws)

    def use(sw):
        for k, v in {**keep, **sw}.items():
            setattr(prefill_wg, k, v)

    try:
        if do_check:
            for label, sw in _ws_variants(ws):  # the warp-specialized variants (the one-partition kernel unchanged)
                use(sw)
                print(f"## float64 checks, {label}", flush=True)
                if check():
                    return 1
        print(f"## prefill: Triton kernel against the Hopper kernel — {torch.cuda.get_device_name()}", flush=True)
        pb = PrefillBench(BenchResults(), flashinfer=False, formats=("bf16",), page=page)
        print(f"pages of {page} tokens", flush=True)
        for name, flops, run, ref in _problems(pb):
            t_ref = bench_us(ref()) if ref else None
            rows = [("vLLM FA3", t_ref)] if t_ref else []
            use({})
            rows.append(("triton (defaults)", bench_us(lambda: run(PrefillOptions(wgmma=False)))))
            for label, sw in variants:
                use(sw)
                rows.append((label, bench_us(lambda: run(PrefillOptions(wgmma=True)))))
            use({})
            for who, t in rows:
                x = f"  {t_ref / t:.2f}x FA3" if t_ref else ""
                print(f"{name:<26} {who:<40} {t:8.1f} us {flops / t / 1e6:6.0f} TFLOP/s{x}", flush=True)
            torch.cuda.empty_cache()
    finally:
        use({})
    return 0


# (batch, cached, new): extends, then prompts alone (cached 0), short ones as a serving step batches them
SHAPES = ((4, 2048, 1024), (8, 1024, 512), (16, 8192, 128), (2, 16384, 2048), (8, 512, 1024),
          (1, 0, 8192), (8, 0, 1024), (16, 0, 256), (64, 0, 128), (4, 0, 64), (1, 0, 1000))


def shapes() -> int:
    """The bf16 extend and prompts at ``SHAPES`` (batch, cached, new), Triton kernel against the warp-specialized
    Hopper kernel: where ``prefill.WGMMA_DEFAULT``'s rule comes from."""
    import torch

    from kvbench.kernels import PagedKV, PrefillOptions, paged_prefill
    from kvbench.tools.common import bench_us
    from kvbench.tools.decode_bench import BenchResults
    from kvbench.tools.prefill_bench import PrefillBench

    for b, pre, new in SHAPES:
        pb = PrefillBench(BenchResults(), flashinfer=False, formats=("bf16",), seq=pre + new, new=new, batch=b)
        x = pb.extend_inputs("bf16")
        kv, o = PagedKV("bf16", x["kc"], x["vc"]), x["qx"].clone()

        def run(w, x=x, kv=kv, o=o, pre=pre, new=new):
            return paged_prefill(x["qx"], x["knx"], x["vnx"], x["cux"], new, kv, x["table"], x["lx"], out=o,
                                 opts=PrefillOptions(max_prefix_len=pre, wgmma=w))

        t0, t1 = bench_us(lambda: run(False)), bench_us(lambda: run(True))
        what = "extend" if pre else "prompts"
        print(f"{what} bf16 {b}x({pre}+{new}): triton {t0:.1f} us, warp-specialized {t1:.1f} us, {t0 / t1:.2f}x",
              flush=True)
        del pb, x, kv, o
        torch.cuda.empty_cache()
    return 0


def quant(new_lens=(64, 128, 256, 512, 1024), prefix: int = 7168, batch: int = 4, fill: bool = True) -> int:
    """The extend over a quantized prefix, batch x (prefix + new): the Triton kernel (its own defaults: fp8 scores
    on the stored e4m3 K, the float16 workspace for nvfp4 and e5m2 where ``WORKSPACE_MIN_Q`` says) against the
    Hopper kernel over a workspace of bf16 (``wgmma=True``), with the bf16 extend (the default: the Hopper kernel)
    beside: where ``prefill.WGMMA_WORKSPACE_MIN_Q`` comes from.  ``fill``: also the workspace's fill alone (the
    dequantizing kernel, no attention) at each format's last size."""
    import torch

    from kvbench.kernels import prefill as P
    from kvbench.kernels._triton_utils import check_kv

    from kvbench.kernels import PagedKV, PrefillOptions, paged_prefill
    from kvbench.tools.common import bench_us
    from kvbench.tools.decode_bench import BenchResults
    from kvbench.tools.prefill_bench import PrefillBench

    for new in new_lens:
        t_bf16 = None
        for fmt in ("bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4"):
            pb = PrefillBench(BenchResults(), flashinfer=False, formats=(fmt,), seq=prefix + new, new=new, batch=batch)
            x = pb.extend_inputs(fmt)
            kv = PagedKV(fmt, x["kc"], x["vc"], x["ks"], x["vs"], x["kbs"], x["vbs"])
            o = x["qx"].clone()

            def run(w, x=x, kv=kv, o=o, new=new):
                return paged_prefill(x["qx"], x["knx"], x["vnx"], x["cux"], new, kv, x["table"], x["lx"], out=o,
                                     opts=PrefillOptions(max_prefix_len=prefix, wgmma=w))

            t0, t1 = bench_us(lambda: run(False)), bench_us(lambda: run(True))
            if fmt == "bf16":
                t_bf16 = t1
            print(f"extend {fmt:<9} {batch}x({prefix}+{new}): triton {t0:8.1f} us, hopper {t1:8.1f} us "
                  f"({t0 / t1:.2f}x); bf16 extend / this: triton {t_bf16 / t0:.2f}x, hopper {t_bf16 / t1:.2f}x",
                  flush=True)
            if fill and fmt != "bf16" and new == new_lens[-1]:
                kc, vc = check_kv(kv, pb.d)
                plan = P.workspace_plan(P.format_code(fmt), False, prefix, new, batch, pb.hk, pb.d, pb.page, True)
                t2 = bench_us(lambda: P._over_workspace(plan, kc, vc, x["table"], x["lx"], x["cux"], batch,
                                                        P.format_code(fmt), x["qx"], lambda *a: None, torch.bfloat16))
                print(f"  the bf16 workspace's fill alone ({fmt}): {t2:.1f} us", flush=True)
            del pb, x, kv, o
            torch.cuda.empty_cache()
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
    p.add_argument("--ws", default="128:3,64:4", help="warp-specialized variants to check and time, keys per tile:stages")
    n = sub.add_parser("ncu", help="three launches of the Hopper kernel, for Nsight Compute")
    n.add_argument("problem", choices=("causal", "extend"))
    sub.add_parser("quant", help="quantized extends: the Triton kernel against the Hopper kernel over a workspace")
    sub.add_parser("shapes", help="the bf16 extend at SHAPES, Triton against the warp-specialized Hopper kernel")
    a = ap.parse_args(argv)
    if a.cmd == "shapes":
        return shapes()
    if a.cmd == "quant":
        return quant()
    return wg([int(x) for x in a.stages.split(",")], a.check, a.page, a.ws) if a.cmd == "wg" else ncu(a.problem)


if __name__ == "__main__":
    sys.exit(main())

"""GPU probes of the paged prefill / extend kernels against FlashAttention 3 (issue 44's extend row; docs/kernels.md,
"The extend against vLLM's FlashAttention 3").  The figures cited there for the Hopper kernel came from this script.

``python docs/scripts/prefill_probes.py wg [--check] [--ws 128:3,64:4] [--page 16]``: the Triton kernel
(``prefill.py``, launch defaults) against the Hopper kernel (``prefill_wg.py``) at each ``--ws`` variant (keys per
tile : stages), on the problems of ``kvbench bench kernels``' prefill part (``tools/prefill_bench.py``): one causal
prompt of 8192, 8 prompts of 1024 (the engine's prefill step under the serving load) and the bf16 extend of 4 x
(7168 cached + 1024 new); 32 / 8 heads, D 128, pages of 16 (``--page``), HND.  Each row: µs (``do_bench`` median),
TFLOP/s and the speed over vLLM's FA3 on the same problem where its library is found (``tools/vllm_fa3.py``).
``--check`` first runs each warp-specialized variant against the float64 reference
(``kernel_check.check_prefill_wgmma``) at the GPU test shapes, and stops on a failure.

``python docs/scripts/prefill_probes.py shapes``: the bf16 extend and prompts alone at eleven (batch, cached, new)
shapes, the Triton kernel against the warp-specialized Hopper kernel (where ``prefill.WGMMA_DEFAULT``'s rule comes
from).

``python docs/scripts/prefill_probes.py quant [--new 64,128,256,512,1024] [--fill 64:4,128:4,128:8]``: extends over
fp8_e4m3 / fp8_e5m2 / nvfp4 prefixes, 4 x (7168 + new), the Triton kernel against the Hopper kernel over a bf16
workspace, each beside the bf16 extend (where ``prefill.WGMMA_WORKSPACE_MIN_Q`` comes from); at the last size, the
Hopper call's kernels by name (torch profiler, µs per call) and the workspace fill alone at each ``--fill`` variant
(tokens per program : warps).

``python docs/scripts/prefill_probes.py ws-parts [--format fp8_e4m3]``: the Hopper kernel's device time (torch
profiler) on the bf16 extend and over a quantized prefix's workspace: as run (scaled), unscaled, refilled with normal
values, and with its pages in random order.

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


_SWITCHES = ("WS_BLOCK_N", "WS_STAGES", "WS_REGS")


def _ws_variants(spec: str) -> list[tuple[str, dict]]:
    """``"128:3,64:4"`` (keys per tile : stages) → (label, prefill_wg switches) per variant."""
    out = []
    for v in filter(None, spec.split(",")):
        bn, st = (int(x) for x in v.split(":"))
        out.append((f"warp-specialized, {bn} keys, {st} stages",
                    dict(WS_BLOCK_N=bn, WS_STAGES=st, WS_REGS=240 if bn == 128 else 232)))
    return out


def wg(do_check: bool, page: int = 16, ws: str = "128:3,64:4") -> int:
    import torch

    from kvbench.kernels import PrefillOptions
    from kvbench.kernels import prefill_wg
    from kvbench.tools.common import bench_us
    from kvbench.tools.decode_bench import BenchResults
    from kvbench.tools.prefill_bench import PrefillBench

    keep = {k: getattr(prefill_wg, k) for k in _SWITCHES}
    variants = _ws_variants(ws)

    def use(sw):
        for k, v in {**keep, **sw}.items():
            setattr(prefill_wg, k, v)

    try:
        if do_check:
            for label, sw in variants:
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


def _kernels_us(fn, calls: int = 20) -> dict:
    """{kernel name: µs of device time per call of ``fn``} by the torch profiler, after two warm-up calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.key[:40]] = out.get(e.key[:40], 0.0) + t / calls
    return out


def quant(new_lens=(64, 128, 256, 512, 1024), prefix: int = 7168, batch: int = 4,
          fills: str = "64:4,128:4,128:8") -> int:
    """The extend over a quantized prefix, batch x (prefix + new): the Triton kernel (its own defaults: fp8 scores
    on the stored e4m3 K, the float16 workspace for nvfp4 and e5m2 where ``WORKSPACE_MIN_Q`` says) against the
    Hopper kernel over a workspace of bf16 (``wgmma=True``), with the bf16 extend (the default: the Hopper kernel)
    beside: where ``prefill.WGMMA_WORKSPACE_MIN_Q`` comes from.  At each format's last size: the Hopper call's
    kernels by name, and the workspace's fill alone (no attention) at each ``fills`` variant (tokens per program :
    warps; the first is what the call above ran with only if it is ``prefill._WS_BLOCK_T``:``_WS_FILL_WARPS``)."""
    import torch

    from kvbench.kernels import prefill as P
    from kvbench.kernels._triton_utils import check_kv

    from kvbench.kernels import PagedKV, PrefillOptions, paged_prefill
    from kvbench.tools.common import bench_us
    from kvbench.tools.decode_bench import BenchResults
    from kvbench.tools.prefill_bench import PrefillBench

    keep = (P._WS_BLOCK_T, P._WS_FILL_WARPS)
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
            if new == new_lens[-1]:
                parts = _kernels_us(lambda: run(True))
                print("  hopper call's kernels, us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()),
                      flush=True)
            if fmt != "bf16" and new == new_lens[-1]:
                kc, vc = check_kv(kv, pb.d)
                plan = P.workspace_plan(P.format_code(fmt), False, prefix, new, batch, pb.hk, pb.d, pb.page, True)
                try:
                    for v in filter(None, fills.split(",")):
                        P._WS_BLOCK_T, P._WS_FILL_WARPS = (int(y) for y in v.split(":"))

                        def fill():
                            P._over_workspace(plan, kc, vc, x["table"], x["lx"], x["cux"], batch, P.format_code(fmt),
                                              x["qx"], lambda *a: None, torch.bfloat16)

                        k = {n: t for n, t in _kernels_us(fill).items() if "dequant" in n}
                        print(f"  the bf16 workspace's fill ({fmt}), {v}: {bench_us(fill):.1f} us per call, "
                              f"kernel {sum(k.values()):.1f} us", flush=True)
                finally:
                    P._WS_BLOCK_T, P._WS_FILL_WARPS = keep
            del pb, x, kv, o
            torch.cuda.empty_cache()
    return 0


def ws_parts(fmt: str = "fp8_e4m3", prefix: int = 7168, new: int = 1024, batch: int = 4) -> int:
    """Why the Hopper kernel takes longer over a workspace than over a bf16 cache: its device time (torch profiler)
    on the bf16 extend, then over one ``fmt`` prefix's workspace as the extend runs it (``SCALED``), over the same
    workspace unscaled, over that workspace refilled with normal random values (unscaled), and with its pages in
    random order as a cache's are."""
    import math

    import torch

    from kvbench.kernels import PagedKV, PrefillOptions, paged_prefill, prefill_wg
    from kvbench.kernels import prefill as P
    from kvbench.kernels._triton_utils import check_kv
    from kvbench.tools.decode_bench import BenchResults
    from kvbench.tools.prefill_bench import PrefillBench

    def attn_us(fn) -> float:
        return sum(t for n, t in _kernels_us(fn).items() if "_prefill_ws" in n)

    for f in ("bf16", fmt):
        pb = PrefillBench(BenchResults(), flashinfer=False, formats=(f,), seq=prefix + new, new=new, batch=batch)
        x = pb.extend_inputs(f)
        kv = PagedKV(f, x["kc"], x["vc"], x["ks"], x["vs"], x["kbs"], x["vbs"])
        o = x["qx"].clone()
        t = attn_us(lambda: paged_prefill(x["qx"], x["knx"], x["vnx"], x["cux"], new, kv, x["table"], x["lx"], out=o,
                                          opts=PrefillOptions(max_prefix_len=prefix, wgmma=True)))
        print(f"{f:<9} the extend as paged_prefill runs it: _prefill_ws {t:.1f} us", flush=True)
        if f == "bf16":
            continue
        kc, vc = check_kv(kv, pb.d)
        plan = P.workspace_plan(P.format_code(f), False, prefix, new, batch, pb.hk, pb.d, pb.page, True)
        ws = []
        P._over_workspace(plan, kc, vc, x["table"], x["lx"], x["cux"], batch, P.format_code(f), x["qx"],
                          lambda *a: ws.append(a), torch.bfloat16)
        kwc, vwc, table, sl, cu, _ = ws[0]
        sm = 1.0 / math.sqrt(pb.d)
        args = (x["qx"], x["knx"], x["vnx"], kwc, vwc, table, sl, cu, new, o, sm)
        for label, fn in (("workspace, scaled (as run)", prefill_wg.launch_dequantized),
                          ("workspace, unscaled", prefill_wg.launch)):
            print(f"{f:<9} {label}: _prefill_ws {attn_us(lambda fn=fn: fn(*args)):.1f} us", flush=True)
        kwc.data.normal_()
        vwc.data.normal_()
        t = attn_us(lambda: prefill_wg.launch(*args))
        print(f"{f:<9} workspace of normal values, unscaled: _prefill_ws {t:.1f} us", flush=True)
        shuffled = table.clone()
        shuffled[:, :plan.npp] = torch.randperm(plan.group * plan.npp, device=table.device).view(plan.group, -1).int()
        sargs = args[:5] + (shuffled,) + args[6:]
        t = attn_us(lambda: prefill_wg.launch(*sargs))
        print(f"{f:<9} the same, pages in random order: _prefill_ws {t:.1f} us", flush=True)
    return 0


def ncu(problem: str) -> int:
    """Three launches of the Hopper kernel on one problem (``causal`` 8 x 1024 or ``extend``), for
    ``ncu --kernel-name regex:_prefill_ws --launch-skip 2 --launch-count 1 ... python prefill_probes.py ncu extend``."""
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
    p.add_argument("--check", action="store_true", help="the Hopper kernel against the float64 reference first")
    p.add_argument("--page", type=int, default=16, help="tokens per page (16, the engine's default)")
    p.add_argument("--ws", default="128:3,64:4", help="warp-specialized variants to check and time, keys per tile:stages")
    n = sub.add_parser("ncu", help="three launches of the Hopper kernel, for Nsight Compute")
    n.add_argument("problem", choices=("causal", "extend"))
    qp = sub.add_parser("quant", help="quantized extends: the Triton kernel against the Hopper kernel over a workspace")
    qp.add_argument("--new", default="64,128,256,512,1024", help="new tokens per sequence, comma list")
    qp.add_argument("--fill", default="64:4,128:4,128:8", help="workspace fill variants, tokens per program:warps")
    sub.add_parser("shapes", help="the bf16 extend at SHAPES, Triton against the warp-specialized Hopper kernel")
    wp = sub.add_parser("ws-parts", help="the Hopper kernel's device time over a workspace: scaled, unscaled, data")
    wp.add_argument("--format", default="fp8_e4m3")
    a = ap.parse_args(argv)
    if a.cmd == "shapes":
        return shapes()
    if a.cmd == "ws-parts":
        return ws_parts(a.format)
    if a.cmd == "quant":
        return quant(tuple(int(x) for x in a.new.split(",")), fills=a.fill)
    return wg(a.check, a.page, a.ws) if a.cmd == "wg" else ncu(a.problem)


if __name__ == "__main__":
    sys.exit(main())

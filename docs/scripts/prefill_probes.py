"""GPU probes of the paged prefill / extend kernel against FlashAttention 3 (issue 44's extend row; docs/kernels.md,
"The extend against vLLM's FA3").  Every figure there came from this script on an H200.

``python docs/scripts/prefill_probes.py pack [--configs N]``: the prefill kernel with and without
``pack_gqa`` (the query heads of a GQA group in one program) at each of its launch configurations, on the
problems of ``kvbench bench kernels``' prefill part (``tools/prefill_bench.py``): one causal prompt of 8192, 8
prompts of 1024 (the engine's prefill step under the serving load), and the extend of 4 x (7168 cached + 1024 new)
over bf16 pages, over e4m3 pages with bf16 queries (split into two e4m3 terms) and with e4m3 queries.  Each row:
µs (``do_bench`` median), TFLOP/s, and the ratio to vLLM's FA3 on the same problem where the library is found
(``tools/vllm_fa3.py``).  32 / 8 heads, D 128, pages of 16, HND.  Before the timing, ``--check`` runs the packed
kernel against the float64 reference (``kernel_check.check_prefill``) for every format at the GPU test shapes.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

# (block_m, block_n, block_n_prefix, num_warps, num_stages); None = paged_prefill's defaults
PACK_CONFIGS = (None, (128, 64, 128, 8, 3), (128, 128, 128, 8, 3), (128, 64, 64, 8, 3), (64, 64, 64, 4, 3),
                (128, 64, 128, 4, 3), (64, 64, 128, 4, 3), (128, 128, 128, 8, 2))
KEYS = ("block_m", "block_n", "block_n_prefix", "num_warps", "num_stages")


def _problems(pb):
    """(name, flops, run(opts) → out, FA3 closure or None) for each problem of ``PrefillBench`` ``pb``."""
    from kvbench.kernels import AttentionParams, PagedKV, paged_prefill
    from kvbench.tools import vllm_fa3

    fa3 = vllm_fa3.available()
    out = []
    for n, length in ((1, pb.seq), pb.prompts):
        x = pb.causal_inputs(n, length)
        kv = PagedKV("bf16", x["kc"], x["vc"])
        o = x["q"].clone()

        def run(opts, x=x, kv=kv, o=o, length=length):
            return paged_prefill(x["q"], x["kn"], x["vn"], x["cu"], length, kv, x["table"], x["lens"], out=o,
                                 opts=replace(opts, max_prefix_len=0))

        ref = (lambda x=x, length=length: vllm_fa3.PagedFA3(x["q"], x["kc"], x["vc"], x["cu"], length, x["table"],
                                                            x["lens"], length)) if fa3 else None
        out.append((f"causal {n}x{length}", n * 4 * pb.hq * pb.d * length * length / 2, run, ref))
    for fmt, q8 in (("bf16", False), ("fp8_e4m3", False), ("fp8_e4m3", True)):
        x = pb.extend_inputs(fmt)
        kv = PagedKV(fmt, x["kc"], x["vc"], x["ks"], x["vs"], x["kbs"], x["vbs"])
        qq, attn = (x["q8"], AttentionParams(q_scale=x["qsc"])) if q8 else (x["qx"], AttentionParams())
        o = x["qx"].clone()

        def run(opts, x=x, kv=kv, o=o, qq=qq, attn=attn):
            return paged_prefill(qq, x["knx"], x["vnx"], x["cux"], pb.new, kv, x["table"], x["lx"], attn=attn, out=o,
                                 opts=replace(opts, max_prefix_len=pb.pre))

        ref = None
        if fa3 and (fmt == "bf16" or q8):
            sc = dict(q_scale=x["qsc"], k_scale=x["ks"], v_scale=x["vs"]) if q8 else {}
            ref = (lambda x=x, qq=qq, sc=sc: vllm_fa3.PagedFA3(qq, x["kc"], x["vc"], x["cux"], pb.new, x["table"],
                                                              x["lx"], pb.seq, **sc))
        name = f"extend {fmt}" + (" e4m3 q" if q8 else " bf16 q" if fmt != "bf16" else "")
        out.append((name, pb.fl, run, ref))
    return out


def pack(configs: int, check: bool) -> int:
    import torch

    from kvbench.kernels import PrefillOptions
    from kvbench.tools.common import bench_us
    from kvbench.tools.decode_bench import BenchResults
    from kvbench.tools.prefill_bench import PrefillBench

    if check:
        from kvbench.tools.common import kernel_formats
        from kvbench.tools.kernel_check import check_prefill

        bad = 0
        for fmt in kernel_formats():
            for case in (check_prefill(fmt, [256, 1, 77, 300], [0, 500, 1000, 31], 32, 8, 128, 16, layout="HND", seed=5,
                                       pack_gqa=True),
                         check_prefill(fmt, [200, 1, 64], [1000, 64, 0], 32, 8, 128, 16, window=300, sinks=True,
                                       q_fp8=True, layout="HND", seed=6, pack_gqa=True),
                         check_prefill(fmt, [256, 1, 77], [0, 0, 0], 32, 8, 128, 16, layout="HND", seed=38,
                                       max_prefix_len=0, pack_gqa=True)):
                print(case.line(), flush=True)
                bad += not case.ok
        if bad:
            return 1
    print(f"## prefill pack_gqa — {torch.cuda.get_device_name()}", flush=True)
    pb = PrefillBench(BenchResults(), flashinfer=False, formats=("bf16", "fp8_e4m3"))
    for name, flops, run, ref in _problems(pb):
        t_ref = bench_us(ref()) if ref else None
        if t_ref:
            print(f"{name:<24} vLLM FA3            {t_ref:8.1f} us {flops / t_ref / 1e6:6.0f} TFLOP/s", flush=True)
        for cfg in PACK_CONFIGS[:configs]:
            for packed in (False, True):
                opts = PrefillOptions(pack_gqa=packed, **({} if cfg is None else dict(zip(KEYS, cfg))))
                try:
                    t = bench_us(lambda: run(opts))
                except Exception as e:  # noqa: BLE001 - a launch that does not fit is reported, not fatal
                    print(f"{name:<24} {str(cfg):<22} pack={packed:d} failed: {type(e).__name__}", flush=True)
                    continue
                x = f"  {t_ref / t:.2f}x FA3" if t_ref else ""
                print(f"{name:<24} {str(cfg or 'defaults'):<22} pack={packed:d} {t:8.1f} us {flops / t / 1e6:6.0f} "
                      f"TFLOP/s{x}", flush=True)
        torch.cuda.empty_cache()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python docs/scripts/prefill_probes.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="pack_gqa off / on over launch configurations, against vLLM's FA3")
    p.add_argument("--configs", type=int, default=len(PACK_CONFIGS), help="the first N of PACK_CONFIGS")
    p.add_argument("--check", action="store_true", help="the packed kernel against the float64 reference first")
    a = ap.parse_args(argv)
    return pack(a.configs, a.check)


if __name__ == "__main__":
    sys.exit(main())

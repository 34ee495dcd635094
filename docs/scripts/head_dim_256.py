"""head_dim 256 (Gemma 3) on the GPU: paged prefill over tile configurations against torch SDPA in the same run
(an 8k causal prompt; an extend of 4 x 1024 new tokens over 7168 cached, SDPA with a boolean mask), bf16 / fp8_e4m3 /
nvfp4 caches, and paged decode B64 x 8192 as a fraction of a device copy.  16 query / 8 kv heads, pages of 16, HND.

    python docs/scripts/head_dim_256.py [HEAD_DIM]   # on a CUDA machine, kvbench importable; default 256
    python docs/scripts/head_dim_256.py --default-only   # the default tiles only (one compile per row)
"""
import argparse

import torch
import torch.nn.functional as F

CFGS = [None, (64, 64, 64, 4, 2), (64, 32, 64, 4, 2), (64, 64, 32, 4, 2), (64, 64, 64, 8, 2), (128, 64, 64, 8, 2),
        (128, 32, 32, 8, 2), (64, 64, 64, 4, 1), (128, 64, 32, 8, 1), (64, 128, 64, 8, 2)]
KEYS = ("block_m", "block_n", "block_n_prefix", "num_warps", "num_stages")
HQ, HK, PAGE = 16, 8, 16


def run_prefill(fmt, q_lens, prefixes, d, gen, dev="cuda", cfgs=CFGS):
    from kvbench.kernels import PagedKV, PrefillOptions, paged_prefill
    from kvbench.tools.common import bench_us
    from kvbench.tools.kernel_check import _attn_inputs, _tokens

    lens = [a + b for a, b in zip(q_lens, prefixes)]
    kv, table = _attn_inputs(fmt, lens, HK, d, PAGE, dev, gen, "HND")
    t = sum(q_lens)
    q, kn, vn = (_tokens(gen, t, h, d, torch.bfloat16, dev) for h in (HQ, HK, HK))
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    res = []
    for c in cfgs:
        kw = {} if c is None else dict(zip(KEYS, c))
        kw["max_prefix_len"] = max(prefixes)
        try:
            res.append((bench_us(lambda: paged_prefill(q, kn, vn, cu, max(q_lens), PagedKV(fmt, **kv), table, sl,
                                                       opts=PrefillOptions(**kw))), c))
        except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
            res.append((float("nan"), f"{c} {type(e).__name__}"))
    # SDPA on the dense equivalent (B sequences of full length, causal over the new rows)
    B, L, n = len(q_lens), lens[0], q_lens[0]
    qd = torch.randn(B, HQ, n, d, dtype=torch.bfloat16, device=dev)
    kd = torch.randn(B, HQ, L, d, dtype=torch.bfloat16, device=dev)
    vd = torch.randn_like(kd)
    if n == L:
        sd = bench_us(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True))
    else:
        m = torch.ones(n, L, dtype=torch.bool, device=dev).tril(L - n)
        sd = bench_us(lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=m))
    print(f"prefill D{d} {fmt} new={n}x{B} prefix={prefixes[0]} SDPA {sd:.0f} us")
    for us, c in res:
        print(f"   {str(c):<28} {us:8.0f} us  {sd / us if us == us else float('nan'):.2f}x SDPA")


def run_decode(fmt, d, gen, bw, dev="cuda"):
    from kvbench.kernels import PagedKV, paged_decode
    from kvbench.tools.common import bench_us
    from kvbench.tools.kernel_check import _attn_inputs, _tokens

    lens = [8192] * 64
    kv, table = _attn_inputs(fmt, lens, HK, d, PAGE, dev, gen, "HND")
    q = _tokens(gen, 64, HQ, d, torch.bfloat16, dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    t = bench_us(lambda: paged_decode(q, PagedKV(fmt, **kv), table, sl))
    nbytes = sum(x.numel() * x.element_size() for x in kv.values() if isinstance(x, torch.Tensor) and x.dim() == 4)
    print(f"decode {fmt} B64x8192 {HQ}/{HK} D{d}: {t:.0f} us, {nbytes / t / 1e3 / bw:.0%} of copy ({bw:.0f} GB/s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="head_dim 256 prefill / decode timings against SDPA (a CUDA GPU)")
    ap.add_argument("head_dim", nargs="?", type=int, default=256)
    ap.add_argument("--default-only", action="store_true", help="time the default tiles only")
    args = ap.parse_args(argv)
    cfgs = CFGS[:1] if args.default_only else CFGS
    from kvbench.tools.common import copy_bandwidth

    gen = torch.Generator().manual_seed(0)
    for fmt in ("bf16", "fp8_e4m3", "nvfp4"):
        run_prefill(fmt, [8192], [0], args.head_dim, gen, cfgs=cfgs)
        run_prefill(fmt, [1024] * 4, [7168] * 4, args.head_dim, gen, cfgs=cfgs)
    bw = copy_bandwidth()
    for fmt in ("bf16", "fp8_e4m3", "nvfp4"):
        run_decode(fmt, args.head_dim, gen, bw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""head_dim 256 (Gemma 3) on the GPU: paged prefill over tile configurations against torch SDPA in the same run
(an 8k causal prompt; an extend of 4 x 1024 new tokens over 7168 cached, SDPA with a boolean mask), bf16 / fp8_e4m3 /
nvfp4 caches, and paged decode B64 x 8192 as a fraction of a device copy.  16 query / 8 kv heads, pages of 16, HND.

    python docs/scripts/head_dim_256.py [HEAD_DIM]   # on a CUDA machine, kvbench importable; default 256
"""
import torch, sys
from kvbench.kernels import PagedKV, PrefillOptions, DecodeOptions, paged_prefill, paged_decode
from kvbench.tools.kernel_check import _attn_inputs, _tokens
from kvbench.tools.common import bench_us
import torch.nn.functional as F
dev = "cuda"; gen = torch.Generator().manual_seed(0)
HQ, HK, D, PAGE = 16, 8, int(sys.argv[1]) if len(sys.argv) > 1 else 256, 16  # another head dim: argv[1]
CFGS = [None, (64, 64, 64, 4, 2), (64, 32, 64, 4, 2), (64, 64, 32, 4, 2), (64, 64, 64, 8, 2), (128, 64, 64, 8, 2),
        (128, 32, 32, 8, 2), (64, 64, 64, 4, 1), (128, 64, 32, 8, 1), (64, 128, 64, 8, 2)]
K = ("block_m", "block_n", "block_n_prefix", "num_warps", "num_stages")
def run_prefill(fmt, q_lens, prefixes):
    lens = [a + b for a, b in zip(q_lens, prefixes)]
    kv, table = _attn_inputs(fmt, lens, HK, D, PAGE, dev, gen, "HND")
    t = sum(q_lens)
    q = _tokens(gen, t, HQ, D, torch.bfloat16, dev); kn = _tokens(gen, t, HK, D, torch.bfloat16, dev); vn = _tokens(gen, t, HK, D, torch.bfloat16, dev)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    res = []
    for c in CFGS:
        kw = {} if c is None else dict(zip(K, c))
        kw["max_prefix_len"] = max(prefixes)
        try:
            f = lambda: paged_prefill(q, kn, vn, cu, max(q_lens), PagedKV(fmt, **kv), table, sl, opts=PrefillOptions(**kw))
            res.append((bench_us(f), c))
        except Exception as e:
            res.append((float("nan"), f"{c} {type(e).__name__}"))
    # SDPA on the dense equivalent (B sequences of full length, causal over the new rows)
    B = len(q_lens); L = lens[0]; n = q_lens[0]
    qd = torch.randn(B, HQ, n, D, dtype=torch.bfloat16, device=dev); kd = torch.randn(B, HQ, L, D, dtype=torch.bfloat16, device=dev); vd = torch.randn_like(kd)
    if n == L:
        sd = bench_us(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True))
    else:
        m = torch.ones(n, L, dtype=torch.bool, device=dev).tril(L - n)
        sd = bench_us(lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=m))
    print(f"prefill D{D} {fmt} new={q_lens[0]}x{B} prefix={prefixes[0]} SDPA {sd:.0f} us")
    for t_, c in res:
        print(f"   {str(c):<28} {t_:8.0f} us  {sd / t_ if t_ == t_ else float('nan'):.2f}x SDPA")
for fmt in ("bf16", "fp8_e4m3", "nvfp4"):
    run_prefill(fmt, [8192], [0])
    run_prefill(fmt, [1024] * 4, [7168] * 4)
# decode B64 x 8192, D 256: fraction of copy
from kvbench.tools.common import copy_bandwidth
bw = copy_bandwidth()
for fmt in ("bf16", "fp8_e4m3", "nvfp4"):
    lens = [8192] * 64
    kv, table = _attn_inputs(fmt, lens, HK, D, PAGE, dev, gen, "HND")
    q = _tokens(gen, 64, HQ, D, torch.bfloat16, dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    t = bench_us(lambda: paged_decode(q, PagedKV(fmt, **kv), table, sl))
    nbytes = sum(x.numel() * x.element_size() for k_, x in kv.items() if isinstance(x, torch.Tensor) and x.dim() == 4)
    print(f"decode {fmt} B64x8192 {HQ}/{HK} D{D}: {t:.0f} us, {nbytes / t / 1e3 / bw:.0%} of copy ({bw:.0f} GB/s)")

"""Shared set-up of the MLA checks and benchmarks (``mla_check.py``, ``mla_bench.py``): DeepSeek-V3 attention
shapes (128 heads, kv_lora_rank 512, rope 64, nope 128, v 128, pages of 64), latent caches filled with
random rows (NaN bytes wherever a kernel must not read), random up-projections and the timers."""

from __future__ import annotations

import math

import torch

from kvbench.core import is_quantized
from kvbench.kernels import get_format
from kvbench.kernels import LatentCache, LatentLayout
from kvbench.kernels import sequence_slots
from kvbench.tools.common import graph_us

__all__ = ["H", "RANK", "ROPE", "NOPE", "VD", "PAGE", "SM", "time_us", "graph_time_us", "copy_bandwidth", "cache_for",
           "fill_cache", "random_weights", "rel_err", "decode_setup"]

H, RANK, ROPE, NOPE, VD, PAGE = 128, 512, 64, 128, 128, 64
SM = (NOPE + ROPE) ** -0.5


def time_us(fn, ms: int = 200) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=ms, return_mode="median")) * 1e3  # µs


def graph_time_us(fn, ms: int = 100) -> float:
    """Median µs of ``fn`` replayed as a CUDA graph (``tools.common.graph_us``; the runtime replays decode
    steps as graphs)."""
    return graph_us(fn, rep=ms)


def copy_bandwidth(dev) -> float:
    x = torch.empty(1 << 29, dtype=torch.uint8, device=dev).random_()  # 512 MiB
    y = torch.empty_like(x)
    us = time_us(lambda: y.copy_(x))
    return 2 * x.numel() / (us * 1e-6) / 1e9


def cache_for(kv_dtype, lens, gen, dev, k_scale=0.02, page=PAGE):
    lay = LatentLayout(RANK, ROPE, kv_dtype)
    pages = [math.ceil(n / page) for n in lens]
    cache = LatentCache.allocate(lay, sum(pages) + 1, page, device=dev, k_scale=k_scale if is_quantized(kv_dtype) else 1.0)
    cache.data.view(torch.uint8).fill_(0xFF)  # NaN everywhere a kernel should not read
    if cache.block_scale is not None:
        cache.block_scale.view(torch.uint8).fill_(0xFF)
    perm = torch.randperm(sum(pages), generator=gen).int()
    pt = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    off = 0
    for i, k in enumerate(pages):
        pt[i, :k] = perm[off : off + k]
        off += k
    return cache, pt.to(dev)


def fill_cache(cache, pt, lens, gen, dev):
    fmt = get_format(cache.layout.kv_dtype)
    for b, n in enumerate(lens):
        if n:
            slots = sequence_slots(pt[b], n, cache.page_size)
            q = fmt.quantize(torch.randn(n, RANK + ROPE, generator=gen).to(dev) * 2, cache.k_scale[0])
            cache.data.view(-1, cache.layout.packed_dim)[slots] = q.data
            if q.block_scale is not None:
                cache.block_scale.view(-1, (RANK + ROPE) // 16)[slots] = q.block_scale


def random_weights(gen, dev, heads=H):
    w_uk = (torch.randn(heads, NOPE, RANK, generator=gen) / math.sqrt(RANK)).to(dev)
    w_uv = (torch.randn(heads, VD, RANK, generator=gen) / math.sqrt(RANK)).to(dev)
    return w_uk, w_uv


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ (NaN when ``out`` holds a NaN: it never passes)."""
    out = out.double()
    if torch.isnan(out).any():
        return float("nan")
    return ((out - ref).norm() / ref.norm()).item()


def decode_setup(kv_dtype, batch, ctx, dev, gen, heads=H):
    """A decode benchmark's inputs: every page filled with real-looking rows → (cache, page table, latent q,
    rope q, seq lens, cache bytes read)."""
    lens = [ctx] * batch
    cache, pt = cache_for(kv_dtype, lens, gen, dev)
    fmt = get_format(kv_dtype)
    rows = fmt.quantize(torch.randn(1024, RANK + ROPE, device=dev) * 2, cache.k_scale[0])  # real-looking bytes
    n = cache.data.shape[0] * PAGE
    idx = torch.arange(n, device=dev) % 1024
    cache.data.view(-1, cache.layout.packed_dim).copy_(rows.data[idx])
    if rows.block_scale is not None:
        cache.block_scale.view(-1, (RANK + ROPE) // 16).copy_(rows.block_scale[idx])
    ql = torch.randn(batch, heads, RANK, device=dev, dtype=torch.bfloat16)
    qp = torch.randn(batch, heads, ROPE, device=dev, dtype=torch.bfloat16)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    bytes_read = batch * ctx * (RANK + ROPE) * fmt.bytes_per_element
    return cache, pt, ql, qp, sl, bytes_read

"""Shared helpers for the MLA kernel tests (imported by tests/test_mla_*.py)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from kvbench.kernels.formats import get_format  # noqa: E402
from kvbench.kernels.mla import LatentCache, LatentLayout  # noqa: E402
from kvbench.kernels.mla_reference import sequence_slots  # noqa: E402

FORMATS = ("bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4")


def poison(t: torch.Tensor) -> torch.Tensor:
    """All-ones bytes: NaN in bf16/fp16/fp8 and in e4m3 block scales."""
    t.view(torch.uint8).fill_(0xFF)
    return t


def make_cache(kv_dtype, rank=64, rope=32, num_pages=48, page_size=4, k_scale=None, device="cpu"):
    lay = LatentLayout(rank, rope, kv_dtype)
    if k_scale is None:
        k_scale = 1.0 if kv_dtype in ("bf16", "fp16") else 0.02
    cache = LatentCache.allocate(lay, num_pages, page_size, device=device, k_scale=k_scale)
    poison(cache.data)
    if cache.block_scale is not None:
        poison(cache.block_scale)
    return cache


def random_pages(lens, page_size, num_pages, gen, device="cpu"):
    """Disjoint random pages per sequence (int32 [B, max_pages])."""
    need = [max(1, math.ceil(n / page_size)) for n in lens]
    width = max(need)
    perm = torch.randperm(num_pages, generator=gen)
    if sum(need) > num_pages:
        raise ValueError("not enough pages for the test batch")
    pt = torch.zeros(len(lens), width, dtype=torch.int32)
    off = 0
    for i, k in enumerate(need):
        pt[i, :k] = perm[off : off + k].int()
        pt[i, k:] = perm[off].int()  # unused entries: any valid page
        off += k
    return pt.to(device)


def fill_cache(cache: LatentCache, page_table, lens, gen, amp=2.0):
    """Write random latent rows of the given lengths through the spec's quantizer (not the kernels)."""
    lay = cache.layout
    fmt = get_format(lay.kv_dtype)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        slots = sequence_slots(page_table[b], n, cache.page_size)
        rows = (torch.randn(n, lay.head_dim, generator=gen) * amp).to(cache.data.device)
        q = fmt.quantize(rows, cache.k_scale[0])
        cache.data.view(-1, lay.packed_dim)[slots] = q.data
        if q.block_scale is not None:
            cache.block_scale.view(-1, lay.head_dim // 16)[slots] = q.block_scale


def mla_weights(h, nope, vd, rank, gen):
    w_uk = torch.randn(h, nope, rank, generator=gen) / math.sqrt(rank)
    w_uv = torch.randn(h, vd, rank, generator=gen) / math.sqrt(rank)
    return w_uk, w_uv


def rel_err(out, ref) -> float:
    out = out.double().cpu()
    ref = ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output"
    return ((out - ref).norm() / ref.norm()).item()

"""Triton helpers shared by the MLA kernels: latent tile loads with dequantization in registers, and
launch-side checks.  Imported only by the kernel modules (it imports triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from kvbench.kernels.mla import FMT_NVFP4, LatentCache, fmt_code  # noqa: F401  (re-exported for kernels)


@triton.jit
def e2m1_to_f32(code):
    """e2m1 codes (int, 0..15; bit 3 = sign) → float32, exactly: the 3 magnitude bits placed as an
    fp16 exponent/mantissa give value · 2^-14 (0.5 lands on the subnormal 0x200)."""
    c = code.to(tl.int16)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def load_nvfp4_part(KV, BS, row, col_byte0, col_blk0, nmask, WIDTH: tl.constexpr, PD: tl.constexpr, NB: tl.constexpr):
    """``WIDTH`` elements of nvfp4 rows ``row`` (token slots), starting at packed byte ``col_byte0`` and
    block ``col_blk0``: returns float32 ``e2m1 · block_scale`` (the per-layer global not applied)."""
    j = tl.arange(0, WIDTH // 2)
    b = tl.load(KV + row[:, None] * PD + col_byte0 + j[None, :], mask=nmask[:, None], other=0)
    s = tl.load(BS + row[:, None] * NB + col_blk0 + (j // 8)[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
    lo = e2m1_to_f32(b & 15) * s
    hi = e2m1_to_f32(b >> 4) * s
    return tl.reshape(tl.join(lo, hi), [row.shape[0], WIDTH])


@triton.jit
def load_latent_tile(KV, BS, slot, nmask, RANK: tl.constexpr, ROPE: tl.constexpr, FMT: tl.constexpr, DT: tl.constexpr):
    """Latent ``[N, RANK]`` and rope key ``[N, ROPE]`` of token slots ``slot`` (int64), in dtype ``DT``.

    Values are the stored values without the per-layer scale (which callers fold into the softmax
    scale and the output): bf16/fp16 as stored, fp8 as stored, nvfp4 as ``e2m1 · block_scale``, all
    exact in bf16.  Masked rows are zero."""
    if FMT == 2:
        PD: tl.constexpr = (RANK + ROPE) // 2
        NB: tl.constexpr = (RANK + ROPE) // 16
        c = load_nvfp4_part(KV, BS, slot, 0, 0, nmask, RANK, PD, NB)
        kpe = load_nvfp4_part(KV, BS, slot, RANK // 2, RANK // 16, nmask, ROPE, PD, NB)
    else:
        D: tl.constexpr = RANK + ROPE
        dr = tl.arange(0, RANK)
        dp = tl.arange(0, ROPE)
        c = tl.load(KV + slot[:, None] * D + dr[None, :], mask=nmask[:, None], other=0.0)
        kpe = tl.load(KV + slot[:, None] * D + RANK + dp[None, :], mask=nmask[:, None], other=0.0)
    return c.to(DT), kpe.to(DT)


def check_cache(cache: LatentCache) -> int:
    cache.validate()
    return fmt_code(cache.layout.kv_dtype)


def tl_dtype(torch_dtype):
    import torch

    table = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if torch_dtype not in table:
        raise ValueError(f"MLA compute dtype must be float32, bfloat16 or float16, got {torch_dtype}")
    return table[torch_dtype]


def check_paging(page_table, seq_lens, batch: int, device) -> None:
    import torch

    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table must be int32 [batch={batch}, max_pages], got {page_table.dtype} {tuple(page_table.shape)}")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (batch,):
        raise ValueError(f"seq_lens must be int32 [batch={batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if page_table.device != device or seq_lens.device != device:
        raise ValueError("page_table and seq_lens must be on the cache's device")
    if not page_table.is_contiguous():
        raise ValueError("page_table must be contiguous")

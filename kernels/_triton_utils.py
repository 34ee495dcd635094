"""Shared pieces of the Triton kernels: format codes, argument checks, and in-register quantize /
dequantize helpers.  Imported only by the kernel modules (torch and triton load here)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kvbench.kernels.formats import get_format

# Format codes passed to kernels as constexpr.
FMT_PLAIN = 0  # bf16 / fp16: stored as is
FMT_FP8 = 1  # float8_e4m3fn / float8_e5m2 with a per-head fp32 scale
FMT_NVFP4 = 2  # e2m1 pairs in a byte + e4m3 block scale per 16 + per-head fp32 global

# Launch option that keeps ``a*b + c`` as two rounded operations (no FMA contraction), so the
# float32 RoPE matches the torch reference bit for bit.
NO_FMA = {"enable_fp_fusion": False}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def format_code(kv_format: str) -> int:
    name = get_format(kv_format).name
    if name in ("bf16", "fp16"):
        return FMT_PLAIN
    if name == "nvfp4":
        return FMT_NVFP4
    return FMT_FP8


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@dataclass
class CacheArgs:
    """One K or V cache plane, validated: data ``[P+1, page, H_kv, Dp]`` and its optional block scale."""

    data: torch.Tensor
    block_scale: Optional[torch.Tensor]
    scale: torch.Tensor
    page_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def slot_stride(self) -> int:
        return self.data.stride(1)

    @property
    def head_stride(self) -> int:
        return self.data.stride(2)

    @property
    def bs_slot_stride(self) -> int:
        return self.block_scale.stride(1) if self.block_scale is not None else 0

    @property
    def bs_head_stride(self) -> int:
        return self.block_scale.stride(2) if self.block_scale is not None else 0

    @property
    def bs_ptr(self):
        return self.block_scale if self.block_scale is not None else self.data


def check_cache(name: str, kv_format: str, data, block_scale, scale, head_dim: int) -> CacheArgs:
    fmt = get_format(kv_format)
    if data.dim() != 4:
        raise ValueError(f"{name} cache must be [num_pages+1, page_size, H_kv, Dp], got shape {tuple(data.shape)}")
    if data.dtype != fmt.storage_dtype:
        raise ValueError(f"{name} cache dtype {data.dtype} does not match format {fmt.name} ({fmt.storage_dtype})")
    if not data.is_contiguous():
        raise ValueError(f"{name} cache must be contiguous")
    dp = fmt.packed_dim(head_dim)
    if data.shape[-1] != dp:
        raise ValueError(f"{name} cache last dim {data.shape[-1]} != {dp} for head_dim {head_dim} in {fmt.name}")
    page_size, hk = data.shape[1], data.shape[2]
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if fmt.has_block_scales:
        if block_scale is None:
            raise ValueError(f"{fmt.name} needs a {name} block_scale tensor")
        want = (*data.shape[:3], head_dim // fmt.block_size)
        if tuple(block_scale.shape) != want or block_scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name} block_scale must be float8_e4m3fn {want}, got {block_scale.dtype} {tuple(block_scale.shape)}")
        if not block_scale.is_contiguous():
            raise ValueError(f"{name} block_scale must be contiguous")
    if fmt.is_quantized:
        if scale is None:
            raise ValueError(f"{fmt.name} needs a {name} scale tensor (fp32 [H_kv])")
    if scale is None:
        scale = torch.ones(hk, dtype=torch.float32, device=data.device)
    if scale.dtype != torch.float32 or scale.numel() != hk or scale.device != data.device:
        raise ValueError(f"{name} scale must be fp32 with {hk} elements on {data.device}, got {scale.dtype} {tuple(scale.shape)} on {scale.device}")
    return CacheArgs(data, block_scale if fmt.has_block_scales else None, scale.contiguous(), page_size, hk, head_dim)


# ------------------------------------------------------------------------------- jit helpers
@triton.jit
def e2m1_to_f32(code):
    """e2m1 codes (int32, 0..15, bit 3 = sign) → float32, via the float16 bit pattern: the 3 magnitude
    bits placed at bits 9..11 of an fp16 give the e2m1 value times 2^-14 for all eight codes."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def e2m1_code(y):
    """float32 values (already divided by their scale) → e2m1 codes (int32 0..15); ties to the even
    code, saturating; the same thresholds as ``formats.quantize_e2m1``."""
    a = tl.abs(y)
    code = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return code | ((y < 0).to(tl.int32) << 3)

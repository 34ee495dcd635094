"""KV-cache formats: the numerics spec, as a torch reference.

Every kernel that stores or reads the cache must agree bit for bit with this file (DESIGN §4).

Scales are *dequantization multipliers*: ``x ≈ q · scale``.  ``scale`` is an fp32 tensor broadcastable
to ``x[..., 0]`` (one value per layer, or per kv-head).  Quantizing never mutates the caller's tensor.

* ``bf16`` / ``fp16``: stored as is, no scale.
* ``fp8_e4m3`` / ``fp8_e5m2``: ``q = cast_rne(clamp(x / scale, ±max))``, max 448 / 57344.
* ``nvfp4``: e2m1 elements, two per byte (even element in the low nibble), one float8_e4m3fn block
  scale per 16 contiguous elements of head_dim, times the fp32 global ``scale``:
  ``s = clamp(amax(block) / 6 / global, 2^-6, 448)`` rounded to e4m3 (RNE);
  ``e = rne_e2m1(x / (s · global))`` saturating at ±6; dequant ``e · s · global``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = [
    "QuantizedKV",
    "KVFormat",
    "FORMATS",
    "FORMAT_NAMES",
    "get_format",
    "E2M1_VALUES",
    "NVFP4_BLOCK",
    "quantize_e2m1",
    "dequantize_e2m1",
    "pack_nibbles",
    "unpack_nibbles",
    "scale_from_amax",
]

NVFP4_BLOCK = 16
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0
E4M3_MIN_NORMAL = 2.0**-6

# Magnitudes of the e2m1 codes 0..7; bit 3 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass
class QuantizedKV:
    """Stored form of a K or V tensor.

    ``data`` has the storage dtype (bf16/fp16/fp8) with the input's shape, or uint8 ``[..., D/2]`` for
    nvfp4.  ``block_scale`` is float8_e4m3fn ``[..., D/16]`` for nvfp4 and ``None`` otherwise.
    """

    data: torch.Tensor
    block_scale: Optional[torch.Tensor] = None


# ----------------------------------------------------------------------------------------- e2m1
def quantize_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scale) to e2m1 codes (uint8, 0..15).

    Round-to-nearest-even on the grid ±{0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at ±6.  A tie goes to the
    code whose mantissa bit is 0 (the even code): 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4.
    NaN maps to +0 (the cache never stores NaN; callers that care check their inputs).
    """
    a = y.abs().float()
    code = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    sign = (y < 0).to(torch.uint8) << 3
    return code | sign


def dequantize_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e2m1 codes → values, computed arithmetically (no lookup table, so no host→device copy and CUDA
    graphs can capture it): magnitude m = (e, b) with e = m >> 1, b = m & 1 is b/2 for e = 0 (subnormal)
    and 2^(e−1)·(1 + b/2) otherwise; bit 3 is the sign."""
    c = codes.to(torch.int32)
    e = ((c >> 1) & 3).float()
    b = (c & 1).float()
    mag = torch.where(e == 0, 0.5 * b, torch.exp2(e - 1) * (1 + 0.5 * b))
    return torch.where((c & 8) != 0, -mag, mag).to(dtype)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 2n]`` uint8 codes → ``[..., n]`` bytes; element 2i in the low nibble, 2i+1 in the high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# ------------------------------------------------------------------------------------- formats
def _expand_scale(scale: torch.Tensor | float, x: torch.Tensor, extra_dims: int) -> torch.Tensor:
    """Broadcast a per-tensor / per-head fp32 scale (shape of x[..., 0] or less) over ``extra_dims``."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    for _ in range(extra_dims):
        s = s.unsqueeze(-1)
    return s


@dataclass(frozen=True)
class KVFormat:
    name: str
    storage_dtype: torch.dtype
    element_bits: int
    bytes_per_element: float  # including scales
    scale_layout: str
    max_value: Optional[float]
    block_size: Optional[int] = None
    block_scale_dtype: Optional[torch.dtype] = None
    _quant: Callable = None  # type: ignore[assignment]
    _dequant: Callable = None  # type: ignore[assignment]

    @property
    def is_quantized(self) -> bool:
        return self.max_value is not None

    @property
    def has_block_scales(self) -> bool:
        return self.block_size is not None

    def packed_dim(self, head_dim: int) -> int:
        """Number of storage elements per head vector (bytes for nvfp4)."""
        if self.name == "nvfp4":
            if head_dim % NVFP4_BLOCK:
                raise ValueError(f"nvfp4 needs head_dim divisible by {NVFP4_BLOCK}, got {head_dim}")
            return head_dim // 2
        return head_dim

    def quantize(self, x: torch.Tensor, scale: torch.Tensor | float = 1.0) -> QuantizedKV:
        return self._quant(self, x, scale)

    def dequantize(self, q: QuantizedKV, scale: torch.Tensor | float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._dequant(self, q, scale, dtype)

    def roundtrip(self, x: torch.Tensor, scale: torch.Tensor | float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dequantize(self.quantize(x, scale), scale, dtype)


def _plain_quant(fmt: KVFormat, x: torch.Tensor, scale) -> QuantizedKV:
    return QuantizedKV(x.to(fmt.storage_dtype))


def _plain_dequant(fmt: KVFormat, q: QuantizedKV, scale, dtype) -> torch.Tensor:
    return q.data.to(dtype)


def _fp8_quant(fmt: KVFormat, x: torch.Tensor, scale) -> QuantizedKV:
    s = _expand_scale(scale, x, 1)
    y = (x.float() / s).clamp(-fmt.max_value, fmt.max_value)
    return QuantizedKV(y.to(fmt.storage_dtype))


def _fp8_dequant(fmt: KVFormat, q: QuantizedKV, scale, dtype) -> torch.Tensor:
    s = _expand_scale(scale, q.data, 1)
    return (q.data.float() * s).to(dtype)


def _nvfp4_quant(fmt: KVFormat, x: torch.Tensor, scale) -> QuantizedKV:
    d = x.shape[-1]
    fmt.packed_dim(d)  # validates divisibility
    xb = x.float().reshape(*x.shape[:-1], d // NVFP4_BLOCK, NVFP4_BLOCK)
    g = _expand_scale(scale, x, 2)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    # divide by a tensor, not a Python float: CUDA turns scalar division into a reciprocal multiply,
    # which rounds differently from true division (the kernels divide exactly)
    s = (amax / torch.full_like(amax, E2M1_MAX) / g).clamp(E4M3_MIN_NORMAL, E4M3_MAX)
    s8 = s.to(torch.float8_e4m3fn)
    y = xb / (s8.float() * g)
    codes = quantize_e2m1(y).reshape(*x.shape[:-1], d)
    return QuantizedKV(pack_nibbles(codes), s8.squeeze(-1))


def _nvfp4_dequant(fmt: KVFormat, q: QuantizedKV, scale, dtype) -> torch.Tensor:
    codes = unpack_nibbles(q.data)
    d = codes.shape[-1]
    vals = dequantize_e2m1(codes).reshape(*codes.shape[:-1], d // NVFP4_BLOCK, NVFP4_BLOCK)
    g = _expand_scale(scale, q.data, 2)
    out = vals * q.block_scale.float().unsqueeze(-1) * g
    return out.reshape(*codes.shape[:-1], d).to(dtype)


FORMATS: dict[str, KVFormat] = {
    "bf16": KVFormat("bf16", torch.bfloat16, 16, 2.0, "none", None, _quant=_plain_quant, _dequant=_plain_dequant),
    "fp16": KVFormat("fp16", torch.float16, 16, 2.0, "none", None, _quant=_plain_quant, _dequant=_plain_dequant),
    "fp8_e4m3": KVFormat(
        "fp8_e4m3", torch.float8_e4m3fn, 8, 1.0, "fp32 per layer or kv-head", E4M3_MAX,
        _quant=_fp8_quant, _dequant=_fp8_dequant,
    ),
    "fp8_e5m2": KVFormat(
        "fp8_e5m2", torch.float8_e5m2, 8, 1.0, "fp32 per layer or kv-head", E5M2_MAX,
        _quant=_fp8_quant, _dequant=_fp8_dequant,
    ),
    "nvfp4": KVFormat(
        "nvfp4", torch.uint8, 4, 0.5 + 1.0 / NVFP4_BLOCK,
        "e4m3 per 16 elems x fp32 global", E2M1_MAX,
        block_size=NVFP4_BLOCK, block_scale_dtype=torch.float8_e4m3fn,
        _quant=_nvfp4_quant, _dequant=_nvfp4_dequant,
    ),
}
FORMAT_NAMES = tuple(FORMATS)


def get_format(name: str) -> KVFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV format {name!r}; supported: {', '.join(FORMAT_NAMES)}") from None


def scale_from_amax(fmt: KVFormat | str, amax: torch.Tensor) -> torch.Tensor:
    """Calibrated dequant scale for an observed absolute maximum.

    fp8: ``amax / max``.  nvfp4 global: ``amax / (6 · 448)`` so the largest block scale fits e4m3.
    Plain formats: 1.  Zero or non-finite amax gives 1 (nothing observed, nothing to scale).
    """
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    amax = torch.as_tensor(amax, dtype=torch.float32)
    if not fmt.is_quantized:
        return torch.ones_like(amax)
    denom = E2M1_MAX * E4M3_MAX if fmt.name == "nvfp4" else fmt.max_value
    s = amax / denom
    ok = torch.isfinite(s) & (s > 0)
    return torch.where(ok, s, torch.ones_like(s))

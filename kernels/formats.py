"""KV-cache formats: the numerics spec, as a torch reference.

Every kernel that stores or reads the cache must agree bit for bit with this file (docs/design.md §4).

A format's name and layout are declared once, in ``kvbench.core.formats`` (the table); this module
attaches its numerics (``register_numerics(name, quantize, dequantize)``) and builds the ``KVFormat``
objects the kernels use from the two.  A table entry without numerics is refused with a clear error
when it is used (``get_format``); every built-in format has them when this module is imported.

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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from kvbench.core import BUILTIN_FORMATS, FORMAT_SPECS, FormatSpec, get_spec

__all__ = [
    "QuantizedKV",
    "KVFormat",
    "FORMATS",
    "FORMAT_NAMES",
    "get_format",
    "register_numerics",
    "unregister_numerics",
    "has_numerics",
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
    ``token_scale`` is ``[...]`` (one value per head vector) for formats with a per-token scale
    (``FormatSpec.token_scale``) and ``None`` otherwise.
    """

    data: torch.Tensor
    block_scale: Optional[torch.Tensor] = None
    token_scale: Optional[torch.Tensor] = None


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

    @property
    def spec(self) -> FormatSpec:
        """The format's entry in the table (``kvbench.core.formats``)."""
        return get_spec(self.name)

    @property
    def has_token_scales(self) -> bool:
        return self.spec.token_scale

    def packed_dim(self, head_dim: int) -> int:
        """Number of storage elements per head vector (bytes for nvfp4)."""
        return self.spec.packed_dim(head_dim)

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


def _e2m1_byte_table() -> torch.Tensor:
    """float32 ``[256, 2]``: the values of a packed byte's (low, high) e2m1 codes, from ``dequantize_e2m1``."""
    b = torch.arange(256, dtype=torch.int32)
    return torch.stack((dequantize_e2m1(b & 0x0F), dequantize_e2m1(b >> 4)), dim=-1)


_E2M1_BYTE_TABLE = _e2m1_byte_table()  # host memory: read only where the packed codes are host tensors


def _e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """Packed nvfp4 bytes ``[..., n]`` → float32 values ``[..., 2n]``.  On the CPU one table lookup per byte
    (the same values as ``dequantize_e2m1``, ~4× faster: the torch backend dequantizes the whole cached history
    every decode step); elsewhere arithmetically, so CUDA graphs can capture it without a device table."""
    if packed.device.type == "cpu":
        return _E2M1_BYTE_TABLE[packed.long()].flatten(-2)
    return dequantize_e2m1(unpack_nibbles(packed))


def _nvfp4_dequant(fmt: KVFormat, q: QuantizedKV, scale, dtype) -> torch.Tensor:
    flat = _e2m1_values(q.data)
    d = flat.shape[-1]
    lead = flat.shape[:-1]
    vals = flat.reshape(*lead, d // NVFP4_BLOCK, NVFP4_BLOCK)
    g = _expand_scale(scale, q.data, 2)
    out = vals * q.block_scale.float().unsqueeze(-1) * g
    return out.reshape(*lead, d).to(dtype)


# ------------------------------------------------------------------------------ the registry
@dataclass(frozen=True)
class _Numerics:
    quantize: Callable
    dequantize: Callable


_NUMERICS: dict[str, _Numerics] = {}
_BUILT: dict[str, KVFormat] = {}


def register_numerics(name: str, quantize: Callable, dequantize: Callable) -> None:
    """Attach the torch reference numerics to the table entry ``name`` (declared first with
    ``kvbench.core.formats.register_format``).  ``quantize(fmt, x, scale) -> QuantizedKV`` and
    ``dequantize(fmt, q, scale, dtype) -> Tensor``; ``scale`` is the per-layer / per-head fp32 tensor scale
    (1.0 for formats without one)."""
    get_spec(name)  # the layout must be declared first
    if name in _NUMERICS:
        raise ValueError(f"KV format {name!r} already has numerics")
    _NUMERICS[name] = _Numerics(quantize, dequantize)
    _BUILT.pop(name, None)


def unregister_numerics(name: str) -> None:
    """Remove a format's numerics (tests that register a temporary format undo it with this)."""
    _NUMERICS.pop(name, None)
    _BUILT.pop(name, None)


def has_numerics(name: str) -> bool:
    return name in _NUMERICS


def _dtype(name: Optional[str]) -> Optional[torch.dtype]:
    return None if name is None else getattr(torch, name)


def _build(spec: FormatSpec) -> KVFormat:
    num = _NUMERICS.get(spec.name)
    if num is None:
        raise ValueError(
            f"KV format {spec.name!r} is in the format table but has no numerics; register them with "
            "kvbench.kernels.formats.register_numerics"
        )
    return KVFormat(
        spec.name, _dtype(spec.storage), spec.element_bits, spec.bytes_per_element, spec.scale_text,
        spec.max_value, block_size=spec.block_size or None, block_scale_dtype=_dtype(spec.block_scale),
        _quant=num.quantize, _dequant=num.dequantize,
    )


class _FormatTable(Mapping):
    """``name -> KVFormat`` for every format of the table that has numerics (read-only, live: a format
    registered later appears here)."""

    def __getitem__(self, name: str) -> KVFormat:
        spec = FORMAT_SPECS[name]
        fmt = _BUILT.get(name)
        if fmt is None or fmt.spec is not spec:
            fmt = _BUILT[name] = _build(spec)
        return fmt

    def __iter__(self) -> Iterator[str]:
        return (n for n in FORMAT_SPECS if n in _NUMERICS)

    def __len__(self) -> int:
        return sum(1 for _ in self)


FORMATS: Mapping[str, KVFormat] = _FormatTable()


def get_format(name: str) -> KVFormat:
    get_spec(name)  # unknown names: the table's error, naming the known formats
    return FORMATS[name]


for _name, _q, _d in (
    ("bf16", _plain_quant, _plain_dequant),
    ("fp16", _plain_quant, _plain_dequant),
    ("fp8_e4m3", _fp8_quant, _fp8_dequant),
    ("fp8_e5m2", _fp8_quant, _fp8_dequant),
    ("nvfp4", _nvfp4_quant, _nvfp4_dequant),
):
    register_numerics(_name, _q, _d)
_missing = [n for n in BUILTIN_FORMATS if n not in _NUMERICS]
if _missing:  # a built-in table entry without numerics is a bug in this file
    raise ImportError(f"KV format(s) {', '.join(_missing)} have no numerics in kvbench.kernels.formats")
# the built-in formats (tests parametrize over them); the live list is kvbench.core.formats.format_names()
FORMAT_NAMES = tuple(FORMATS)


def scale_from_amax(fmt: KVFormat | str, amax: torch.Tensor) -> torch.Tensor:
    """Calibrated dequant scale for an observed absolute maximum.

    fp8: ``amax / max``.  nvfp4 global: ``amax / (6 · 448)`` so the largest block scale fits e4m3
    (block-scaled formats: element max times the block scale's largest value).  Formats without a tensor
    scale: 1.  Zero or non-finite amax gives 1 (nothing observed, nothing to scale).
    """
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    amax = torch.as_tensor(amax, dtype=torch.float32)
    if not fmt.spec.tensor_scale:  # plain formats, and formats whose scales are all stored per token
        return torch.ones_like(amax)
    denom = fmt.max_value
    if fmt.block_scale_dtype is not None:  # the global scale leaves room for the largest block scale
        denom = denom * torch.finfo(fmt.block_scale_dtype).max
    s = amax / denom
    ok = torch.isfinite(s) & (s > 0)
    return torch.where(ok, s, torch.ones_like(s))

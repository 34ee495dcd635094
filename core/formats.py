"""The KV format table: the one place a KV-cache format is declared (docs/design.md §4).

Each entry says how a K or V head vector is laid out in the cache: the element code and its storage
dtype, how codes are packed into bytes, the block scales along ``head_dim``, whether a per-layer (or
per-kv-head) fp32 tensor scale multiplies it, and whether a per-token scale is stored beside each token.
Everything that needs to know a format's *layout* (config validation, the paged cache, capacity
planning, the CLI, report ordering) reads it from here.  The *numerics* (quantize / dequantize in torch)
live in ``kvbench.kernels.formats``, keyed by the same names.

No torch import: dtypes are named by their torch attribute name (``"float8_e4m3fn"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = [
    "FormatSpec",
    "FORMAT_SPECS",
    "PACKINGS",
    "STORAGE_BITS",
    "register_format",
    "unregister_format",
    "format_names",
    "quantized_names",
    "plain_names",
    "get_spec",
    "is_quantized",
    "names_text",
    "BUILTIN_FORMATS",
    "KV_SCALE_POLICIES",
    "ENGINE_ALIASES",
    "AUTO_FORMAT",
    "canonical_format",
]

# bits of one stored value, by torch dtype name (elements, block scales, token scales)
STORAGE_BITS: dict[str, int] = {
    "float32": 32, "bfloat16": 16, "float16": 16, "float8_e4m3fn": 8, "float8_e5m2": 8, "uint8": 8, "int8": 8,
}
# how element codes sit in their storage: "none" = one element per storage value; "e2m1x2" = two 4-bit
# codes per byte, the even element in the low nibble
PACKINGS: dict[str, int] = {"none": 1, "e2m1x2": 2}


@dataclass(frozen=True)
class FormatSpec:
    """Layout of one KV format.  ``block_size`` 0 means no block scale."""

    name: str
    element_bits: int
    storage: str
    packing: str = "none"
    block_size: int = 0
    block_scale: Optional[str] = None
    tensor_scale: bool = False
    token_scale: bool = False
    max_value: Optional[float] = None
    quantized: bool = False
    description: str = ""
    # storage of the per-token scale (token_scale formats): one value per token per kv head and plane
    token_scale_storage: str = "float32"

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").isalnum() or self.name != self.name.lower():
            raise ValueError(f"format name {self.name!r} must be lower-case letters, digits and underscores")
        if self.storage not in STORAGE_BITS:
            raise ValueError(f"format {self.name}: unknown storage {self.storage!r}; known: {', '.join(STORAGE_BITS)}")
        if self.packing not in PACKINGS:
            raise ValueError(f"format {self.name}: unknown packing {self.packing!r}; known: {', '.join(PACKINGS)}")
        if self.element_bits * PACKINGS[self.packing] != STORAGE_BITS[self.storage]:
            raise ValueError(
                f"format {self.name}: {PACKINGS[self.packing]} element(s) of {self.element_bits} bits do not fill "
                f"one {self.storage} value"
            )
        if (self.block_size > 0) != (self.block_scale is not None):
            raise ValueError(f"format {self.name}: block_size and block_scale go together")
        if self.block_scale is not None and self.block_scale not in STORAGE_BITS:
            raise ValueError(f"format {self.name}: unknown block scale storage {self.block_scale!r}")
        if self.token_scale and self.token_scale_storage not in STORAGE_BITS:
            raise ValueError(f"format {self.name}: unknown token scale storage {self.token_scale_storage!r}")
        if self.quantized != (self.max_value is not None):
            raise ValueError(f"format {self.name}: a quantized format has a max_value, a plain one has none")

    # ---------------------------------------------------------------------------------- sizes
    @property
    def bytes_per_element(self) -> float:
        """Bytes per element of a head vector, block scales included (token scales are per token:
        ``bytes_per_token``)."""
        b = self.element_bits / 8
        if self.block_size:
            b += STORAGE_BITS[self.block_scale] / 8 / self.block_size
        return b

    @property
    def token_scale_bytes(self) -> int:
        """Bytes of the per-token scale of one head vector (0 without one)."""
        return STORAGE_BITS[self.token_scale_storage] // 8 if self.token_scale else 0

    def bytes_per_token(self, head_dim: int) -> float:
        """Bytes of one K (or V) head vector of ``head_dim`` elements, every scale that is stored per
        token included (block scales and the token scale; tensor scales are per layer and not counted)."""
        return head_dim * self.bytes_per_element + self.token_scale_bytes

    @property
    def has_block_scales(self) -> bool:
        return self.block_size > 0

    # ---------------------------------------------------------------------------------- shapes
    def head_dim_error(self, head_dim: int) -> Optional[str]:
        """Why a head vector of ``head_dim`` elements cannot be stored in this format, or None."""
        if self.block_size and head_dim % self.block_size:
            return f"{self.name} needs head_dim divisible by {self.block_size} (got {head_dim})"
        per = PACKINGS[self.packing]
        if head_dim % per:
            return f"{self.name} needs head_dim divisible by {per} (got {head_dim})"
        return None

    def check_head_dim(self, head_dim: int) -> None:
        err = self.head_dim_error(head_dim)
        if err:
            raise ValueError(err)

    def packed_dim(self, head_dim: int) -> int:
        """Storage values per head vector (bytes for ``e2m1x2``)."""
        self.check_head_dim(head_dim)
        return head_dim // PACKINGS[self.packing]

    def blocks(self, head_dim: int) -> int:
        """Block scales per head vector (0 without block scales)."""
        return head_dim // self.block_size if self.block_size else 0

    @property
    def scale_text(self) -> str:
        """The scales in words (the ``kvbench formats`` table)."""
        parts = []
        if self.block_size:
            parts.append(f"{_short(self.block_scale)} per {self.block_size} elems")
        if self.token_scale:
            parts.append(f"{_short(self.token_scale_storage)} per token")
        if self.tensor_scale:
            parts.append("fp32 per layer or kv-head" if not parts else "fp32 global")
        return " x ".join(parts) or "none"


def _short(storage: str) -> str:
    return {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2", "float32": "fp32", "float16": "fp16",
            "bfloat16": "bf16"}.get(storage, storage)


# where a quantized format's tensor scales come from (docs/design.md §4): 1.0, the checkpoint's k_scale/v_scale, or a
# calibration run in bf16
KV_SCALE_POLICIES = ("unit", "checkpoint", "calibrate")

# insertion-ordered: the order of the CLI, `kvbench formats` and the reports
FORMAT_SPECS: dict[str, FormatSpec] = {}


def register_format(spec: FormatSpec) -> FormatSpec:
    """Declare a KV format (the one place a format's name and layout are written).  A duplicate name is
    an error.  Its numerics are registered with ``kvbench.kernels.formats.register_numerics``."""
    if not isinstance(spec, FormatSpec):
        raise TypeError(f"register_format takes a FormatSpec, got {type(spec).__name__}")
    if spec.name in FORMAT_SPECS:
        raise ValueError(f"KV format {spec.name!r} is already registered")
    FORMAT_SPECS[spec.name] = spec
    return spec


def unregister_format(name: str) -> None:
    """Remove a format (tests that register a temporary one undo it with this)."""
    FORMAT_SPECS.pop(name, None)


def format_names() -> tuple[str, ...]:
    """Every registered format, in table order."""
    return tuple(FORMAT_SPECS)


def quantized_names() -> tuple[str, ...]:
    return tuple(n for n, s in FORMAT_SPECS.items() if s.quantized)


def plain_names() -> tuple[str, ...]:
    """The formats stored as is (no quantization, no scales), in table order."""
    return tuple(n for n, s in FORMAT_SPECS.items() if not s.quantized)


def get_spec(name: str) -> FormatSpec:
    try:
        return FORMAT_SPECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown KV format {name!r}; supported: {names_text()}") from None


def is_quantized(name: str) -> bool:
    return get_spec(name).quantized


# the KV cache dtype names of vLLM / SGLang (``--kv-cache-dtype``) -> the kvbench format that stores the same
# thing (their "fp8" is e4m3).  ``AUTO_FORMAT`` ("auto": the model's compute dtype) is resolved by
# ``canonical_format`` from the compute dtype.  The one table of engine spellings of KV formats.
ENGINE_ALIASES: dict[str, str] = {
    "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "fp4_e2m1": "nvfp4", "fp4": "nvfp4",
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
}
AUTO_FORMAT = "auto"


def canonical_format(name: str, compute_dtype: Optional[str] = None) -> str:
    """The registered format a KV dtype name means: a kvbench name or an engine spelling (``ENGINE_ALIASES``),
    any case; ``auto`` is the plain format stored in the compute dtype (``float16`` -> fp16, else bf16, as the
    engine stores a float32 model's KV).  ValueError for anything else."""
    n = str(name).strip().lower()
    if n in FORMAT_SPECS:
        return n
    if n == AUTO_FORMAT:
        plain = [f for f, s in FORMAT_SPECS.items() if not s.quantized and s.storage == compute_dtype]
        return plain[0] if plain else "bf16"
    if n in ENGINE_ALIASES and ENGINE_ALIASES[n] in FORMAT_SPECS:
        return ENGINE_ALIASES[n]
    raise ValueError(f"unknown KV format {name!r}; supported: {names_text()} "
                     f"(engine spellings: {AUTO_FORMAT}, {', '.join(ENGINE_ALIASES)})")


def names_text(sep: str = ", ") -> str:
    """The registered names joined (CLI help, error messages)."""
    return sep.join(FORMAT_SPECS)


# ------------------------------------------------------------------------------ built-in formats
register_format(FormatSpec("bf16", 16, "bfloat16", description="stored as is"))
register_format(FormatSpec("fp16", 16, "float16", description="stored as is"))
register_format(FormatSpec(
    "fp8_e4m3", 8, "float8_e4m3fn", tensor_scale=True, max_value=448.0, quantized=True,
    description="fp8 e4m3, fp32 dequant scale per layer (or kv head)",
))
register_format(FormatSpec(
    "fp8_e5m2", 8, "float8_e5m2", tensor_scale=True, max_value=57344.0, quantized=True,
    description="fp8 e5m2, fp32 dequant scale per layer (or kv head)",
))
register_format(FormatSpec(
    "nvfp4", 4, "uint8", packing="e2m1x2", block_size=16, block_scale="float8_e4m3fn", tensor_scale=True,
    max_value=6.0, quantized=True,
    description="e2m1 two per byte, e4m3 scale per 16 elements x fp32 global",
))

# the formats that ship with kvbench (the ones the Triton kernels implement)
BUILTIN_FORMATS: tuple[str, ...] = format_names()

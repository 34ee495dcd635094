"""The one table of Triton format codes (constexpr ``FMT``), derived from each format's spec
(``core/formats.py``): a kernel layout is chosen by how a format stores its values, never by its name.  Torch-
and triton-free, so the MLA layout module can use it without loading the kernels.

- ``FMT_PLAIN``: not quantized (bf16, fp16): stored as is;
- ``FMT_FP8``: one 8-bit float per element with a per-layer (or per-head) fp32 tensor scale (fp8_e4m3, fp8_e5m2);
- ``FMT_NVFP4``: e2m1 pairs in a byte, an e4m3 scale per 16 elements and an fp32 tensor scale (nvfp4).

Any other layout (a plugin's int8 with per-token scales, say) has no kernel: ``format_code`` raises naming it,
rather than send it down a path that would read its bytes as fp8.
"""

from __future__ import annotations

from kvbench.core import get_spec

__all__ = ["FMT_PLAIN", "FMT_FP8", "FMT_NVFP4", "format_code"]

FMT_PLAIN, FMT_FP8, FMT_NVFP4 = 0, 1, 2
_FP8_STORAGE = ("float8_e4m3fn", "float8_e5m2")


def format_code(kv_format: str) -> int:
    """The kernels' code for format ``kv_format`` (a registered name); ValueError when no kernel layout fits."""
    spec = get_spec(kv_format)
    if not spec.quantized:
        return FMT_PLAIN
    if (spec.storage in _FP8_STORAGE and spec.packing == "none" and spec.tensor_scale and not spec.block_size
            and not spec.token_scale):
        return FMT_FP8
    if (spec.packing == "e2m1x2" and spec.block_size == 16 and spec.block_scale == "float8_e4m3fn" and spec.tensor_scale
            and not spec.token_scale):
        return FMT_NVFP4
    raise ValueError(f"KV format {spec.name!r} has no Triton kernel layout (the kernels store plain 16-bit values, "
                     "8-bit floats with a tensor scale, or e2m1 pairs with e4m3 scales per 16 elements); run it on the "
                     "torch backend")

"""A toy KV format, added the way any format is: one table entry plus its numerics, nothing else.

``int8_tok``: int8 elements with one fp32 scale per token per kv head, stored beside the token
(``FormatSpec.token_scale``).  Scale ``s = amax(|x|) / 127`` over the head vector (1 for an all-zero
vector), ``q = round_half_even(x / s)`` clamped to ±127, dequant ``q · s``.  It has no per-layer tensor scale,
so the scale policy ``unit`` is exact for it.  Only the torch reference backend runs it (the Triton and
FlashInfer kernels implement the built-in formats).

Load it with ``KVBENCH_PLUGINS=kvbench_toy_format`` (this directory on ``PYTHONPATH``) or ``register()``.
"""

from __future__ import annotations

import torch

from kvbench.core.formats import FormatSpec, register_format, unregister_format
from kvbench.kernels.formats import QuantizedKV, register_numerics, unregister_numerics

NAME = "int8_tok"
SPEC = FormatSpec(
    NAME, 8, "int8", token_scale=True, max_value=127.0, quantized=True,
    description="int8, fp32 scale per token per kv head (test-only toy format)",
)


def _quantize(fmt, x: torch.Tensor, scale) -> QuantizedKV:
    xf = x.float()
    s = xf.abs().amax(dim=-1) / fmt.max_value
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(xf / s.unsqueeze(-1)).clamp(-fmt.max_value, fmt.max_value).to(torch.int8)
    return QuantizedKV(q, token_scale=s)


def _dequantize(fmt, q: QuantizedKV, scale, dtype) -> torch.Tensor:
    return (q.data.float() * q.token_scale.float().unsqueeze(-1)).to(dtype)


def register() -> None:
    register_format(SPEC)
    register_numerics(NAME, _quantize, _dequantize)


def unregister() -> None:
    unregister_numerics(NAME)
    unregister_format(NAME)


register()

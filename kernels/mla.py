"""MLA (multi-head latent attention) over a quantized latent cache: layout and public entry points.

DeepSeek-style MLA keeps one compressed latent per token, ``c_kv`` (``kv_lora_rank`` values, e.g. 512),
plus a decoupled RoPE key ``k_pe`` (``rope_dim`` values, e.g. 64) shared by all heads.  In the paged pool
that is a single cache "head" (``H_kv = 1``) of head dim ``kv_lora_rank + rope_dim`` (576), stored in any
KV format (docs/design.md §4): per layer ``data [num_pages + 1, page_size, 1, Dp]`` and, for nvfp4,
``block_scale [num_pages + 1, page_size, 1, D/16]`` (the 16-element blocks tile the latent and the rope
part separately, since both are multiples of 16).  One per-layer scale set, ``k_scale [1]``, serves the
latent's use as K and as V (``v_scale`` is unused for MLA).

Per-head keys and values are the up-projections of the latent: ``k_nope[h] = W_UK[h] · c_kv`` and
``v[h] = W_UV[h] · c_kv`` with ``kv_b_proj.weight`` viewed as ``[H, qk_nope_dim + v_head_dim, rank]``.
The kernels work in the absorbed form: ``q_lat[h] = W_UK[h]ᵀ · q_nope[h]`` (``absorb_query``), attention
over the latent + rope keys, output in latent space, then ``out[h] = W_UV[h] · o_lat[h]``
(``unabsorb_output``).  ``kernels/mla_reference.py`` checks them against the non-absorbed float64 form.

This module holds the cache layout and the projections; the kernels live beside it and import it (never the
other way round, so importing the layout does not import triton):

* ``kernels.mla_append``: ``mla_append`` (fused Triton: RoPE on q_pe and k_pe, quantize latent + k_pe, write by
  slot mapping, optional fp8 q) and ``mla_append_unfused`` (torch RoPE, ``formats.quantize``, indexed store);
* ``kernels.mla_decode``: ``mla_decode`` (split-K over pages, dequant in registers, many heads per program);
* ``kernels.mla_prefill``: ``mla_prefill`` (new tokens over a quantized cached prefix plus their own latent, causal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = [
    "LatentLayout",
    "LatentCache",
    "rope_cos_sin_cache",
    "split_kv_b",
    "absorb_query",
    "unabsorb_output",
]

# Format codes shared by the Triton kernels (constexpr FMT): the one table of kernels/format_codes.py.
from kvbench.kernels.format_codes import FMT_FP8, FMT_NVFP4, FMT_PLAIN  # noqa: E402,F401
from kvbench.kernels.format_codes import format_code as fmt_code  # noqa: E402,F401 - the MLA kernels' name


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class LatentLayout:
    """Shape and format of one token's latent cache entry: ``[kv_lora_rank | rope_dim]``."""

    kv_lora_rank: int = 512
    rope_dim: int = 64
    kv_dtype: str = "bf16"

    def __post_init__(self) -> None:
        fmt_code(self.kv_dtype)
        for n in ("kv_lora_rank", "rope_dim"):
            v = getattr(self, n)
            # The kernels tile the latent and the rope part separately; tl.arange needs powers of two.
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"MLA {n} must be a power of two >= 16 for the Triton kernels, got {v}")

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def packed_dim(self) -> int:
        return self.head_dim // 2 if self.kv_dtype == "nvfp4" else self.head_dim

    @property
    def bytes_per_token(self) -> float:
        from kvbench.kernels.formats import get_format

        return self.head_dim * get_format(self.kv_dtype).bytes_per_element


@dataclass
class LatentCache:
    """One layer's latent pages (views of the paged pool; ``H_kv = 1``)."""

    layout: LatentLayout
    data: "object"  # torch.Tensor [num_pages + 1, page_size, 1, packed_dim]
    block_scale: Optional["object"]  # torch.Tensor [num_pages + 1, page_size, 1, head_dim / 16] or None
    k_scale: "object"  # fp32 torch.Tensor [1] (dequant multiplier, per layer)

    @property
    def page_size(self) -> int:
        return int(self.data.shape[1])

    @property
    def num_pages(self) -> int:
        """Usable pages (the last one is the scratch page)."""
        return int(self.data.shape[0]) - 1

    @classmethod
    def allocate(cls, layout: LatentLayout, num_pages: int, page_size: int, device="cpu", k_scale: float = 1.0) -> "LatentCache":
        import torch

        from kvbench.kernels.formats import NVFP4_BLOCK, get_format

        fmt = get_format(layout.kv_dtype)
        data = torch.zeros(num_pages + 1, page_size, 1, layout.packed_dim, dtype=fmt.storage_dtype, device=device)
        bs = None
        if fmt.has_block_scales:
            bs = torch.zeros(num_pages + 1, page_size, 1, layout.head_dim // NVFP4_BLOCK, dtype=torch.float8_e4m3fn, device=device)
        scale = torch.full((1,), float(k_scale), dtype=torch.float32, device=device)
        return cls(layout, data, bs, scale)

    def validate(self) -> None:
        import torch

        from kvbench.kernels.formats import get_format

        fmt = get_format(self.layout.kv_dtype)
        d = self.data
        if d.dim() != 4 or d.shape[2] != 1 or d.shape[3] != self.layout.packed_dim:
            raise ValueError(f"latent cache data must be [pages + 1, page_size, 1, {self.layout.packed_dim}], got {tuple(d.shape)}")
        if d.dtype != fmt.storage_dtype or not d.is_contiguous():
            raise ValueError(f"latent cache data must be contiguous {fmt.storage_dtype}, got {d.dtype}")
        if fmt.has_block_scales:
            bs = self.block_scale
            if bs is None or tuple(bs.shape) != (*d.shape[:3], self.layout.head_dim // 16) or bs.dtype != torch.float8_e4m3fn:
                raise ValueError("nvfp4 latent cache needs block_scale [pages + 1, page_size, 1, head_dim/16] float8_e4m3fn")
        if self.k_scale.dtype != torch.float32 or self.k_scale.numel() < 1 or self.k_scale.device != d.device:
            raise ValueError("k_scale must be an fp32 tensor of shape [1] on the cache's device")

    def dequantize_slots(self, slots, dtype=None):
        """Dequantized ``(c_kv, k_pe)`` of the given slots (torch, via the numerics spec)."""
        import torch

        from kvbench.kernels.formats import QuantizedKV, get_format

        dtype = dtype or torch.float32
        fmt = get_format(self.layout.kv_dtype)
        slots = slots.long()
        q = QuantizedKV(
            self.data.view(-1, self.layout.packed_dim)[slots],
            None if self.block_scale is None else self.block_scale.view(-1, self.layout.head_dim // 16)[slots],
        )
        x = fmt.dequantize(q, self.k_scale[0], dtype=torch.float32).to(dtype)
        r = self.layout.kv_lora_rank
        return x[..., :r], x[..., r:]


def rope_cos_sin_cache(max_positions: int, rope_dim: int, base: float = 10000.0, device="cpu"):
    """``[max_positions, rope_dim]`` fp32: cos of the ``rope_dim/2`` frequencies, then their sin."""
    import torch

    inv = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
    ang = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=-1).to(torch.float32).to(device)


def split_kv_b(kv_b_weight, num_heads: int, qk_nope_dim: int, v_head_dim: int):
    """``kv_b_proj.weight [H·(nope + v), rank]`` → ``(W_UK [H, nope, rank], W_UV [H, v, rank])``."""
    w = kv_b_weight.view(num_heads, qk_nope_dim + v_head_dim, -1)
    return w[:, :qk_nope_dim], w[:, qk_nope_dim:]


def absorb_query(q_nope, w_uk):
    """``q_nope [T, H, nope]`` → ``q_lat [T, H, rank]`` with ``q_lat[h] = W_UK[h]ᵀ q_nope[h]``."""
    import torch

    return torch.einsum("thn,hnr->thr", q_nope, w_uk.to(q_nope.dtype))


def unabsorb_output(o_lat, w_uv):
    """``o_lat [T, H, rank]`` → ``out [T, H, v_head]`` with ``out[h] = W_UV[h] o_lat[h]``."""
    import torch

    return torch.einsum("thr,hvr->thv", o_lat, w_uv.to(o_lat.dtype))

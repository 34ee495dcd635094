"""MLA (DeepSeek multi-head latent attention) through the attention backends.

An MLA model calls ``backend.forward_mla(q_nope, q_pe, c_kv, k_pe, layer, cache, meta)`` once per layer:

* ``q_nope [T, H, nope]``, ``q_pe [T, H, rope]`` (pre-RoPE), ``c_kv [T, rank]`` (after ``kv_a_layernorm``)
  and ``k_pe [T, rope]`` (pre-RoPE, one key shared by all heads), all in the compute dtype;
* the backend applies RoPE to ``q_pe``/``k_pe``, appends ``[c_kv | rope(k_pe)]`` to the layer's latent
  plane of the paged cache (``KVCacheSpec(mla=True)``: ``H_kv = 1``, head dim ``rank + rope``, one
  per-layer ``k_scale``) and returns ``[T, H * v_head_dim]``.

Attention: ``score[h] = (q_nope[h]·W_UK[h]c + rope(q_pe[h])·rope(k_pe)) · softmax_scale``, output
``Σ p · W_UV[h]c`` with ``kv_b_proj.weight`` viewed as ``[H, nope + v, rank]`` (``W_UK``, ``W_UV``).  The
phase semantics are those of ``base.py``: in prefill the new tokens see the quantized prefix and their
own latent in compute precision; in decode everything comes from the pages.

``quantize_query`` for MLA rounds the absorbed query ``[W_UKᵀ q_nope | rope(q_pe)]`` through
float8_e4m3fn with the dequant multiplier ``layer.q_scale`` (the form the MLA kernels consume).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

__all__ = ["MLAAttentionLayer", "absorb", "unabsorb"]


@dataclass
class MLAAttentionLayer:
    """Static per-layer description of an MLA layer (``w_uk``/``w_uv`` are views of ``kv_b_proj``)."""

    layer_idx: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    w_uk: Optional["torch.Tensor"] = None  # [H, nope, rank]
    w_uv: Optional["torch.Tensor"] = None  # [H, v, rank]
    q_scale: float = 1.0  # dequant multiplier of the fp8 absorbed query (quantize_query)
    sliding_window: None = None  # MLA layers attend to the full context
    sinks: None = None

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


def absorb(q_nope: "torch.Tensor", w_uk: "torch.Tensor") -> "torch.Tensor":
    """``q_lat [T, H, rank] = W_UK[h]ᵀ q_nope[h]`` as one batched matmul over heads (no weight copy)."""
    import torch

    return torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)


def unabsorb(o_lat: "torch.Tensor", w_uv: "torch.Tensor") -> "torch.Tensor":
    """``out [T, H, v] = W_UV[h] o_lat[h]``."""
    import torch

    return torch.bmm(o_lat.transpose(0, 1), w_uv.to(o_lat.dtype).transpose(1, 2)).transpose(0, 1)

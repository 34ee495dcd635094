"""Gemma 3 text decoder (``Gemma3ForCausalLM``) over the paged KV cache, built from the llama family's parts.

What differs from Llama, each a ``ModelConfig`` field (gemma3_config.py fills them):

* RMSNorm scales by ``1 + weight``, in float32 before the cast back (``norm_plus_one``; checkpoints store
  ``weight``, llama.cpp's GGUF files ``1 + weight``, which the GGUF loader undoes);
* the token embedding is multiplied by ``sqrt(hidden)`` rounded to the compute dtype (``embed_scale``);
* four norms per layer: before and after attention, before and after the MLP (``sandwich_norms``), each
  branch's output normed before it joins the residual stream;
* per-head RMSNorm on q and k before RoPE (``qk_norm``), softmax scale ``query_pre_attn_scalar ** -0.5``;
* GeGLU MLP with tanh-approximated GELU (``hidden_act``);
* sliding-window (local) layers interleaved with global ones, the local layers rotating with their own base
  (``local_rope_theta``) and the global ones with ``rope_theta`` and any rope scaling (``RopeCache.local``,
  ``AttentionLayer.local_rope``);
* tied embeddings; final logits soft-capped when configured (``final_logit_softcapping``).

Parameter names are Hugging Face's (``model.layers.N.pre_feedforward_layernorm.weight`` ...).
"""

from __future__ import annotations

import functools

from typing import Optional

import torch
from torch import nn

from kvbench.runtime.models.config import ModelConfig
from kvbench.runtime.models.llama import MLP, Attention, LlamaForCausalLM

__all__ = ["Gemma3ForCausalLM", "GemmaRMSNorm"]


@functools.lru_cache(maxsize=None)
def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=dtype))


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` in float32, cast back to ``x``'s dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """norm(x); with ``residual``: (norm(x + residual), x + residual), as ``llama.RMSNorm``."""
        s = x if residual is None else x + residual
        xf = s.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(s.dtype)
        return y if residual is None else (y, s)


class GemmaAttention(Attention):
    norm_cls = GemmaRMSNorm


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = GemmaAttention(cfg, idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, backend, cache, meta, residual=None):
        """As ``llama.DecoderLayer``: ``x`` the previous layer's (normed) MLP output, ``residual`` the stream
        before it → (this layer's normed MLP output, the stream before it)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        a = self.post_attention_layernorm(self.self_attn(h, backend, cache, meta))
        h, residual = self.pre_feedforward_layernorm(a, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class _GemmaBody(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3ForCausalLM(LlamaForCausalLM):
    attention_cls = GemmaAttention

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.config = cfg
        self.model = _GemmaBody(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, backend, cache, meta) -> torch.Tensor:
        emb = self.model.embed_tokens(input_ids)
        # the scale rounded to the compute dtype, as a host number: no tensor made on the device per step (a
        # host-to-device copy cannot be captured in a CUDA graph); the product is the same as with a tensor
        x = emb * _rounded(self.config.embed_scale or 1.0, emb.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, backend, cache, meta, residual)
        return self.model.norm(x) if residual is None else self.model.norm(x, residual)[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().logits(hidden)
        cap = self.config.final_logit_softcapping
        return out if not cap else torch.tanh(out / cap) * cap

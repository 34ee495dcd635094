"""DeepSeek-style decoder with MLA attention over a paged latent cache.

Attention follows DeepSeek-V2 (Hugging Face parameter names under ``self_attn.``): ``q_proj`` (or
``q_a_proj`` → ``q_a_layernorm`` → ``q_b_proj``) gives per head ``[q_nope | q_pe]``;
``kv_a_proj_with_mqa`` gives ``[c_kv | k_pe]`` (one rope key for all heads), ``c_kv`` goes through
``kv_a_layernorm``; ``kv_b_proj`` holds ``W_UK``/``W_UV`` (``[H, nope + v, rank]``), handed to the
backend, which does RoPE + quantize + append + attention (``runtime/attention/mla_base.py``); ``o_proj``.

The MLP is a dense SwiGLU (``gate_proj``/``up_proj``/``down_proj``) in every layer, standing in for
DeepSeek's mixture of experts (DeepSeek-V2-Lite's first, dense layer has this shape): the model is about
attention and the latent KV cache.  Flat token batches and metadata are those of ``LlamaForCausalLM``,
so the runner, engine and CUDA graphs use it unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvbench.runtime.attention.base import AttentionMetadata
from kvbench.runtime.attention.mla_base import MLAAttentionLayer
from kvbench.runtime.models.config import ModelConfig
from kvbench.runtime.models.llama import LlamaForCausalLM, RMSNorm

__all__ = ["DeepseekForCausalLM", "MLAAttention"]


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        from kvbench.runtime.models.deepseek_config import mla_softmax_scale

        H, h = cfg.num_heads, cfg.hidden_size
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, H * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, h, bias=False)
        self.spec = MLAAttentionLayer(
            layer_idx=idx, num_heads=H, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, softmax_scale=mla_softmax_scale(cfg),
        )

    def bind(self) -> None:
        """Point the spec's ``W_UK``/``W_UV`` at views of ``kv_b_proj`` (after loading or moving weights)."""
        s = self.spec
        w = self.kv_b_proj.weight.detach().view(s.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        s.w_uk, s.w_uv = w[:, : s.qk_nope_head_dim], w[:, s.qk_nope_head_dim :]

    def forward(self, x, backend, cache, meta: AttentionMetadata) -> torch.Tensor:
        s = self.spec
        T = x.shape[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, s.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        out = backend.forward_mla(q_nope, q_pe.contiguous(), c_kv, k_pe.contiguous(), s, cache, meta)
        return self.o_proj(out)


class DeepseekForCausalLM(LlamaForCausalLM):
    """Same interface as ``LlamaForCausalLM`` (forward, logits, bind, from_state, load_weights)."""

    attention_cls = MLAAttention

    def __init__(self, cfg: ModelConfig):
        if not cfg.is_mla:
            raise ValueError("DeepseekForCausalLM needs an MLA config (kv_lora_rank > 0)")
        super().__init__(cfg)

    def bind(self, kmajor: Optional[bool] = None) -> None:
        """MLA's ``W_UK``/``W_UV`` views and the MLP's fused gate/up (K-major as ``LlamaForCausalLM.bind``)."""
        for layer in self.model.layers:
            layer.self_attn.bind()
            layer.mlp.fuse(kmajor)

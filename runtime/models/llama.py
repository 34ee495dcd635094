"""Llama-family decoder (Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), GPT-OSS-style attention
with sinks and per-layer sliding windows) over a paged KV cache.

Parameter names follow Hugging Face (``model.layers.N.self_attn.q_proj.weight`` ...), so a checkpoint's
state dict loads as is.  Attention itself is delegated to an ``AttentionBackend`` with pre-RoPE q/k/v.
The model works on flat token batches ``[T]`` (no padding); the metadata says which rows belong to which
sequence.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvbench.kernels import rms_norm, silu_mul
from kvbench.runtime.attention.base import AttentionBackend, AttentionLayer, AttentionMetadata
from kvbench.runtime.gemm_library import linear
from kvbench.runtime.models.config import ModelConfig

__all__ = ["LlamaForCausalLM", "RMSNorm"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """norm(x); with ``residual``: (norm(x + residual), x + residual), one launch on a GPU
        (``kernels/fused_ops.py``)."""
        return rms_norm(x, self.weight, self.eps, residual)


def k_major(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] (the same values) as a view of a contiguous [K, N] tensor, for a CUDA GPU.  ``F.linear``
    then runs ``x @ w.T`` as a GEMM of two row-major operands, which cuBLAS runs faster than the [N, K]
    layout at decode batch sizes on an H100: 9% for the gate/up projection and the logits of Llama-3-8B at 64
    rows (docs/performance.md, "Decode step with K-major weights").  Idempotent (no copy when ``w`` is already
    such a view)."""
    return w.t().contiguous().t()


def _fuse_linears(*lins: nn.Linear, kmajor: bool = False) -> tuple:
    """Concatenate the weights (and biases) of linears with the same input; re-point each linear's
    parameters at its slice so the memory is not doubled.  Returns ``(weight, bias)`` for F.linear.
    ``kmajor``: the fused weight is stored [K, N] (``k_major``), each linear's weight a view of its columns."""
    if kmajor:
        w = torch.cat([l.weight.detach().t() for l in lins], dim=1).contiguous().t()
    else:
        w = torch.cat([l.weight.detach() for l in lins], dim=0).contiguous()
    b = None
    if lins[0].bias is not None:
        b = torch.cat([l.bias.detach() for l in lins], dim=0).contiguous()
    o = 0
    for l in lins:
        n = l.out_features
        l.weight = nn.Parameter(w[o : o + n], requires_grad=False)
        if b is not None:
            l.bias = nn.Parameter(b[o : o + n], requires_grad=False)
        o += n
    return w, b


def _to_k_major(lin: nn.Linear) -> None:
    lin.weight = nn.Parameter(k_major(lin.weight.detach()), requires_grad=False)


class Attention(nn.Module):
    norm_cls = RMSNorm  # of the per-head q/k norms (Gemma's scales by 1 + weight)

    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        H, Hk, D, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(h, H * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, Hk * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, Hk * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(H * D, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = self.norm_cls(D, cfg.rms_norm_eps)
            self.k_norm = self.norm_cls(D, cfg.rms_norm_eps)
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(H))
        self.spec = AttentionLayer(
            layer_idx=idx,
            num_heads=H,
            num_kv_heads=Hk,
            head_dim=D,
            softmax_scale=cfg.softmax_scale,
            sliding_window=cfg.sliding_windows[idx],
            local_rope=cfg.local_rope(idx),
        )
        self.qk_norm = cfg.qk_norm

        self._qkv = None  # fused (weight, bias) views, set by fuse()

    def fuse(self, kmajor: Optional[bool] = None) -> None:
        """One [q; k; v] weight; the q/k/v parameters become views of it (names and state dict unchanged).
        ``kmajor`` (default: on a CUDA GPU): it and ``o_proj``'s weight are stored K-major (``k_major``)."""
        kmajor = self.q_proj.weight.is_cuda if kmajor is None else kmajor
        self._qkv = _fuse_linears(self.q_proj, self.k_proj, self.v_proj, kmajor=kmajor)
        if kmajor:
            _to_k_major(self.o_proj)

    def forward(self, x, backend: AttentionBackend, cache, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        s = self.spec
        if self._qkv is not None:
            nq, nk = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
            q, k, v = linear(x, *self._qkv).split([nq, nk, nk], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(T, s.num_heads, s.head_dim)
        k = k.reshape(T, s.num_kv_heads, s.head_dim)
        v = v.reshape(T, s.num_kv_heads, s.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        o = self.o_proj
        return linear(backend.forward(q, k, v, s, cache, meta), o.weight, o.bias)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act = cfg.hidden_act  # silu (SwiGLU) | gelu_tanh (GeGLU)

        self._gate_up = None

    def fuse(self, kmajor: Optional[bool] = None) -> None:
        """One [gate; up] weight (views as for q/k/v); ``kmajor`` as for q/k/v, with ``down_proj``."""
        kmajor = self.gate_proj.weight.is_cuda if kmajor is None else kmajor
        self._gate_up = _fuse_linears(self.gate_proj, self.up_proj, kmajor=kmajor)
        if kmajor:
            _to_k_major(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "gelu_tanh":
            if self._gate_up is not None:
                gate, up = linear(x, *self._gate_up).chunk(2, dim=-1)
            else:
                gate, up = self.gate_proj(x), self.up_proj(x)
            return linear(nn.functional.gelu(gate, approximate="tanh") * up, self.down_proj.weight)
        if self._gate_up is not None:
            return linear(silu_mul(linear(x, *self._gate_up)), self.down_proj.weight)
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block; ``attn_cls`` builds the attention (``Attention``, or MLA for DeepSeek)."""

    def __init__(self, cfg: ModelConfig, idx: int, attn_cls=None):
        super().__init__()
        self.self_attn = (attn_cls or Attention)(cfg, idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, backend, cache, meta, residual=None):
        """``x``: the previous layer's output and ``residual`` the stream before it (None for the first
        layer, whose input is the stream itself) → (this layer's MLP output, the stream before it).  The
        residual adds happen inside the next norm (one launch each), the last one in the final norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, backend, cache, meta), residual)
        return self.mlp(h), residual


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_cls=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, attn_cls) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    attention_cls = Attention  # the per-layer attention module (DeepSeek's MLA subclass swaps it)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = _Body(cfg, self.attention_cls)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def attention_layers(self) -> list[AttentionLayer]:
        return [layer.self_attn.spec for layer in self.model.layers]

    def bind(self, kmajor: Optional[bool] = None) -> None:
        """Point the attention specs at their sink parameters and fuse q/k/v and gate/up weights (call
        after loading or moving weights).  ``kmajor`` (default: the weights are on a CUDA GPU): the
        projections and an untied ``lm_head`` are stored K-major (``k_major``); a tied table stays row-major,
        since the embedding gathers its rows."""
        kmajor = self.model.embed_tokens.weight.is_cuda if kmajor is None else kmajor
        for layer in self.model.layers:
            att = layer.self_attn
            att.spec.sinks = att.sinks.detach().float() if hasattr(att, "sinks") else None
            att.fuse(kmajor)
            layer.mlp.fuse(kmajor)
        if kmajor and not self.config.tie_word_embeddings:
            _to_k_major(self.lm_head)

    def lm_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, backend: AttentionBackend, cache, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` (normed) of a flat token batch."""
        x, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(x, backend, cache, meta, residual)
        return self.model.norm(x) if residual is None else self.model.norm(x, residual)[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_weight()).float()

    @classmethod
    def from_state(cls, cfg: ModelConfig, state: dict[str, torch.Tensor], device, dtype) -> "LlamaForCausalLM":
        """Build on the meta device and adopt the checkpoint tensors (no second copy of the weights)."""
        with torch.device("meta"):
            model = cls(cfg)
        model._check_names(state)
        own = model.state_dict()
        adopted = {}
        for k, t in own.items():
            src = state[k]
            if tuple(src.shape) != tuple(t.shape):
                raise ValueError(f"{k}: checkpoint shape {tuple(src.shape)} != model {tuple(t.shape)}")
            adopted[k] = src.to(device=device, dtype=dtype)
        model.load_state_dict(adopted, strict=True, assign=True)
        return model

    def _check_names(self, state: dict) -> None:
        own = self.state_dict()
        skip = ("rotary_emb.inv_freq", "k_scale", "v_scale", "q_scale", "prob_scale")
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own and not k.endswith(skip)]
        if self.config.tie_word_embeddings:
            unexpected = [k for k in unexpected if k != "lm_head.weight"]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}")

    def load_weights(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Copy a HF-named state dict in (ignores ``k_scale``/``v_scale``/rotary buffers)."""
        own = self.state_dict()
        skip = ("rotary_emb.inv_freq", "k_scale", "v_scale", "q_scale", "prob_scale")
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own and not k.endswith(skip)]
        if self.config.tie_word_embeddings:
            missing = [k for k in missing if k != "lm_head.weight"]
        if strict and (missing or unexpected):
            raise ValueError(f"checkpoint does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
        with torch.no_grad():
            for k, t in own.items():
                if k in state:
                    src = state[k]
                    if tuple(src.shape) != tuple(t.shape):
                        raise ValueError(f"{k}: checkpoint shape {tuple(src.shape)} != model {tuple(t.shape)}")
                    t.copy_(src.to(t.dtype))

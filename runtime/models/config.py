"""Architecture description of a llama-family model (parsed from HF config.json or GGUF metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["ModelConfig", "SUPPORTED_ARCHS", "MLA_ARCHS", "GEMMA_ARCHS", "llama_from_hf_config"]

# HF ``architectures`` / ``model_type`` values the llama-family implementation covers.
SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# Gemma 3, text only (runtime/models/gemma3.py; its config.json is read by gemma3_config.py)
GEMMA_ARCHS = {"Gemma3ForCausalLM": "gemma3"}
# activations of the MLP: SwiGLU (silu) or GeGLU with tanh-approximated GELU (Gemma)
_ACTS = {"silu": "silu", "swiglu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# DeepSeek-V2/V3 attention (MLA) with dense MLPs only (runtime/models/deepseek.py).
MLA_ARCHS = {"DeepseekV2ForCausalLM": "deepseek-mla", "DeepseekV3ForCausalLM": "deepseek-mla"}


@dataclass
class ModelConfig:
    arch: str  # llama | mistral | qwen2 | qwen3 | gemma3 | gpt-oss-attn | deepseek-mla
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    rotary_dim: Optional[int] = None  # None = head_dim
    rope_style: str = "neox"
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_windows: list = field(default_factory=list)  # per layer: int or None; [] = all full
    attention_sinks: bool = False
    hidden_act: str = "silu"
    bos_token_id: Optional[int] = None
    eos_token_ids: list = field(default_factory=list)
    # MLA (arch "deepseek-mla"; kv_lora_rank 0 = not MLA).  head_dim is then qk_nope + qk_rope,
    # num_kv_heads 1 (one latent "head" per token), rotary_dim qk_rope_head_dim.
    q_lora_rank: Optional[int] = None  # None: a direct q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Gemma 3 (runtime/models/gemma3.py): RMSNorm scales by (1 + weight); the embedding is multiplied by
    # ``embed_scale`` (sqrt(hidden)); norms before and after attention and the MLP ("sandwich"); softmax scale
    # ``query_pre_attn_scalar ** -0.5``; the sliding-window (local) layers rotate with their own base and
    # scaling (``local_rope_theta``; None = the same tables as the global layers); final logits soft-capped.
    norm_plus_one: bool = False
    embed_scale: Optional[float] = None
    sandwich_norms: bool = False
    query_pre_attn_scalar: Optional[float] = None
    local_rope_theta: Optional[float] = None
    local_rope_scaling: Optional[dict] = None
    final_logit_softcapping: Optional[float] = None

    def __post_init__(self) -> None:
        if self.is_mla:
            for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if int(getattr(self, n)) <= 0:
                    raise ValueError(f"MLA config needs a positive {n}")
            self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
            self.num_kv_heads = 1
            self.rotary_dim = self.qk_rope_head_dim
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.hidden_act not in _ACTS:
            raise ValueError(f"unsupported activation {self.hidden_act!r}; supported: silu (SwiGLU), gelu_pytorch_tanh (GeGLU)")
        self.hidden_act = _ACTS[self.hidden_act]
        if not self.sliding_windows:
            self.sliding_windows = [None] * self.num_layers
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError("sliding_windows needs one entry per layer")

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def softmax_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def local_rope(self, layer: int) -> bool:
        """Layer ``layer`` rotates with the local tables (a sliding-window layer of a model that has them)."""
        return self.local_rope_theta is not None and self.sliding_windows[layer] is not None

    def rope_cache(self, max_positions: int, device="cpu"):
        """The rotary tables of the engine: the global layers', with the local layers' as ``.local`` when the
        model has them (``AttentionLayer.local_rope`` picks them)."""
        from kvbench.runtime.attention.base import build_rope_cache

        rope = build_rope_cache(self.rope_dim, max_positions, self.rope_theta, self.rope_scaling, self.rope_style, device)
        if self.local_rope_theta is not None:
            rope.local = build_rope_cache(self.rope_dim, max_positions, self.local_rope_theta, self.local_rope_scaling,
                                          self.rope_style, device)
        return rope

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_head_dim(self) -> int:
        """Head dim of a cache entry: the latent plus the rope key for MLA, else head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    def kv_spec(self, kv_dtype: str, page_size: int, layout: str = "HND"):
        """The paged cache's ``KVCacheSpec`` for this model (one latent plane per layer for MLA)."""
        from kvbench.runtime.config import KVCacheSpec

        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.kv_head_dim, kv_dtype, page_size, mla=self.is_mla,
                           layout=layout)

    def num_params(self) -> int:
        h, L = self.hidden_size, self.num_layers
        attn = h * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.is_mla:
            H, r = self.num_heads, self.kv_lora_rank
            q_in = self.q_lora_rank or h
            attn = (h * self.q_lora_rank if self.q_lora_rank else 0) + q_in * H * self.head_dim
            attn += h * (r + self.qk_rope_head_dim) + r * H * (self.qk_nope_head_dim + self.v_head_dim)
            attn += H * self.v_head_dim * h
        mlp = 3 * h * self.intermediate_size
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return L * (attn + mlp + 2 * h) + emb + h


def _get(d: dict, *names: str, default: Any = None) -> Any:
    for n in names:
        if d.get(n) is not None:
            return d[n]
    return default


def is_mla_config(cfg: dict) -> bool:
    """A DeepSeek-V2/V3 (MLA) ``config.json``: runtime/models/deepseek_config.py reads it."""
    return any(a in MLA_ARCHS for a in cfg.get("architectures") or []) or cfg.get("model_type") in ("deepseek_v2", "deepseek_v3")


def llama_from_hf_config(cfg: dict) -> ModelConfig:
    """ModelConfig from a Hugging Face ``config.json`` dict of the llama family (Llama, Mistral, Qwen2, Qwen3);
    ``runtime.models.hf_config.from_hf_config`` sends MLA configs elsewhere first."""
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
    if arch is None:
        mt = cfg.get("model_type")
        arch = mt if mt in SUPPORTED_ARCHS.values() else None
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: "
            f"{', '.join([*SUPPORTED_ARCHS, *GEMMA_ARCHS, *MLA_ARCHS])}"
        )
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    head_dim = int(_get(cfg, "head_dim", default=hidden // heads))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None
    max_window_layers = cfg.get("max_window_layers")
    windows: list = []
    layer_types = cfg.get("layer_types")
    for i in range(layers):
        if layer_types and cfg.get("sliding_window"):
            w = cfg["sliding_window"] if layer_types[i] == "sliding_attention" else None
        else:
            w = window
            if arch in ("qwen2", "qwen3") and window and max_window_layers is not None and i < max_window_layers:
                w = None  # HF Qwen2/3: the first max_window_layers layers use full attention
        windows.append(int(w) if w else None)
    # rope: transformers >= 5 writes "rope_parameters" (theta inside); older configs rope_theta + rope_scaling
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "full_attention" in rp:  # per-layer-type parameters: use the full-attention set
        rp = rp["full_attention"]
    theta = float((rp or {}).get("rope_theta") or _get(cfg, "rope_theta", default=10000.0))
    scaling = rp if rp else cfg.get("rope_scaling")
    if scaling and (scaling.get("rope_type", scaling.get("type")) in (None, "default")):
        scaling = None
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    eos = cfg.get("eos_token_id")
    partial = float(cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0)
    return ModelConfig(
        arch=arch,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=head_dim,
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", default=1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", default=4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        o_bias=arch != "qwen2" and bool(cfg.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
        sliding_windows=windows,
        hidden_act=cfg.get("hidden_act", "silu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=list(eos) if isinstance(eos, list) else ([eos] if eos is not None else []),
    )

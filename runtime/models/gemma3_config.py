"""Gemma 3 (text) configs, from a Hugging Face ``config.json`` or from GGUF metadata, and the refusals of
checkpoints the embedded engine does not run (mixtures of experts, multimodal towers).

Which layers slide: ``layer_types`` (``sliding_attention`` / ``full_attention``) when the config lists them,
else ``sliding_window_pattern`` N (every N-th layer global, the rest local; 6 when absent, Gemma 3's).  RoPE:
transformers >= 5 writes ``rope_parameters`` per layer type; older configs ``rope_theta`` (global),
``rope_local_base_freq`` (local) and ``rope_scaling`` (global layers only).

GGUF files (llama.cpp's ``gemma3`` architecture) carry neither the pattern nor the local base: llama.cpp
fixes them for the family (every 6th layer global, local base 10000, no scaling on local layers) and so
does this reader, unless the file has ``gemma3.attention.sliding_window_pattern``.  The softmax scale is
``1/sqrt(head_dim)`` except for the 27B model (62 layers), whose ``query_pre_attn_scalar`` is
``hidden / heads``, as llama.cpp has it.
"""

from __future__ import annotations

from typing import Optional

from kvbench.runtime.models.config import ModelConfig

__all__ = ["from_hf_gemma3", "gemma3_from_gguf", "is_gemma3_config", "refuse_unsupported", "EXTERNAL_HINT"]

EXTERNAL_HINT = "run it through an external engine instead (a vLLM or SGLang server target: docs/external-engines.md)"
_PATTERN = 6
_LOCAL_BASE = 10000.0


def is_gemma3_config(cfg: dict) -> bool:
    return "Gemma3ForCausalLM" in (cfg.get("architectures") or []) or cfg.get("model_type") == "gemma3_text"


def _arch_name(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    return archs[0] if archs else str(cfg.get("model_type"))


def refuse_unsupported(cfg: dict) -> None:
    """A ``ValueError`` naming the architecture for checkpoints the engine does not run: mixtures of experts
    (Mixtral, Qwen2/3-MoE, ... ; DeepSeek's are refused by deepseek_config.py) and multimodal models (a
    vision or audio tower, e.g. Gemma3ForConditionalGeneration)."""
    name = _arch_name(cfg)
    archs = " ".join(cfg.get("architectures") or []) + " " + str(cfg.get("model_type") or "")
    experts = next((k for k in ("num_local_experts", "num_experts", "moe_num_experts") if (cfg.get(k) or 0) > 0), None)
    if experts or "moe" in archs.lower() or "mixtral" in archs.lower():
        why = f" ({experts}={cfg[experts]})" if experts else ""
        raise ValueError(f"{name} is a mixture-of-experts model{why}: the embedded engine runs dense decoders only; "
                         + EXTERNAL_HINT)
    towers = [k for k in ("vision_config", "audio_config", "vision_tower") if cfg.get(k)]
    if towers or "ForConditionalGeneration" in archs:
        what = f" ({', '.join(towers)})" if towers else ""
        raise ValueError(f"{name} is a multimodal model{what}: the embedded engine runs text-only decoders "
                         f"(a text-only checkpoint such as Gemma3ForCausalLM loads); " + EXTERNAL_HINT)


def _rope_sets(cfg: dict) -> tuple[float, Optional[dict], float]:
    """(global theta, global scaling or None, local theta)."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        full, local = dict(rp.get("full_attention") or {}), dict(rp.get("sliding_attention") or {})
        if local.get("rope_type", "default") not in (None, "default"):
            raise ValueError(f"Gemma 3 rope scaling on sliding-window layers ({local}) is not supported")
        theta = float(full.pop("rope_theta", 1_000_000.0))
        local_theta = float(local.get("rope_theta", _LOCAL_BASE))
    else:
        full = dict(cfg.get("rope_scaling") or {})
        theta = float(cfg.get("rope_theta") or 1_000_000.0)
        local_theta = float(cfg.get("rope_local_base_freq") or _LOCAL_BASE)
    kind = full.get("rope_type", full.get("type"))
    scaling = None if kind in (None, "default") else {k: v for k, v in full.items() if k != "partial_rotary_factor"}
    return theta, scaling, local_theta


def from_hf_gemma3(cfg: dict) -> ModelConfig:
    """ModelConfig of a Gemma 3 text ``config.json`` (``Gemma3ForCausalLM``, model_type ``gemma3_text``)."""
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("Gemma3ForCausalLM with attn_logit_softcapping: the attention kernels do not soft-cap scores")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma3ForCausalLM with use_bidirectional_attention (an embedding model) is not a causal decoder")
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if not types:
        n = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or _PATTERN)
        types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"layer_types lists {len(types)} layers for num_hidden_layers={layers}")
    windows = [int(window) if window and t == "sliding_attention" else None for t in types]
    theta, scaling, local_theta = _rope_sets(cfg)
    eos = cfg.get("eos_token_id")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    return ModelConfig(
        arch="gemma3", hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
        intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 131072),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)), qk_norm=True,
        sliding_windows=windows, hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=list(eos) if isinstance(eos, list) else ([eos] if eos is not None else []),
        norm_plus_one=True, embed_scale=hidden**0.5, sandwich_norms=True,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
        local_rope_theta=local_theta, final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )


def gemma3_from_gguf(meta: dict) -> ModelConfig:
    """ModelConfig of a llama.cpp ``gemma3`` GGUF file (metadata as ``gguf_loader.read_gguf_metadata`` gives it)."""

    def g(key, default=None):
        return meta.get(f"gemma3.{key}", default)

    layers, heads, hidden = int(g("block_count")), int(g("attention.head_count")), int(g("embedding_length"))
    head_dim = int(g("attention.key_length", 256))
    pattern = int(g("attention.sliding_window_pattern", _PATTERN))
    window = g("attention.sliding_window")
    types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    cfg = {
        "num_hidden_layers": layers, "num_attention_heads": heads, "hidden_size": hidden, "head_dim": head_dim,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)), "intermediate_size": int(g("feed_forward_length")),
        "vocab_size": int(g("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])) or 0)),  # 0: from the embedding
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)), "sliding_window": window,
        "layer_types": types, "rope_theta": float(g("rope.freq_base", 1_000_000.0)), "rope_local_base_freq": _LOCAL_BASE,
        "max_position_embeddings": int(g("context_length", 131072)),
        "query_pre_attn_scalar": hidden / heads if layers == 62 else head_dim,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if g("rope.scaling.type") not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": g("rope.scaling.type"), "factor": float(g("rope.scaling.factor", 1.0))}
    return from_hf_gemma3(cfg)

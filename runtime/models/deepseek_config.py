"""ModelConfig for DeepSeek-style MLA models: from an ``MLAShape`` preset (synthetic models) or from a
Hugging Face ``config.json`` (DeepSeek-V2/V3 without a mixture of experts), plus the MLA softmax scale.

RoPE follows the public DeepSeek-V2 modelling code: YaRN frequencies (``factor``, ``beta_fast``/``beta_slow``,
``original_max_position_embeddings``), cos/sin multiplied by ``mscale(factor, mscale) /
mscale(factor, mscale_all_dim)`` (1.0 for the published configs) and the softmax scale
``qk_head_dim^-0.5 · mscale(factor, mscale_all_dim)²``, with ``mscale(s, m) = 0.1 · m · ln s + 1`` for
``s > 1``.  Pairs are interleaved (``rope_style="interleaved"``).
"""

from __future__ import annotations

import math
from typing import Optional

from kvbench.runtime.models.config import ModelConfig

__all__ = ["mla_config_from_shape", "from_hf_deepseek", "mla_softmax_scale", "yarn_mscale", "mla_shape_of"]

MLA_ARCH = "deepseek-mla"


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_scaling(factor: Optional[float], mscale: float, mscale_all_dim: float, original: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> Optional[dict]:
    if not factor or factor <= 1:
        return None
    return {
        "rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original),
        "beta_fast": float(beta_fast), "beta_slow": float(beta_slow), "mscale": float(mscale),
        "mscale_all_dim": float(mscale_all_dim),
        # cos/sin multiplier (build_rope_cache reads attention_factor)
        "attention_factor": yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim),
    }


def mla_softmax_scale(cfg: ModelConfig) -> float:
    s = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    sc = cfg.rope_scaling or {}
    if sc.get("rope_type") == "yarn" and sc.get("mscale_all_dim"):
        m = yarn_mscale(float(sc["factor"]), float(sc["mscale_all_dim"]))
        s *= m * m
    return s


def mla_config_from_shape(shape, intermediate_size: int) -> ModelConfig:
    """A dense-MLP decoder with ``shape``'s attention (``mla_shapes.MLAShape``)."""
    return ModelConfig(
        arch=MLA_ARCH, hidden_size=shape.hidden_size, num_layers=shape.num_layers, num_heads=shape.num_heads,
        num_kv_heads=1, head_dim=shape.qk_head_dim, intermediate_size=intermediate_size, vocab_size=shape.vocab_size,
        rms_norm_eps=shape.rms_norm_eps, rope_theta=shape.rope_theta,
        rope_scaling=_yarn_scaling(shape.yarn_factor, shape.yarn_mscale_all_dim, shape.yarn_mscale_all_dim, 4096),
        rope_style=shape.rope_style, max_position_embeddings=4096 * int(shape.yarn_factor or 1),
        q_lora_rank=shape.q_lora_rank, kv_lora_rank=shape.kv_lora_rank, qk_nope_head_dim=shape.qk_nope_head_dim,
        qk_rope_head_dim=shape.qk_rope_head_dim, v_head_dim=shape.v_head_dim,
    )


def mla_shape_of(cfg: ModelConfig):
    """The ``MLAShape`` of an MLA ModelConfig (for ``make_mla_weights``)."""
    from kvbench.runtime.models.mla_shapes import MLAShape

    sc = cfg.rope_scaling or {}
    return MLAShape(
        "config", hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, num_layers=cfg.num_layers, vocab_size=cfg.vocab_size, rope_theta=cfg.rope_theta,
        rope_style=cfg.rope_style, yarn_factor=sc.get("factor"), yarn_mscale_all_dim=float(sc.get("mscale_all_dim") or 0.0),
        rms_norm_eps=cfg.rms_norm_eps,
    )


def from_hf_deepseek(cfg: dict) -> ModelConfig:
    """DeepSeek-V2/V3 ``config.json`` → ModelConfig.  Checkpoints with routed experts are refused: the
    engine's DeepSeek decoder has dense MLPs only."""
    experts = cfg.get("n_routed_experts") or 0
    layers = int(cfg["num_hidden_layers"])
    if experts and int(cfg.get("first_k_dense_replace") or 0) < layers:
        raise ValueError(
            f"DeepSeek checkpoint with a mixture of experts (n_routed_experts={experts}): the engine runs MLA "
            "attention with dense MLPs only; use synthetic:deepseek-v2-lite (or synthetic:deepseek-v3) for MLA work"
        )
    sc = cfg.get("rope_scaling") or {}
    scaling = None
    if sc.get("type", sc.get("rope_type")) == "yarn":
        scaling = _yarn_scaling(sc.get("factor"), float(sc.get("mscale") or 1.0), float(sc.get("mscale_all_dim") or 0.0),
                                int(sc.get("original_max_position_embeddings") or 4096), float(sc.get("beta_fast") or 32),
                                float(sc.get("beta_slow") or 1))
    elif sc:
        raise ValueError(f"unsupported DeepSeek rope scaling {sc!r} (yarn or none)")
    eos = cfg.get("eos_token_id")
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    return ModelConfig(
        arch=MLA_ARCH, hidden_size=int(cfg["hidden_size"]), num_layers=layers, num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=1, head_dim=nope + rope, intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope_theta=float(cfg.get("rope_theta") or 10000.0), rope_scaling=scaling, rope_style="interleaved",
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), hidden_act=cfg.get("hidden_act", "silu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=list(eos) if isinstance(eos, list) else ([eos] if eos is not None else []),
        q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=int(cfg["kv_lora_rank"]), qk_nope_head_dim=nope,
        qk_rope_head_dim=rope, v_head_dim=int(cfg["v_head_dim"]),
    )

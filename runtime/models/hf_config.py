"""``from_hf_config``: a Hugging Face ``config.json`` dict to a ``ModelConfig``, whichever family reads it (the
llama family in runtime/models/config.py, DeepSeek-V2/V3 attention without experts in deepseek_config.py)."""

from __future__ import annotations

from kvbench.runtime.models.config import ModelConfig, is_mla_config, llama_from_hf_config
from kvbench.runtime.models.deepseek_config import from_hf_deepseek

__all__ = ["from_hf_config"]


def from_hf_config(cfg: dict) -> ModelConfig:
    """ModelConfig from a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2, Qwen3; DeepSeek-V2/V3
    attention when the checkpoint has no mixture of experts)."""
    return from_hf_deepseek(cfg) if is_mla_config(cfg) else llama_from_hf_config(cfg)

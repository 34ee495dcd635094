"""``from_hf_config``: a Hugging Face ``config.json`` dict to a ``ModelConfig``, whichever family reads it (the
llama family in runtime/models/config.py, DeepSeek-V2/V3 attention without experts in deepseek_config.py, Gemma 3
in gemma3_config.py)."""

from __future__ import annotations

from kvbench.runtime.models.config import ModelConfig, is_mla_config, llama_from_hf_config
from kvbench.runtime.models.deepseek_config import from_hf_deepseek
from kvbench.runtime.models.gemma3_config import from_hf_gemma3, is_gemma3_config, refuse_unsupported

__all__ = ["from_hf_config"]


def from_hf_config(cfg: dict) -> ModelConfig:
    """ModelConfig from a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2, Qwen3, Gemma 3 text;
    DeepSeek-V2/V3 attention when the checkpoint has no mixture of experts).  Mixtures of experts and
    multimodal checkpoints are refused, naming the architecture (``gemma3_config.refuse_unsupported``)."""
    if is_mla_config(cfg):
        return from_hf_deepseek(cfg)
    refuse_unsupported(cfg)
    return from_hf_gemma3(cfg) if is_gemma3_config(cfg) else llama_from_hf_config(cfg)

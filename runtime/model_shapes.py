"""Attention shapes of well-known models, for capacity planning and synthetic models.

Only what the KV cache depends on (layers, kv heads, head dim; MLA latent width) plus the query heads and
hidden size that performance work needs.  Numbers are from the models' published configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvbench.runtime.config import KVCacheSpec


@dataclass(frozen=True)
class AttentionShape:
    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_context: int
    mla_latent_dim: Optional[int] = None  # kv_lora_rank + qk_rope_head_dim for MLA models

    def kv_spec(self, kv_dtype: str = "bf16", page_size: int = 16) -> KVCacheSpec:
        if self.mla_latent_dim:
            return KVCacheSpec(self.num_layers, 1, self.mla_latent_dim, kv_dtype, page_size, mla=True)
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim, kv_dtype, page_size)


SHAPES: dict[str, AttentionShape] = {
    s.name: s
    for s in (
        AttentionShape("smollm2-135m", 30, 9, 3, 64, 576, 8192),
        AttentionShape("llama-3-8b", 32, 32, 8, 128, 4096, 8192),
        AttentionShape("llama-3-70b", 80, 64, 8, 128, 8192, 8192),
        AttentionShape("qwen3-8b", 36, 32, 8, 128, 4096, 40960),
        AttentionShape("mistral-7b", 32, 32, 8, 128, 4096, 32768),
        AttentionShape("gpt-oss-20b", 24, 64, 8, 64, 2880, 131072),
        AttentionShape("deepseek-v2-lite", 27, 16, 1, 192, 2048, 163840, mla_latent_dim=512 + 64),
        AttentionShape("deepseek-v3", 61, 128, 1, 192, 7168, 163840, mla_latent_dim=512 + 64),
    )
}


def get_shape(name: str) -> AttentionShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}") from None

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
        AttentionShape("llama-3.2-1b", 16, 32, 8, 64, 2048, 131072),
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
    """A built-in shape by name, any case (``Llama-3-8B`` is ``llama-3-8b``)."""
    try:
        return SHAPES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)} (or pass a config.json or "
                         "model directory with --model-config)") from None


def _int(cfg: dict, *keys: str, default: Optional[int] = None) -> Optional[int]:
    for k in keys:
        if cfg.get(k) is not None:
            return int(cfg[k])
    return default


def shape_from_hf_config(cfg: dict, name: str = "config.json") -> AttentionShape:
    """The attention shape of a Hugging Face ``config.json`` dict (any decoder that names its heads the usual
    way; multimodal configs: their ``text_config``; DeepSeek MLA: the latent width).  ValueError naming the
    missing key."""
    if cfg.get("num_hidden_layers") is None and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"]}
    try:
        layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
        heads = _int(cfg, "num_attention_heads", "n_head")
        hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
        if layers is None or heads is None or hidden is None:
            missing = [k for k, v in (("num_hidden_layers", layers), ("num_attention_heads", heads), ("hidden_size", hidden)) if v is None]
            raise ValueError(f"{name}: no {', '.join(missing)}; not a decoder model config")
        kv_heads = _int(cfg, "num_key_value_heads", "num_kv_heads", "multi_query_group_num", default=heads)
        head_dim = _int(cfg, "head_dim", default=hidden // heads)
        ctx = _int(cfg, "max_position_embeddings", "max_sequence_length", "seq_length", "n_positions", default=0)
        rank = _int(cfg, "kv_lora_rank", default=0)
        if rank:  # MLA: one latent vector (kv_lora_rank + rope dims) per token and layer
            rope = _int(cfg, "qk_rope_head_dim", default=0)
            nope = _int(cfg, "qk_nope_head_dim", default=0)
            return AttentionShape(name, layers, heads, 1, nope + rope, hidden, ctx, mla_latent_dim=rank + rope)
    except (TypeError, ValueError) as e:
        if isinstance(e, ValueError) and str(e).startswith(name):
            raise
        raise ValueError(f"{name}: a head count or size is not an integer ({e})") from None
    if min(layers, heads, kv_heads, head_dim, hidden) <= 0:
        raise ValueError(f"{name}: layers, heads, kv heads and head_dim must be positive")
    return AttentionShape(name, layers, heads, kv_heads, head_dim, hidden, ctx)


def load_shape(path: str) -> AttentionShape:
    """The attention shape of a ``config.json`` file or a model directory holding one."""
    import json
    from pathlib import Path

    p = Path(path).expanduser()
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise ValueError(f"--model-config {path}: " + ("the directory has no config.json" if p.is_dir() else "no such file"))
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--model-config {path}: not a JSON config ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--model-config {path}: not a JSON object")
    name = p.name if p.is_dir() else (p.parent.name or p.name) if f.name == "config.json" else p.stem
    return shape_from_hf_config(cfg, name or str(f))


def shard_shape(shape: AttentionShape, tp: int) -> tuple[AttentionShape, str]:
    """The per-GPU KV shape under tensor parallelism ``tp``, with a note of how the kv heads are split.

    KV heads are split over the GPUs (``num_kv_heads / tp`` each); with fewer kv heads than GPUs they are
    replicated (each GPU stores one, as vLLM and SGLang do) when ``tp`` is a multiple of them.  An MLA latent
    is stored whole on every GPU.  Anything else is a ValueError."""
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if tp == 1:
        return shape, "tp 1"
    from dataclasses import replace

    kv = shape.num_kv_heads
    if shape.mla_latent_dim:
        return shape, f"tp {tp}: the MLA latent is stored whole on each GPU"
    if kv % tp == 0:
        return replace(shape, num_kv_heads=kv // tp, num_heads=max(1, shape.num_heads // tp)), \
            f"tp {tp}: {kv} kv heads split, {kv // tp} per GPU"
    if tp % kv == 0:
        return replace(shape, num_kv_heads=1, num_heads=max(1, shape.num_heads // tp)), \
            f"tp {tp}: {kv} kv heads replicated, 1 per GPU ({tp // kv} copies of each)"
    raise ValueError(f"--tp {tp} does not divide the {kv} kv heads of {shape.name} (nor do they divide it); "
                     f"use a tp that divides {kv} or a multiple of it")

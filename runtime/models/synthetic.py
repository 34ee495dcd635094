"""Synthetic models: random weights in the shapes of real models, for performance and capacity work.

Name syntax: ``synthetic:<preset>[,key=value...]`` e.g. ``synthetic:llama-3-8b,layers=2`` (overrides any
ModelConfig field; ``layers`` is short for ``num_layers``; ``window=N`` resizes the sliding windows).  The MLP of ``gpt-oss-20b`` is a dense
SwiGLU of the active-expert width (4 × 2880) standing in for its mixture of experts: the preset is about
attention (sinks, alternating 128-token sliding window) and the KV cache, not the MoE.

``deepseek-v2-lite`` and ``deepseek-v3`` are MLA models (``runtime/models/deepseek.py``): the attention
shapes of ``mla_shapes.MLA_SHAPES``, random attention weights from ``make_mla_weights``, and in every layer
a dense SwiGLU MLP of the width of DeepSeek-V2-Lite's first (dense) layer, 10944 (V3: 18432), standing in
for the mixture of experts.  At full depth they are large (V2-Lite 2.6e9 parameters, V3 3.7e10 of which
2.4e10 dense MLP): ``layers=2`` keeps them small, and MLA fields such as
``kv_lora_rank``, ``qk_rope_head_dim``, ``qk_nope_head_dim``, ``v_head_dim``, ``intermediate_size``
can be overridden too (``kv_lora_rank`` and ``qk_rope_head_dim`` must stay powers of two ≥ 16 for the
Triton kernels).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from kvbench.runtime.models.config import ModelConfig

__all__ = ["SYNTHETIC_PRESETS", "parse_synthetic", "ByteTokenizer"]


def _llama3_8b() -> ModelConfig:
    return ModelConfig(
        arch="llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072,
    )


def _llama32_1b() -> ModelConfig:
    """Llama-3.2-1B's published config (tied input/output embeddings; 1.24e9 parameters)."""
    return ModelConfig(
        arch="llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        intermediate_size=8192, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=True,
    )


def _qwen3_8b() -> ModelConfig:
    return ModelConfig(
        arch="qwen3", hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=12288, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, qk_norm=True,
    )


def _gpt_oss_20b() -> ModelConfig:
    layers = 24
    return ModelConfig(
        arch="gpt-oss-attn", hidden_size=2880, num_layers=layers, num_heads=64, num_kv_heads=8, head_dim=64,
        intermediate_size=4 * 2880, vocab_size=201088, rms_norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 4096},
        max_position_embeddings=131072, qkv_bias=True, o_bias=True, attention_sinks=True,
        sliding_windows=[128 if i % 2 == 0 else None for i in range(layers)],
    )


def _deepseek(name: str, intermediate: int):
    def build() -> ModelConfig:
        from kvbench.runtime.models.deepseek_config import mla_config_from_shape
        from kvbench.runtime.models.mla_shapes import get_mla_shape

        return mla_config_from_shape(get_mla_shape(name), intermediate)

    return build


SYNTHETIC_PRESETS = {
    "llama-3-8b": _llama3_8b, "llama-3.2-1b": _llama32_1b, "qwen3-8b": _qwen3_8b, "gpt-oss-20b": _gpt_oss_20b,
    "deepseek-v2-lite": _deepseek("deepseek-v2-lite", 10944), "deepseek-v3": _deepseek("deepseek-v3", 18432),
}
_ALIASES = {"layers": "num_layers", "vocab": "vocab_size", "hidden": "hidden_size", "heads": "num_heads", "kv_heads": "num_kv_heads"}


def parse_synthetic(name: str) -> Optional[ModelConfig]:
    """ModelConfig for a ``synthetic:`` name, or None when ``name`` is not synthetic."""
    if not name.startswith("synthetic:"):
        return None
    preset, *opts = name[len("synthetic:"):].split(",")
    if preset not in SYNTHETIC_PRESETS:
        raise ValueError(f"unknown synthetic model {preset!r}; presets: {', '.join(SYNTHETIC_PRESETS)}")
    cfg = SYNTHETIC_PRESETS[preset]()
    known = {f.name: f for f in dataclasses.fields(ModelConfig)}
    changes = {}
    window = None
    for o in opts:
        k, sep, v = o.partition("=")
        k = _ALIASES.get(k.strip(), k.strip())
        if k == "window" and sep:  # replaces the preset's sliding-window size (layers with a window)
            window = int(v)
            continue
        if not sep or k not in known or k in ("sliding_windows", "rope_scaling", "eos_token_ids"):
            raise ValueError(f"bad synthetic option {o!r}; use key=value with a ModelConfig field")
        cur = getattr(cfg, k)
        if k == "q_lora_rank":  # Optional[int]: "none" = a direct q_proj
            changes[k] = None if v.lower() in ("none", "0", "") else int(v)
            continue
        changes[k] = type(cur)(v) if cur is not None and not isinstance(cur, bool) else v.lower() in ("1", "true")
    n = changes.get("num_layers", cfg.num_layers)
    wins = [cfg.sliding_windows[i % len(cfg.sliding_windows)] for i in range(n)]
    changes["sliding_windows"] = [w if w is None or window is None else window for w in wins]
    if cfg.is_mla:
        if window is not None or any(w is not None for w in changes["sliding_windows"]):
            raise ValueError("MLA models attend to the full context; window= does not apply")
        changes.setdefault("head_dim", changes.get("qk_nope_head_dim", cfg.qk_nope_head_dim)
                           + changes.get("qk_rope_head_dim", cfg.qk_rope_head_dim))
    return dataclasses.replace(cfg, **changes)


class ByteTokenizer:
    """UTF-8 byte tokenizer for synthetic models (ids 0..255 are bytes; larger ids decode to a letter)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_ids: list[int] = []  # random weights: never stop early
        self.bos_token_id = None
        self.chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            out.append(int(i) if int(i) < 128 else 97 + int(i) % 26)
        return out.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.decode([i]) for i in ids]

    @property
    def byte_pieces(self) -> list[bytes]:
        """Each id's bytes (``decode`` joins them): incremental detokenization joins bytes too."""
        if getattr(self, "_pieces", None) is None:
            self._pieces = [bytes([i if i < 128 else 97 + i % 26]) for i in range(self.vocab_size)]
        return self._pieces

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + ("\nassistant:" if add_generation_prompt else "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))

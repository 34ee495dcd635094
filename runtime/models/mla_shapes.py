"""Synthetic MLA attention configs (DeepSeek-V2-Lite and DeepSeek-V3 shapes) with random weights.

For performance work and kernel checks without a checkpoint: the shapes follow the models' published
``config.json`` (attention part only); weights are random with Hugging Face parameter names, so the
runtime's MLA layer can load them exactly as it would a real checkpoint's attention block.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

__all__ = ["MLAShape", "MLA_SHAPES", "get_mla_shape", "make_mla_weights", "mla_layer_param_shapes"]


@dataclass(frozen=True)
class MLAShape:
    name: str
    hidden_size: int
    num_heads: int
    q_lora_rank: Optional[int]  # None: a direct q_proj (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_layers: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_style: str = "interleaved"  # DeepSeek checkpoints store q_pe / k_pe with interleaved pairs
    yarn_factor: Optional[float] = None
    yarn_mscale_all_dim: float = 0.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for n in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "num_layers", "vocab_size"):
            if int(getattr(self, n)) <= 0:
                raise ValueError(f"MLAShape.{n} must be positive, got {getattr(self, n)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError("q_lora_rank must be positive or None")
        if self.rope_style not in ("neox", "interleaved"):
            raise ValueError(f"rope_style must be neox or interleaved, got {self.rope_style!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Cache head dim: the latent plus the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim^-0.5``, times the YaRN ``mscale²`` when the model uses YaRN with mscale_all_dim."""
        s = self.qk_head_dim ** -0.5
        if self.yarn_factor and self.yarn_mscale_all_dim and self.yarn_factor > 1:
            m = 0.1 * self.yarn_mscale_all_dim * math.log(self.yarn_factor) + 1.0
            s *= m * m
        return s

    def with_layers(self, num_layers: int) -> "MLAShape":
        return replace(self, num_layers=num_layers)

    def to_dict(self) -> dict:
        return asdict(self)


MLA_SHAPES: dict[str, MLAShape] = {
    "deepseek-v2-lite": MLAShape(
        "deepseek-v2-lite", hidden_size=2048, num_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_layers=27, vocab_size=102400,
        yarn_factor=40.0, yarn_mscale_all_dim=0.707,
    ),
    "deepseek-v3": MLAShape(
        "deepseek-v3", hidden_size=7168, num_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_layers=61, vocab_size=129280,
        yarn_factor=40.0, yarn_mscale_all_dim=1.0,
    ),
}


def get_mla_shape(name: str) -> MLAShape:
    try:
        return MLA_SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown MLA shape {name!r}; known: {', '.join(MLA_SHAPES)}") from None


def mla_layer_param_shapes(shape: MLAShape) -> dict[str, tuple[int, ...]]:
    """Hugging Face names (under ``self_attn.``) and shapes of one layer's attention parameters."""
    h = shape.num_heads
    p: dict[str, tuple[int, ...]] = {}
    if shape.q_lora_rank is None:
        p["q_proj.weight"] = (h * shape.qk_head_dim, shape.hidden_size)
    else:
        p["q_a_proj.weight"] = (shape.q_lora_rank, shape.hidden_size)
        p["q_a_layernorm.weight"] = (shape.q_lora_rank,)
        p["q_b_proj.weight"] = (h * shape.qk_head_dim, shape.q_lora_rank)
    p["kv_a_proj_with_mqa.weight"] = (shape.kv_lora_rank + shape.qk_rope_head_dim, shape.hidden_size)
    p["kv_a_layernorm.weight"] = (shape.kv_lora_rank,)
    p["kv_b_proj.weight"] = (h * (shape.qk_nope_head_dim + shape.v_head_dim), shape.kv_lora_rank)
    p["o_proj.weight"] = (shape.hidden_size, h * shape.v_head_dim)
    return p


def make_mla_weights(shape: MLAShape | str, num_layers: Optional[int] = None, *, dtype=None, device="cpu",
                     seed: int = 0) -> dict:
    """Random attention weights of ``shape``: ``{"model.layers.{i}.self_attn.<name>": tensor}``.

    Linear weights are N(0, 1/fan_in) (unit-variance activations stay unit variance), norm weights 1.
    ``num_layers`` defaults to the shape's own (DeepSeek-V3's 61 layers are ~23 GB in bf16: ask for fewer).
    Deterministic for a given seed, independent of device.
    """
    import torch

    if isinstance(shape, str):
        shape = get_mla_shape(shape)
    n = shape.num_layers if num_layers is None else int(num_layers)
    if n <= 0:
        raise ValueError(f"num_layers must be positive, got {n}")
    dtype = dtype or torch.float32
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        for name, shp in mla_layer_param_shapes(shape).items():
            if name.endswith("layernorm.weight"):
                w = torch.ones(shp)
            else:
                w = torch.randn(shp, generator=gen) / math.sqrt(shp[1])
            out[f"model.layers.{i}.self_attn.{name}"] = w.to(dtype=dtype, device=device)
    return out

"""Local Hugging Face directory (config.json + *.safetensors, sharded or not) -> config and tensors.

Only safetensors are read (never pickle / ``.bin``), and no code from the directory is run.  Attention
scales stored in the checkpoint are returned separately, per layer, under the names vLLM and SGLang load:
``...self_attn[.attn].k_scale`` / ``v_scale`` / ``kv_scale`` (one scale for both), the modelopt style
``...self_attn.k_proj.k_scale`` / ``v_proj.v_scale``, the compressed-tensors / quark style
``...self_attn.{q,k,v}_proj.output_scale``, and the query scale ``...self_attn[.attn].q_scale`` (the dequant
multiplier of fp8 queries; ``quantize_query``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch

from kvbench.runtime.models.config import ModelConfig
from kvbench.runtime.models.hf_config import from_hf_config

__all__ = ["load_hf_dir", "CheckpointScales"]

_SCALE_RE = re.compile(
    r"model\.layers\.(\d+)\.self_attn\."
    r"(?:(?:attn\.|mla_attn\.)?(?P<plain>q_scale|k_scale|v_scale|kv_scale)|k_proj\.(?P<mo_k>k_scale)|v_proj\.(?P<mo_v>v_scale)"
    r"|(?P<ct>[qkv])_proj\.output_scale)$"
)


def scale_kind(name: str) -> Optional[tuple[int, str]]:
    """``(layer, kind)`` of a checkpoint attention-scale tensor name (kind in q_scale, k_scale, v_scale,
    kv_scale), or None for any other tensor."""
    m = _SCALE_RE.fullmatch(name)
    if m is None:
        return None
    kind = m.group("plain") or m.group("mo_k") or m.group("mo_v") or f"{m.group('ct')}_scale"
    return int(m.group(1)), kind


class CheckpointScales:
    """Per-layer K/V (and query) dequant scales found in a checkpoint (``None`` where absent)."""

    def __init__(self, num_layers: int):
        self.k: list[Optional[torch.Tensor]] = [None] * num_layers
        self.v: list[Optional[torch.Tensor]] = [None] * num_layers
        self.q: list[Optional[torch.Tensor]] = [None] * num_layers

    @property
    def complete(self) -> bool:
        return all(x is not None for x in self.k) and all(x is not None for x in self.v)

    @property
    def any(self) -> bool:
        return any(x is not None for x in self.k + self.v)


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor], CheckpointScales]:
    from safetensors import safe_open

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json (expected a Hugging Face model directory)")
    cfg = from_hf_config(json.loads(cfg_file.read_text()))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        bins = list(path.glob("*.bin")) + list(path.glob("*.pt"))
        hint = " (pickle checkpoints are not loaded; convert them to safetensors)" if bins else ""
        raise FileNotFoundError(f"no *.safetensors in {path}{hint}")
    state: dict[str, torch.Tensor] = {}
    scales = CheckpointScales(cfg.num_layers)
    for fn in files:
        with safe_open(str(path / fn), framework="pt", device="cpu") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                hit = scale_kind(name)
                if hit is not None:
                    layer, kind = hit
                    t = t.float().reshape(-1)
                    if layer >= cfg.num_layers:
                        continue
                    if kind in ("k_scale", "kv_scale"):
                        scales.k[layer] = t
                    if kind in ("v_scale", "kv_scale"):
                        scales.v[layer] = t
                    if kind == "q_scale":
                        scales.q[layer] = t
                    continue
                state[name] = t.to(dtype) if t.is_floating_point() else t
    if "lm_head.weight" not in state and not cfg.tie_word_embeddings:
        cfg.tie_word_embeddings = True
    return cfg, state, scales

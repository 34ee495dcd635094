"""Local Hugging Face directory (config.json + *.safetensors, sharded or not) -> config and tensors.

Only safetensors are read (never pickle / ``.bin``), and no code from the directory is run.  KV scales
stored in the checkpoint (``...self_attn.k_scale`` / ``v_scale``, or ``...k_proj.output_scale`` style
``kv_scale``) are returned separately, per layer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch

from kvbench.runtime.models.config import ModelConfig, from_hf_config

__all__ = ["load_hf_dir", "CheckpointScales"]

_SCALE_RE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|v_scale|kv_scale)$")


class CheckpointScales:
    """Per-layer K/V dequant scales found in a checkpoint (``None`` where absent)."""

    def __init__(self, num_layers: int):
        self.k: list[Optional[torch.Tensor]] = [None] * num_layers
        self.v: list[Optional[torch.Tensor]] = [None] * num_layers

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
                m = _SCALE_RE.fullmatch(name)
                if m:
                    layer, kind = int(m.group(1)), m.group(2)
                    t = t.float().reshape(-1)
                    if kind in ("k_scale", "kv_scale"):
                        scales.k[layer] = t
                    if kind in ("v_scale", "kv_scale"):
                        scales.v[layer] = t
                    continue
                state[name] = t.to(dtype) if t.is_floating_point() else t
    if "lm_head.weight" not in state and not cfg.tie_word_embeddings:
        cfg.tie_word_embeddings = True
    return cfg, state, scales

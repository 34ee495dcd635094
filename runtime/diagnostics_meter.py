"""The engine side of a KV-format diagnosis (``kvbench diagnose``, ``harness/diagnose.py``): one model loaded
once and shared by every engine of a diagnosis, the KL of engine configurations against a bf16 reference on
fixed texts, the layer maps they run with, and the capacity of those maps.

* ``load_for(cfg)``: the model of a configuration, loaded once for every engine;
* ``KLMeter``: token-pooled KL(reference ‖ candidate) of the configuration with extra layers in bf16, each
  run on a fresh engine (``Engine(cfg, loaded=..., scales=...)``) that scores the texts with full rows;
  ``new_probe()`` / ``measure(probe=...)`` wrap the candidate's attention backend in a ``DiagnosticProbe``
  (``runtime/diagnostics_probe.py``);
* ``capacity_rows`` / ``capacity_basis``: bytes per token, tokens and concurrency of per-layer maps in a KV
  budget (the settings', else the engine's own).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch

from kvbench.core import SKIP_FORMAT, canonical_skip_layers, format_layer_list, mixed_bytes_per_token, parse_layer_set, resolve_layer_dtypes
from kvbench.runtime.config import EngineConfig, context_length

__all__ = ["REF_CACHE_BYTES", "TextIds", "KLMeter", "load_for", "run_config", "capacity_rows", "capacity_basis"]

REF_CACHE_BYTES = 2 * 2**30  # reference log-prob rows kept in memory up to this size (else recomputed)

TextIds = tuple[list[int], list[int]]  # (context ids, continuation ids)


def load_for(cfg: EngineConfig):
    """The model of ``cfg`` on its device and compute dtype, loaded once for every engine of a diagnosis."""
    from kvbench.runtime.models.engine_setup import engine_device, engine_dtype
    from kvbench.runtime.models.loader import load_model

    device = engine_device(cfg)
    return load_model(cfg.model, device=device, dtype=engine_dtype(cfg, device), seed=cfg.seed)


def run_config(cfg: EngineConfig, longest: int, loaded) -> EngineConfig:
    """The engine settings of one diagnosis run: eager, one text at a time, a cache just big enough."""
    from kvbench.runtime.kv_cache import bytes_per_token

    spec = loaded.config.kv_spec("bf16", cfg.page_size, cfg.kv_layout)
    need = (longest + 4 * cfg.page_size) * bytes_per_token(spec) * 1.25
    return replace(cfg, enforce_eager=True, max_running=1, kv_budget_gb=max(need, 2**20) / 2**30,
                   max_model_len=min(longest + cfg.page_size, loaded.config.max_position_embeddings))


class KLMeter:
    """Token-pooled KL(reference ‖ engine) of engine configurations over fixed texts (one shared model)."""

    def __init__(self, loaded, cfg: EngineConfig, texts: Sequence[TextIds], scales=None,
                 progress: Optional[Callable[[str], None]] = None):
        from kvbench.runtime.engine import Engine

        self.loaded, self.texts = loaded, list(texts)
        longest = max(len(c) + len(x) for c, x in self.texts)
        self.base = run_config(cfg, longest, loaded)
        self.progress = progress or (lambda s: None)
        self.runs = 0
        self.seconds = 0.0
        ref_cfg = replace(self.base, kv_dtype="bf16", kv_scales="unit", kv_scales_per_head=False,
                          kv_dtype_skip_layers=None, kv_layer_dtypes=None, quantize_query="none")
        self._ref_engine = Engine(ref_cfg, loaded=loaded)
        vocab = loaded.config.vocab_size
        self._keep = sum(len(x) for _, x in self.texts) * vocab * 4 <= REF_CACHE_BYTES
        self._refs: dict[int, torch.Tensor] = {}
        self.scales = scales
        if self.scales is None:  # the candidate's policy (calibrate / checkpoint / unit), computed once with the
            # configuration's own context length (calibration prompts are cut to it) and a token-sized cache
            e = Engine(replace(cfg, enforce_eager=True, max_running=1, kv_budget_gb=self.base.kv_budget_gb), loaded=loaded)
            self.scales = e.scales
            e.shutdown()

    def close(self) -> None:
        self._ref_engine.shutdown()

    def reference(self, i: int) -> torch.Tensor:
        hit = self._refs.get(i)
        if hit is not None:
            return hit
        ctx, cont = self.texts[i]
        lp = self._ref_engine.score(ctx, cont, full_distribution=True).full_logprobs.float().cpu()
        if self._keep:
            self._refs[i] = lp
        return lp

    def new_probe(self):
        """A ``DiagnosticProbe`` sized for the model, to pass to ``measure``."""
        from kvbench.runtime.diagnostics_probe import DiagnosticProbe

        m = self.loaded.config
        return DiagnosticProbe(m.num_layers, m.num_kv_heads, m.kv_head_dim)

    def layer_formats(self, extra_bf16: Sequence[int] = ()) -> list[str]:
        """Every layer's format: the configuration's map with the layers ``extra_bf16`` in bf16 too."""
        m = self.loaded.config
        fmts = resolve_layer_dtypes(self.base.kv_dtype, m.num_layers, self.base.kv_dtype_skip_layers,
                                    self.base.kv_layer_dtypes, m.sliding_windows)
        for i in extra_bf16:
            fmts[i] = SKIP_FORMAT
        return fmts

    def bytes_per_token(self, fmts: Sequence[str]) -> float:
        """KV bytes per token of the per-layer formats ``fmts`` on this model."""
        m = self.loaded.config
        return mixed_bytes_per_token(fmts, m.num_kv_heads, m.kv_head_dim, 1 if m.is_mla else 2)

    def map_options(self, extra_bf16: Sequence[int] = ()) -> dict:
        """``kv_dtype_skip_layers`` / ``kv_layer_dtypes`` of the configuration with ``extra_bf16`` in bf16 as
        well: the skip set grows (in the configuration's own spelling) unless some of those layers have a format
        of their own in ``kv_layer_dtypes``, where the map is spelled out per layer."""
        base = self.base
        if not base.kv_layer_dtypes:
            return {"kv_dtype_skip_layers": _union(base.kv_dtype_skip_layers, extra_bf16), "kv_layer_dtypes": None}
        fmts = self.layer_formats(extra_bf16)
        main = base.kv_dtype
        skip = [i for i, f in enumerate(fmts) if f == SKIP_FORMAT and main != SKIP_FORMAT]
        groups: dict[str, list[int]] = {}
        for i, f in enumerate(fmts):
            if f not in (main, SKIP_FORMAT):
                groups.setdefault(f, []).append(i)
        per_layer = ";".join(f"{format_layer_list(ix)}:{f}" for f, ix in groups.items())
        return {"kv_dtype_skip_layers": format_layer_list(skip) or None, "kv_layer_dtypes": per_layer or None}

    def measure(self, extra_bf16: Sequence[int] = (), probe=None, what: str = "") -> dict:
        """``{"kl", "top1_agree", "tokens"}`` of the candidate with the layers ``extra_bf16`` in bf16 (on top of
        the configuration's own map); ``probe``: a ``DiagnosticProbe`` wrapped around the engine's backend."""
        from kvbench.runtime.engine import Engine

        t0 = time.perf_counter()
        cfg = replace(self.base, **self.map_options(extra_bf16))
        engine = Engine(cfg, loaded=self.loaded, scales=self.scales)
        try:
            if probe is not None:
                engine.runner.backend = probe.wrap(engine.runner.backend)
            kl_sum, agree, n = 0.0, 0, 0
            for i, (ctx, cont) in enumerate(self.texts):
                if probe is not None:
                    probe.begin_text()
                cand = engine.score(ctx, cont, full_distribution=True).full_logprobs.float().cpu()
                ref = self.reference(i)
                kl = (ref.exp() * (ref - cand)).sum(-1).double()
                kl_sum += float(kl.clamp_min(0).sum())
                agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())
                n += int(kl.numel())
        finally:
            engine.shutdown()
        self.runs += 1
        dt = time.perf_counter() - t0
        self.seconds += dt
        out = {"kl": kl_sum / max(n, 1), "top1_agree": agree / max(n, 1), "tokens": n}
        self.progress(f"{what or 'candidate'}: KL {out['kl']:.3g} ({dt:.1f} s)")
        return out


def _union(base_skip: Optional[str], layers: Sequence[int]) -> Optional[str]:
    idx, pats = parse_layer_set(base_skip)
    return canonical_skip_layers([format_layer_list(set(idx) | set(layers), pats)])


def capacity_rows(loaded, cfg: EngineConfig, maps: Sequence[tuple[str, list[str]]], budget_bytes: float, context_len: int) -> list[dict]:
    """Bytes per token, tokens and max concurrency of each ``(name, per-layer formats)`` in the budget."""
    from kvbench.runtime.kv_cache import plan_capacity

    m = loaded.config
    rows = []
    for name, fmts in maps:
        main = cfg.kv_dtype if cfg.kv_dtype in fmts else fmts[0]
        spec = replace(m.kv_spec(main, cfg.page_size, cfg.kv_layout), layer_dtypes=tuple(fmts))
        p = plan_capacity(spec, budget_bytes, context_len)
        rows.append({"name": name, "bytes_per_token": p.bytes_per_token, "tokens": p.tokens, "max_concurrency": p.max_concurrency})
    return rows


def capacity_basis(cfg: EngineConfig, loaded, budget_bytes: Optional[float] = None,
                   context_len: Optional[int] = None) -> tuple[float, int]:
    """(KV budget in bytes, context per sequence) of capacity rows: ``budget_bytes`` / ``context_len`` when
    given, else the engine's own (``cfg``'s budget on its device, its context length)."""
    from kvbench.runtime.models.engine_setup import engine_device, kv_budget_bytes

    m = loaded.config
    ctx = context_len or context_length(cfg.max_model_len, m.max_position_embeddings)  # refuses, never cuts
    budget = budget_bytes
    if budget is None:
        budget = kv_budget_bytes(cfg, engine_device(cfg), loaded)
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"KV budget must be positive, got {budget}")
    return float(budget), int(ctx)

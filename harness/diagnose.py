"""Where a KV format's error comes from: per-layer / per-head statistics, the per-layer KL contribution,
and a checked suggestion of layers to keep in bf16 (``kvbench diagnose``; the schema is ``DIAG_SCHEMA``).

One model is loaded once and shared by every engine of a diagnosis (``Engine(cfg, loaded=..., scales=...)``):

1. the **reference**: the same engine with a bf16 cache (unit scales, no per-layer map, queries unrounded);
2. the **candidate** as configured, with a ``DiagnosticProbe`` around its attention backend: per layer and kv
   head, for K and V, the quantization error of the stored values, the fraction saturated and flushed to
   zero, the scale in use against the observed amax, and the attention output's error against a
   full-precision reference on the same inputs (``runtime/diagnostics_probe.py``);
3. **leave-one-out**: the candidate with one quantized layer at a time switched to bf16 (same scales); the
   layer's KL contribution is ``KL(candidate) − KL(candidate, that layer in bf16)``;
4. the **suggestion** (with a KL limit): layers ranked by contribution, the shortest prefix of the ranking
   whose measured KL is at or below the limit, found by doubling then bisection over the prefix length
   (every step measured; the smallest such prefix when KL falls as layers are added, which the steps show).

KL is the token-pooled mean of KL(reference ‖ candidate) over every continuation token of every text, with
teacher forcing in the engine's scoring mode (continuation tokens read their own K/V as stored): the
fidelity suite's ``kl_mean`` on the same texts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch

from kvbench.core.formats import get_spec
from kvbench.core.layer_formats import (SKIP_FORMAT, canonical_skip_layers, format_layer_list, layer_dtypes_summary,
                                        mixed_bytes_per_token, parse_layer_set, resolve_layer_dtypes)
from kvbench.runtime.config import EngineConfig

__all__ = ["DIAG_SCHEMA", "DiagnoseSettings", "KLMeter", "run_diagnosis", "texts_to_ids", "check_diagnosable", "load_for", "diagnosis_texts", "capacity_rows"]

DIAG_SCHEMA = "kvbench:diagnostics:v1"
REF_CACHE_BYTES = 2 * 2**30  # reference log-prob rows kept in memory up to this size (else recomputed)

TextIds = tuple[list[int], list[int]]  # (context ids, continuation ids)


@dataclass
class DiagnoseSettings:
    kl_limit: Optional[float] = None  # suggest layers to keep in bf16 until KL <= this
    leave_one_out: bool = True
    probe: bool = True
    budget_bytes: Optional[float] = None  # capacity rows: KV budget (None: the engine's own budget)
    context_len: Optional[int] = None  # capacity rows: context per sequence (None: the engine's max length)
    label: str = ""  # the texts' name


def check_diagnosable(cfg: EngineConfig) -> None:
    """A ``ValueError`` for a configuration with nothing to diagnose (every layer unquantized)."""
    if not get_spec(cfg.kv_dtype).quantized and not cfg.kv_layer_dtypes:
        raise ValueError(f"--kv-dtype {cfg.kv_dtype} is not quantized: nothing to diagnose (give fp8_e4m3, fp8_e5m2, nvfp4, ...)")


def load_for(cfg: EngineConfig):
    """The model of ``cfg`` on its device and compute dtype, loaded once for every engine of a diagnosis."""
    from kvbench.runtime.models.engine_setup import engine_device, engine_dtype
    from kvbench.runtime.models.loader import load_model

    device = engine_device(cfg)
    return load_model(cfg.model, device=device, dtype=engine_dtype(cfg, device), seed=cfg.seed)


def texts_to_ids(tokenizer, texts) -> list[TextIds]:
    """``(context, continuation)`` ids of fidelity ``Text``s, tokenized as the embedded client scores them."""
    out = []
    for t in texts:
        ctx = list(tokenizer.encode(t.context, add_special_tokens=True))
        cont = list(tokenizer.encode(t.continuation, add_special_tokens=False))
        if not ctx:
            bos = getattr(tokenizer, "bos_token_id", None)
            if bos is None:
                raise ValueError(f"text {t.item_id}: empty context and the tokenizer has no BOS token")
            ctx = [bos]
        if cont:
            out.append((ctx, cont))
    if not out:
        raise ValueError("no text with a non-empty continuation to diagnose")
    return out


def diagnosis_texts(tokenizer, client, limit: int, data_dir: Optional[str], text_tokens: Optional[int] = None,
                    haystack_file: Optional[str] = None, max_model_len: Optional[int] = None) -> tuple[list[TextIds], str]:
    """The fidelity suite's texts as ``(context, continuation)`` ids and their label: the first ``limit`` GSM8K
    test solutions, or long texts of ``text_tokens`` tokens (GSM8K solutions concatenated, or ``haystack_file``);
    ``client`` counts tokens for long texts (anything ``suites.fidelity_texts.token_counter`` takes)."""
    from kvbench.suites.base import SuiteOptions
    from kvbench.suites.fidelity import gsm8k_texts
    from kvbench.suites.fidelity_texts import build_long_texts, long_text_spec, token_counter

    extra = {k: v for k, v in (("text_tokens", text_tokens), ("haystack_file", haystack_file)) if v}
    opts = SuiteOptions(limit=limit, data_dir=data_dir, progress=False, extra=extra)
    spec = long_text_spec(opts)
    if spec is None:
        return texts_to_ids(tokenizer, gsm8k_texts(opts)), "gsm8k-solutions"
    texts, label = build_long_texts(opts, spec, token_counter(client), max_model_len)
    return texts_to_ids(tokenizer, texts), f"texts={label}"


def _run_config(cfg: EngineConfig, longest: int, loaded) -> EngineConfig:
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
        self.base = _run_config(cfg, longest, loaded)
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

    def layer_formats(self, extra_bf16: Sequence[int] = ()) -> list[str]:
        """Every layer's format: the configuration's map with the layers ``extra_bf16`` in bf16 too."""
        m = self.loaded.config
        fmts = resolve_layer_dtypes(self.base.kv_dtype, m.num_layers, self.base.kv_dtype_skip_layers,
                                    self.base.kv_layer_dtypes, m.sliding_windows)
        for i in extra_bf16:
            fmts[i] = SKIP_FORMAT
        return fmts

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


def _suggest(meter: KLMeter, ranking: list[int], kl_full: float, limit: float) -> dict:
    """The shortest prefix of ``ranking`` (layers to keep in bf16) whose measured KL <= ``limit``."""
    steps: dict[int, dict] = {0: {"kl": kl_full}}

    def at(k: int) -> float:
        if k not in steps:
            skip = meter.map_options(ranking[:k])["kv_dtype_skip_layers"]
            steps[k] = meter.measure(ranking[:k], what=f"bf16 on {k} layer{'s' if k != 1 else ''} ({skip})")
        return steps[k]["kl"]

    n = len(ranking)
    best: Optional[int] = 0 if kl_full <= limit else None
    if best is None and n:
        lo, k = 0, 1
        while k < n and at(k) > limit:  # doubling: the first power of two that meets the limit
            lo, k = k, min(2 * k, n)
        if at(k) <= limit:
            hi = k
            while hi - lo > 1:  # bisection: lo fails, hi meets the limit (both measured)
                mid = (lo + hi) // 2
                if at(mid) <= limit:
                    hi = mid
                else:
                    lo = mid
            best = hi
    k = best if best is not None else n
    rows = []
    for j in sorted(steps):
        opts = meter.map_options(ranking[:j])
        row = {"skip_layers": opts["kv_dtype_skip_layers"], "n_skipped": j, "kl": steps[j]["kl"],
               "bytes_per_token": _bpt(meter, meter.layer_formats(ranking[:j]))}
        if opts["kv_layer_dtypes"]:  # the per-layer map only where the configuration has one
            row["kv_layer_dtypes"] = opts["kv_layer_dtypes"]
        rows.append(row)
    chosen = meter.map_options(ranking[:k])
    out = {"limit": limit, "skip_layers": chosen["kv_dtype_skip_layers"], "kl": at(k), "met": best is not None,
           "ranking": ranking, "steps": rows, "layer_dtypes": meter.layer_formats(ranking[:k])}
    if meter.base.kv_layer_dtypes:  # the per-layer map the suggestion leaves (None: every such layer now in bf16)
        out["kv_layer_dtypes"] = chosen["kv_layer_dtypes"]
    return out


def _bpt(meter: KLMeter, fmts: list[str]) -> float:
    m = meter.loaded.config
    return mixed_bytes_per_token(fmts, m.num_kv_heads, m.kv_head_dim, 1 if m.is_mla else 2)


def run_diagnosis(cfg: EngineConfig, texts: Sequence[TextIds], settings: Optional[DiagnoseSettings] = None, loaded=None,
                  progress: Optional[Callable[[str], None]] = None, scales=None) -> dict:
    """The diagnosis of ``cfg``'s KV format on ``texts`` (``DIAG_SCHEMA``; docs/accuracy.md).  ``loaded``: the
    model, already loaded (else ``cfg.model`` loads); ``scales``: the KV scales of an engine already running
    this configuration (else computed by its policy)."""
    settings = settings or DiagnoseSettings()
    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    if loaded is None:
        loaded = load_for(cfg)
    m = loaded.config
    if m.is_mla:
        raise ValueError("kvbench diagnose does not run MLA models yet (per-layer formats need separate K and V planes)")
    meter = KLMeter(loaded, cfg, texts, scales=scales, progress=say)
    try:
        fmts = meter.layer_formats()
        probe = None
        if settings.probe:
            from kvbench.runtime.diagnostics_probe import DiagnosticProbe

            probe = DiagnosticProbe(m.num_layers, m.num_kv_heads, m.kv_head_dim)
        full = meter.measure(probe=probe, what=f"candidate {cfg.kv_dtype}")
        layers = probe.result() if probe is not None else [
            {"layer": i, "format": f, "sliding_window": m.sliding_windows[i]} for i, f in enumerate(fmts)]
        quantized = [i for i, f in enumerate(fmts) if get_spec(f).quantized]
        for d in layers:
            d["kl_loo"] = d["kl_contribution"] = None
        if settings.leave_one_out:
            for j, i in enumerate(quantized):
                r = meter.measure([i], what=f"layer {i} in bf16 ({j + 1}/{len(quantized)})")
                layers[i]["kl_loo"] = r["kl"]
                layers[i]["kl_contribution"] = full["kl"] - r["kl"]
        suggestion = None
        if settings.kl_limit is not None:
            if not settings.leave_one_out:
                raise ValueError("a suggestion ranks layers by their leave-one-out KL contribution; do not turn it off")
            ranking = sorted(quantized, key=lambda i: -layers[i]["kl_contribution"])
            suggestion = _suggest(meter, ranking, full["kl"], settings.kl_limit)
            budget, ctx = _capacity_basis(cfg, loaded, settings)
            maps = [("bf16", [SKIP_FORMAT] * m.num_layers), (_map_name(cfg.kv_dtype, cfg.kv_dtype_skip_layers, fmts), fmts)]
            chosen = suggestion.pop("layer_dtypes")
            if chosen != fmts:
                maps.append((_map_name(cfg.kv_dtype, suggestion["skip_layers"], chosen), chosen))
            suggestion["capacity"] = {"context_len": ctx, "budget_bytes": budget, "rows": capacity_rows(loaded, cfg, maps, budget, ctx)}
    finally:
        meter.close()
    return {
        "schema": DIAG_SCHEMA, "model": loaded.model_id, "kv_dtype": cfg.kv_dtype, "kv_scales": cfg.kv_scales,
        "kv_dtype_skip_layers": cfg.kv_dtype_skip_layers, "kv_layer_dtypes": cfg.kv_layer_dtypes, "layer_dtypes": fmts,
        "num_layers": m.num_layers, "num_kv_heads": m.num_kv_heads, "head_dim": m.kv_head_dim,
        "backend": cfg.backend_label, "quantize_query": cfg.quantize_query,
        "texts": {"n": len(texts), "tokens": full["tokens"], "label": settings.label},
        "scales": meter.scales.summary() if meter.scales is not None else None,
        "layers": layers,
        "kl": {"full": full["kl"], "top1_agree": full["top1_agree"], "tokens": full["tokens"],
               "method": "leave-one-out" if settings.leave_one_out else None},
        "suggestion": suggestion, "confirm": None,
        "runs": meter.runs + 1, "seconds": round(time.perf_counter() - t0, 1),
    }


def _map_name(kv_dtype: str, skip: Optional[str], fmts: Sequence[str]) -> str:
    """``nvfp4 skip 1,2`` when the layers that differ are all bf16, else the per-layer summary."""
    if {f for f in fmts if f != kv_dtype} <= {SKIP_FORMAT}:
        return f"{kv_dtype} skip {skip}" if skip else kv_dtype
    return layer_dtypes_summary(fmts, kv_dtype)


def _capacity_basis(cfg: EngineConfig, loaded, settings: DiagnoseSettings) -> tuple[float, int]:
    """(KV budget in bytes, context per sequence) of the capacity rows: the settings', else the engine's."""
    from kvbench.runtime.config import context_length
    from kvbench.runtime.models.engine_setup import engine_device, kv_budget_bytes

    m = loaded.config
    ctx = settings.context_len or context_length(cfg.max_model_len, m.max_position_embeddings)  # refuses, never cuts
    budget = settings.budget_bytes
    if budget is None:
        budget = kv_budget_bytes(cfg, engine_device(cfg), loaded)
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"KV budget must be positive, got {budget}")
    return float(budget), int(ctx)

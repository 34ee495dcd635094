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

This module is the harness half (texts, settings, the suggestion's search, the diagnosis record); the engine
half (loading the model once, the KL runs, the probe, capacity of layer maps) is ``runtime/diagnostics_meter.py``,
whose public names (``KLMeter``, ``load_for``, ``capacity_rows``) are re-exported here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from kvbench.core import get_spec
from kvbench.core import SKIP_FORMAT, layer_dtypes_summary
from kvbench.runtime import EngineConfig
# the engine side (loading the model once, KL runs, probes, capacity of layer maps) is the runtime's
from kvbench.runtime import REF_CACHE_BYTES, KLMeter, TextIds, capacity_basis, capacity_rows, load_for

__all__ = ["DIAG_SCHEMA", "DiagnoseSettings", "KLMeter", "run_diagnosis", "texts_to_ids", "check_diagnosable", "load_for",
           "diagnosis_texts", "capacity_rows", "REF_CACHE_BYTES", "TextIds"]

DIAG_SCHEMA = "kvbench:diagnostics:v1"


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
    from kvbench.suites import SuiteOptions
    from kvbench.suites import gsm8k_texts
    from kvbench.suites import build_long_texts, long_text_spec, token_counter

    extra = {k: v for k, v in (("text_tokens", text_tokens), ("haystack_file", haystack_file)) if v}
    opts = SuiteOptions(limit=limit, data_dir=data_dir, progress=False, extra=extra)
    spec = long_text_spec(opts)
    if spec is None:
        return texts_to_ids(tokenizer, gsm8k_texts(opts)), "gsm8k-solutions"
    texts, label = build_long_texts(opts, spec, token_counter(client), max_model_len)
    return texts_to_ids(tokenizer, texts), f"texts={label}"


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
               "bytes_per_token": meter.bytes_per_token(meter.layer_formats(ranking[:j]))}
        if opts["kv_layer_dtypes"]:  # the per-layer map only where the configuration has one
            row["kv_layer_dtypes"] = opts["kv_layer_dtypes"]
        rows.append(row)
    chosen = meter.map_options(ranking[:k])
    out = {"limit": limit, "skip_layers": chosen["kv_dtype_skip_layers"], "kl": at(k), "met": best is not None,
           "ranking": ranking, "steps": rows, "layer_dtypes": meter.layer_formats(ranking[:k])}
    if meter.base.kv_layer_dtypes:  # the per-layer map the suggestion leaves (None: every such layer now in bf16)
        out["kv_layer_dtypes"] = chosen["kv_layer_dtypes"]
    return out


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
        probe = meter.new_probe() if settings.probe else None
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
            budget, ctx = capacity_basis(cfg, loaded, settings.budget_bytes, settings.context_len)
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

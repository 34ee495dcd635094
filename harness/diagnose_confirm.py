"""The sweep that confirms a diagnosis' suggestion: bf16, the candidate as diagnosed, and the candidate with
the suggested layers in bf16, on the fidelity and long-context (ruler) suites, in one embedded target.

``confirm_config(cfg, diag, ...)`` returns the sweep config (a dict, written as YAML next to the
diagnosis); ``kvbench sweep confirm.yaml --out DIR`` runs it, and its report puts the three side by side.
"""

from __future__ import annotations

from typing import Optional

from kvbench.runtime import EngineConfig

__all__ = ["confirm_config", "DEFAULT_RULER"]

# the default sweep's long-context suite (configs/default.yaml): needles at 1k and 2k tokens, three depths
DEFAULT_RULER = {"name": "ruler", "limit": 1, "max_tokens": 32,
                 "params": {"context_lengths": [1024, 2048], "depths": 3,
                            "tasks": ["niah_single", "niah_multikey", "niah_multivalue"]}}


def _kv_entry(cfg: EngineConfig, skip: Optional[str], layer_dtypes: Optional[str]) -> dict:
    """The sweep KV entry of ``cfg``'s KV configuration with the given per-layer formats."""
    kv = cfg.kv.with_options(kv_dtype_skip_layers=skip, kv_layer_dtypes=layer_dtypes)
    return {"dtype": kv.dtype, "scales": kv.scales, **dict(kv.options)}


def confirm_config(cfg: EngineConfig, diag: dict, fidelity_texts: int, ruler: Optional[dict] = None,
                   fidelity_params: Optional[dict] = None, data_dir: Optional[str] = None) -> dict:
    """A sweep config: kv entries bf16, the diagnosed candidate, and the candidate with the suggested skip set."""
    sug = diag.get("suggestion") or {}
    if not sug:
        raise ValueError("the diagnosis has no suggestion to confirm (give a KL limit)")
    engine = {k: v for k, v in (("device", cfg.device), ("dtype", cfg.dtype), ("kv_budget_gb", cfg.kv_budget_gb),
                                ("max_model_len", cfg.max_model_len), ("page_size", cfg.page_size),
                                ("kv_layout", cfg.kv_layout), ("calibration_prompts", cfg.calibration_prompts),
                                ("seed", cfg.seed)) if v is not None}
    kv = [{"dtype": "bf16"}, _kv_entry(cfg, cfg.kv_dtype_skip_layers, cfg.kv_layer_dtypes)]
    sug_layers = sug["kv_layer_dtypes"] if "kv_layer_dtypes" in sug else cfg.kv_layer_dtypes
    if (sug.get("skip_layers"), sug_layers) != (cfg.kv_dtype_skip_layers, cfg.kv_layer_dtypes):
        kv.append(_kv_entry(cfg, sug["skip_layers"], sug_layers))
    backend = cfg.prefill_backend if cfg.prefill_backend == cfg.decode_backend else f"{cfg.prefill_backend}+{cfg.decode_backend}"
    # the diagnosis' texts; exact full-vocabulary KL on short texts, so the sweep's fidelity KL is the diagnosis' own
    # measure (long texts keep the top-k + tail estimate: full rows of 8k tokens are gigabytes)
    fp = dict(fidelity_params or {})
    fid = {"name": "fidelity", "limit": int(fidelity_texts),
           "params": {"top_k": 20, **({} if fp.get("text_tokens") else {"exact": True}), **fp}}
    out = {
        "name": "confirm-skip-layers",
        "description": (f"confirms kvbench diagnose's suggestion for {diag['model']} {cfg.kv_dtype}: keep layers "
                        f"{sug['skip_layers'] or '(none)'} in bf16 (diagnosed KL {diag['kl']['full']:.4g} -> "
                        f"{sug['kl']:.4g}, limit {sug['limit']:g})"),
        "model": cfg.model or "default",
        "engine": engine,
        "targets": [{"name": "embedded", "type": "embedded"}],
        "axes": {"backends": [backend], "kv": kv, "concurrency": [1]},
        "accuracy_concurrency": 4,
        "suites": [dict(ruler or DEFAULT_RULER), fid],
        "load": {"num_prompts": 2, "prompts_per_concurrency": 1, "input_len": 64, "output_len": 8,
                 "request_rate": "inf", "warmup": 0},
        "baseline": {"kv_dtype": "bf16"},
    }
    if data_dir:
        out["data_dir"] = str(data_dir)
    return out

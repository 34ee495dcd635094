"""Engine flags shared by ``serve``, ``eval`` and ``bench`` (DESIGN §11).

``@engine_options`` adds the flags to a typer command's signature and hands the command one
``engine: EngineConfig`` argument instead, so every command spells the flags the same way.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Callable, Optional

import typer

from kvbench.core.backends import PHASES, assert_supported, backend_names
from kvbench.core.formats import KV_SCALE_POLICIES, format_names
from kvbench.runtime.config import ConfigError, EngineConfig

_PANEL = "Engine"


def _opt(default, *names, help: str, **kw):
    return typer.Option(default, *names, help=help, rich_help_panel=_PANEL, **kw)


# name -> (annotation, typer.Option)
ENGINE_PARAMS: dict[str, tuple[object, object]] = {
    "model": (Optional[str], _opt(None, "--model", help="HF directory, GGUF file, preset or synthetic:<shape>; default: SmolLM2-135M-Instruct")),
    "kv_dtype": (str, _opt("bf16", "--kv-dtype", help=f"KV format: {', '.join(format_names())}")),
    "kv_scales": (str, _opt("unit", "--kv-scales", help=f"KV scale source: {', '.join(KV_SCALE_POLICIES)}")),
    "kv_scales_per_head": (bool, _opt(False, "--kv-scales-per-head", help="Calibrate one scale per kv-head instead of per layer")),
    "backend": (Optional[str], _opt(None, "--backend", help=f"Attention backend for both phases: {', '.join(backend_names())}")),
    "prefill_backend": (Optional[str], _opt(None, "--prefill-backend", help="Prefill attention backend (overrides --backend)")),
    "decode_backend": (Optional[str], _opt(None, "--decode-backend", help="Decode attention backend (overrides --backend)")),
    "fused_append": (bool, _opt(True, "--fused-append/--no-fused-append", help="Fused RoPE+quantize+append kernel")),
    "quantize_query": (str, _opt("none", "--quantize-query", metavar="none|prefill|decode|both",
                                 help="fp8 (e4m3) queries in attention, per phase: none, prefill (every prefill/extend chunk), "
                                      "decode (decode steps and scored continuations) or both (reproduces fp8-Q accuracy loss); "
                                      "the query scale comes from the checkpoint when it has one, else 1.0")),
    "page_size": (int, _opt(16, "--page-size", help="Tokens per KV page")),
    "kv_layout": (str, _opt("HND", "--kv-layout", help="KV page layout: HND (head-major pages) or NHD (token-major)")),
    "kv_budget_gb": (Optional[float], _opt(None, "--kv-budget-gb", help="KV cache budget in GiB (default: --mem-fraction of free memory)")),
    "mem_fraction": (float, _opt(0.85, "--mem-fraction", help="Fraction of free device memory for the KV cache")),
    "max_running": (int, _opt(64, "--max-running", help="Maximum concurrently running requests")),
    "max_num_batched_tokens": (int, _opt(2048, "--max-batched-tokens", help="Chunked-prefill token budget per step")),
    "max_model_len": (Optional[int], _opt(None, "--max-model-len", help="Context length limit (default: the model's)")),
    "device": (Optional[str], _opt(None, "--device", help="cpu or cuda[:N] (default: cuda when available)")),
    "dtype": (Optional[str], _opt(None, "--dtype", help="Compute dtype: float32 (CPU default), bfloat16 (GPU default), float16")),
    "enforce_eager": (bool, _opt(False, "--enforce-eager", help="Disable CUDA graphs")),
    "seed": (int, _opt(0, "--seed", help="Engine seed (weights of synthetic models, sampling defaults)")),
    "served_model_name": (Optional[str], _opt(None, "--served-model-name", help="Model id served at /v1/models (default: derived from --model)")),
}


def build_engine_config(values: dict) -> EngineConfig:
    v = dict(values)
    given = {p: bool(v.get(f"{p}_backend")) for p in PHASES}  # set by its own flag (else --backend / default)
    backend = v.pop("backend", None)
    v["prefill_backend"] = v.get("prefill_backend") or backend or "torch"
    v["decode_backend"] = v.get("decode_backend") or backend or "torch"
    try:
        cfg = EngineConfig(**v)
    except ConfigError as e:  # a usage error naming the flag (exit 2), not a traceback
        raise typer.BadParameter(str(e), param_hint=_flag(e.field)) from None
    for phase in PHASES:  # the backend table says which formats each backend runs (kvbench.core.backends)
        name = getattr(cfg, f"{phase}_backend")
        try:
            assert_supported(name, cfg.kv_dtype, phase)
        except ValueError as e:
            flag = f"--{phase}-backend" if given[phase] else "--backend"
            raise typer.BadParameter(str(e), param_hint=f"'{flag}'") from None
    return cfg


def _flag(field: Optional[str]) -> Optional[str]:
    """The command-line flag of an EngineConfig field (``'--device'``), or None."""
    entry = ENGINE_PARAMS.get(field or "")
    decls = getattr(entry[1], "param_decls", None) if entry else None
    return f"'{decls[0].split('/')[0]}'" if decls else None


def engine_options(func: Callable) -> Callable:
    """Decorate a command whose signature has an ``engine`` parameter; adds the engine flags."""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.name != "engine"]
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=ann)
        for name, (ann, opt) in ENGINE_PARAMS.items()
    ]
    # keyword-only params must come after positional ones
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.kind != p.VAR_KEYWORD else p for p in params]

    @functools.wraps(func)
    def wrapper(**kwargs):
        engine_values = {name: kwargs.pop(name) for name in ENGINE_PARAMS}
        engine = build_engine_config(engine_values)
        try:
            return func(engine=engine, **kwargs)
        except (ValueError, FileNotFoundError) as e:
            # bad model paths, unsupported (format, phase, backend) pairs, missing optional packages:
            # the message says what to do; the traceback only helps when debugging kvbench itself
            if os.environ.get("KVBENCH_DEBUG"):
                raise
            typer.echo(f"error: {e}\n(set KVBENCH_DEBUG=1 for the traceback)", err=True)
            raise typer.Exit(2) from None

    wrapper.__signature__ = sig.replace(parameters=params + extra)  # type: ignore[attr-defined]
    return wrapper

"""Engine flags shared by ``serve``, ``eval`` and ``bench`` (docs/design.md §11).

``@engine_options`` adds the flags to a typer command's signature and hands the command one
``engine: EngineConfig`` argument instead, so every command spells the flags the same way.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Callable, Optional

import typer

from kvbench.core import PHASES, assert_supported, backend_names
from kvbench.core import AUTO_FORMAT, ENGINE_ALIASES, KV_SCALE_POLICIES, canonical_format, format_names
from kvbench.harness.launch.options import external_backend_engines
from kvbench.harness.layer_options import LAYER_OPTIONS, check_model_layers, check_model_layers_overlap
from kvbench.runtime import ConfigError, EngineConfig

_PANEL = "Engine"


def _opt(default, *names, help: str, **kw):
    return typer.Option(default, *names, help=help, rich_help_panel=_PANEL, **kw)


# name -> (annotation, typer.Option)
ENGINE_PARAMS: dict[str, tuple[object, object]] = {
    "model": (Optional[str], _opt(None, "--model", help="HF directory, GGUF file, preset or synthetic:<shape>; default: SmolLM2-135M-Instruct")),
    "kv_dtype": (str, _opt("bf16", "--kv-dtype", help=f"KV format: {', '.join(format_names())}")),
    "kv_scales": (str, _opt("unit", "--kv-scales", help=f"KV scale source: {', '.join(KV_SCALE_POLICIES)}")),
    "kv_scales_per_head": (bool, _opt(False, "--kv-scales-per-head", help="Calibrate one scale per kv-head instead of per layer")),
    "kv_dtype_skip_layers": (Optional[str], _opt(None, "--kv-dtype-skip-layers", metavar="LAYERS",
                                                 help="Layers whose KV stays bf16 (the rest in --kv-dtype): indices and "
                                                      "ranges, or sliding_window, as one argument: 0,1,31 / 0-3 / "
                                                      "sliding_window")),
    "kv_layer_dtypes": (Optional[str], _opt(None, "--kv-layer-dtypes", metavar="LAYERS:FORMAT;...",
                                            help="Other KV formats per layer group (the rest in --kv-dtype), e.g. "
                                                 "'0-3:fp8_e4m3;31:bf16'")),
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
    "mixed_prefill": (bool, _opt(False, "--mixed-prefill/--no-mixed-prefill",
                                 help="Run the decoding requests' next tokens inside prefill steps (one token each, decode "
                                      "semantics) rather than holding them while a prompt chunk runs")),
    "overlap_schedule": (bool, _opt(True, "--overlap-schedule/--no-overlap-schedule",
                                    help="Launch each step before the last one's tokens reach the host (the host's "
                                         "per-step work then runs while the device computes; outputs are the same)")),
    "max_model_len": (Optional[int], _opt(None, "--max-model-len", help="Context length limit (default: the model's)")),
    "device": (Optional[str], _opt(None, "--device", help="cpu or cuda[:N] (default: cuda when available)")),
    "dtype": (Optional[str], _opt(None, "--dtype", help="Compute dtype: float32 (CPU default), bfloat16 (GPU default), float16")),
    "enforce_eager": (bool, _opt(False, "--enforce-eager", help="Disable CUDA graphs")),
    "gemm_library": (str, _opt("cublas", "--gemm-library", metavar="cublas|cublaslt|triton",
                               help="The linear layers' library on a CUDA GPU: torch's BLAS (cublas, cublaslt) or "
                                    "kvbench's few-row Triton GEMM for decode steps (triton)")),
    "seed": (int, _opt(0, "--seed", help="Engine seed (weights of synthetic models, sampling defaults)")),
    "served_model_name": (Optional[str], _opt(None, "--served-model-name", help="Model id served at /v1/models (default: derived from --model)")),
}


# vLLM / SGLang spellings of the flags above: alias parameter -> (EngineConfig field, annotation, option).
# None = not given; a given alias sets the field (the value spelled as the engines spell it is accepted too).
_ALIAS_PANEL = "Engine (vLLM / SGLang spellings)"


def _alias(flag: str, canonical: str, note: str = ""):
    return typer.Option(None, flag, help=f"Same as {canonical}{note}", rich_help_panel=_ALIAS_PANEL, show_default=False)


ENGINE_ALIAS_PARAMS: dict[str, tuple[str, object, object]] = {
    "alias_kv_cache_dtype": ("kv_dtype", Optional[str], _alias(
        "--kv-cache-dtype", "--kv-dtype", f"; also {AUTO_FORMAT} (the compute dtype: bf16, or fp16 with --dtype float16), "
        + ", ".join(f"{k} ({v})" for k, v in ENGINE_ALIASES.items()))),
    "alias_kv_cache_dtype_skip_layers": ("kv_dtype_skip_layers", Optional[str], _alias(
        "--kv-cache-dtype-skip-layers", "--kv-dtype-skip-layers", " (vLLM's flag; give its list as one argument: "
        "'0 1 31' or 0,1,31)")),
    "alias_attention_backend": ("backend", Optional[str], _alias("--attention-backend", "--backend (both phases)")),
    "alias_prefill_attention_backend": ("prefill_backend", Optional[str], _alias("--prefill-attention-backend", "--prefill-backend")),
    "alias_decode_attention_backend": ("decode_backend", Optional[str], _alias("--decode-attention-backend", "--decode-backend")),
    "alias_max_num_seqs": ("max_running", Optional[int], _alias("--max-num-seqs", "--max-running")),
    "alias_gpu_memory_utilization": ("mem_fraction", Optional[float], _alias(
        "--gpu-memory-utilization", "--mem-fraction", " (here: the fraction of free memory given to the KV cache)")),
    "alias_mem_fraction_static": ("mem_fraction", Optional[float], _alias(
        "--mem-fraction-static", "--mem-fraction", " (here: the fraction of free memory given to the KV cache)")),
    "alias_block_size": ("page_size", Optional[int], _alias("--block-size", "--page-size")),
    "alias_context_length": ("max_model_len", Optional[int], _alias("--context-length", "--max-model-len")),
}


def canonical_flag(field: str) -> str:
    """The kvbench spelling of an engine field's flag (``'--kv-dtype'``)."""
    return ENGINE_PARAMS[field][1].param_decls[0].split("/")[0]


def merge_aliases(values: dict, aliases: dict, given: Optional[set] = None) -> tuple[dict, dict[str, str]]:
    """Fold the alias flags' values (``ENGINE_ALIAS_PARAMS`` name -> value or None) into the canonical
    ``values``; returns them with the flag that set each field.  ``given``: the canonical fields the user set
    on the command line; an alias that disagrees with one of them (or with another alias) is a usage error."""
    values, flags = dict(values), {}
    for name, (field, _, opt) in ENGINE_ALIAS_PARAMS.items():
        value = aliases.get(name)
        if value is None:
            continue
        flag = opt.param_decls[0]
        other = flags.get(field) or (canonical_flag(field) if field in (given or ()) else None)
        if other and values[field] != value:
            raise typer.BadParameter(f"{other} {values[field]} and {flag} {value} set the same thing; give one of them",
                                     param_hint=f"'{flag}'")
        values[field], flags[field] = value, flag
    return values, flags


def _kv_dtype(value: str, compute_dtype: Optional[str], flag: str) -> str:
    try:
        return canonical_format(value, compute_dtype)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint=f"'{flag}'") from None


def _backend(value: Optional[str], flag: str) -> Optional[str]:
    """Our backend names in any case; an external engine's backend name is a usage error saying which engine
    runs it."""
    if not value:
        return value
    name = value.strip().lower()
    if name in backend_names():
        return name
    engines = external_backend_engines(name)
    if engines:
        which = " and ".join(engines)
        raise typer.BadParameter(
            f"{value}: {'an' if which[0] in 'aeiosx' else 'a'} {which} attention backend; the embedded engine runs "
            f"{', '.join(backend_names())}; to run {which}, use a server target (docs/external-engines.md)",
            param_hint=f"'{flag}'")
    return value  # EngineConfig names the field and lists the backends


def build_engine_config(values: dict, flags: Optional[dict[str, str]] = None) -> EngineConfig:
    """The EngineConfig of the engine flags' values (``ENGINE_PARAMS`` names; aliases already merged).
    ``flags``: the flag that set a field where it was not the kvbench spelling (messages name it)."""
    flags = dict(flags or {})
    flag = lambda f: flags.get(f) or canonical_flag(f)  # noqa: E731
    v = dict(values)
    if v.get("kv_dtype") is not None:
        v["kv_dtype"] = _kv_dtype(v["kv_dtype"], v.get("dtype"), flag("kv_dtype"))
    for key in ("backend", "prefill_backend", "decode_backend"):
        v[key] = _backend(v.get(key), flag(key))
    given = {p: bool(v.get(f"{p}_backend")) for p in PHASES}  # set by its own flag (else --backend / default)
    backend = v.pop("backend", None)
    v["prefill_backend"] = v.get("prefill_backend") or backend or "torch"
    v["decode_backend"] = v.get("decode_backend") or backend or "torch"
    try:
        cfg = EngineConfig(**v)
    except ConfigError as e:  # a usage error naming the flag (exit 2), not a traceback
        field = e.field
        if field in ("prefill_backend", "decode_backend") and not given[field.split("_")[0]]:
            field = "backend"  # the value came from --backend
        hint = f"'{flags[field]}'" if field in flags else _flag(field)
        msg = str(e)
        if field in LAYER_OPTIONS and msg.startswith(f"{field}: "):
            msg = msg[len(field) + 2:]  # the flag names the option already
        raise typer.BadParameter(msg, param_hint=hint) from None
    _check_layers(cfg, flag)
    for phase in PHASES:  # the backend table says which formats each backend runs (kvbench.core.backends)
        name = getattr(cfg, f"{phase}_backend")
        try:
            assert_supported(name, cfg.kv_dtype, phase)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint=f"'{flag(f'{phase}_backend') if given[phase] else flag('backend')}'") from None
    return cfg


def _check_layers(cfg: EngineConfig, flag: Callable[[str], str]) -> None:
    """The per-layer formats against the model's layers when they are known before it loads (``synthetic:``
    names, local directories): a layer the model does not have is a usage error now, not at start-up."""
    try:
        check_model_layers_overlap(cfg.kv_dtype_skip_layers, cfg.kv_layer_dtypes)
        check_model_layers(cfg.model, cfg.kv_dtype, cfg.kv_dtype_skip_layers, cfg.kv_layer_dtypes)
    except ValueError as e:
        msg = str(e)
        field = next((f for f in LAYER_OPTIONS if msg.startswith(f)), None)
        if field is None or not getattr(cfg, field):
            field = "kv_dtype_skip_layers" if cfg.kv_dtype_skip_layers else "kv_layer_dtypes"
        else:
            msg = msg[len(field):].lstrip(" :")
        raise typer.BadParameter(msg, param_hint=f"'{flag(field)}'") from None


def _flag(field: Optional[str]) -> Optional[str]:
    """The command-line flag of an engine field (``'--device'``), or None."""
    entry = ENGINE_PARAMS.get(field or "")
    decls = getattr(entry[1], "param_decls", None) if entry else None
    return f"'{decls[0].split('/')[0]}'" if decls else None


_CTX = "engine_options_ctx"  # the typer.Context the wrapper asks for (which flags the user gave)


def _given_on_command_line(ctx, names) -> set:
    """The parameters of the running click command that the user set (command line or environment)."""
    if ctx is None:
        return set()
    # by name: typer may carry its own copy of click's ParameterSource enum
    return {n for n in names if getattr(ctx.get_parameter_source(n), "name", None) in ("COMMANDLINE", "ENVIRONMENT", "PROMPT")}


def engine_options(func: Callable) -> Callable:
    """Decorate a command whose signature has an ``engine`` parameter; adds the engine flags."""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.name != "engine"]
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=ann)
        for name, (ann, opt) in ENGINE_PARAMS.items()
    ] + [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=ann)
        for name, (_, ann, opt) in ENGINE_ALIAS_PARAMS.items()
    ] + [inspect.Parameter(_CTX, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)]
    # keyword-only params must come after positional ones
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.kind != p.VAR_KEYWORD else p for p in params]

    @functools.wraps(func)
    def wrapper(**kwargs):
        ctx = kwargs.pop(_CTX, None)
        engine_values = {name: kwargs.pop(name) for name in ENGINE_PARAMS}
        aliases = {name: kwargs.pop(name) for name in ENGINE_ALIAS_PARAMS}
        engine_values, flags = merge_aliases(engine_values, aliases, _given_on_command_line(ctx, ENGINE_PARAMS))
        engine = build_engine_config(engine_values, flags)
        try:
            return func(engine=engine, **kwargs)
        except (ValueError, FileNotFoundError) as e:
            # bad model paths, unsupported (format, phase, backend) pairs, missing optional packages:
            # the message says what to do; the traceback only helps when debugging kvbench itself
            if os.environ.get("KVBENCH_DEBUG"):
                raise
            from kvbench.harness.errors import UserError

            raise UserError(f"{e} (KVBENCH_DEBUG=1 shows the traceback)") from None

    wrapper.__signature__ = sig.replace(parameters=params + extra)  # type: ignore[attr-defined]
    return wrapper

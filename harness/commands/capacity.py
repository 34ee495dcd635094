"""`kvbench capacity`: KV tokens and max concurrency per format for a model shape and budget.

The shape is a built-in one (``--model-shape``, any case) or read from a model's ``config.json``
(``--model-config`` FILE or DIR); ``--tp N`` gives the per-GPU numbers with the kv heads split over N GPUs.
``--kv-dtype-skip-layers`` / ``--kv-layer-dtypes`` add a mixed row (``fp8_e4m3 skip 0,1,31``) beside the
uniform ones, right after the row of its main format (``--kv-dtype``): every layer counted in its own format
(``kvbench.core.layer_formats``), with the model's layer count and sliding windows.  A model with sliding-window
layers (Gemma 3, Mistral, GPT-OSS) gets ``max_concurrency_windowed`` beside each row: sliding layers counted
at their window plus one page per sequence (``runtime.kv_cache.windowed_capacity``), what an engine that frees
out-of-window pages holds; the embedded engine keeps every layer's pages for the whole context.
"""

from __future__ import annotations

import math
from typing import Optional

import typer

from kvbench.core import AUTO_FORMAT, ENGINE_ALIASES, names_text
from kvbench.harness.errors import UserError


def resolve_shape(model_shape: str, model_config: Optional[str] = None, tp: int = 1):
    """(per-GPU shape, the unsharded shape, a note on the split) of ``--model-config`` (a config.json or a model
    directory) when given, else of ``--model-shape`` (a built-in name, any case, or a path as --model-config)."""
    from pathlib import Path

    from kvbench.runtime import get_shape, load_shape, shard_shape

    if model_config is not None:
        shape = load_shape(model_config)
    elif Path(model_shape).expanduser().exists() and model_shape.strip().lower() not in _builtin_names():
        shape = load_shape(model_shape)
    else:
        shape = get_shape(model_shape)
    per_gpu, note = shard_shape(shape, tp)
    return per_gpu, shape, note


def _builtin_names() -> tuple[str, ...]:
    from kvbench.runtime import SHAPES

    return tuple(SHAPES)


def shape_windows(model_shape: str, model_config: Optional[str], num_layers: int) -> list:
    """The sliding window of every layer of the shape (None: full attention): from the config.json's
    ``layer_types`` / sliding-window keys, or the synthetic preset of a built-in shape; all full otherwise."""
    import json
    from pathlib import Path

    path = model_config
    if path is None and Path(model_shape).expanduser().exists() and model_shape.strip().lower() not in _builtin_names():
        path = model_shape
    windows = None
    if path is not None:
        p = Path(path).expanduser()
        try:
            cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            cfg = {}
        cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) and cfg.get("num_hidden_layers") is None else cfg
        if isinstance(cfg, dict) and isinstance(cfg.get("layer_types"), list) and cfg.get("sliding_window"):
            windows = [int(cfg["sliding_window"]) if t == "sliding_attention" else None for t in cfg["layer_types"]]
        elif isinstance(cfg, dict):
            from kvbench.runtime import from_hf_config

            try:
                windows = from_hf_config(cfg).sliding_windows
            except (ValueError, KeyError, TypeError):  # an architecture the engine does not run: no windows known
                windows = None
    else:
        from kvbench.runtime import SYNTHETIC_PRESETS, parse_synthetic

        name = model_shape.strip().lower()
        if name in SYNTHETIC_PRESETS:
            windows = parse_synthetic(f"synthetic:{name}").sliding_windows
    if not windows or len(windows) != num_layers:
        return [None] * num_layers
    return list(windows)


def mixed_row(shape, whole, model_shape: str, model_config: Optional[str], kv_dtype: str, skip_layers, layer_dtypes,
              budget_bytes: float, context: int, page_size: int) -> dict:
    """The capacity row of a mixed per-layer map: every layer in its own format (``resolve_layer_dtypes``),
    bytes per token summed over the layers (``mixed_bytes_per_token``)."""
    from dataclasses import replace

    from kvbench.core import canonical_format
    from kvbench.core import canonical_layer_dtypes, canonical_skip_layers, layer_dtypes_summary, mixed_bytes_per_token, resolve_layer_dtypes
    from kvbench.runtime import plan_capacity

    main = _canonical("--kv-dtype", canonical_format, kv_dtype)
    skip = _canonical("--kv-dtype-skip-layers", canonical_skip_layers, skip_layers)
    per_layer = _canonical("--kv-layer-dtypes", canonical_layer_dtypes, layer_dtypes)
    if shape.mla_latent_dim:
        raise ValueError(f"{whole.name} is an MLA model: its latent cache has one format for every layer "
                         "(no --kv-dtype-skip-layers / --kv-layer-dtypes)")
    windows = shape_windows(model_shape, model_config, shape.num_layers)
    try:
        layers = resolve_layer_dtypes(main, shape.num_layers, skip, per_layer, windows)
    except ValueError as e:
        msg = str(e).replace("this model", whole.name)
        flag = "--kv-layer-dtypes" if msg.startswith("kv_layer_dtypes") else "--kv-dtype-skip-layers"
        raise ValueError(f"{flag}: {msg.split(': ', 1)[1] if msg.startswith('kv_') else msg}") from None
    # the engine's own plan of this cache (pages of every layer in its format); its bytes per token are
    # mixed_bytes_per_token of the layers' formats
    plan = plan_capacity(replace(shape.kv_spec(main, page_size), layer_dtypes=tuple(layers)), budget_bytes, context)
    assert math.isclose(plan.bytes_per_token, mixed_bytes_per_token(layers, shape.num_kv_heads, shape.head_dim))
    name = f"{main} skip {skip}" if skip and not per_layer else layer_dtypes_summary(layers, main)
    return {**plan.to_dict(), "name": name, "kv_dtype_skip_layers": skip, "kv_layer_dtypes": per_layer,
            "layer_formats": {f: layers.count(f) for f in dict.fromkeys(layers)}}


def _canonical(flag: str, canon, value) -> Optional[str]:
    try:
        return canon(value)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def capacity_rows(model_shape: str, kv_budget_gb: float, context: int, page_size: int = 16, formats: Optional[list[str]] = None,
                  tp: int = 1, model_config: Optional[str] = None, kv_dtype: str = "fp8_e4m3",
                  skip_layers: Optional[str] = None, layer_dtypes: Optional[str] = None) -> list[dict]:
    """One row per KV format: bytes per token, pages, tokens and max concurrency in ``kv_budget_gb`` GiB
    (per GPU when ``tp`` > 1: the rows' ``tp`` / ``kv_heads_per_gpu`` / ``split`` say how).  With
    ``skip_layers`` / ``layer_dtypes`` one mixed row (main format ``kv_dtype``) follows that format's row."""
    from kvbench.core import canonical_format, format_names
    from kvbench.runtime import plan_capacity, windowed_capacity

    # the flags' own names in the messages; plan_capacity checks the same for library callers
    if not (math.isfinite(kv_budget_gb) and kv_budget_gb > 0):
        raise ValueError(f"--kv-budget-gb must be > 0, got {kv_budget_gb:g}")
    if context <= 0:
        raise ValueError(f"--context must be > 0, got {context}")
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"--page-size must be a positive power of two (as the engine requires), got {page_size}")
    kv_dtype = _canonical("--kv-dtype", canonical_format, kv_dtype)  # checked with or without a mixed row
    shape, whole, note = resolve_shape(model_shape, model_config, tp)
    extra = {"model": whole.name, "tp": tp, "kv_heads_per_gpu": 1 if shape.mla_latent_dim else shape.num_kv_heads,
             "split": note}
    rows = []
    for name in formats or format_names():
        plan = plan_capacity(shape.kv_spec(name, page_size), kv_budget_gb * 2**30, context)
        rows.append({**plan.to_dict(), "name": name, **extra})
    if skip_layers or layer_dtypes:
        row = {**mixed_row(shape, whole, model_shape, model_config, kv_dtype, skip_layers, layer_dtypes,
                           kv_budget_gb * 2**30, context, page_size), **extra}
        at = next((i + 1 for i, r in enumerate(rows) if r["kv_dtype"] == row["kv_dtype"]), len(rows))
        rows.insert(at, row)
    windows = [] if shape.mla_latent_dim else shape_windows(model_shape, model_config, shape.num_layers)
    if any(w is not None for w in windows):  # what an engine that drops out-of-window pages fits (module doc)
        from dataclasses import replace

        for r in rows:
            fmts = r.get("layer_formats")
            layers = None
            if fmts:
                from kvbench.core import resolve_layer_dtypes

                layers = tuple(resolve_layer_dtypes(r["kv_dtype"], shape.num_layers, r["kv_dtype_skip_layers"],
                                                    r["kv_layer_dtypes"], windows))
            spec = replace(shape.kv_spec(r["kv_dtype"], page_size), layer_dtypes=layers)
            r.update(windowed_capacity(spec, windows, kv_budget_gb * 2**30, context))
    base = rows[0]["bytes_per_token"]
    for r in rows:
        r["bytes_vs_first"] = r["bytes_per_token"] / base
    return rows


def register(app: typer.Typer) -> None:
    @app.command("capacity")
    def capacity(
        model_shape: str = typer.Option("llama-3-8b", "--model-shape", help="Model attention shape (see runtime/model_shapes.py)."),
        kv_budget_gb: float = typer.Option(40.0, "--kv-budget-gb", help="KV cache budget in GiB."),
        context: int = typer.Option(4096, "--context", help="Tokens per sequence (prompt + output)."),
        page_size: int = typer.Option(16, "--page-size", "--block-size", help="Tokens per page."),
        model_config: Optional[str] = typer.Option(None, "--model-config", help="A model's config.json, or its directory: the shape to plan for (instead of --model-shape)."),
        tp: int = typer.Option(1, "--tp", "--tensor-parallel-size", help="GPUs the kv heads are split over; the numbers are per GPU with --kv-budget-gb per GPU (fewer kv heads than GPUs: replicated, one per GPU; MLA latents: whole on each GPU)."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
        kv_dtype: str = typer.Option("fp8_e4m3", "--kv-dtype", "--kv-cache-dtype", help=f"Main format of the mixed row (with --kv-dtype-skip-layers / --kv-layer-dtypes): {names_text()}, or an engine spelling ({', '.join((AUTO_FORMAT, *ENGINE_ALIASES))})."),
        skip_layers: Optional[str] = typer.Option(None, "--kv-dtype-skip-layers", "--kv-cache-dtype-skip-layers", metavar="LAYERS", help="Add a mixed row: these layers in bf16, the rest in --kv-dtype (0,1,31 / 0-3 / sliding_window; one argument)."),
        layer_dtypes: Optional[str] = typer.Option(None, "--kv-layer-dtypes", metavar="LAYERS:FORMAT;...", help="Add a mixed row: other formats per layer group, the rest in --kv-dtype (e.g. '0-3:nvfp4;31:bf16')."),
    ) -> None:
        """How many tokens and concurrent sequences each KV format fits in a budget."""
        try:
            rows = capacity_rows(model_shape, kv_budget_gb, context, page_size, tp=tp, model_config=model_config,
                                 kv_dtype=kv_dtype, skip_layers=skip_layers, layer_dtypes=layer_dtypes)
        except ValueError as e:
            raise UserError(str(e)) from None
        if json_out:
            import json

            typer.echo(json.dumps(rows, indent=2))
            return
        from kvbench.harness.term import console, table

        per_gpu = f" per GPU ({rows[0]['split']})" if tp > 1 else ""
        sliding = rows[0].get("sliding_layers", 0)
        cols = ("format", "bytes/token", "vs bf16", "pages", "tokens", f"max concurrency @ {context}")
        if sliding:
            cols += ("… sliding layers windowed",)
        t = table(f"KV capacity: {rows[0]['model']}, {kv_budget_gb:g} GiB{per_gpu}, context {context}, page {page_size}",
                  cols, justify="right")
        for r in rows:
            cells = [r["name"], f"{r['bytes_per_token']:,.0f}", f"{r['bytes_vs_first']:.4f}", f"{r['num_pages']:,}",
                     f"{r['tokens']:,}", f"{r['max_concurrency']:,}"]
            t.add_row(*cells, *([f"{r['max_concurrency_windowed']:,}"] if sliding else []))
        console().print(t)
        if sliding:
            typer.echo(f"{sliding} of {rows[0]['num_layers']} layers slide: the last column counts "
                       "them at their window plus one page per sequence (an engine that frees out-of-window pages, e.g. "
                       "vLLM's or SGLang's hybrid allocators); kvbench's engine keeps every layer's pages today")

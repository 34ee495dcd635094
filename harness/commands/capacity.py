"""`kvbench capacity`: KV tokens and max concurrency per format for a model shape and budget.

The shape is a built-in one (``--model-shape``, any case) or read from a model's ``config.json``
(``--model-config`` FILE or DIR); ``--tp N`` gives the per-GPU numbers with the kv heads split over N GPUs.
"""

from __future__ import annotations

import math
from typing import Optional

import typer

from kvbench.harness.errors import UserError


def resolve_shape(model_shape: str, model_config: Optional[str] = None, tp: int = 1):
    """(per-GPU shape, the unsharded shape, a note on the split) of ``--model-config`` (a config.json or a model
    directory) when given, else of ``--model-shape`` (a built-in name, any case, or a path as --model-config)."""
    from pathlib import Path

    from kvbench.runtime.model_shapes import get_shape, load_shape, shard_shape

    if model_config is not None:
        shape = load_shape(model_config)
    elif Path(model_shape).expanduser().exists() and model_shape.strip().lower() not in _builtin_names():
        shape = load_shape(model_shape)
    else:
        shape = get_shape(model_shape)
    per_gpu, note = shard_shape(shape, tp)
    return per_gpu, shape, note


def _builtin_names() -> tuple[str, ...]:
    from kvbench.runtime.model_shapes import SHAPES

    return tuple(SHAPES)


def capacity_rows(model_shape: str, kv_budget_gb: float, context: int, page_size: int = 16, formats: Optional[list[str]] = None,
                  tp: int = 1, model_config: Optional[str] = None) -> list[dict]:
    """One row per KV format: bytes per token, pages, tokens and max concurrency in ``kv_budget_gb`` GiB
    (per GPU when ``tp`` > 1: the rows' ``tp`` / ``kv_heads_per_gpu`` / ``split`` say how)."""
    from kvbench.core.formats import format_names
    from kvbench.runtime.kv_cache import plan_capacity

    # the flags' own names in the messages; plan_capacity checks the same for library callers
    if not (math.isfinite(kv_budget_gb) and kv_budget_gb > 0):
        raise ValueError(f"--kv-budget-gb must be > 0, got {kv_budget_gb:g}")
    if context <= 0:
        raise ValueError(f"--context must be > 0, got {context}")
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"--page-size must be a positive power of two (as the engine requires), got {page_size}")
    shape, whole, note = resolve_shape(model_shape, model_config, tp)
    rows = []
    for name in formats or format_names():
        plan = plan_capacity(shape.kv_spec(name, page_size), kv_budget_gb * 2**30, context)
        rows.append({**plan.to_dict(), "model": whole.name, "tp": tp,
                     "kv_heads_per_gpu": 1 if shape.mla_latent_dim else shape.num_kv_heads, "split": note})
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
    ) -> None:
        """How many tokens and concurrent sequences each KV format fits in a budget."""
        try:
            rows = capacity_rows(model_shape, kv_budget_gb, context, page_size, tp=tp, model_config=model_config)
        except ValueError as e:
            raise UserError(str(e)) from None
        if json_out:
            import json

            typer.echo(json.dumps(rows, indent=2))
            return
        from kvbench.harness.term import console, table

        per_gpu = f" per GPU ({rows[0]['split']})" if tp > 1 else ""
        t = table(f"KV capacity: {rows[0]['model']}, {kv_budget_gb:g} GiB{per_gpu}, context {context}, page {page_size}",
                  ("format", "bytes/token", "vs bf16", "pages", "tokens", f"max concurrency @ {context}"), justify="right")
        for r in rows:
            t.add_row(r["kv_dtype"], f"{r['bytes_per_token']:,.0f}", f"{r['bytes_vs_first']:.4f}", f"{r['num_pages']:,}",
                      f"{r['tokens']:,}", f"{r['max_concurrency']:,}")
        console().print(t)

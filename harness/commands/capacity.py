"""`kvbench capacity`: KV tokens and max concurrency per format for a model shape and budget."""

from __future__ import annotations

import math
from typing import Optional

import typer


def capacity_rows(model_shape: str, kv_budget_gb: float, context: int, page_size: int = 16, formats: Optional[list[str]] = None) -> list[dict]:
    from kvbench.core.formats import format_names
    from kvbench.runtime.kv_cache import plan_capacity
    from kvbench.runtime.model_shapes import get_shape

    # the flags' own names in the messages; plan_capacity checks the same for library callers
    if not (math.isfinite(kv_budget_gb) and kv_budget_gb > 0):
        raise ValueError(f"--kv-budget-gb must be > 0, got {kv_budget_gb:g}")
    if context <= 0:
        raise ValueError(f"--context must be > 0, got {context}")
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"--page-size must be a positive power of two (as the engine requires), got {page_size}")
    shape = get_shape(model_shape)
    rows = []
    for name in formats or format_names():
        plan = plan_capacity(shape.kv_spec(name, page_size), kv_budget_gb * 2**30, context)
        rows.append(plan.to_dict())
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
        page_size: int = typer.Option(16, "--page-size", help="Tokens per page."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """How many tokens and concurrent sequences each KV format fits in a budget."""
        try:
            rows = capacity_rows(model_shape, kv_budget_gb, context, page_size)
        except ValueError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        if json_out:
            import json

            typer.echo(json.dumps(rows, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"KV capacity: {model_shape}, {kv_budget_gb:g} GiB, context {context}, page {page_size}")
        for col in ("format", "bytes/token", "vs bf16", "pages", "tokens", f"max concurrency @ {context}"):
            t.add_column(col, justify="right")
        for r in rows:
            t.add_row(r["kv_dtype"], f"{r['bytes_per_token']:,.0f}", f"{r['bytes_vs_first']:.4f}", f"{r['num_pages']:,}",
                      f"{r['tokens']:,}", f"{r['max_concurrency']:,}")
        Console().print(t)

"""`kvbench formats`: the KV formats and their storage cost."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("formats")
    def formats(json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
        """List KV formats: element bits, scale layout, bytes per element (scales included)."""
        from kvbench.kernels.formats import FORMATS

        rows = [
            {
                "name": f.name,
                "storage": str(f.storage_dtype).replace("torch.", ""),
                "element_bits": f.element_bits,
                "scale": f.scale_layout,
                "bytes_per_element": f.bytes_per_element,
                "max": f.max_value,
            }
            for f in FORMATS.values()
        ]
        if json_out:
            import json

            typer.echo(json.dumps(rows, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        t = Table(title="KV formats")
        for col in ("name", "storage", "bits", "scale layout", "bytes/elem", "vs bf16", "max |x/scale|"):
            t.add_column(col)
        for r in rows:
            t.add_row(
                r["name"], r["storage"], str(r["element_bits"]), r["scale"], f"{r['bytes_per_element']:.4f}",
                f"{r['bytes_per_element'] / 2:.4f}", "-" if r["max"] is None else f"{r['max']:g}",
            )
        Console().print(t)

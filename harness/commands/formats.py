"""`kvbench formats`: the KV formats of the format table, their storage cost and the backends that run them."""

from __future__ import annotations

import typer


def format_rows() -> list[dict]:
    """One row per registered format (``kvbench.core.formats``), in table order."""
    from kvbench.core import PHASES, backend_names, supported_formats
    from kvbench.core import FORMAT_SPECS

    rows = []
    for f in FORMAT_SPECS.values():
        runs = {b: [p for p in PHASES if f.name in supported_formats(b, p)] for b in backend_names()}
        rows.append({
            "name": f.name,
            "storage": f.storage,
            "element_bits": f.element_bits,
            "scale": f.scale_text,
            "bytes_per_element": f.bytes_per_element,
            "token_scale_bytes": f.token_scale_bytes,  # per token and kv head, beside the elements
            "max": f.max_value,
            "backends": {b: ps for b, ps in runs.items() if ps},
        })
    return rows


def _backends_text(backends: dict) -> str:
    from kvbench.core import PHASES

    return ", ".join(b if len(ps) == len(PHASES) else f"{b} ({'/'.join(ps)})" for b, ps in backends.items()) or "-"


def register(app: typer.Typer) -> None:
    @app.command("formats")
    def formats(json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
        """List KV formats: element bits, scale layout, bytes per element (scales included), backends."""
        rows = format_rows()
        if json_out:
            import json

            typer.echo(json.dumps(rows, indent=2))
            return
        from kvbench.harness.term import console, table

        t = table("KV formats", ("name", "storage", "bits", "scale layout", "bytes/elem", "vs bf16", "max |x/scale|",
                                 "backends"))
        for r in rows:
            t.add_row(
                r["name"], r["storage"], str(r["element_bits"]), r["scale"], f"{r['bytes_per_element']:.4f}",
                f"{r['bytes_per_element'] / 2:.4f}", "-" if r["max"] is None else f"{r['max']:g}",
                _backends_text(r["backends"]),
            )
        console().print(t)

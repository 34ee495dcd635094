"""`kvbench load` (placeholder until its module lands)."""

import typer


def register(app: typer.Typer) -> None:
    @app.command("load", help="(not yet available)")
    def _load() -> None:
        typer.echo("kvbench load is not available in this build", err=True)
        raise typer.Exit(2)

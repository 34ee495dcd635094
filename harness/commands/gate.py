"""`kvbench gate` (placeholder until its module lands)."""

import typer


def register(app: typer.Typer) -> None:
    @app.command("gate", help="(not yet available)")
    def _gate() -> None:
        typer.echo("kvbench gate is not available in this build", err=True)
        raise typer.Exit(2)

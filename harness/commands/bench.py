"""`kvbench bench` (placeholder until its module lands)."""

import typer


def register(app: typer.Typer) -> None:
    @app.command("bench", help="(not yet available)")
    def _bench() -> None:
        typer.echo("kvbench bench is not available in this build", err=True)
        raise typer.Exit(2)

"""`kvbench sweep` (placeholder until its module lands)."""

import typer


def register(app: typer.Typer) -> None:
    @app.command("sweep", help="(not yet available)")
    def _sweep() -> None:
        typer.echo("kvbench sweep is not available in this build", err=True)
        raise typer.Exit(2)

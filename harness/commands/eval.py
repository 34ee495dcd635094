"""`kvbench eval` (placeholder until its module lands)."""

import typer


def register(app: typer.Typer) -> None:
    @app.command("eval", help="(not yet available)")
    def _eval() -> None:
        typer.echo("kvbench eval is not available in this build", err=True)
        raise typer.Exit(2)

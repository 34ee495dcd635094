"""`kvbench compare` (placeholder until its module lands)."""

import typer


def register(app: typer.Typer) -> None:
    @app.command("compare", help="(not yet available)")
    def _compare() -> None:
        typer.echo("kvbench compare is not available in this build", err=True)
        raise typer.Exit(2)

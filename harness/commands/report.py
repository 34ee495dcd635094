"""`kvbench report` (placeholder until its module lands)."""

import typer


def register(app: typer.Typer) -> None:
    @app.command("report", help="(not yet available)")
    def _report() -> None:
        typer.echo("kvbench report is not available in this build", err=True)
        raise typer.Exit(2)

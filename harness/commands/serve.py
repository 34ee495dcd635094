"""`kvbench serve` (placeholder until its module lands)."""

import typer


def register(app: typer.Typer) -> None:
    @app.command("serve", help="(not yet available)")
    def _serve() -> None:
        typer.echo("kvbench serve is not available in this build", err=True)
        raise typer.Exit(2)

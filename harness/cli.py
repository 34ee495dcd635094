"""The ``kvbench`` command line.

Each command lives in ``harness/commands/<name>.py`` with a ``register(app)`` function; heavy imports
(torch, the engine, pandas) happen inside the command bodies so ``kvbench --help`` stays instant.
Modules named in ``$KVBENCH_PLUGINS`` are imported first (``kvbench.core.plugins``).
"""

from __future__ import annotations

import importlib

import typer

from kvbench.core import PluginError, load_plugins
from kvbench.harness import __version__
from kvbench.harness.cli_errors import KvbenchGroup, report_error
from kvbench.harness.term import Typer

COMMANDS = ("serve", "eval", "load", "sweep", "report", "compare", "gate", "bench", "capacity", "formats", "diagnose")

app = Typer(  # commands and groups with kvbench's help layout (harness/term.py)
    name="kvbench",
    help="What does fp8 or nvfp4 KV cost in accuracy, and what does it buy in speed and capacity?",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
    cls=KvbenchGroup,  # user errors: one line `kvbench <command>: error: ...`, exit 2 (harness/cli_errors.py)
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvbench {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """kvbench: accuracy-and-throughput harness for KV-cache precision."""


# plugins ($KVBENCH_PLUGINS: extra KV formats and the like) register before any command reads the tables
try:
    load_plugins()
except PluginError as _e:
    report_error("kvbench", str(_e))
    raise SystemExit(2) from None

for _name in COMMANDS:
    importlib.import_module(f"kvbench.harness.commands.{_name}").register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

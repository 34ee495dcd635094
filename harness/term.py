"""Terminal output for commands: rich consoles that do not wrap when the output is not a terminal, tables
that never cut a value, and the layout of ``--help``.

``rich`` wraps at 80 columns when stdout is a pipe or file, which folds table rows (and turns long values
into ``…``); a log or a ``| grep`` wants whole lines.  :func:`console` gives a console that is as wide as
needed off a terminal (``$COLUMNS`` still wins when set) and the terminal's width on one; :func:`table`
gives a ``rich`` table whose columns fold a long value onto the next line instead of cutting it.

``--help`` is typer's rich help with two changes (:class:`HelpLayout`, on every kvbench command and group
through :class:`Typer`): a switch shows no ``<bool>`` placeholder (it takes no value), and off a terminal
(a pipe, a file, a CI log) the help is :data:`HELP_WIDTH` columns wide instead of 80, so no option name or
help word is cut to ``…``.  ``$COLUMNS`` / ``$TERMINAL_WIDTH`` still set the width when given.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Optional

import typer
from typer.core import TyperCommand, TyperGroup

WIDE = 10_000  # off a terminal: never wrap (tables are only as wide as their content)


def console(stderr: bool = False, **kw: Any):
    """A ``rich`` console for stdout (or stderr): no wrapping at 80 columns when it is not a terminal."""
    from rich.console import Console

    c = Console(stderr=stderr, **kw)
    if "width" not in kw and not c.is_terminal and not os.environ.get("COLUMNS"):
        c = Console(stderr=stderr, width=WIDE, **kw)
    return c


def table(title: str, columns, justify: str = "left"):
    """A ``rich`` table with ``columns`` (names); a cell too wide for a narrow terminal folds, never ``…``."""
    from rich.table import Table

    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify=justify, overflow="fold")
    return t


# ------------------------------------------------------------------------------ command help
HELP_WIDTH = 160  # --help off a terminal: room for the longest option names beside their help, nothing cut


def help_width() -> Optional[int]:
    """The width of ``--help``: None (rich's choice: the terminal's, or ``$COLUMNS`` / ``$TERMINAL_WIDTH``)
    on a terminal or when the environment names one, else :data:`HELP_WIDTH`."""
    if os.environ.get("COLUMNS") or os.environ.get("TERMINAL_WIDTH"):
        return None
    try:
        on_terminal = sys.stdout.isatty()
    except (AttributeError, ValueError):  # no stdout, or a closed one
        on_terminal = False
    return None if on_terminal else HELP_WIDTH


@contextmanager
def _rich_help_width(width: Optional[int]):
    """typer's rich help at ``width`` columns meanwhile (None: unchanged)."""
    from typer import rich_utils

    saved = rich_utils.MAX_WIDTH
    if width is not None:
        rich_utils.MAX_WIDTH = width
    try:
        yield
    finally:
        rich_utils.MAX_WIDTH = saved


class HelpLayout:
    """The ``--help`` of a kvbench command or group (mixed in before typer's class; see the module doc)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)  # type: ignore[misc]
        for p in params:
            if getattr(p, "is_flag", False) and getattr(p, "metavar", None) is None:
                p.metavar = ""  # rich help shows the metavar in place of the type: nothing for a switch
        return params

    def format_help(self, ctx, formatter) -> None:
        with _rich_help_width(help_width()):
            return super().format_help(ctx, formatter)  # type: ignore[misc]


class Command(HelpLayout, TyperCommand):
    """A kvbench command: typer's, with kvbench's help layout."""


class Group(HelpLayout, TyperGroup):
    """A kvbench command group (``kvbench bench``): typer's, with kvbench's help layout."""


class Typer(typer.Typer):
    """``typer.Typer`` whose commands and groups default to :class:`Command` / :class:`Group`."""

    def __init__(self, *, cls: Optional[type] = None, **kw: Any) -> None:
        super().__init__(cls=cls or Group, **kw)

    def command(self, name: Optional[str] = None, *, cls: Optional[type] = None, **kw: Any):
        return super().command(name, cls=cls or Command, **kw)

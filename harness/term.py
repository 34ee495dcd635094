"""Terminal output for commands: rich consoles that do not wrap when the output is not a terminal, and
tables that never cut a value.

``rich`` wraps at 80 columns when stdout is a pipe or file, which folds table rows (and turns long values
into ``…``); a log or a ``| grep`` wants whole lines.  :func:`console` gives a console that is as wide as
needed off a terminal (``$COLUMNS`` still wins when set) and the terminal's width on one; :func:`table`
gives a ``rich`` table whose columns fold a long value onto the next line instead of cutting it.
"""

from __future__ import annotations

import os
from typing import Any

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

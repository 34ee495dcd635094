"""User errors: bad input the user can fix, reported as one line.

Code anywhere in the harness calls :func:`fail` (or raises :class:`UserError`); ``kvbench.harness.cli.main``
prints it as ``kvbench <command>: error: <message>`` on stderr and exits 2, without a traceback.
"""

from __future__ import annotations

from typing import NoReturn


class UserError(Exception):
    """Bad input from the user (a missing file, a wrong value); the message is one line."""


def fail(msg: str) -> NoReturn:
    """Stop the command with a user error (exit 2, one line on stderr)."""
    raise UserError(msg)

"""How the ``kvbench`` command line reports a user's mistakes: one line, exit 2.

Every user error -- a usage error from click/typer (unknown option, bad value, missing argument), a
:class:`~kvbench.harness.errors.UserError` raised by a command -- is printed as ONE line on stderr::

    kvbench <command>: error: <message>

and the process exits with 2, without a traceback or a rich panel.  Under GitHub Actions
(``GITHUB_ACTIONS=true``) a workflow-command line ``::error::<same text>`` also goes to stdout, so the
error shows as an annotation.  Ctrl-C exits 130 without a traceback.  While a command runs, each warning
text is printed once, as ``kvbench: warning: <text>`` (also when a module logs the text it warns with).  Exit codes a command raises itself
(``typer.Exit``: the gate's 0/1/3/4) pass through unchanged.

:class:`KvbenchGroup` is the root command's click class (``typer.Typer(cls=KvbenchGroup)``), so the same
handling applies to ``kvbench`` on the shell and to ``typer.testing.CliRunner().invoke(app, ...)``.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from contextlib import contextmanager
from typing import Any, Optional, Sequence

import typer
from typer._click.exceptions import BadParameter, ClickException, UsageError  # typer's own (vendored) click
from typer.core import TyperGroup
from typer.exceptions import Abort

from kvbench.harness.errors import UserError
from kvbench.harness.term import HelpLayout

PROG = "kvbench"
USAGE_EXIT = 2
INTERRUPT_EXIT = 130


def one_line(msg: str) -> str:
    """A message on one line: newlines become spaces, runs of blanks collapse."""
    return " ".join(str(msg).split())


def command_path(root: Any, args: Sequence[str], prog: str = PROG) -> str:
    """``kvbench sweep`` / ``kvbench bench kernels``: the (sub)command named by ``args``, as far as it resolves.

    The root and its sub-groups take only flag options, so the first argument not starting with ``-`` at
    each group level names the next command."""
    parts = [prog]
    cmd: Any = root
    rest = list(args)
    while isinstance(getattr(cmd, "commands", None), dict):
        name = next((a for a in rest if not a.startswith("-")), None)
        if name is None or name not in cmd.commands:
            break
        parts.append(name)
        rest = rest[rest.index(name) + 1:]
        cmd = cmd.commands[name]
    return " ".join(parts)


def _ctx_path(ctx: Any, root: Any, args: Sequence[str]) -> str:
    if ctx is None:
        return command_path(root, args)
    names = []
    c: Any = ctx
    while c is not None:
        names.append(c.info_name or "")
        c = c.parent
    names[-1] = PROG  # the root: whatever the program was called, the message names kvbench
    return " ".join(reversed([n for n in names if n]))


def _annotation_text(text: str) -> str:
    """A GitHub workflow-command message (``%``, CR and LF escaped as the runner expects)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def report_error(path: str, msg: str, annotate: bool = True) -> None:
    """Print the one error line (and, under GitHub Actions, its ``::error::`` annotation on stdout)."""
    line = f"{path}: error: {one_line(msg)}"
    if annotate and os.environ.get("GITHUB_ACTIONS") == "true":
        typer.echo(f"::error::{_annotation_text(line)}")
    typer.echo(line, err=True)


def usage_message(e: UsageError) -> str:
    """click's message for a usage error, with where to look for the options."""
    msg = one_line(e.format_message())
    ctx = e.ctx
    if ctx is not None and ctx.command.get_help_option(ctx) is not None and not isinstance(e, BadParameter):
        msg += f" (see '{_ctx_path(ctx, ctx.find_root().command, ())} {ctx.help_option_names[0]}')"
    return msg


_SEEN_WARNINGS: set[tuple[str, str]] = set()
_SEEN_TEXTS: set[str] = set()  # texts shown once, as a warning or a WARNING log record


def _show_warning_once(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` for the command line: ``kvbench: warning: <text>``, each text once per process."""
    key = (category.__name__, one_line(str(message)))
    if key in _SEEN_WARNINGS:
        return
    _SEEN_WARNINGS.add(key)
    _SEEN_TEXTS.add(key[1])
    try:
        (file or sys.stderr).write(f"{PROG}: warning: {one_line(str(message))}\n")
    except OSError:  # stderr gone: nothing to tell
        pass


# loggers that repeat a warning the code also raises with ``warnings.warn`` (the unit-scale warning of
# runtime/scales.py): their WARNING records print once per process too, and not again after the warning
WARN_ONCE_LOGGERS = ("kvbench.scales",)


class _OnceFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = one_line(record.getMessage())
        if key in _SEEN_TEXTS:
            return False
        _SEEN_TEXTS.add(key)
        return True


_ONCE = _OnceFilter()


@contextmanager
def warning_display():
    """While a command runs: every warning shown once (by category and text, wherever it is raised) on one
    line; the filters (``-W``, ``PYTHONWARNINGS``) still decide which are shown at all.  One command is
    one process on the shell; afterwards (tests invoking several commands) Python's display is restored."""
    saved = warnings.showwarning
    warnings.showwarning = _show_warning_once
    logs = [logging.getLogger(name) for name in WARN_ONCE_LOGGERS]
    for log in logs:
        log.addFilter(_ONCE)
    try:
        yield
    finally:
        warnings.showwarning = saved
        for log in logs:
            log.removeFilter(_ONCE)
        _SEEN_WARNINGS.clear()
        _SEEN_TEXTS.clear()


class KvbenchGroup(HelpLayout, TyperGroup):
    """The root ``kvbench`` group: runs the command without click's standalone handling and reports errors
    as :func:`report_error` lines (see the module docstring); its help has kvbench's layout (harness/term.py)."""

    def main(self, args: Optional[Sequence[str]] = None, prog_name: Optional[str] = None,
             complete_var: Optional[str] = None, standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        prog_name = prog_name or PROG
        if not standalone_mode:  # a caller that handles errors itself
            return super().main(args=argv, prog_name=prog_name, complete_var=complete_var,
                                standalone_mode=False, **extra)
        try:
            with warning_display():
                rv = super().main(args=argv, prog_name=prog_name, complete_var=complete_var,
                                  standalone_mode=False, **extra)
        except UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `kvbench` / `kvbench bench` alone: the help was shown
                if e.format_message().strip():
                    typer.echo(e.format_message(), err=True)
                sys.exit(e.exit_code)
            report_error(_ctx_path(e.ctx, self, argv), usage_message(e))
            sys.exit(USAGE_EXIT)
        except UserError as e:
            report_error(command_path(self, argv), str(e), annotate=not getattr(e, "annotated", False))
            sys.exit(USAGE_EXIT)
        except ClickException as e:  # FileError and the like: still one line, click's own exit code
            report_error(command_path(self, argv), e.format_message())
            sys.exit(e.exit_code)
        except (Abort, KeyboardInterrupt):
            sys.exit(INTERRUPT_EXIT)
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)

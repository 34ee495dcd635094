"""Rows as they are measured: every tool prints a table header once, then each row (flushed) the moment it
is measured, and a progress line on stderr saying what is being measured now.

The progress line is ``[i/n] label…``: on a terminal it is rewritten in place (carriage return, erase to
the end of the line) and erased before each row is printed; otherwise (a log file, a pipe) it is a plain
line per step.  ``stream_rows`` runs a list of ``Step`` and yields the rows; each step's function returns
a list or a generator of rows, or one row (a generator gives its rows one by one, while it measures the
next).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, TextIO

__all__ = ["Step", "Progress", "progress_line", "stream_rows", "run_steps"]

ELLIPSIS = "…"


@dataclass
class Step:
    """One measurement: ``label`` names it on the progress line; ``run()`` returns its rows (a list or a
    generator of rows, a single row — a tuple is one row — or None)."""

    label: str
    run: Callable[[], Any]


def progress_line(i: int, total: int, label: str) -> str:
    """``[12/48] decode fp8_e4m3 B=64 L=8192…``"""
    return f"[{i}/{total}] {label}{ELLIPSIS}"


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """The progress line on ``stream`` (stderr by default).  ``tty`` None: ask the stream."""

    def __init__(self, total: int, stream: Optional[TextIO] = None, tty: Optional[bool] = None):
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self.tty = _is_tty(self.stream) if tty is None else tty
        self.current = ""  # the line now shown (TTY), "" when none
        self.t0 = time.monotonic()

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
        except UnicodeEncodeError:  # a stream that cannot encode the ellipsis
            self.stream.write(text.replace(ELLIPSIS, "..."))
        self.stream.flush()

    def update(self, i: int, label: str) -> str:
        line = progress_line(i, self.total, label)
        if self.tty:
            self._write("\r\x1b[K" + line)
            self.current = line
        else:
            self._write(line + "\n")
        return line

    def clear(self) -> None:
        """Erase the line on a terminal (before a row is printed on the same screen)."""
        if self.tty and self.current:
            self._write("\r\x1b[K")

    def redraw(self) -> None:
        if self.tty and self.current:
            self._write(self.current)

    def done(self, what: str = "done") -> None:
        line = f"[{self.total}/{self.total}] {what} in {time.monotonic() - self.t0:.0f} s"
        self._write(("\r\x1b[K" if self.tty else "") + line + "\n")
        self.current = ""


def _rows_of(result: Any) -> Iterable:
    """A step's result as rows: a list or an iterator (a generator) holds rows; None none; anything else,
    a tuple included, is one row."""
    if result is None:
        return ()
    if isinstance(result, list) or hasattr(result, "__next__"):
        return result
    return (result,)


def stream_rows(steps: list[Step], *, fmt: Callable[[Any], str] = str, header: Optional[str] = None,
                out: Optional[TextIO] = None, progress: Optional[Progress] = None,
                on_error: Optional[Callable[[Step, BaseException], Any]] = None) -> Iterator:
    """Run ``steps`` in order and yield their rows; each row is printed (``fmt(row)``, flushed) on ``out``
    (stdout) before it is yielded, so the table grows while the run goes on.  ``header`` is printed once,
    first.  ``on_error(step, exc)``: a row (or rows) standing for a step that raised; without it the
    exception propagates."""
    out = sys.stdout if out is None else out
    progress = progress if progress is not None else Progress(len(steps))
    if header:
        progress.clear()
        print(header, file=out, flush=True)
    for i, step in enumerate(steps, 1):
        progress.update(i, step.label)
        try:
            rows = iter(_rows_of(step.run()))
            while True:
                try:
                    row = next(rows)
                except StopIteration:
                    break
                progress.clear()
                print(fmt(row), file=out, flush=True)
                progress.redraw()
                yield row
        except Exception as e:  # noqa: BLE001 - reported as a row when asked to
            if on_error is None:
                progress.clear()
                raise
            for row in _rows_of(on_error(step, e)):
                progress.clear()
                print(fmt(row), file=out, flush=True)
                progress.redraw()
                yield row
    progress.done()


def run_steps(steps: list[Step], **kw) -> list:
    """``stream_rows`` to the end → every row."""
    return list(stream_rows(steps, **kw))

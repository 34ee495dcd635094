"""One note on stderr per long step (loading a model, dequantizing it, calibrating KV scales), so no step is
silent: ``loading SmolLM2-135M-Instruct (gguf, 30 layers)… dequantizing… done in 3.2 s``.

On a terminal a step is one line that grows as it goes; otherwise (a log file, a pipe, a test capturing
stderr) the step prints its opening line at once and the whole line again when it ends, so a log shows
what was running when something stopped.  Quiet when ``$KVBENCH_QUIET`` is set (to anything but ``0``)
or inside ``quiet()``.  ``sys.stderr`` is looked up at each write (tests and progress bars swap it).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Iterator, Optional

__all__ = ["QUIET_ENV", "Step", "step", "note", "quiet", "is_quiet"]

QUIET_ENV = "KVBENCH_QUIET"
ELLIPSIS = "…"

_lock = threading.Lock()
_quiet_depth = 0


def is_quiet() -> bool:
    env = os.environ.get(QUIET_ENV, "")
    return _quiet_depth > 0 or (env != "" and env != "0")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No step notes inside (nesting and threads share one counter)."""
    global _quiet_depth
    with _lock:
        _quiet_depth += 1
    try:
        yield
    finally:
        with _lock:
            _quiet_depth -= 1


def _write(text: str) -> None:
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.write(text)
        stream.flush()
    except (OSError, ValueError):  # a closed stream: notes are never worth failing for
        pass


def _tty() -> bool:
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):
        return False


def note(msg: str) -> None:
    """One line on stderr (unless quiet)."""
    if not is_quiet():
        _write(msg + "\n")


class Step:
    """A long step: ``Step("loading x")`` opens it, ``part("dequantizing")`` adds what it does now,
    ``done(extra)`` closes it with the elapsed time (``fail()`` when it raised).  ``text()`` is the line."""

    def __init__(self, title: str, enabled: Optional[bool] = None):
        self.title = title
        self.parts: list[str] = []
        self.t0 = time.perf_counter()
        self.enabled = (not is_quiet()) if enabled is None else enabled
        self.live = self.enabled and _tty()
        self.closed = False
        if self.enabled:
            _write(f"{title}{ELLIPSIS}" + (" " if self.live else "\n"))

    def part(self, text: str) -> None:
        self.parts.append(text)
        if self.live:
            _write(f"{text}{ELLIPSIS} ")

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def text(self, end: str) -> str:
        return f"{self.title}{ELLIPSIS} " + "".join(f"{p}{ELLIPSIS} " for p in self.parts) + end

    def done(self, extra: str = "") -> None:
        self._close(f"done in {self.elapsed:.1f} s" + (f"; {extra}" if extra else ""))

    def fail(self) -> None:
        self._close(f"failed after {self.elapsed:.1f} s")

    def _close(self, end: str) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.enabled:
            return
        _write(end + "\n" if self.live else self.text(end) + "\n")


@contextlib.contextmanager
def step(title: str) -> Iterator[Step]:
    """``with step("loading x") as s: ...; s.part("dequantizing")``: closed with its time (or as failed)."""
    s = Step(title)
    try:
        yield s
    except BaseException:
        s.fail()
        raise
    s.done()

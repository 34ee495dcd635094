"""The sweep's progress display on stderr: a rich progress bar over cells, or one plain line per cell.

Safe to call from several threads at once (``kvbench sweep --parallel N`` runs cell groups in threads):
every update happens under one lock, and each thread keeps its own phase text, so the bar's description
shows what every running group is doing ("a: gsm8k | b: load test")."""

from __future__ import annotations

import re
import sys
import threading
from typing import Optional


class SweepDisplay:
    """``enabled=True``: a rich progress bar; ``None``: one plain line per finished cell, no bar;
    ``False``: silent."""

    def __init__(self, total: int, enabled: Optional[bool], parallel: int = 1):
        self.enabled = enabled
        self.progress = None
        self.total = total
        self.parallel = max(1, parallel)
        self.cell_times: list[float] = []  # seconds of each finished cell (target start-up included)
        self._lock = threading.RLock()
        self._phases: dict[int, str] = {}  # thread id -> that thread's current phase text
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            from kvbench.harness.term import console

            self.progress = Progress(TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                     TextColumn("{task.fields[eta]}"), TextColumn("{task.description}"),
                                     console=console(stderr=True))  # off a terminal: whole lines, no 80-column wrap
            self.task = self.progress.add_task("", total=total, eta="")

    def __enter__(self):
        if self.progress:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self.progress:
            self.progress.__exit__(*exc)

    def _describe(self) -> None:
        self.progress.update(self.task, description=" | ".join(self._phases.values()))

    def phase(self, text: str) -> None:
        """What the calling thread's group does now."""
        if self.progress:
            with self._lock:
                self._phases[threading.get_ident()] = text
                self._describe()

    def clear_phase(self) -> None:
        """The calling thread's group has ended: its phase leaves the description."""
        if self.progress:
            with self._lock:
                if self._phases.pop(threading.get_ident(), None) is not None:
                    self._describe()

    def eta_text(self) -> str:
        """``"ETA 4m 10s"`` from the finished cells' times (empty before the first cell ends or after the last)."""
        return format_eta(eta_seconds(self.cell_times, self.total - len(self.cell_times), self.parallel))

    def finished(self, line: str, seconds: Optional[float] = None) -> None:
        """One cell ended after ``seconds`` (its target's start-up included; ``None``: not timed, e.g. its
        target never came up).  ``line`` may carry rich markup such as ``[green]done[/]``."""
        with self._lock:
            self.cell_times.append(float("nan") if seconds is None else seconds)
            eta = self.eta_text()
            if self.progress:
                self.progress.console.print(line)
                self.progress.update(self.task, advance=1, eta=eta)
            elif self.enabled is None:  # plain lines (no bar)
                tail = f"  [{len(self.cell_times)}/{self.total}{', ' + eta if eta else ''}]" if self.total > 1 else ""
                print(re.sub(r"\[/?[a-z]*\]", "", line) + tail, file=sys.stderr, flush=True)


def eta_seconds(cell_times: list[float], remaining: int, parallel: int = 1) -> Optional[float]:
    """Seconds until the ``remaining`` cells are done: the mean time of the finished cells (untimed ones,
    NaN, left out) times the remaining cells, spread over up to ``parallel`` groups at once.  ``None``
    when nothing timed has finished yet or nothing remains."""
    timed = [t for t in cell_times if t == t and t >= 0]
    if remaining <= 0 or not timed:
        return None
    return sum(timed) / len(timed) * remaining / max(1, min(parallel, remaining))


def format_eta(seconds: Optional[float]) -> str:
    """``"ETA 45s"``, ``"ETA 4m 10s"``, ``"ETA 2h 05m"``; empty for ``None``."""
    if seconds is None:
        return ""
    s = int(round(seconds))
    if s < 60:
        return f"ETA {s}s"
    if s < 3600:
        return f"ETA {s // 60}m {s % 60:02d}s"
    return f"ETA {s // 3600}h {s % 3600 // 60:02d}m"

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

    def __init__(self, total: int, enabled: Optional[bool]):
        self.enabled = enabled
        self.progress = None
        self._lock = threading.RLock()
        self._phases: dict[int, str] = {}  # thread id -> that thread's current phase text
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                     TextColumn("{task.description}"), console=Console(stderr=True))
            self.task = self.progress.add_task("", total=total)

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

    def finished(self, line: str) -> None:
        """One cell ended (``line`` may carry rich markup such as ``[green]done[/]``)."""
        with self._lock:
            if self.progress:
                self.progress.console.print(line)
                self.progress.advance(self.task)
            elif self.enabled is None:  # plain lines (no bar)
                print(re.sub(r"\[/?[a-z]*\]", "", line), file=sys.stderr, flush=True)

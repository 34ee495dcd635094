"""What to type next after ``kvbench sweep``: the exact ``--resume`` command after an interrupted (or partly
failed) sweep, the ``kvbench report`` / ``kvbench gate`` commands after a finished one; and SIGTERM turned
into the same clean stop as Ctrl-C while a sweep runs."""

from __future__ import annotations

import contextlib
import shlex
import signal
import threading
from pathlib import Path
from typing import Iterator, Optional

__all__ = ["SweepTerminated", "resume_command", "finished_commands", "interrupted_lines", "sigterm_as_interrupt"]


class SweepTerminated(KeyboardInterrupt):
    """SIGTERM arrived while the sweep ran (handled like Ctrl-C: running cells are not marked done)."""


def resume_command(config: str, run_dir: Path | str, only: Optional[str] = None, data_dir: Optional[str] = None,
                   parallel: int = 1, devices: Optional[str] = None) -> str:
    """``kvbench sweep CONFIG --out RUN --resume`` with the ``--only`` / ``--data-dir`` / ``--parallel`` /
    ``--devices`` that were given (each shell-quoted), so pasting it finishes exactly the same sweep."""
    words = ["kvbench", "sweep", config, "--out", str(run_dir), "--resume"]
    if only is not None:
        words += ["--only", only]
    if data_dir is not None:
        words += ["--data-dir", data_dir]
    if parallel != 1:
        words += ["--parallel", str(parallel)]
    if devices is not None:
        words += ["--devices", devices]
    return " ".join(shlex.quote(w) for w in words)


def finished_commands(run_dir: Path | str) -> list[str]:
    """The commands that read a finished run: its report and its gate."""
    q = shlex.quote(str(run_dir))
    return [f"kvbench report {q}", f"kvbench gate {q}"]


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM raises ``SweepTerminated`` (a ``KeyboardInterrupt``) in the main thread, so a
    terminated sweep stops as Ctrl-C stops it.  Only the main thread can set handlers: elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):  # noqa: ARG001 - signal handler signature
        raise SweepTerminated()

    try:
        previous = signal.signal(signal.SIGTERM, _raise)
    except (ValueError, OSError):  # pragma: no cover - no signals here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted_lines(command: str) -> list[str]:
    """The lines printed when the sweep stops early."""
    return ["sweep interrupted: finished cells are kept, the running ones will be redone.",
            "resume it with:", f"  {command}"]

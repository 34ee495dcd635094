"""Server processes of the harness: free ports, health waits, launching a shell command into its own
process group with its output captured to a log, and killing that group (also the groups a crashed sweep
left behind).  ``harness/targets.py`` builds target sessions on top; it re-exports these names.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Optional

__all__ = ["TargetError", "free_port", "wait_healthy", "spawn_logged", "reap_stale", "kill_group"]


class TargetError(RuntimeError):
    """A target could not be started or reached; the message says why (with the log tail)."""


_PORT_LOCK = threading.Lock()
_PORTS_GIVEN: set[int] = set()  # every port free_port handed out in this process


def free_port(host: str = "127.0.0.1") -> int:
    """A free port the OS picked, never one this process was handed before: servers launched side by side
    (``--parallel``) never race for one port, even while an earlier one is still starting."""
    with _PORT_LOCK:
        for _ in range(1000):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _PORTS_GIVEN:
                _PORTS_GIVEN.add(port)
                return port
    raise TargetError(f"no free port on {host} that was not handed out already")


def _get(url: str, timeout: float = 5.0):
    import httpx

    return httpx.get(url, timeout=timeout)


def wait_healthy(url: str, timeout_s: float, proc: Optional[subprocess.Popen] = None,
                 log_path: Optional[Path] = None, interval_s: float = 0.25,
                 alive: Optional[Callable[[], bool]] = None) -> float:
    """Poll ``url`` until it answers 200; fail early if ``proc`` exits or ``alive()`` turns false (an in-process
    server's thread).  Returns the seconds waited."""
    t0 = time.monotonic()
    last = "no answer yet"
    while True:
        if proc is not None and proc.poll() is not None:
            raise TargetError(f"server exited with code {proc.returncode} before {url} answered{_cause(log_path)}"
                              + _tail(log_path))
        if alive is not None and not alive():
            raise TargetError(f"the server stopped before {url} answered: its start-up failed (the error is logged "
                              "above it)")
        try:
            r = _get(url, timeout=min(5.0, max(timeout_s, 0.5)))
            if r.status_code == 200:
                return time.monotonic() - t0
            last = f"HTTP {r.status_code}"
        except Exception as e:  # connection refused while starting
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() - t0 > timeout_s:
            raise TargetError(f"{url} not healthy after {timeout_s:g} s (last: {last})" + _tail(log_path))
        time.sleep(interval_s)


_CAUSE_MARKS = ("error", "exception", "traceback", "usage:", "not found", "no such", "invalid", "cannot", "failed",
                "unrecognized", "out of memory")


def _cause(path: Optional[Path]) -> str:
    """``": <the log's last line that names an error>"`` (else its last line), so the first line of a failed
    start says why; empty when there is no log."""
    if path is None or not Path(path).exists():
        return ""
    lines = [ln.strip() for ln in Path(path).read_text(errors="replace")[-20000:].splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("$ ")]  # not the launch command itself
    if not lines:
        return ""
    hits = [ln for ln in lines if any(m in ln.lower() for m in _CAUSE_MARKS)
            and not ln.lower().startswith(("traceback", "during handling"))]
    line = (hits or lines)[-1]
    return f": {line[:300]}"


def _tail(path: Optional[Path], n: int = 2000) -> str:
    if path is None or not Path(path).exists():
        return ""
    text = Path(path).read_text(errors="replace")[-n:]
    return f"\n--- server log tail ({path}) ---\n{text}"


def _load_prctl():
    try:
        import ctypes

        return ctypes.CDLL(None).prctl
    except Exception:
        return None


# resolved here, in the parent: between fork and exec (other threads may hold the loader's locks when
# servers are launched from several threads) the child only calls it
_PRCTL = _load_prctl()


def _die_with_parent() -> None:
    """In the launched shell (before exec): get SIGKILL when the launching thread of the sweep process
    ends or the process dies, even by kill -9 (a server is always killed before its launching thread ends)."""
    try:
        if _PRCTL is not None:
            _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except Exception:
        pass


def _start_time(pid: int) -> Optional[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def reap_stale(logs_dir: Path) -> list[int]:
    """Kill the process groups of servers that a crashed sweep left behind; returns the groups killed.

    A ``*.pid`` file holds the group leader's pid and start time.  The group is killed when the leader
    is still that process, or gone (what is left of its group is the old server's); a live process with
    that pid but another start time is a recycled pid and is left alone."""
    killed = []
    for pid_file in sorted(Path(logs_dir).glob("*.pid")):
        try:
            pid_s, started = pid_file.read_text().split()
            pid = int(pid_s)
        except FileNotFoundError:  # its server was closed meanwhile (a sweep killing its own servers)
            continue
        except ValueError:
            pid, started = -1, ""
        now = _start_time(pid) if pid > 0 else "invalid"
        if now is None or now == started:
            try:
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        pid_file.unlink(missing_ok=True)
    return killed


def kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left after ``grace_s``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # children may outlive the leader; the group id is the leader's pid
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(timeout=grace_s)


def spawn_logged(cmd: str, log_path: Path, env: Mapping[str, str]) -> tuple[subprocess.Popen, Path]:
    """Start ``cmd`` under a shell in a new process group (session), its stdout and stderr appended to
    ``log_path`` after a ``$ cmd`` line, killed with the launching thread (``_die_with_parent``); writes the
    group leader's pid and start time to ``log_path.with_suffix(".pid")`` for ``reap_stale``.
    Returns the process and that pid file (the caller removes it after ``kill_group``)."""
    with open(log_path, "ab", buffering=0) as logf:
        logf.write(f"$ {cmd}\n".encode())
        proc = subprocess.Popen(cmd, shell=True, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(env), start_new_session=True, preexec_fn=_die_with_parent)
    pid_file = log_path.with_suffix(".pid")
    pid_file.write_text(f"{proc.pid} {_start_time(proc.pid)}\n")
    return proc, pid_file

"""How loaded the machine was during one load test: ``MachineProbe.start()`` before it, ``.stop()`` after.

The record (``summary["machine_load"]`` of a load test):

- ``cpu_count``: logical CPUs (``os.cpu_count()``);
- ``loadavg_before`` / ``loadavg_after``: ``os.getloadavg()`` (1, 5, 15 minutes), None where there is none;
- ``wall_s``: the probe's span;
- ``own_cpu_s``: CPU seconds of this process (every thread: an embedded engine runs here) and of its live
  descendants (a launched server), over the span; ``own_cpu_share`` = that over ``wall_s × cpu_count``;
- ``busy_share``: the share of all CPUs that was busy over the span (``/proc/stat``: user, nice, system, irq,
  softirq, steal), and ``others_cpu_share`` = ``busy_share − own_cpu_share`` (at least 0): what processes
  outside kvbench and its servers took, plus the hypervisor's steal.  None without ``/proc`` (not Linux).

A descendant that exits during the span takes its CPU time with it, and an endpoint target's server on the
same machine is not a descendant: both count as "others".
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

__all__ = ["MachineProbe", "proc_stat_times", "own_cpu_seconds"]

_PROC = Path("/proc")


def _loadavg() -> Optional[list[float]]:
    try:
        return [round(x, 3) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def proc_stat_times(proc: Path = _PROC) -> Optional[tuple[float, float]]:
    """(busy, total) CPU seconds of every CPU since boot from ``/proc/stat``; None where it cannot be read."""
    try:
        line = (proc / "stat").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    parts = line.split()
    if not parts or parts[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user/nice]
    vals = [float(x) for x in parts[1:9]] + [0.0] * max(0, 9 - len(parts))
    tick = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
    busy = vals[0] + vals[1] + vals[2] + vals[5] + vals[6] + vals[7]
    total = busy + vals[3] + vals[4]
    return busy / tick, total / tick


def _stat_fields(pid: int, proc: Path) -> Optional[list[str]]:
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; split after the last ')'
    return text[text.rfind(")") + 2:].split()


def _descendants(root: int, proc: Path) -> list[int]:
    children: dict[int, list[int]] = {}
    try:
        pids = [int(p.name) for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return []
    for pid in pids:
        f = _stat_fields(pid, proc)
        if f and len(f) > 1:
            children.setdefault(int(f[1]), []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def own_cpu_seconds(proc: Path = _PROC) -> dict[int, float]:
    """{pid: CPU seconds} of this process (user + system, every thread) and each live descendant."""
    t = os.times()
    out = {os.getpid(): t.user + t.system}
    if not (proc / "self").exists():
        return out
    tick = float(os.sysconf("SC_CLK_TCK"))
    for pid in _descendants(os.getpid(), proc):
        f = _stat_fields(pid, proc)
        if f and len(f) > 12:
            out[pid] = (float(f[11]) + float(f[12])) / tick  # utime, stime (fields 14, 15 of stat)
    return out


class MachineProbe:
    """CPU and load-average readings around a load test (see the module docstring)."""

    def __init__(self, proc: Path = _PROC):
        self.proc = proc
        self.t0 = time.perf_counter()
        self.load0 = _loadavg()
        self.stat0 = proc_stat_times(proc)
        self.own0 = own_cpu_seconds(proc)

    @classmethod
    def start(cls, proc: Path = _PROC) -> "MachineProbe":
        return cls(proc)

    def stop(self) -> dict:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        stat1 = proc_stat_times(self.proc)
        own1 = own_cpu_seconds(self.proc)
        # a process seen only at the end counts from 0 (it started during the span); one gone at the end is lost
        own = sum(max(0.0, v - self.own0.get(pid, 0.0)) for pid, v in own1.items())
        cpus = os.cpu_count() or 1
        out = {"cpu_count": cpus, "loadavg_before": self.load0, "loadavg_after": _loadavg(), "wall_s": round(wall, 3),
               "own_cpu_s": round(own, 3), "own_cpu_share": round(min(1.0, own / (wall * cpus)), 4),
               "own_processes": len(own1), "busy_share": None, "others_cpu_share": None}
        if self.stat0 is not None and stat1 is not None and stat1[1] > self.stat0[1]:
            busy = (stat1[0] - self.stat0[0]) / (stat1[1] - self.stat0[1])
            out["busy_share"] = round(min(1.0, max(0.0, busy)), 4)
            out["others_cpu_share"] = round(max(0.0, out["busy_share"] - out["own_cpu_share"]), 4)
        return out

"""Cell groups side by side (``kvbench sweep --parallel N``): devices, ports and the group scheduler.

A cell group shares one target launch.  With ``--parallel 1`` (the default) groups run one after another
in the calling thread, exactly as before.  With N > 1 up to N groups run at once, each in its own thread:

* ``server`` groups run side by side, each server on its own devices (``CUDA_VISIBLE_DEVICES`` set to the
  ids it was given, ``{devices}`` / ``{tp_size}`` in its launch template) and its own port (``free_port``
  never hands out one port twice).  A server needs ``tp_size`` devices (the target's key, default 1).
  The devices a target may use: ``--devices`` when given, else the target's ``devices``, else the visible
  GPUs (``CUDA_VISIBLE_DEVICES`` when set, else those ``nvidia-smi -L`` lists).  On a machine without GPUs
  (and no ``--devices``) servers get no devices and run side by side on ports alone.  A group waits until
  enough devices are free; they return to the pool once its server is killed.  A target whose
  ``tp_size`` exceeds its devices is a config error before anything starts.  A server target with a
  fixed ``port`` runs one group at a time.  A server target of ``replicas: N`` launches N servers per group:
  the group takes ``N × tp_size`` devices (also with ``--parallel 1`` when GPUs are visible: replicas never
  share one), each replica ``tp_size`` of them in order, and its fixed ports are ``port`` .. ``port + N - 1``.
* ``endpoint`` groups that share a server run one at a time (they would measure each other's load): every
  URL of a replica list is held; groups of disjoint endpoints may overlap.
* ``embedded`` groups run one at a time (the engine lives in this process, on its device; when that
  device is in the pool it is held while an embedded group runs, so no server is placed on it).

Groups start in matrix order (a group that must wait for devices holds back the ones after it).  Load
tests of groups running at once share this host's CPU for the load generator, so their client-side
timings are not independent of each other (each cell's ``summary.json`` target records ``parallel``).

A failure in one group (its server does not start, a cell fails) never stops the others.  An exception
that escapes a group (Ctrl-C, ``KeyboardInterrupt``) stops the sweep: no new group starts, every live
server's process group is killed, running cells are not marked done (``--resume`` redoes exactly the
cells that are not done), and the exception is raised again once the workers have ended.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from kvbench.harness.matrix import Cell
from kvbench.harness.sweep.config import SweepConfig, SweepConfigError

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ devices
def parse_devices(text: str, flag: str = "--devices") -> list[int]:
    """``"0,1,2,3"`` -> ``[0, 1, 2, 3]``; a ``SweepConfigError`` naming the bad part otherwise (not a
    non-negative integer, repeated, or no id at all)."""
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise SweepConfigError(f"{flag}: expected device ids such as 0,1,2,3, got {text!r}")
    ids: list[int] = []
    for p in parts:
        if not p.isdigit():
            raise SweepConfigError(f"{flag}: {p!r} is not a device id (a non-negative integer) in {text!r}")
        if int(p) in ids:
            raise SweepConfigError(f"{flag}: device {int(p)} is listed twice in {text!r}")
        ids.append(int(p))
    return ids


def visible_devices(environ: Optional[dict] = None) -> list[int]:
    """The GPU ids this machine lets the sweep use: ``CUDA_VISIBLE_DEVICES`` when set (ids up to the
    first one that is not a non-negative integer, as CUDA reads it; GPU UUIDs are refused: pass
    ``--devices``), else one id per GPU that ``nvidia-smi -L`` lists, else none."""
    env = os.environ if environ is None else environ
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        ids: list[int] = []
        for p in (s.strip() for s in cvd.split(",")):
            if p.startswith(("GPU-", "MIG-")):
                raise SweepConfigError(f"CUDA_VISIBLE_DEVICES={cvd} names GPUs by UUID; pass --devices with the "
                                       "device indices the servers may use")
            if not p.isdigit():
                break
            ids.append(int(p))
        return ids
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return list(range(sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))))


class DevicePool:
    """Which device ids are in use.  Not locked itself: the scheduler calls it under its own lock."""

    def __init__(self) -> None:
        self.busy: set[int] = set()

    def take(self, allowed: list[int], n: int) -> Optional[list[int]]:
        """The first ``n`` free ids of ``allowed`` (in its order), now busy; None when fewer are free."""
        free = [d for d in allowed if d not in self.busy]
        if len(free) < n:
            return None
        got = free[:n]
        self.busy.update(got)
        return got

    def give(self, ids: Optional[list[int]]) -> None:
        self.busy.difference_update(ids or ())


# ------------------------------------------------------------------------------ plans
@dataclass
class GroupPlan:
    """How one cell group is scheduled."""

    cells: list[Cell]
    target: str
    kind: str  # the target's type
    allowed: Optional[list[int]] = None  # device ids its launch may take; None: no devices assigned
    need: int = 0  # devices per launch (tp_size) when ``allowed`` is set
    exclusive: tuple[str, ...] = field(default_factory=tuple)  # held by one running group at a time
    tp_size: int = 1
    replicas: int = 1  # copies of the server the group launches (a server target's ``replicas``)


def target_tp_size(spec) -> int:
    return int(getattr(spec, "tp_size", 1) or 1)


def target_replicas(spec) -> int:
    """Copies of the server a server target launches (its ``replicas``, default 1)."""
    return int(getattr(spec, "server_replicas", 1) or 1)


def replica_devices(devices: Optional[list[int]], replicas: int, tp: int) -> list[Optional[list[int]]]:
    """The devices of each of ``replicas`` servers of ``tp`` devices from the ``devices`` a group was given, in
    order (None: none assigned, for every replica); a ``SweepConfigError`` when they are too few."""
    if devices is None:
        return [None] * replicas
    if len(devices) < replicas * tp:
        raise SweepConfigError(f"{replicas} replicas of tp_size {tp} need {replicas * tp} devices, got "
                               f"{len(devices)} ({','.join(map(str, devices)) or 'none'})")
    return [list(devices[i * tp:(i + 1) * tp]) for i in range(replicas)]


def exclusive_keys(spec) -> tuple[str, ...]:
    """What one running group holds alone: every URL of an endpoint (each replica), every fixed port of a server
    (replica i listens on ``port + i``)."""
    from kvbench.harness.replica_set import server_key

    if spec.type == "endpoint":
        return tuple(f"endpoint:{server_key(u)}" for u in (getattr(spec, "replicas", None) or [spec.base_url]))
    if spec.type == "server" and spec.port:
        return tuple(f"port:{spec.host}:{spec.port + i}" for i in range(target_replicas(spec)))
    return ()


def plan_groups(sweep: SweepConfig, groups: list[list[Cell]], parallel: int, devices: Optional[list[int]] = None,
                visible: Callable[[], list[int]] = visible_devices) -> list[GroupPlan]:
    """One ``GroupPlan`` per group; a ``SweepConfigError`` when a server can never get its devices.

    Devices are assigned to a server group when ``devices`` (``--devices``) is given or its target lists
    ``devices``, or with ``parallel > 1`` (or a target of several ``replicas``) when GPUs are visible; otherwise
    none (at ``parallel == 1`` that is the behaviour of a sweep without these options: the server sees what this
    process sees)."""
    if parallel < 1:
        raise SweepConfigError(f"--parallel must be at least 1, got {parallel}")
    seen: dict[str, list[int]] = {}

    def _visible() -> list[int]:
        if "v" not in seen:
            seen["v"] = list(visible())
        return seen["v"]

    plans = []
    for g in groups:
        spec = sweep.target(g[0].config["target"])
        tp, reps = target_tp_size(spec), target_replicas(spec)
        p = GroupPlan(cells=g, target=spec.name, kind=spec.type, tp_size=tp, replicas=reps,
                      exclusive=exclusive_keys(spec))
        if spec.type == "server":
            allowed = devices if devices is not None else getattr(spec, "devices", None)
            if allowed is None and (parallel > 1 or reps > 1):  # replicas never share a device
                allowed = _visible() or None
            if allowed is not None:
                allowed = list(allowed)
                if tp * reps > len(allowed):
                    src = ("--devices" if devices is not None else "its devices" if getattr(spec, "devices", None)
                           is not None else "the visible GPUs")
                    each = f"{reps} replicas × tp_size {tp} need {tp * reps} devices" if reps > 1 else \
                        f"tp_size {tp} needs {tp} devices per server"
                    raise SweepConfigError(f"target {spec.name!r}: {each}, but {src} {allowed} "
                                           f"hold{'s' if len(allowed) == 1 else ''} only {len(allowed)}")
                p.allowed, p.need = allowed, tp * reps
        elif spec.type == "embedded":  # in this process, one group at a time, on this process's device
            p.exclusive = ("embedded",)
            if parallel > 1:
                try:
                    vis = _visible()
                except SweepConfigError:
                    vis = []
                pool = devices if devices is not None else vis
                if vis and vis[0] in pool:
                    p.allowed, p.need = [vis[0]], 1
        plans.append(p)
    return plans


def simulate(plans: list[GroupPlan], parallel: int) -> list[tuple[int, Optional[list[int]]]]:
    """(wave, devices) of every plan if all groups took equally long: what ``--dry-run`` shows."""
    pool, out = DevicePool(), []
    wave, running, held = 0, [], set()
    for p in plans:
        while True:
            fits = len(running) < parallel and not (set(p.exclusive) & held)
            devs = pool.take(p.allowed, p.need) if fits and p.allowed is not None else None
            if fits and (p.allowed is None or devs is not None):
                break
            if not running:  # cannot happen for validated plans; never loop
                break
            for q, d in running:  # the wave ends: everything running finishes
                pool.give(d)
            running, held, wave = [], set(), wave + 1
        running.append((p, devs))
        held.update(p.exclusive)
        out.append((wave, devs))
    return out


# ------------------------------------------------------------------------------ the scheduler
class GroupScheduler:
    """Runs plans through ``run_one(plan, devices)``: inline one after another with ``parallel == 1``,
    else up to ``parallel`` at once in threads.  ``stop`` is set when the sweep is being stopped (workers
    check it between cells); ``kill_all`` kills every live server of the sweep (called, repeatedly, from
    the calling thread while it waits for the workers to end after an interruption)."""

    def __init__(self, parallel: int, kill_all: Callable[[], None] = lambda: None, poll_s: float = 0.1):
        self.parallel = parallel
        self.kill_all = kill_all
        self.poll_s = poll_s
        self.stop = threading.Event()
        self.pool = DevicePool()
        self._cond = threading.Condition()
        self._running = 0
        self._held: set[str] = set()
        self._error: Optional[BaseException] = None
        self.max_running = 0  # the most groups that ran at once

    def run(self, plans: list[GroupPlan], run_one: Callable[[GroupPlan, Optional[list[int]]], None]) -> None:
        if self.parallel == 1:
            for p in plans:
                devs = self.pool.take(p.allowed, p.need) if p.allowed is not None else None
                try:
                    self.max_running = 1
                    run_one(p, devs)
                finally:
                    self.pool.give(devs)
            return
        threads: list[threading.Thread] = []
        try:
            for i, p in enumerate(plans):
                ok, devs = self._wait_for_room(p)
                if not ok:
                    break
                t = threading.Thread(target=self._worker, args=(p, devs, run_one), name=f"kvbench-group-{i}", daemon=True)
                threads.append(t)
                t.start()
            with self._cond:
                while self._running and not self.stop.is_set():
                    self._cond.wait(self.poll_s)
        except BaseException as e:  # Ctrl-C (or a bug) in this thread
            with self._cond:
                self._error = self._error or e
        if self._error is not None:
            self.stop.set()
            self._shutdown(threads)
            raise self._error

    def _wait_for_room(self, p: GroupPlan) -> tuple[bool, Optional[list[int]]]:
        with self._cond:
            while not self.stop.is_set():
                if self._running < self.parallel and not (set(p.exclusive) & self._held):
                    devs = self.pool.take(p.allowed, p.need) if p.allowed is not None else None
                    if p.allowed is None or devs is not None:
                        self._running += 1
                        self.max_running = max(self.max_running, self._running)
                        self._held.update(p.exclusive)
                        return True, devs
                self._cond.wait(self.poll_s)
        return False, None

    def _worker(self, p: GroupPlan, devs: Optional[list[int]], run_one) -> None:
        try:
            run_one(p, devs)
        except BaseException as e:  # the group could not even record its failure: stop the sweep
            with self._cond:
                self._error = self._error or e
                self.stop.set()
        finally:
            with self._cond:
                self._running -= 1
                self._held.difference_update(p.exclusive)
                self.pool.give(devs)
                self._cond.notify_all()

    def _shutdown(self, threads: list[threading.Thread]) -> None:
        """Kill every live server until every worker has ended (a server launched while the first kill ran is
        caught by a later one; the workers kill their own on the way out too)."""
        while True:
            try:
                self.kill_all()
            except Exception as e:  # never let a kill error hide the interruption
                log.warning("killing the sweep's servers: %s: %s", type(e).__name__, e)
            alive = [t for t in threads if t.is_alive()]
            if not alive:
                return
            for t in alive:
                t.join(self.poll_s)

"""The worker half of ``kvbench sweep --executor ray``: one cell group as a Ray task, and the cell sink.

``run_group_task`` runs on a Ray worker.  It opens the group's target and runs its cells through the same
code as a local sweep (``runner._run_group`` / ``_run_cell``), into a temporary run store of its own on the
worker's disk (removed when the task ends).  After each cell, done or failed, it reads that cell's files back
(``cell_payload``) and puts them into the ``CellSink``, an actor the driver created; the driver drains the sink
and writes the files into its own run store with the store's atomic writes, so no file system is shared.  A
retried task first asks the sink which cells it already holds and skips them; every task first tells the sink
which node it runs on (so the driver knows which node a ``NodeDiedError`` is about).

The task's display (``RelayDisplay``) forwards what the group is doing to the sink, for the driver's
progress bar, and keeps each finished cell's line and time for its payload.  The fidelity reference of a
cell is computed on the worker, once per group (the worker's store is the cache).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from kvbench.core import RunStore, load_plugins, release_memory
from kvbench.harness.cell_work import CellWork, DefaultWork
from kvbench.harness.fidelity_refs import FidelityRefs
from kvbench.harness.matrix import Cell
from kvbench.harness.runner import _RESULT_FILES, SweepOutcome, _record_failure, _run_group
from kvbench.harness.sweep.config import SweepConfig

log = logging.getLogger(__name__)

RESULT_FILES = _RESULT_FILES  # what a cell directory holds after a cell (JSON files travel as text like the rest)


class CellSink:
    """The driver's mailbox (a Ray actor): workers ``put`` each finished cell and ``phase`` what their group
    does, and which node its task ``started`` on; the driver ``drain``s all three.  ``done_keys`` are the cells
    put so far (a retried task skips them)."""

    def __init__(self) -> None:
        self._cells: list[tuple[str, dict]] = []
        self._phases: dict[int, Optional[str]] = {}
        self._started: dict[int, str] = {}
        self._keys: set[str] = set()

    def put(self, key: str, payload: dict) -> None:
        self._cells.append((key, payload))
        self._keys.add(key)

    def phase(self, group: int, text: Optional[str]) -> None:
        self._phases[group] = text

    def started(self, group: int, node_id: str) -> None:
        self._started[group] = node_id

    def drain(self) -> tuple[list[tuple[str, dict]], dict[int, Optional[str]], dict[int, str]]:
        cells, phases, started = self._cells, self._phases, self._started
        self._cells, self._phases, self._started = [], {}, {}
        return cells, phases, started

    def done_keys(self) -> list[str]:
        return sorted(self._keys)


class RelayDisplay:
    """The display ``_run_group`` / ``_run_cell`` talk to on a worker: phases go to the sink (not waited for),
    each cell's finished line and time are kept for its payload (``take``)."""

    def __init__(self, sink, group: int):
        self.sink, self.group = sink, group
        self._last: Optional[tuple[str, Optional[float]]] = None

    def phase(self, text: str) -> None:
        self.sink.phase.remote(self.group, text)

    def clear_phase(self) -> None:
        self.sink.phase.remote(self.group, None)

    def finished(self, line: str, seconds: Optional[float] = None) -> None:
        self._last = (line, seconds)

    def take(self) -> tuple[Optional[str], Optional[float]]:
        last, self._last = self._last, None
        return last or (None, None)


def node_info(ray) -> dict:
    """Which Ray node this task runs on (recorded in each cell's summary ``target.ray_node``)."""
    ctx = ray.get_runtime_context()
    info: dict[str, Any] = {"node_id": ctx.get_node_id(), "hostname": socket.gethostname()}
    try:
        info["ip"] = ray.util.get_node_ip_address()
    except Exception:  # pragma: no cover - an older Ray
        pass
    try:
        info["gpu_ids"] = [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # pragma: no cover
        pass
    return info


def cell_payload(store: RunStore, cell: Cell, node: dict, line: Optional[str], seconds: Optional[float]) -> dict:
    """Everything the driver writes for ``cell``: its status, its result files as text (the summary's target
    with ``ray_node`` added), and the line and time the display prints."""
    summary = store.read_json(cell.key, "summary")
    if summary is not None:
        summary["target"] = {**(summary.get("target") or {}), "ray_node": node}
        store.write_json(cell.key, "summary", summary)
    d = store.cell_dir(cell.key)
    files = {name: (d / name).read_text(encoding="utf-8") for name in RESULT_FILES if (d / name).is_file()}
    return {"status": store.status(cell.key), "files": files, "line": line, "seconds": seconds, "node": node}


def run_group_task(sweep: SweepConfig, cells: list[Cell], sink, group: int, work: Optional[CellWork] = None,
                   opener: Optional[Callable] = None, plugins: Optional[str] = None, cwd: Optional[str] = None) -> dict:
    """The body of one cell group's Ray task (see the module docstring); returns the node it ran on and the
    keys of the cells it reported.  An error beyond a cell (e.g. closing the target) fails the group's
    unreported cells with that error, as a local ``--parallel`` sweep does; only a dead worker or node, or a
    cancellation, ends the task without reporting every cell.  ``cwd``: the driver's working directory, made
    this worker's when it exists here; ``plugins``: the driver's ``$KVBENCH_PLUGINS``, imported first."""
    import ray

    from kvbench.harness.targets import open_target

    if cwd and os.path.isdir(cwd):  # relative paths of the config (data_dir, models) as the driver reads them
        os.chdir(cwd)
    if plugins:
        load_plugins(plugins)
    threads = os.environ.get("OMP_NUM_THREADS", "")  # Ray sets it to the task's CPUs
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:  # a reused worker: torch read it before
        sys.modules["torch"].set_num_threads(int(threads))
    node = node_info(ray)
    held = set(ray.get([sink.started.remote(group, node["node_id"]), sink.done_keys.remote()])[1])
    cells = [c for c in cells if c.key not in held]
    if not cells:
        return {"node": node, "cells": [], "pid": os.getpid()}
    root = Path(tempfile.mkdtemp(prefix="kvbench-ray-"))
    sent: list[str] = []
    display = RelayDisplay(sink, group)

    def after_cell(cell: Cell) -> None:
        line, seconds = display.take()
        ray.get(sink.put.remote(cell.key, cell_payload(store, cell, node, line, seconds)))
        sent.append(cell.key)
        shutil.rmtree(store.cell_dir(cell.key), ignore_errors=True)

    store = RunStore(root)
    opener = opener or open_target
    try:
        refs = FidelityRefs(sweep, root / "fidelity", opener)
        outcome = SweepOutcome(root, cells)
        try:
            _run_group(sweep, store, cells, work or DefaultWork(sweep), refs, opener, display, outcome,
                       after_cell=after_cell)
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
            log.error("cell group of %s failed: %s", cells[0].label, err)
            for cell in cells:
                if cell.key not in sent:
                    _record_failure(store, cell, err, traceback.format_exc(), {})
                    display.finished(f"[red]failed[/] {cell.label}: {err.splitlines()[0][:200]}")
                    after_cell(cell)
    finally:
        display.clear_phase()
        shutil.rmtree(root, ignore_errors=True)
        release_memory()
    return {"node": node, "cells": sent, "pid": os.getpid()}

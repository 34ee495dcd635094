"""The sweep runner: cells in order, one target launch per cell group, results written atomically.

For every cell: flush the target's prefix cache, run the accuracy suites (only in the cell whose
concurrency is the sweep's ``accuracy_concurrency``), the load test (every cell; prompts salted with the
cell key so no cell reuses another's prefixes), and record the KV capacity.  A cell is ``done`` only
when its ``status`` file says so; a cell that raises is recorded ``failed`` with its error in
``summary.json`` (and the traceback in ``error.txt``) and the sweep goes on.  ``resume=True`` skips done
cells and redoes every other one.  One sweep at a time per run directory (``RunLock`` on ``RUN/.lock``); a resume may add
cells and change what only reports read (gate, description), never what produced a finished cell
(``_check_resume``).  What a cell runs comes from a ``CellWork`` (``cell_work.py``; tests
inject fakes, the default ``DefaultWork`` calls the suites, the fidelity suite and the load generator); the
manifest's provenance (git, versions, device, dates) comes from ``provenance.py``.  ``parallel > 1`` runs
several cell groups at once, each server on its own devices and port (``parallel.py``); an ``executor``
(``ray_executor.py``, ``kvbench sweep --executor ray``) runs each group elsewhere through ``_run_group`` and
sends each cell's files back to be written here (docs/scale-out.md).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from kvbench.core import release_memory, rss_bytes
from kvbench.harness.cell_work import CellWork, DefaultWork, FidelityRef  # noqa: F401 - re-exported
from kvbench.harness.fidelity_refs import _BorrowedClient, FidelityGuardedWork, FidelityRefs  # noqa: F401 - re-exported
from kvbench.harness.matrix import Cell, engine_options, expand, groups, select
from kvbench.harness.parallel import GroupPlan, GroupScheduler, plan_groups
from kvbench.harness.provenance import (  # noqa: F401 - re-exported
    device_info,
    git_info,
    manifest_base,
    now_iso,
    package_versions,
)
from kvbench.harness.run_dir import RunInUseError, RunLock, _check_resume  # noqa: F401 - re-exported
from kvbench.core import STATUS_DONE, STATUS_FAILED, RunStore
from kvbench.core import atomic_write_text, remove_stale_temp_files
from kvbench.harness.sweep.config import SweepConfig, SweepConfigError
from kvbench.harness.sweep.display import SweepDisplay as _Display
from kvbench.harness.targets import TargetSession, open_target, reap_stale
from kvbench.suites import PRIMARY_METRICS

log = logging.getLogger(__name__)


@dataclass
class SweepOutcome:
    run_dir: Path
    selected: list[Cell]
    done: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed


def _manifest(store: RunStore, sweep: SweepConfig, cells: list[Cell], resume: bool, only: Optional[str]) -> dict:
    """The run's manifest: the current config (report-only changes such as ``gate`` take effect), the full
    matrix and one entry per run; checks that a resumed run may reuse its finished cells."""
    prev = _check_resume(store, sweep, cells) if store.exists() else {}
    m = manifest_base(sweep)
    m["created"] = prev.get("created", m["created"])
    m["cells"] = [{"key": c.key, "label": c.label, "config": c.config, "run_accuracy": c.run_accuracy, "run_load": c.run_load} for c in cells]
    m["runs"] = list(prev.get("runs", [])) + [{"started": now_iso(), "resume": resume, "only": only,
                                                "git": m["git"], "device": m["device"]}]
    return m


def run_sweep(sweep: SweepConfig, out: Path | str, resume: bool = False, only: Optional[str] = None,
              work: Optional[CellWork] = None, progress: Optional[bool] = True,
              opener: Callable = open_target, parallel: int = 1,
              devices: Optional[list[int]] = None, executor=None) -> SweepOutcome:
    """Run (or resume) the sweep into ``out``; returns which cells finished, failed or were skipped.

    ``parallel``: up to that many cell groups at once (``harness/parallel.py``; 1: one after another);
    ``devices``: the GPU ids servers may use (``--devices``; default: each target's ``devices``, else
    the visible GPUs when ``parallel > 1``).  Device plans are checked before anything is touched (a
    ``SweepConfigError`` when a server can never get its ``tp_size`` devices).  The run directory is
    locked (``RunLock``) before anything in it is read or written.  ``executor``: where the cell groups run
    (None: in this process; ``harness/ray_executor.py`` ``RayExecutor``: as Ray tasks, connected before the
    run directory is locked and disconnected afterwards)."""
    store = RunStore(out)
    all_cells = expand(sweep)
    cells = select(all_cells, only)
    plan_groups(sweep, groups(cells), parallel, devices)  # fail early: nothing is locked or written yet
    if executor is None:
        with RunLock(store.root):
            return _run_locked(sweep, store, all_cells, cells, resume, only, work, progress, opener, parallel, devices)
    with executor.connected(), RunLock(store.root):
        return _run_locked(sweep, store, all_cells, cells, resume, only, work, progress, opener, parallel, devices,
                           executor=executor)


def _run_locked(sweep: SweepConfig, store: RunStore, all_cells: list[Cell], cells: list[Cell], resume: bool,
                only: Optional[str], work: Optional[CellWork], progress: Optional[bool], opener: Callable,
                parallel: int = 1, devices: Optional[list[int]] = None, executor=None) -> SweepOutcome:
    if store.exists() and not resume:
        raise SweepConfigError(f"{store.root} already holds a run; pass --resume to finish it or choose another --out")
    manifest = _manifest(store, sweep, all_cells, resume, only)
    # temporary files of atomic writes a killed sweep left behind (we hold the lock: nothing else writes here)
    for p in remove_stale_temp_files(store.root, recursive=True):
        log.warning("removed %s, left by an interrupted write", p)
    store.write_manifest(manifest)
    for pgid in reap_stale(store.root / "logs"):
        log.warning("killed the process group %d of a server left behind by an interrupted sweep", pgid)
    work = work or DefaultWork(sweep)
    refs = FidelityRefs(sweep, store.root / "fidelity", opener)
    outcome = SweepOutcome(store.root, cells)
    todo = []
    for c in cells:
        if store.is_done(c.key):
            outcome.skipped.append(c.key)
        else:
            todo.append(c)

    plans = plan_groups(sweep, groups(todo), parallel, devices)
    if parallel > 1:
        work = FidelityGuardedWork(work, refs)  # one computation per fidelity reference
    if parallel > 1 or devices is not None:
        manifest["runs"][-1].update(parallel=parallel, devices=devices)
    if executor is not None:  # the groups run elsewhere (each computes its own fidelity references)
        manifest["runs"][-1].update(executor.manifest_info())
        store.write_manifest(manifest)
        with executor.display(len(todo), progress if todo else False) as display:
            executor.run_groups(sweep, store, plans, work, opener, display, outcome)
    else:
        with _Display(len(todo), progress if todo else False, parallel=parallel) as display:
            _run_groups(sweep, store, plans, work, refs, opener, display, outcome, parallel)
    if parallel > 1 or any(p.allowed is not None for p in plans):
        manifest["runs"][-1]["cell_devices"] = _cell_devices(store, todo)

    manifest["device"] = manifest["runs"][-1]["device"] = device_info()  # now with the GPUs torch saw
    manifest["runs"][-1].update(finished=now_iso(), done=len(outcome.done), failed=len(outcome.failed),
                                skipped=len(outcome.skipped))
    store.write_manifest(manifest)
    return outcome


class SweepInterrupted(RuntimeError):
    """The sweep was stopped while a cell ran: the cell is not done (``--resume`` redoes it)."""


def _run_groups(sweep, store, plans: list[GroupPlan], work, refs, opener, display, outcome, parallel: int) -> None:
    """Every group through a ``GroupScheduler``; each group's cells are added to ``outcome`` when it ends
    (in matrix order at the end when groups ran side by side)."""
    lock = threading.Lock()
    sched = GroupScheduler(parallel, kill_all=lambda: reap_stale(store.root / "logs"))

    def run_one(plan: GroupPlan, devs: Optional[list[int]]) -> None:
        mine = SweepOutcome(store.root, plan.cells)
        try:
            _run_group(sweep, store, plan.cells, work, refs, opener, display, mine, devices=devs,
                       stop=sched.stop if parallel > 1 else None, parallel=parallel,
                       pass_devices=devs is not None and plan.kind == "server")
        except Exception as e:
            if parallel == 1:
                raise
            err = f"{type(e).__name__}: {e}"  # beyond a cell (e.g. closing the target): the group's rest fails
            log.error("cell group of %s failed: %s", plan.cells[0].label, err)
            for cell in plan.cells:
                if cell.key not in mine.done and cell.key not in mine.failed and not store.is_done(cell.key):
                    _record_failure(store, cell, err, traceback.format_exc(), {})
                    mine.failed.append(cell.key)
        finally:
            display.clear_phase()
            with lock:
                outcome.done.extend(mine.done)
                outcome.failed.extend(mine.failed)
            _release_group_memory(plan)

    sched.run(plans, run_one)
    if parallel > 1:
        pos = {c.key: i for i, c in enumerate(outcome.selected)}
        outcome.done.sort(key=lambda k: pos.get(k, -1))
        outcome.failed.sort(key=lambda k: pos.get(k, -1))


def _release_group_memory(plan: GroupPlan) -> None:
    """After a cell group (its target closed, its frame gone): free what it left, so a sweep's peak is its
    largest group's, not the sum (core/memory.py: callable caches that pin an in-process server's engine,
    garbage cycles, the C allocator's free pages)."""
    freed = release_memory()
    log.debug("cell group of %s: released %.2f GB; RSS now %.2f GB", plan.cells[0].label, freed / 1e9, rss_bytes() / 1e9)


def _cell_devices(store: RunStore, cells: list[Cell]) -> dict[str, Optional[list[int]]]:
    """The devices each cell of this run was given (from its summary's target), for the manifest."""
    out = {}
    for c in cells:
        try:
            target = (store.read_json(c.key, "summary") or {}).get("target") or {}
        except (OSError, ValueError):
            continue
        out[c.key] = target.get("devices")
    return out


def _run_group(sweep, store, group, work, refs, opener, display, outcome, devices: Optional[list[int]] = None,
               stop: Optional[threading.Event] = None, parallel: int = 1, pass_devices: bool = False,
               after_cell: Optional[Callable[[Cell], None]] = None) -> None:
    """One target launch for the cells of ``group``.  ``devices``: the GPU ids the group was given (passed
    to the opener as ``devices=`` when ``pass_devices``, recorded in the session info); ``stop``: once
    set, no further cell starts and none is marked done; ``after_cell``: called with each cell once its
    files and status are written (done or failed; a Ray worker sends them to the driver from there)."""
    after_cell = after_cell or (lambda cell: None)
    first = group[0]
    spec = sweep.target(first.config["target"])
    log_path = store.root / "logs" / f"{first.key}.log"
    on = f" on devices {','.join(map(str, devices))}" if devices is not None else ""
    display.phase(f"{first.label}: starting target{on}")
    t_start = time.monotonic()  # the group's first cell's time includes the target's start-up
    try:
        extra = {"devices": list(devices)} if pass_devices and devices is not None else {}
        ctx = opener(spec, first.config, engine_options(sweep, first), log_path, **extra)
        session = ctx.__enter__()
    except Exception as e:  # the target did not come up: every cell of the group fails with that error
        err = f"target {spec.name!r} failed to start: {type(e).__name__}: {e}"
        startup = {"startup_s": round(time.monotonic() - t_start, 3)}
        for cell in group:
            _record_failure(store, cell, err, traceback.format_exc(), startup if cell is first else {})
            outcome.failed.append(cell.key)
            display.finished(f"[red]failed[/] {cell.label}: {err.splitlines()[0]}")
            after_cell(cell)
        return
    startup_s = round(time.monotonic() - t_start, 3)
    if devices is not None:
        session.info.setdefault("devices", list(devices))
    if parallel > 1:
        session.info["parallel"] = parallel  # timings of cells run side by side share the client host
    try:
        for cell in group:
            if stop is not None and stop.is_set():
                break
            ok = _run_cell(sweep, store, cell, session, work, refs, display, stop=stop,
                           startup_s=startup_s if cell is first else None)
            (outcome.done if ok else outcome.failed).append(cell.key)
            after_cell(cell)
    finally:
        ctx.__exit__(None, None, None)


def _run_cell(sweep: SweepConfig, store: RunStore, cell: Cell, session: TargetSession, work: CellWork,
              refs: FidelityRefs, display: _Display, stop: Optional[threading.Event] = None,
              startup_s: Optional[float] = None) -> bool:
    """One cell on an open target; ``startup_s``: the seconds its target took to start (the group's first
    cell; None for the others), recorded in its summary and counted in the time it prints."""
    d = store.cell_dir(cell.key)
    for name in _RESULT_FILES:  # a redone cell starts clean
        (d / name).unlink(missing_ok=True)
    store.init_cell(cell.key, cell.config, cell.label)
    t0 = time.monotonic()
    summary: dict = {"suites": {}, "load": None, "capacity": None, "error": None, "target": session.info}
    if startup_s is not None:
        summary["startup_s"] = startup_s
    startup_s = startup_s or 0.0
    try:
        session.flush()
        if cell.run_accuracy and sweep.suites:
            items: list[dict] = []
            try:
                fidelity = refs.for_cell(cell, session)
                for spec in sweep.suites:
                    display.phase(f"{cell.label}: {spec.name}")
                    records, suite_summary = work.suite(spec, session.client, cell, fidelity)
                    items.extend(records)
                    summary["suites"][spec.name] = suite_summary
            finally:  # what finished is kept, also when a later suite fails
                store.write_items(cell.key, items)
            _diagnose_cell(sweep, store, cell, session, display, summary)
        if sweep.load.enabled and cell.run_load and not cell.config.get("aa_control"):  # accuracy-only cells: no load
            display.phase(f"{cell.label}: load test")
            session.flush()
            load_summary, requests = work.load(session.base_url(), session.model_id, cell)
            store.write_requests(cell.key, requests)
            summary["load"] = load_summary
            if requests and not any(r.get("success") for r in requests):
                first = next((r.get("error") for r in requests if r.get("error")), "no error text")
                raise RuntimeError(f"load test: all {len(requests)} requests failed; first error: {first}")
        summary["capacity"] = session.capacity()
        if summary["capacity"] is not None:
            store.write_json(cell.key, "capacity", summary["capacity"])
        summary["elapsed_s"] = round(time.monotonic() - t0, 3)
        _replica_health(session, summary)
        if stop is not None and stop.is_set():  # its server may have been killed under it: not done
            raise SweepInterrupted("the sweep was stopped while this cell ran; --resume redoes it")
        store.write_json(cell.key, "summary", summary)
        store.set_status(cell.key, STATUS_DONE)
        took = summary["elapsed_s"] + startup_s
        display.finished(f"[green]done[/]   {cell.label} ({_took(took, startup_s)}){_brief(summary)}", took)
        return True
    except Exception as e:
        summary["elapsed_s"] = round(time.monotonic() - t0, 3)
        _replica_health(session, summary)
        err = f"{type(e).__name__}: {e}"
        _record_failure(store, cell, err, traceback.format_exc(), summary)
        display.finished(f"[red]failed[/] {cell.label}: {err.splitlines()[0][:200]}", summary["elapsed_s"] + startup_s)
        log.warning("cell %s (%s) failed: %s", cell.key, cell.label, err)
        return False
    finally:
        if callable(getattr(session, "copy_log", None)):  # several launched replicas: each one's log
            session.copy_log(d / "server.log")
        else:
            session.log_offset = _copy_log_slice(session.log_path, getattr(session, "log_offset", 0), d / "server.log")


def _replica_health(session, summary: dict) -> None:
    """A target of several replicas: which are in rotation, which were taken out and why, the failovers
    (harness/replica_client.py), as ``summary["replica_health"]``."""
    health = getattr(session, "replica_health", None)
    if callable(health):
        summary["replica_health"] = health()


_RESULT_FILES = ("items.jsonl", "requests.jsonl", "capacity.json", "summary.json", "error.txt", "server.log",
                 "diagnostics.json")


def _diagnose_cell(sweep, store: RunStore, cell: Cell, session, display, summary: dict) -> None:
    """The cell's per-layer diagnostics when the sweep asks for them (``diagnostics:``; embedded, quantized)."""
    from kvbench.harness.cell_diagnostics import brief, run_cell_diagnostics, wants_diagnostics

    spec = getattr(sweep, "diagnostics", None)
    if not wants_diagnostics(spec, cell.config, session.client):
        return
    display.phase(f"{cell.label}: diagnostics")
    diag = run_cell_diagnostics(spec, session.client, sweep.data_dir,
                                progress=lambda s: display.phase(f"{cell.label}: diagnostics: {s}"))
    store.write_json(cell.key, "diagnostics", diag)
    summary["diagnostics"] = brief(diag)


def _record_failure(store: RunStore, cell: Cell, err: str, tb: str, summary: dict) -> None:
    if store.status(cell.key) is None:
        store.init_cell(cell.key, cell.config, cell.label)
    summary = {"suites": {}, "load": None, "capacity": None, **summary, "error": err}
    atomic_write_text(store.cell_dir(cell.key) / "error.txt", tb)
    store.write_json(cell.key, "summary", summary)
    store.set_status(cell.key, STATUS_FAILED)


def _copy_log_slice(log_path: Optional[Path], offset: int, dest: Path) -> int:
    """Copy the target log written since ``offset`` (the launch output goes to the group's first cell)
    into the cell directory; returns the new offset."""
    if not log_path or not Path(log_path).exists():
        return offset
    with open(log_path, "rb") as f:
        f.seek(offset)
        data = f.read()
    atomic_write_text(dest, data.decode("utf-8", errors="replace"))
    return offset + len(data)


def _took(seconds: float, startup_s: float) -> str:
    """``"12.3 s"``, or ``"12.3 s incl. 8.1 s target start-up"`` for a group's first cell."""
    return f"{seconds:.1f} s" + (f" incl. {startup_s:.1f} s target start-up" if startup_s >= 0.05 else "")


def _brief(summary: dict) -> str:
    parts = []
    for name, s in summary["suites"].items():
        errors = int(s.get("errors") or 0)
        tail = f" ({errors} error{'s' if errors != 1 else ''})" if errors else ""  # failed requests, apart from accuracy
        primary = PRIMARY_METRICS.get(name)  # the figure the report and the gate use (ruler: scores.ruler)
        if primary and isinstance(s.get(primary), (int, float)):
            parts.append(f"{name} {s[primary]:.3f}{tail}")
        elif "accuracy" in s:
            parts.append(f"{name} {s['accuracy']:.3f}{tail}")
        elif errors and not s.get("answered"):
            parts.append(f"{name} —{tail}")
        elif "kl_mean" in s:
            parts.append(f"{name} KL {s['kl_mean']:.2e}")
    load = summary.get("load") or {}
    if "output_throughput" in load:
        parts.append(f"{load['output_throughput']:.1f} out tok/s")
    return (": " + ", ".join(parts)) if parts else ""

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
manifest's provenance (git, versions, device, dates) comes from ``provenance.py``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
import traceback
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from kvbench.harness.cell_work import CellWork, DefaultWork, FidelityRef  # noqa: F401 - re-exported
from kvbench.harness.client import Client
from kvbench.harness.matrix import Cell, cell_config, engine_options, expand, groups, select
from kvbench.harness.provenance import (  # noqa: F401 - re-exported
    device_info,
    git_info,
    manifest_base,
    now_iso,
    package_versions,
)
from kvbench.harness.store import (STATUS_DONE, STATUS_FAILED, RunStore, atomic_write_text, canonical_key,
                                   remove_stale_temp_files)
from kvbench.harness.sweep_config import SweepConfig, SweepConfigError
from kvbench.harness.targets import TargetSession, open_target, reap_stale

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


class _Display:
    """A rich progress bar over cells on stderr; ``enabled=None``: one plain line per cell, no bar;
    ``False``: silent."""

    def __init__(self, total: int, enabled: Optional[bool]):
        self.enabled = enabled
        self.progress = None
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

    def phase(self, text: str) -> None:
        if self.progress:
            self.progress.update(self.task, description=text)

    def finished(self, line: str) -> None:
        if self.progress:
            self.progress.console.print(line)
            self.progress.advance(self.task)
        elif self.enabled is None:  # plain lines (no bar)
            import re
            import sys

            print(re.sub(r"\[/?[a-z]*\]", "", line), file=sys.stderr, flush=True)


class RunInUseError(SweepConfigError):
    """Another sweep holds the run directory's lock."""


class RunLock:
    """An exclusive advisory lock (``fcntl.flock``) on ``RUN/.lock``, held for a whole sweep, so a second
    sweep on the same run directory stops before it touches anything (it would re-run the same cells
    and reap the first sweep's live servers).  Released on exit, exceptions included; the OS releases it
    when the process dies, so a crashed sweep never leaves the directory locked.  The file holds the
    holder's pid (for the error message) and is left in place: unlinking a flock'd file races."""

    NAME = ".lock"

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.path = self.root / self.NAME
        self.fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as e:
            raise SweepConfigError(f"cannot use {self.root} as a run directory: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            except OSError:
                holder = "unknown"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunInUseError(f"{self.root} is in use by another sweep (pid {holder}); wait for it to finish "
                                    "or use another --out directory") from None
            raise SweepConfigError(f"cannot lock {self.path}: {e.strerror or e}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.ftruncate(fd, 0)  # no stale pid for the next reader
            except OSError:
                pass
            os.close(fd)  # closing the only descriptor drops the flock

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# What a finished cell's results depend on besides its own cell config (the cell key hashes the cell config
# only): on --resume these must not change while any cell is done.  ``gate``, ``description``, ``name`` and
# ``baseline`` only steer reports (an A/A control cell copies the baseline's config into its own key), so
# they may change; the matrix may grow (new cells get new keys).
_RUN_KEYS = ("engine", "suites", "load", "slo", "seed", "data_dir")
_MATRIX_KEYS = ("models", "targets", "backends", "kv", "concurrency", "accuracy_concurrency", "aa_control", "baseline")


def _read_manifest(store: RunStore) -> dict:
    path = store.manifest_path
    try:
        old = store.manifest()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SweepConfigError(f"{path} is not valid JSON ({e}); restore it, or use a new --out directory") from None
    except OSError as e:
        raise SweepConfigError(f"cannot read {path}: {e.strerror or e}") from None
    cells = old.get("cells") if isinstance(old, dict) else None
    if (not isinstance(old, dict) or not isinstance(old.get("config"), dict) or not isinstance(cells, list)
            or not all(isinstance(c, dict) and isinstance(c.get("key"), str) for c in cells)):
        raise SweepConfigError(f"{path} is not a kvbench sweep manifest (no config and cells); restore it, "
                               "or use a new --out directory")
    return old


def _norm_dir(p: Optional[str]) -> Optional[str]:
    return None if p is None else os.path.realpath(p)


def _diff(a, b, path: str, out: list[str]) -> None:
    """Paths (``load.num_prompts``, ``suites[0].limit``) where ``a`` and ``b`` differ, with both values."""
    if a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            _diff(a.get(k), b.get(k), f"{path}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out)
    else:
        out.append(f"{path}: was {json.dumps(a, default=str)}, now {json.dumps(b, default=str)}")


def _check_resume(store: RunStore, sweep: SweepConfig, cells: list[Cell]) -> dict:
    """Refuse to resume when a finished cell would be reused although something that produced it changed.

    Cells are keyed by their cell config only, so: every cell of the old run with results on disk must
    still be in the matrix; a finished cell must keep its config and whether it runs the accuracy suites;
    while any cell is finished, the engine options, the targets its cells ran on, the suites, the load
    test, the SLOs, the seed and the data directory (compared as a real path) must be the same.  New cells
    may be added, and with no finished cell nothing is reused, so anything may change."""
    old = _read_manifest(store)
    prev, cur = old["config"], sweep.to_dict()
    old_cells = {c["key"]: c for c in old["cells"]}
    new_cells = {c.key: c for c in cells}
    base = store.root / "cells"
    on_disk = {}
    if base.is_dir():
        for d in base.iterdir():
            st = store.status(d.name) if d.is_dir() else None
            if st is not None:
                on_disk[d.name] = st
    done = sorted(k for k, st in on_disk.items() if st == STATUS_DONE)

    def labels(keys) -> str:
        keys = sorted(keys)
        names = [str(old_cells.get(k, {}).get("label") or k) for k in keys[:6]]
        return ", ".join(names) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")

    problems: list[str] = []
    advice: list[str] = []
    matrix_changed = False
    dropped = [k for k in on_disk if k in old_cells and k not in new_cells]
    if dropped:
        matrix_changed = True
        problems.append(f"cells of this run are not in the new matrix: {labels(dropped)}")
        advice.append("keep those cells in the config (--only picks which cells run)")
    unknown = [k for k in done if k not in old_cells and k in new_cells]
    if unknown:
        problems.append(f"finished cells the manifest does not describe: {', '.join(unknown)}")
    changed = [k for k in done if k in old_cells and k in new_cells
               and (old_cells[k].get("config") != new_cells[k].config
                    or bool(old_cells[k].get("run_accuracy")) != new_cells[k].run_accuracy)]
    if changed:
        matrix_changed = True
        problems.append(f"finished cells would change whether they run the accuracy suites: {labels(changed)}")
    differs = []
    if matrix_changed:
        differs += [k for k in _MATRIX_KEYS if prev.get(k) != cur.get(k)]
    if done:
        for k in _RUN_KEYS:
            a, b = prev.get(k), cur.get(k)
            if k == "data_dir":
                if _norm_dir(a) != _norm_dir(b):
                    differs.append(k)
                    problems.append(f"data_dir: was {a or '(none)'}, now {b or '(none)'}")
                    advice.append(f"pass the original --data-dir {a}" if a else
                                  "run without --data-dir (the run was made without a data directory)")
                continue
            if a != b:
                differs.append(k)
                lines: list[str] = []
                _diff(a, b, k, lines)
                problems.append("; ".join(lines[:4]) + (f" (and {len(lines) - 4} more)" if len(lines) > 4 else ""))
        used = {old_cells[k].get("config", {}).get("target") for k in done if k in old_cells}
        old_targets = {t.get("name"): t for t in prev.get("targets") or [] if isinstance(t, dict)}
        new_targets = {t["name"]: t for t in cur["targets"]}
        for name in sorted(n for n in used if n is not None):
            if old_targets.get(name) != new_targets.get(name):
                if "targets" not in differs:
                    differs.append("targets")
                lines = []
                _diff(old_targets.get(name), new_targets.get(name), f"target {name}", lines)
                problems.append("; ".join(lines[:4]))
    if problems:
        made = f"; its {len(done)} finished cell{'s were' if len(done) != 1 else ' was'} made with the old values" if done else ""
        todo = " and ".join(dict.fromkeys(advice)) or "restore the original values"
        raise SweepConfigError(
            f"{store.root} was made with a different config (differs in: {', '.join(dict.fromkeys(differs)) or 'cells'}): "
            f"{'; '.join(problems)}{made}; to resume, {todo}, or use a new --out directory")
    return old


def _manifest(store: RunStore, sweep: SweepConfig, cells: list[Cell], resume: bool, only: Optional[str]) -> dict:
    """The run's manifest: the current config (report-only changes such as ``gate`` take effect), the full
    matrix and one entry per run; checks that a resumed run may reuse its finished cells."""
    prev = _check_resume(store, sweep, cells) if store.exists() else {}
    m = manifest_base(sweep)
    m["created"] = prev.get("created", m["created"])
    m["cells"] = [{"key": c.key, "label": c.label, "config": c.config, "run_accuracy": c.run_accuracy} for c in cells]
    m["runs"] = list(prev.get("runs", [])) + [{"started": now_iso(), "resume": resume, "only": only,
                                                "git": m["git"], "device": m["device"]}]
    return m


def run_sweep(sweep: SweepConfig, out: Path | str, resume: bool = False, only: Optional[str] = None,
              work: Optional[CellWork] = None, progress: Optional[bool] = True,
              opener: Callable = open_target) -> SweepOutcome:
    """Run (or resume) the sweep into ``out``; returns which cells finished, failed or were skipped.

    The run directory is locked (``RunLock``) before anything in it is read or written."""
    store = RunStore(out)
    all_cells = expand(sweep)
    cells = select(all_cells, only)
    with RunLock(store.root):
        return _run_locked(sweep, store, all_cells, cells, resume, only, work, progress, opener)


def _run_locked(sweep: SweepConfig, store: RunStore, all_cells: list[Cell], cells: list[Cell], resume: bool,
                only: Optional[str], work: Optional[CellWork], progress: Optional[bool], opener: Callable) -> SweepOutcome:
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

    with _Display(len(todo), progress if todo else False) as display:
        for group in groups(todo):
            _run_group(sweep, store, group, work, refs, opener, display, outcome)

    manifest["device"] = manifest["runs"][-1]["device"] = device_info()  # now with the GPUs torch saw
    manifest["runs"][-1].update(finished=now_iso(), done=len(outcome.done), failed=len(outcome.failed),
                                skipped=len(outcome.skipped))
    store.write_manifest(manifest)
    return outcome


def _run_group(sweep, store, group, work, refs, opener, display, outcome) -> None:
    first = group[0]
    spec = sweep.target(first.config["target"])
    log_path = store.root / "logs" / f"{first.key}.log"
    display.phase(f"{first.label}: starting target")
    try:
        ctx = opener(spec, first.config, engine_options(sweep, first), log_path)
        session = ctx.__enter__()
    except Exception as e:  # the target did not come up: every cell of the group fails with that error
        err = f"target {spec.name!r} failed to start: {type(e).__name__}: {e}"
        for cell in group:
            _record_failure(store, cell, err, traceback.format_exc(), {})
            outcome.failed.append(cell.key)
            display.finished(f"[red]failed[/] {cell.label}: {err.splitlines()[0]}")
        return
    try:
        for cell in group:
            ok = _run_cell(sweep, store, cell, session, work, refs, display)
            (outcome.done if ok else outcome.failed).append(cell.key)
    finally:
        ctx.__exit__(None, None, None)


def _run_cell(sweep: SweepConfig, store: RunStore, cell: Cell, session: TargetSession, work: CellWork,
              refs: FidelityRefs, display: _Display) -> bool:
    d = store.cell_dir(cell.key)
    for name in _RESULT_FILES:  # a redone cell starts clean
        (d / name).unlink(missing_ok=True)
    store.init_cell(cell.key, cell.config, cell.label)
    t0 = time.monotonic()
    summary: dict = {"suites": {}, "load": None, "capacity": None, "error": None, "target": session.info}
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
        if sweep.load.enabled and not cell.config.get("aa_control"):  # the A/A cell repeats accuracy only
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
        store.write_json(cell.key, "summary", summary)
        store.set_status(cell.key, STATUS_DONE)
        display.finished(f"[green]done[/]   {cell.label} ({summary['elapsed_s']:.1f} s){_brief(summary)}")
        return True
    except Exception as e:
        summary["elapsed_s"] = round(time.monotonic() - t0, 3)
        err = f"{type(e).__name__}: {e}"
        _record_failure(store, cell, err, traceback.format_exc(), summary)
        display.finished(f"[red]failed[/] {cell.label}: {err.splitlines()[0][:200]}")
        log.warning("cell %s (%s) failed: %s", cell.key, cell.label, err)
        return False
    finally:
        session.log_offset = _copy_log_slice(session.log_path, getattr(session, "log_offset", 0), d / "server.log")


_RESULT_FILES = ("items.jsonl", "requests.jsonl", "capacity.json", "summary.json", "error.txt", "server.log")


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


def _brief(summary: dict) -> str:
    parts = []
    for name, s in summary["suites"].items():
        errors = int(s.get("errors") or 0)
        tail = f" ({errors} error{'s' if errors != 1 else ''})" if errors else ""  # failed requests, apart from accuracy
        if "accuracy" in s:
            parts.append(f"{name} {s['accuracy']:.3f}{tail}")
        elif errors and not s.get("answered"):
            parts.append(f"{name} —{tail}")
        elif "kl_mean" in s:
            parts.append(f"{name} KL {s['kl_mean']:.2e}")
    load = summary.get("load") or {}
    if "output_throughput" in load:
        parts.append(f"{load['output_throughput']:.1f} out tok/s")
    return (": " + ", ".join(parts)) if parts else ""


class _BorrowedClient:
    """A client handed to code that closes it, whose real owner closes it later (or runs ``on_close``)."""

    def __init__(self, client: Client, on_close: Optional[Callable[[], None]] = None):
        self._client, self._on_close = client, on_close
        self.model_id = client.model_id

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def close(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()


class FidelityRefs:
    """The fidelity reference of each cell: bf16 KV and torch backends for embedded targets (the target's
    own backends otherwise), same model, target and engine options.  When the cell being run is that
    configuration its own client serves the reference; otherwise the reference target is opened only
    when the suite asks (a cache miss) and closed as soon as the suite closes its client."""

    def __init__(self, sweep: SweepConfig, cache_dir: Path, opener: Callable):
        self.sweep, self.cache_dir, self.opener = sweep, Path(cache_dir), opener

    def reference_cell(self, cell: Cell) -> Cell:
        c = cell.config
        embedded = self.sweep.target(c["target"]).type == "embedded"
        pre, dec = ("torch", "torch") if embedded else (c["prefill_backend"], c["decode_backend"])
        cfg = cell_config(c["model"], c["target"], pre, dec, "bf16", "unit", c["concurrency"])
        return Cell(key=canonical_key(cfg), label="fidelity reference", config=cfg, index=-1, run_accuracy=True)

    def for_cell(self, cell: Cell, session: TargetSession) -> FidelityRef:
        ref = self.reference_cell(cell)
        ekw = engine_options(self.sweep, ref)
        desc = {k: v for k, v in ref.config.items() if k != "concurrency"}
        label = f"{ref.config['model']}:{ref.config['target']}:bf16:{canonical_key({**desc, 'engine': ekw})}"

        def make_client() -> Client:
            if ref.group == cell.group:
                return _BorrowedClient(session.client)
            stack = ExitStack()
            target = self.sweep.target(ref.config["target"])
            log_path = self.cache_dir.parent / "logs" / f"reference-{ref.key}.log"
            ref_session = stack.enter_context(self.opener(target, ref.config, ekw, log_path))
            return _BorrowedClient(ref_session.client, on_close=stack.close)

        self.cache_dir.mkdir(parents=True, exist_ok=True)
        return FidelityRef(label, make_client, self.cache_dir)

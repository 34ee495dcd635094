"""The sweep runner: cells in order, one target launch per cell group, results written atomically.

For every cell: flush the target's prefix cache, run the accuracy suites (only in the cell whose
concurrency is the sweep's ``accuracy_concurrency``), the load test (every cell; prompts salted with the
cell key so no cell reuses another's prefixes), and record the KV capacity.  A cell is ``done`` only
when its ``status`` file says so; a cell that raises is recorded ``failed`` with its error in
``summary.json`` (and the traceback in ``error.txt``) and the sweep goes on.  ``resume=True`` skips done
cells and redoes every other one.  What a cell runs comes from a ``CellWork`` (``cell_work.py``; tests
inject fakes, the default ``DefaultWork`` calls the suites, the fidelity suite and the load generator); the
manifest's provenance (git, versions, device, dates) comes from ``provenance.py``.
"""

from __future__ import annotations

import logging
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
from kvbench.harness.store import STATUS_DONE, STATUS_FAILED, RunStore, atomic_write_text, canonical_key
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


def _check_resume(store: RunStore, sweep: SweepConfig) -> dict:
    old = store.manifest()
    if old.get("config") != sweep.to_dict():
        prev, cur = old.get("config") or {}, sweep.to_dict()
        diff = sorted(k for k in set(prev) | set(cur) if prev.get(k) != cur.get(k))
        raise SweepConfigError(f"{store.root} was made with a different config (differs in: {', '.join(diff)}); "
                               "use a new --out directory")
    return old


def _manifest(store: RunStore, sweep: SweepConfig, cells: list[Cell], resume: bool, only: Optional[str]) -> dict:
    prev = _check_resume(store, sweep) if store.exists() else {}
    m = manifest_base(sweep)
    m["created"] = prev.get("created", m["created"])
    m["cells"] = [{"key": c.key, "label": c.label, "config": c.config, "run_accuracy": c.run_accuracy} for c in cells]
    m["runs"] = list(prev.get("runs", [])) + [{"started": now_iso(), "resume": resume, "only": only,
                                                "git": m["git"], "device": m["device"]}]
    return m


def run_sweep(sweep: SweepConfig, out: Path | str, resume: bool = False, only: Optional[str] = None,
              work: Optional[CellWork] = None, progress: Optional[bool] = True,
              opener: Callable = open_target) -> SweepOutcome:
    """Run (or resume) the sweep into ``out``; returns which cells finished, failed or were skipped."""
    store = RunStore(out)
    if store.exists() and not resume:
        raise SweepConfigError(f"{store.root} already holds a run; pass --resume to finish it or choose another --out")
    all_cells = expand(sweep)
    cells = select(all_cells, only)
    manifest = _manifest(store, sweep, all_cells, resume, only)
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
        if "accuracy" in s:
            parts.append(f"{name} {s['accuracy']:.3f}")
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

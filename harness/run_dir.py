"""A sweep's run directory: the lock that keeps one sweep at a time in it (``RunLock``) and the check that a
resumed run may reuse its finished cells (``_check_resume``)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Optional

from kvbench.harness.matrix import Cell
from kvbench.core import STATUS_DONE, RunStore
from kvbench.harness.sweep.config import SweepConfig, SweepConfigError


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


def _backfill(prev: dict, cur: dict) -> dict:
    """The old run's config with the keys a newer kvbench added (absent from its manifest) filled in, so that
    resuming a run made before a schema addition does not read as a changed config.  A missing key takes
    the current value only when that value is unset (None, empty, or the dataclass default): a new option
    set to something else did not produce the old cells and still reads as a change."""
    from dataclasses import MISSING, fields

    from kvbench.harness.sweep.specs import LoadSpec, SuiteSpec, TargetSpec

    def defaults(cls) -> dict:
        out = {}
        for f in fields(cls):
            if f.default is not MISSING:
                out[f.name] = f.default
            elif f.default_factory is not MISSING:  # type: ignore[misc]
                out[f.name] = f.default_factory()  # type: ignore[misc]
        return out

    def fill(old, new, cls):
        if not isinstance(old, dict) or not isinstance(new, dict):
            return old
        unset = defaults(cls)
        out = dict(old)
        for k, v in new.items():
            if k not in old and (v in (None, "", {}, []) or (k in unset and unset[k] == v)):
                out[k] = v
        return out

    def by_name(entries) -> dict:
        return {e.get("name"): e for e in entries or [] if isinstance(e, dict)}

    out = dict(prev)
    if isinstance(out.get("suites"), list):
        new = by_name(cur.get("suites"))
        out["suites"] = [fill(s, new.get(s.get("name")), SuiteSpec) if isinstance(s, dict) else s for s in out["suites"]]
    if isinstance(out.get("targets"), list):
        new = by_name(cur.get("targets"))
        out["targets"] = [fill(t, new.get(t.get("name")), TargetSpec) if isinstance(t, dict) else t for t in out["targets"]]
    if isinstance(out.get("load"), dict):
        out["load"] = fill(out["load"], cur.get("load"), LoadSpec)
    return out


# target keys that do not change what a finished cell measured: which GPUs its servers used (``devices``), and
# after how many connection failures in a row a replica leaves the rotation (``replica_max_failures``; a
# ``kvbench sweep --replica-max-failures`` override): a resume may change them
_PLACEMENT_KEYS = ("devices", "replica_max_failures")


def _placed(target: dict) -> dict:
    """A target's config without what only places its work (``_PLACEMENT_KEYS``)."""
    return {k: v for k, v in target.items() if k not in _PLACEMENT_KEYS}


def _check_resume(store: RunStore, sweep: SweepConfig, cells: list[Cell]) -> dict:
    """Refuse to resume when a finished cell would be reused although something that produced it changed.

    Cells are keyed by their cell config only, so: every cell of the old run with results on disk must
    still be in the matrix; a finished cell must keep its config and whether it runs the accuracy suites;
    while any cell is finished, the engine options, the targets its cells ran on, the suites, the load
    test, the SLOs, the seed and the data directory (compared as a real path) must be the same.  New cells
    may be added, and with no finished cell nothing is reused, so anything may change."""
    old = _read_manifest(store)
    cur = sweep.to_dict()
    prev = _backfill(old["config"], cur)
    old_cells = {c["key"]: c for c in old["cells"]}
    new_cells = {c.key: c for c in cells}
    on_disk = _cells_on_disk(store)
    done = sorted(k for k, st in on_disk.items() if st == STATUS_DONE)
    problems: list[str] = []
    advice: list[str] = []
    matrix_changed = _cell_problems(on_disk, done, old_cells, new_cells, problems, advice)
    differs = []
    if matrix_changed:
        differs += [k for k in _MATRIX_KEYS if prev.get(k) != cur.get(k)]
    if done:
        _run_key_problems(prev, cur, differs, problems, advice)
        _target_problems(prev, cur, {old_cells[k].get("config", {}).get("target") for k in done if k in old_cells},
                         differs, problems)
    if problems:
        made = f"; its {len(done)} finished cell{'s were' if len(done) != 1 else ' was'} made with the old values" if done else ""
        todo = " and ".join(dict.fromkeys(advice)) or "restore the original values"
        raise SweepConfigError(
            f"{store.root} was made with a different config (differs in: {', '.join(dict.fromkeys(differs)) or 'cells'}): "
            f"{'; '.join(problems)}{made}; to resume, {todo}, or use a new --out directory")
    return old


def _cells_on_disk(store: RunStore) -> dict:
    """``{cell key: status}`` of the cell directories with a status on disk."""
    base = store.root / "cells"
    on_disk = {}
    if base.is_dir():
        for d in base.iterdir():
            st = store.status(d.name) if d.is_dir() else None
            if st is not None:
                on_disk[d.name] = st
    return on_disk


def _cell_problems(on_disk: dict, done: list, old_cells: dict, new_cells: dict, problems: list[str],
                   advice: list[str]) -> bool:
    """Append what the matrix's cells would break to ``problems`` / ``advice``; whether the matrix changed
    under a cell with results (cells dropped, or finished cells whose config or suites changed)."""

    def labels(keys) -> str:
        keys = sorted(keys)
        names = [str(old_cells.get(k, {}).get("label") or k) for k in keys[:6]]
        return ", ".join(names) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")

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
                    or bool(old_cells[k].get("run_accuracy")) != new_cells[k].run_accuracy
                    # manifests from before run_load: every cell but the A/A control ran the load test
                    or bool(old_cells[k].get("run_load", not (old_cells[k].get("config") or {}).get("aa_control")))
                    != getattr(new_cells[k], "run_load", True))]
    if changed:
        matrix_changed = True
        problems.append(f"finished cells would change whether they run the accuracy suites or the load test: "
                        f"{labels(changed)}")
    return matrix_changed


def _run_key_problems(prev: dict, cur: dict, differs: list[str], problems: list[str], advice: list[str]) -> None:
    """The run-wide settings (``_RUN_KEYS``) that changed under finished cells, into ``differs`` / ``problems``."""
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


def _target_problems(prev: dict, cur: dict, used: set, differs: list[str], problems: list[str]) -> None:
    """The targets the finished cells ran on (``used``) that changed, into ``differs`` / ``problems``."""
    # what only places a target's work (its ``devices``, ``replica_max_failures``) may change on a resume
    old_targets = {t.get("name"): _placed(t) for t in prev.get("targets") or [] if isinstance(t, dict)}
    new_targets = {t["name"]: _placed(t) for t in cur["targets"]}
    for name in sorted(n for n in used if n is not None):
        if old_targets.get(name) != new_targets.get(name):
            if "targets" not in differs:
                differs.append("targets")
            lines: list[str] = []
            _diff(old_targets.get(name), new_targets.get(name), f"target {name}", lines)
            problems.append("; ".join(lines[:4]))

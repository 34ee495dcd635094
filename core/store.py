"""The run directory (docs/design.md §10) and the selectors over its cells.

    RUN/manifest.json
    RUN/cells/<key>/cell.json  items.jsonl  requests.jsonl  capacity.json  summary.json  status

Every file goes through ``core.io``'s atomic writes.  A cell counts as finished only when its ``status``
file says ``done``; everything else is redone by ``--resume``.  Reports and the gate read runs through
this module alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from kvbench.core.io import StoreError, atomic_write_json, atomic_write_jsonl, atomic_write_text, read_jsonl
from kvbench.core.records import SCHEMA_VERSION
from kvbench.core.kv_config import is_kv_option, kv_option, list_valued_options

__all__ = [
    "SCHEMA_VERSION", "STATUS_DONE", "STATUS_FAILED", "STATUS_RUNNING", "StoreError", "OutDirError",
    "check_out_dir", "CellRef", "RunStore", "parse_selector", "matches", "select_cells",
]

STATUS_DONE = "done"
STATUS_FAILED = "failed"
STATUS_RUNNING = "running"


class OutDirError(StoreError, ValueError):
    """An output directory that cannot be used (a file, under a file, not writable, already holding results).

    A ``ValueError`` too, so commands that turn ``ValueError`` into a one-line usage error do so for it."""


def check_out_dir(path: Path | str, flag: str = "--out") -> Path:
    """Check, before any work, that ``path`` can be used as an output directory; returns it as a Path.

    It may exist (as a directory) or not; when it does not, its nearest existing ancestor must be a writable
    directory so that it can be created.  Nothing is created here.  Raises :class:`OutDirError` with a
    one-line message naming ``flag`` otherwise."""
    p = Path(path)
    if p.exists() or p.is_symlink():
        if not p.is_dir():
            raise OutDirError(f"{flag} {p} is not a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise OutDirError(f"{flag} {p} is not writable")
        return p
    parent = p.absolute().parent
    while not (parent.exists() or parent.is_symlink()):
        parent = parent.parent
    if not parent.is_dir():
        raise OutDirError(f"{flag} {p} is not a directory ({parent} is a file)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutDirError(f"{flag} {p} cannot be created ({parent} is not writable)")
    return p


@dataclass
class CellRef:
    key: str
    path: Path
    config: dict
    label: str
    status: Optional[str]

    @property
    def done(self) -> bool:
        return self.status == STATUS_DONE


class RunStore:
    def __init__(self, root: Path | str):
        self.root = Path(root)

    # -- manifest
    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    def write_manifest(self, manifest: dict) -> None:
        atomic_write_json(self.manifest_path, {"schema_version": SCHEMA_VERSION, **manifest})

    def manifest(self) -> dict:
        if not self.manifest_path.exists():
            raise StoreError(f"{self.root} is not a kvbench run (no manifest.json)")
        return json.loads(self.manifest_path.read_text())

    def exists(self) -> bool:
        return self.manifest_path.exists()

    # -- cells
    def cell_dir(self, key: str) -> Path:
        return self.root / "cells" / key

    def cells(self) -> list[CellRef]:
        base = self.root / "cells"
        if not base.is_dir():
            return []
        refs = []
        for d in sorted(p for p in base.iterdir() if p.is_dir()):
            cj = d / "cell.json"
            if not cj.exists():
                continue
            meta = json.loads(cj.read_text())
            refs.append(CellRef(d.name, d, meta.get("config", {}), meta.get("label", d.name), self.status(d.name)))
        return refs

    def init_cell(self, key: str, config: dict, label: str) -> Path:
        d = self.cell_dir(key)
        atomic_write_json(d / "cell.json", {"key": key, "label": label, "config": config})
        self.set_status(key, STATUS_RUNNING)
        return d

    def status(self, key: str) -> Optional[str]:
        p = self.cell_dir(key) / "status"
        return p.read_text().strip() if p.exists() else None

    def set_status(self, key: str, status: str) -> None:
        atomic_write_text(self.cell_dir(key) / "status", status + "\n")

    def is_done(self, key: str) -> bool:
        return self.status(key) == STATUS_DONE

    # -- records
    def write_items(self, key: str, records: Iterable[dict]) -> None:
        atomic_write_jsonl(self.cell_dir(key) / "items.jsonl", records)

    def write_requests(self, key: str, records: Iterable[dict]) -> None:
        atomic_write_jsonl(self.cell_dir(key) / "requests.jsonl", records)

    def read_items(self, key: str) -> list[dict]:
        return read_jsonl(self.cell_dir(key) / "items.jsonl")

    def read_requests(self, key: str) -> list[dict]:
        return read_jsonl(self.cell_dir(key) / "requests.jsonl")

    def write_json(self, key: str, name: str, obj: Any) -> None:
        atomic_write_json(self.cell_dir(key) / f"{name}.json", obj)

    def read_json(self, key: str, name: str) -> Optional[dict]:
        p = self.cell_dir(key) / f"{name}.json"
        return json.loads(p.read_text()) if p.exists() else None

    def iter_done(self) -> Iterator[CellRef]:
        return (c for c in self.cells() if c.done)


# ------------------------------------------------------------------------------- selectors
# a selector may name the KV options of a cell's ``options`` (kvbench.core.kv_config); values of the layer sets
# hold commas (``kv_dtype_skip_layers=0,1,31``), so a bare selector part continues the previous value
NONE_VALUES = ("none", "")  # a selector value that matches a cell without the option


def parse_selector(text: str) -> dict[str, str]:
    """``key=value[,key=value]`` → dict; raises ValueError with the offending part.  After a layer-set key
    (``kv_dtype_skip_layers=0,1,31``) parts without ``=`` belong to its value."""
    out: dict[str, str] = {}
    last = None
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            if last in list_valued_options():
                out[last] += "," + part
                continue
            raise ValueError(f"selector part {part!r} is not key=value (selector {text!r})")
        k, v = part.split("=", 1)
        last = k.strip()
        out[last] = v.strip()
    if not out:
        raise ValueError("empty selector; use key=value[,key=value] over cell config keys")
    return out


def _option_matches(config: dict, key: str, want: str) -> bool:
    have = (config.get("options") or {}).get(key)
    if want.strip().lower() in NONE_VALUES:
        return have in (None, False, "none")
    if have is None:
        return False
    if key in list_valued_options():  # layer sets compare canonically
        canon = kv_option(key).parse
        try:
            return canon(want) == canon(have)
        except ValueError:
            return False
    return str(have).lower() == want.strip().lower()


def matches(config: dict, selector: dict[str, str]) -> bool:
    """Every ``key=value`` holds for the cell config: top-level keys as strings, KV options in its
    ``options`` (layer sets compared canonically; ``none`` = the option not set)."""
    for k, v in selector.items():
        if k in config:
            if str(config[k]) != v:
                return False
        elif is_kv_option(k):
            if not _option_matches(config, k, str(v)):
                return False
        else:
            return False
    return True


def select_cells(cells: list[CellRef], selector: dict[str, str]) -> list[CellRef]:
    return [c for c in cells if matches(c.config, selector)]

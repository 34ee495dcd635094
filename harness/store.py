"""Run directory and record schemas (DESIGN §10).

    RUN/manifest.json
    RUN/cells/<key>/cell.json  items.jsonl  requests.jsonl  capacity.json  summary.json  status

Every file is written to a temporary file in the same directory, fsynced, then renamed over the target,
so a crash leaves either the old file or the new one, never a torn one.  A cell counts as finished only
when its ``status`` file says ``done``; everything else is redone by ``--resume``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

SCHEMA_VERSION = 1
STATUS_DONE = "done"
STATUS_FAILED = "failed"
STATUS_RUNNING = "running"

ITEM_FIELDS = (
    "suite", "item_id", "repeat", "seed", "prompt_hash", "raw_output", "extracted", "target", "correct",
    "invalid", "finish_reason", "prompt_tokens", "output_tokens", "latency_s", "scores", "protocol",
)
REQUEST_FIELDS = (
    "request_id", "success", "error", "prompt_tokens", "output_tokens", "start_s", "ttft_s", "latency_s",
    "itl_s", "tpot_s",
)


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


class StoreError(RuntimeError):
    pass


class OutDirError(StoreError, ValueError):
    """An output directory that cannot be used (a file, under a file, not writable, already holding results).

    A ``ValueError`` too, so commands that turn ``ValueError`` into a one-line usage error do so for it."""


# ------------------------------------------------------------------------------ output directories
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


# ------------------------------------------------------------------------------ atomic writes
# atomic_write_bytes' temporary files: ".<target name>.<8 random chars from mkstemp>.tmp" beside the target
_TMP_SUFFIX = ".tmp"
_TMP_RE = re.compile(r"\.(?P<target>.+)\.[a-z0-9_]{8}" + re.escape(_TMP_SUFFIX))


def _tmp_prefix(name: str) -> str:
    return f".{name}."


def remove_stale_temp_files(directory: Path | str, recursive: bool = False) -> list[Path]:
    """Delete the temporary files that an interrupted :func:`atomic_write_bytes` left in ``directory``.

    A write killed between creating its temporary file and renaming it (SIGKILL, power loss) leaves a
    ``.<name>.<random>.tmp`` file beside ``<name>``; the target itself is intact (old or new content).  Only
    regular files whose names match that exact pattern are removed (no symlinks, directories or other
    names); ``recursive`` also cleans every sub-directory.  Returns the removed paths (sorted).  A missing
    directory is not an error.  Call it only while nothing is writing into ``directory`` (e.g. when a
    sweep resumes): a live writer's temporary file looks the same."""
    root = Path(directory)
    if not root.is_dir():
        return []
    dirs = [root]
    if recursive:
        dirs += [Path(d) for d, _, _ in os.walk(root) if Path(d) != root]
    removed = []
    for d in dirs:
        try:
            entries = list(os.scandir(d))
        except FileNotFoundError:
            continue
        for e in entries:
            if not _TMP_RE.fullmatch(e.name) or not e.is_file(follow_symlinks=False):
                continue
            try:
                os.unlink(e.path)
            except FileNotFoundError:
                continue
            removed.append(Path(e.path))
    return sorted(removed)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(path.name), suffix=_TMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path | str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def atomic_write_jsonl(path: Path | str, records: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True, default=_json_default) + "\n" for r in records))


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):  # numpy / torch scalars
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def read_jsonl(path: Path | str) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    out = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise StoreError(f"{path}:{n}: invalid JSON line ({e})") from None
    return out


def canonical_key(config: dict, length: int = 12) -> str:
    """Stable short hash of a cell's canonical config (sorted keys, no whitespace)."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def prompt_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# ---------------------------------------------------------------------------------- the store
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
def parse_selector(text: str) -> dict[str, str]:
    """``key=value[,key=value]`` → dict; raises ValueError with the offending part."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ValueError(f"selector part {part!r} is not key=value (selector {text!r})")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    if not out:
        raise ValueError("empty selector; use key=value[,key=value] over cell config keys")
    return out


def matches(config: dict, selector: dict[str, str]) -> bool:
    return all(k in config and str(config[k]) == v for k, v in selector.items())


def select_cells(cells: list[CellRef], selector: dict[str, str]) -> list[CellRef]:
    return [c for c in cells if matches(c.config, selector)]

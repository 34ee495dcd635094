"""Atomic file writes, JSON lines and the short hashes records and cell keys use (docs/design.md §10).

Every file is written to a temporary file in the same directory, fsynced, then renamed over the target,
so a crash leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterable

__all__ = [
    "StoreError",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_write_jsonl",
    "json_default",
    "read_jsonl",
    "remove_stale_temp_files",
    "canonical_json",
    "canonical_key",
    "prompt_hash",
    "cache_dir",
]


class StoreError(RuntimeError):
    """A run directory or record file that cannot be read or written as expected."""


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()

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
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=json_default) + "\n")


def atomic_write_jsonl(path: Path | str, records: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True, default=json_default) + "\n" for r in records))


def json_default(o: Any) -> Any:
    """``json.dumps(default=...)`` for numpy / torch scalars and arrays and paths (duck-typed: no import)."""
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


def canonical_json(obj: Any) -> str:
    """Sorted keys, no whitespace, ``str`` for anything else: the text a cell key hashes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def canonical_key(config: dict, length: int = 12) -> str:
    """Stable short hash of a cell's canonical config (sorted keys, no whitespace)."""
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()[:length]


def prompt_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def cache_dir() -> Path:
    """Where kvbench keeps downloaded models, converted tokenizers and weights: ``$KVBENCH_CACHE`` or
    ``~/.cache/kvbench``."""
    return Path(os.environ.get("KVBENCH_CACHE") or Path.home() / ".cache" / "kvbench")

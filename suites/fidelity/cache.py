"""The fidelity reference cache: one entry per (reference, texts, top-k, greedy window), capped in size.

An entry is ``<slot>-<model>.npz`` (arrays, no pickle) and ``<slot>-<model>.json`` (meta, written last: its
presence marks a complete entry).  ``slot`` hashes everything but the model's contents: the reference's
logits-relevant settings, where the model is (path, served id), the texts, k and the window; ``model`` hashes
the model's identity (core/model_identity.py: size, mtime, sampled content hash; harness/fidelity_key.py
says what the key holds for each kind of target).  A model rewritten at the same path keeps the slot and
changes the model part, so its old entry is never read: the reference is rebuilt, the log says so
("model file changed since the cached reference") and what changed, and the stale entry is removed.

Size cap: ``KVBENCH_FIDELITY_CACHE_MAX_MB`` (default 1024; 0 = no cap).  After every write the least
recently used entries (a hit touches its meta file) are removed until the cache fits, never the entry just
written.  An entry is removed meta first, so a reader sees a whole entry or none; a reader that loses the race
with an eviction reads a miss and recomputes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from kvbench.core import describe_change, identity_digest, identity_locator
from kvbench.suites.base import SuiteError
from kvbench.suites.fidelity.ref import CACHE_VERSION, RefText, Text, load_reference, save_reference

log = logging.getLogger(__name__)

MAX_MB_ENV = "KVBENCH_FIDELITY_CACHE_MAX_MB"
DEFAULT_MAX_MB = 1024
ORPHAN_AGE_S = 3600.0  # an .npz without its meta this old is a write that died, not one under way


@dataclass(frozen=True)
class EntryKey:
    slot: str
    model: str

    @property
    def name(self) -> str:
        return f"{self.slot}-{self.model}"


def entry_key(reference: Union[str, dict], texts: list[Text], top_k: int, greedy_tokens: int) -> EntryKey:
    """``reference``: a ``{"model": identity, "settings": {...}}`` key (harness/fidelity_key.py), or a bare
    label (a caller that knows nothing about its model: the label alone keys it)."""
    if isinstance(reference, dict):
        model = reference.get("model") or {}
        where = {"settings": reference.get("settings"), "locator": identity_locator(model)}
        digest = identity_digest(model, 12)
    else:
        where, digest = {"label": reference}, "label"
    h = hashlib.sha256()
    h.update(json.dumps({"v": CACHE_VERSION, "ref": where, "k": top_k, "g": greedy_tokens}, sort_keys=True, default=str).encode())
    for t in texts:
        h.update(json.dumps([t.item_id, t.context, t.continuation]).encode())
    return EntryKey(h.hexdigest()[:20], digest)


def max_bytes_from_env() -> Optional[int]:
    """The cap in bytes from ``KVBENCH_FIDELITY_CACHE_MAX_MB`` (None: no cap)."""
    raw = os.environ.get(MAX_MB_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_MB * 2**20
    try:
        mb = float(raw)
    except ValueError:
        raise SuiteError(f"{MAX_MB_ENV}={raw!r} is not a number of megabytes (0 = no cap)") from None
    if mb < 0:
        raise SuiteError(f"{MAX_MB_ENV} must be >= 0 megabytes (0 = no cap), got {raw}")
    return None if mb == 0 else int(mb * 2**20)


def _read_meta(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class ReferenceCache:
    """Entries under ``root``; see the module doc."""

    def __init__(self, root: Path, max_bytes: Optional[int] = None):
        self.root = Path(root)
        self.max_bytes = max_bytes

    def load(self, key: EntryKey) -> Optional[list[RefText]]:
        """The entry's references (its meta touched: recently used), or None on a miss."""
        try:
            refs = load_reference(self.root, key.name)
        except (OSError, ValueError, KeyError) as e:  # evicted under us, or damaged: recompute
            log.info("fidelity reference cache entry %s unreadable (%s): recomputing", key.name, e)
            return None
        if refs is not None:
            try:
                os.utime(self.root / f"{key.name}.json")
            except OSError:
                pass
        return refs

    def explain_miss(self, key: EntryKey, model: Optional[dict]) -> Optional[str]:
        """Why ``key`` missed when the same slot has an entry of another model: that model's change."""
        for meta_path in sorted(self.root.glob(f"{key.slot}-*.json")):
            if meta_path.stem == key.name:
                continue
            meta = _read_meta(meta_path) or {}
            old = (meta.get("reference_key") or {}).get("model")
            if old is not None and model is not None:
                return describe_change(old, model)
            return "the model's identity differs from the cached reference's"
        return None

    def save(self, key: EntryKey, refs: list[RefText], meta: dict) -> None:
        save_reference(self.root, key.name, refs, meta)
        for meta_path in self.root.glob(f"{key.slot}-*.json"):  # the same slot's other models: stale
            if meta_path.stem != key.name:
                self._remove(meta_path.stem)
        self.enforce_cap(keep=key.name)

    def _remove(self, name: str) -> int:
        """Remove one entry, meta first (a reader then sees no entry rather than half of one); its bytes."""
        freed = 0
        for suffix in (".json", ".npz"):
            p = self.root / f"{name}{suffix}"
            try:
                freed += p.stat().st_size
                p.unlink()
            except FileNotFoundError:
                continue
        return freed

    def entries(self) -> list[tuple[float, int, str]]:
        """(last use, bytes, name) of every complete entry, least recently used first."""
        out = []
        for meta_path in self.root.glob("*.json"):
            name = meta_path.stem
            try:
                used = meta_path.stat().st_mtime
                size = meta_path.stat().st_size + (self.root / f"{name}.npz").stat().st_size
            except FileNotFoundError:
                continue
            out.append((used, size, name))
        return sorted(out)

    def _orphans(self) -> int:
        """Remove .npz files whose meta never came (a write that died an hour ago or more); their bytes."""
        freed, now = 0, time.time()
        for npz in self.root.glob("*.npz"):
            try:
                if not (self.root / f"{npz.stem}.json").exists() and now - npz.stat().st_mtime > ORPHAN_AGE_S:
                    freed += npz.stat().st_size
                    npz.unlink()
            except FileNotFoundError:
                continue
        return freed

    def enforce_cap(self, keep: Optional[str] = None) -> list[str]:
        """Remove least recently used entries until the cache fits ``max_bytes``; returns the removed names."""
        self._orphans()
        if self.max_bytes is None:
            return []
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        removed = []
        for _, size, name in entries:
            if total <= self.max_bytes:
                break
            if name == keep:
                continue
            total -= size
            self._remove(name)
            removed.append(name)
        if removed:
            log.info("fidelity reference cache %s: evicted %d least recently used entr%s to stay under %.0f MB",
                     self.root, len(removed), "y" if len(removed) == 1 else "ies", self.max_bytes / 2**20)
        if total > self.max_bytes:
            log.warning("fidelity reference cache %s: entry %s alone is %.0f MB, over %s=%.0f MB; kept",
                        self.root, keep, total / 2**20, MAX_MB_ENV, self.max_bytes / 2**20)
        return removed

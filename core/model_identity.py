"""What model a path holds: a fingerprint cheap enough to take on every run (a few MB read, never the whole
file) and strict enough that a file rewritten at the same path (re-quantized, re-exported) reads as another
model.  Used by the fidelity reference cache (suites/fidelity/cache.py) to never reuse a reference computed
from other weights; both the engine side and the harness can call it (core imports nothing else from kvbench).

A file's fingerprint is its resolved path, size, modification time (ns) and a SHA-256 over its head (for a
GGUF the first ``HEAD_BYTES``: magic, metadata, tokenizer and tensor table; for a safetensors file its whole
JSON header), ``SAMPLES`` chunks of ``CHUNK_BYTES`` spread evenly over the rest, and its last chunk.  A file
no larger than the head plus the samples is hashed whole.  A Hugging Face directory is config.json, the
tokenizer and chat-template files (hashed whole: they are small) and every ``*.safetensors`` file's
fingerprint; a hub id is the directory of its resolved local snapshot.  A synthetic model is its name, its
shape (the resolved config) and its seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from pathlib import Path
from typing import Optional

__all__ = [
    "HEAD_BYTES", "file_fingerprint", "gguf_identity", "hf_dir_identity", "synthetic_identity", "model_identity",
    "identity_digest", "identity_locator", "describe_change",
]

HEAD_BYTES = 4 * 2**20  # a GGUF's metadata (tokenizer lists included) and tensor table sit at the start
SAMPLES = 16
CHUNK_BYTES = 64 * 2**10
SMALL_FILE_BYTES = 8 * 2**20  # tokenizer / config files up to this size are hashed whole
HF_SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                  "chat_template.json", "chat_template.jinja", "model.safetensors.index.json")

_memo: dict[tuple, dict] = {}
_memo_lock = threading.Lock()


def _sha_of_ranges(path: Path, ranges: list[tuple[int, int]]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for start, n in ranges:
            f.seek(start)
            h.update(struct.pack("<QQ", start, n))
            h.update(f.read(n))
    return h.hexdigest()


def _ranges(size: int, head: int) -> list[tuple[int, int]]:
    """The byte ranges a fingerprint hashes: the head, SAMPLES chunks spread over the rest, the last chunk."""
    if size <= head + (SAMPLES + 1) * CHUNK_BYTES:
        return [(0, size)]
    out = [(0, head)]
    span = size - head - CHUNK_BYTES
    for i in range(SAMPLES):
        out.append((head + span * (2 * i + 1) // (2 * SAMPLES), CHUNK_BYTES))
    out.append((size - CHUNK_BYTES, CHUNK_BYTES))
    return out


def _safetensors_head(path: Path, size: int) -> int:
    """Bytes of a safetensors file's header: the 8-byte length and the JSON it announces (the head otherwise)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
    except (OSError, struct.error):
        return min(size, HEAD_BYTES)
    return min(size, 8 + n) if n < size else min(size, HEAD_BYTES)


def file_fingerprint(path: str | os.PathLike, head: Optional[int] = None) -> dict:
    """``{"path", "size", "mtime_ns", "sha256", "hashed_bytes"}`` of one file (``head``: bytes hashed from the
    start; default ``HEAD_BYTES``, a safetensors file's header length for ``*.safetensors``).  Memoized on
    (path, size, mtime, ctime, inode, head): a sweep asks once per cell, and any write changes the ctime."""
    p = Path(path).expanduser().resolve()
    st = p.stat()
    if head is None:
        head = _safetensors_head(p, st.st_size) if p.suffix == ".safetensors" else HEAD_BYTES
    memo_key = (str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, head)  # ctime: any write, even mtime-preserving
    with _memo_lock:
        if memo_key in _memo:
            return dict(_memo[memo_key])
    ranges = _ranges(st.st_size, head)
    fp = {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
          "sha256": _sha_of_ranges(p, ranges)[:32], "hashed_bytes": sum(n for _, n in ranges)}
    with _memo_lock:
        _memo[memo_key] = fp
    return dict(fp)


def gguf_identity(path: str | os.PathLike) -> dict:
    return {"kind": "gguf", **file_fingerprint(path)}


def hf_dir_identity(path: str | os.PathLike, hub_id: Optional[str] = None) -> dict:
    """config, tokenizer / template files (whole) and every safetensors file (header + samples) of a directory."""
    d = Path(path).expanduser().resolve()
    files: dict[str, dict] = {}
    names = sorted({n for n in HF_SMALL_FILES if (d / n).is_file()} | {p.name for p in d.glob("*.safetensors")}
                   | {p.name for p in d.glob("*.tiktoken")} | {p.name for p in d.glob("*.jinja")})
    for name in names:
        f = d / name
        small = not name.endswith(".safetensors") and f.stat().st_size <= SMALL_FILE_BYTES
        fp = file_fingerprint(f, head=f.stat().st_size if small else None)
        fp.pop("path")
        files[name] = fp
    out = {"kind": "hf", "path": str(d), "files": files}
    if hub_id:
        out["hub_id"] = hub_id
    return out


def synthetic_identity(name: str, seed: int, shape: Optional[dict] = None) -> dict:
    """A synthetic model: random weights of ``shape`` (the resolved config) drawn from ``seed``."""
    return {"kind": "synthetic", "name": name, "seed": int(seed), "shape": shape}


def model_identity(kind: str, location: str, seed: int = 0, shape: Optional[dict] = None,
                   hub_id: Optional[str] = None) -> dict:
    """The identity of a resolved model (kind: gguf | hf | synthetic, as ``runtime.models.loader.resolve_model``
    gives it)."""
    if kind == "synthetic":
        return synthetic_identity(location, seed, shape)
    if kind == "gguf":
        return gguf_identity(location)
    if kind == "hf":
        return hf_dir_identity(location, hub_id)
    raise ValueError(f"unknown model kind {kind!r}; expected gguf, hf or synthetic")


def identity_digest(identity: dict, length: int = 16) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:length]


_LOCATOR_KEYS = ("kind", "path", "name", "hub_id", "model", "model_id", "url")


def identity_locator(identity: dict) -> dict:
    """Where the model is, without what it holds (kind, path / name / served model): two identities with the
    same locator and different digests are the same model name holding other weights."""
    return {k: identity[k] for k in _LOCATOR_KEYS if k in identity}


def _file_change(name: str, old: dict, new: dict) -> Optional[str]:
    parts = []
    if old.get("size") != new.get("size"):
        parts.append(f"size {old.get('size')} -> {new.get('size')} bytes")
    if old.get("mtime_ns") != new.get("mtime_ns"):
        parts.append("modification time changed")
    if old.get("sha256") != new.get("sha256"):
        parts.append("content hash changed")
    return f"{name}: {', '.join(parts)}" if parts else None


def describe_change(old: dict, new: dict) -> str:
    """One line saying how model identity ``old`` differs from ``new`` (for the cache's rebuild message)."""
    if old.get("kind") != new.get("kind"):
        return f"model kind {old.get('kind')} -> {new.get('kind')}"
    if "files" in old or "files" in new:
        of, nf = old.get("files") or {}, new.get("files") or {}
        out = [f"{n}: added" for n in sorted(set(nf) - set(of))] + [f"{n}: removed" for n in sorted(set(of) - set(nf))]
        out += [c for n in sorted(set(of) & set(nf)) if (c := _file_change(n, of[n], nf[n]))]
        return f"{new.get('path')}: " + ("; ".join(out) or "contents changed")
    if "sha256" in new:
        return _file_change(str(new.get("path")), old, new) or f"{new.get('path')}: contents changed"
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return "changed: " + ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in diff)[:500]

"""``--model org/name``: a Hugging Face hub id, taken from the local hub cache or downloaded.

A hub id is resolved only when no local file or directory of that name exists.  The local cache
(``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``) is tried first; when the
snapshot is not there and ``HF_HUB_OFFLINE`` is not set, the config, tokenizer and safetensors files are
downloaded into it.  When neither works the error says how to provide a local copy.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

__all__ = ["HUB_ID", "is_hub_id", "hub_cache_dir", "hub_offline", "hub_snapshot", "local_copy_hint"]

# owner/name, as the hub spells repository ids (no leading dot, one slash, no .gguf file name)
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")
# what a model snapshot needs: config, tokenizer files and the safetensors weights (not the other formats)
_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def is_hub_id(ref: Optional[str]) -> bool:
    """Whether ``ref`` reads as a hub id (``owner/name``) and names nothing on the local disk."""
    if not ref or not HUB_ID.match(ref) or ref.lower().endswith(".gguf") or ".." in ref:
        return False
    return not Path(ref).exists()


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home).expanduser() / "hub"


def local_copy_hint(repo_id: str) -> str:
    """How to give kvbench a local copy of a hub model (the end of every hub error)."""
    return (f"download it where the hub is reachable with `huggingface-cli download {repo_id} --local-dir DIR` and "
            "pass --model DIR, or point HF_HOME (or HF_HUB_CACHE) at a cache that holds it and set HF_HUB_OFFLINE=1")


def cached_snapshot(repo_id: str) -> Optional[str]:
    """The directory of ``repo_id``'s snapshot in the local hub cache, or None (never touches the network)."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, cache_dir=str(hub_cache_dir()), local_files_only=True, allow_patterns=_PATTERNS)
    except Exception:  # not cached (LocalEntryNotFoundError), or huggingface_hub missing
        return None


def hub_snapshot(repo_id: str) -> str:
    """A local directory holding ``repo_id``'s config, tokenizer and safetensors: the cached snapshot, else a
    download.  ValueError (saying how to provide a local copy) when the model cannot be had."""
    path = cached_snapshot(repo_id)
    if path and (Path(path) / "config.json").is_file():
        return path
    if hub_offline():
        raise ValueError(f"model {repo_id!r} is not in the Hugging Face cache ({hub_cache_dir()}) and HF_HUB_OFFLINE "
                         f"is set; {local_copy_hint(repo_id)}")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"model {repo_id!r} reads as a Hugging Face hub id, but huggingface_hub is not installed; "
                         f"pip install huggingface_hub, or {local_copy_hint(repo_id)}") from None
    try:
        path = snapshot_download(repo_id, cache_dir=str(hub_cache_dir()), allow_patterns=_PATTERNS)
    except Exception as e:  # unreachable hub, unknown or gated repository
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot get model {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {reason[:200]}); "
                         f"{local_copy_hint(repo_id)}") from None
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"hub repository {repo_id!r} has no config.json (a GGUF-only repository?); download the "
                         f".gguf file and pass --model FILE.gguf")
    return path

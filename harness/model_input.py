"""What ``--model`` may name, checked before anything loads (``--dry-run``, command start-up).

``--model`` takes a local Hugging Face directory, a GGUF file, a preset, ``synthetic:<shape>`` or a hub id
(``owner/name``, taken from the local hub cache or downloaded: ``kvbench.runtime.models.hub``).
:func:`check_model_ref` refuses, as a user error, a reference that reads as a local path but names nothing,
and a hub id that cannot be had offline; it never downloads.  No torch here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from kvbench.harness.errors import UserError

__all__ = ["looks_like_path", "check_model_ref"]


def looks_like_path(ref: str) -> bool:
    """A reference that can only mean a local file or directory: it starts with ``.``, ``/`` or ``~``, ends
    with ``.gguf``, or holds a path separator without reading as a hub id."""
    from kvbench.runtime import HUB_ID

    if ref.startswith((".", "/", "~")) or ref.lower().endswith(".gguf"):
        return True
    has_sep = "/" in ref or (os.sep != "/" and os.sep in ref)
    return has_sep and not HUB_ID.match(ref)


def check_model_ref(ref: Optional[str]) -> None:
    """Raise ``UserError`` when ``--model ref`` cannot work: a path-looking reference that does not exist,
    a directory with neither config.json nor one .gguf file, or (with ``HF_HUB_OFFLINE`` set) a hub id
    that is not in the local cache.  None (the default model), presets, ``synthetic:`` names and hub ids
    pass (a hub id is fetched when the model loads)."""
    if ref is None or ref.startswith("synthetic:"):
        return
    from kvbench.runtime import cached_snapshot, hub_offline, is_hub_id, local_copy_hint

    p = Path(ref).expanduser()
    if p.exists():
        if p.is_dir() and not (p / "config.json").is_file() and len(list(p.glob("*.gguf"))) != 1:
            raise UserError(f"--model {ref}: the directory holds neither config.json (a Hugging Face model) "
                            "nor one .gguf file")
        if p.is_file() and p.suffix.lower() != ".gguf":
            raise UserError(f"--model {ref}: a file must be a .gguf; for a Hugging Face model pass its directory")
        return
    if looks_like_path(ref):
        raise UserError(f"--model {ref}: no such file or directory")
    if is_hub_id(ref) and hub_offline() and cached_snapshot(ref) is None:
        raise UserError(f"--model {ref}: not in the Hugging Face cache and HF_HUB_OFFLINE is set; "
                        f"{local_copy_hint(ref)}")

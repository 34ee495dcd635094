"""Provenance of a sweep run for its manifest: git sha and dirtiness, package versions, device, dates."""

from __future__ import annotations

import functools

from pathlib import Path
from typing import Optional

from kvbench.harness.sweep.config import SweepConfig

_VERSIONED = ("kvbench", "torch", "triton", "transformers", "numpy", "flashinfer-python", "sglang", "vllm", "lm-eval")


def now_iso() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def git_info() -> dict:
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> Optional[str]:
        try:
            r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": bool(status) if status is not None else None}


def package_versions() -> dict:
    import platform
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def device_info() -> dict:
    import os
    import platform
    import sys

    info: dict = {"host": platform.node(), "platform": platform.platform(), "cpu_count": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    torch = sys.modules.get("torch")  # only when something already loaded it (never imported just for this)
    try:
        if torch is not None and torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["cuda"] = torch.version.cuda
    except Exception:  # torch missing or broken: the manifest still gets written
        pass
    if "gpus" not in info:  # a sweep of server targets never loads torch: ask the driver (the GPUs launched servers use)
        smi = nvidia_smi()
        if smi:
            info["gpus"] = [g["name"] for g in smi]
            info["gpu_memory_mib"] = [g["memory_mib"] for g in smi]
            info["driver"] = smi[0]["driver"]
    return info


@functools.lru_cache(maxsize=1)
def nvidia_smi() -> list[dict]:
    """``[{name, memory_mib, driver}]`` per GPU from ``nvidia-smi`` ([] without one or on any failure); asked
    once per process (the provenance and every server cell's admission default read it)."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        r = subprocess.run([exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    out = []
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[1].isdigit():
            out.append({"name": parts[0], "memory_mib": int(parts[1]), "driver": parts[2]})
    return out


def manifest_base(sweep: SweepConfig) -> dict:
    import sys

    return {
        "name": sweep.name, "config": sweep.to_dict(), "config_path": sweep.source, "baseline": sweep.baseline,
        "command": sys.argv, "git": git_info(), "versions": package_versions(), "device": device_info(),
        "created": now_iso(),
    }

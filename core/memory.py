"""Process memory: resident set size now and at its peak (Linux ``/proc/self/status``), resetting that peak,
and giving freed memory back to the system between sweep cells (``release_memory``).

CPython frees objects by reference count (cycles at the next collection), but the C allocator (glibc malloc) keeps freed blocks in its arenas
for reuse; a large model's freed tensors can stay in the process's RSS until ``malloc_trim`` hands whole free
pages back.  ``release_memory`` runs a full garbage collection (engines hold reference cycles through their
threads and callbacks) and then ``malloc_trim(0)`` where glibc is the C library; elsewhere it only collects.
Nothing here imports torch or numpy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
from typing import Optional

__all__ = ["rss_bytes", "peak_rss_bytes", "reset_peak_rss", "release_memory", "malloc_trim", "clear_callable_caches"]

_STATUS = "/proc/self/status"
_libc: Optional[ctypes.CDLL] = None
_libc_tried = False


def _status_kib(field: str) -> Optional[int]:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``), or None where there is no such file."""
    try:
        with open(_STATUS, encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes() -> int:
    """The process's resident set size now (0 where /proc is not available)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        kib = _status_kib("VmRSS")
        return (kib or 0) * 1024


def peak_rss_bytes() -> int:
    """The process's peak resident set size since it started or since the last ``reset_peak_rss``."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB
    except (ImportError, OSError):
        return 0


def reset_peak_rss() -> bool:
    """Reset the peak (VmHWM) to the current RSS, so a later ``peak_rss_bytes`` is the peak of what ran in
    between; False where the kernel does not allow it (then peaks can only be sampled)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _glibc() -> Optional[ctypes.CDLL]:
    global _libc, _libc_tried
    if not _libc_tried:
        _libc_tried = True
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
            _libc = lib if lib is not None and hasattr(lib, "malloc_trim") else None
        except OSError:
            _libc = None
    return _libc


def malloc_trim() -> bool:
    """Hand the C allocator's free pages back to the system (glibc ``malloc_trim(0)``); False elsewhere."""
    lib = _glibc()
    if lib is None:
        return False
    try:
        return bool(lib.malloc_trim(0))
    except (OSError, AttributeError):
        return False


# module-level caches keyed by callables, which keep those callables (and what they close over) alive: FastAPI
# (0.11x and later) classifies every route's endpoint function in LRU caches, so an in-process server's
# routes, closures over its engine, outlive the server.  Cleared only where the module is already loaded.
CALLABLE_CACHE_MODULES = ("fastapi.dependencies.models",)


def clear_callable_caches() -> int:
    """Clear the ``functools`` caches of ``CALLABLE_CACHE_MODULES`` (never importing them); how many."""
    n = 0
    for name in CALLABLE_CACHE_MODULES:
        mod = sys.modules.get(name)
        for attr in dir(mod) if mod is not None else ():
            fn = getattr(mod, attr, None)
            if callable(getattr(fn, "cache_clear", None)):
                fn.cache_clear()
                n += 1
    return n


def release_memory() -> int:
    """Drop callable caches that pin finished servers' engines, collect garbage, then trim the C allocator's
    arenas; returns the bytes of RSS this gave back (>= 0)."""
    before = rss_bytes()
    clear_callable_caches()
    gc.collect()
    malloc_trim()
    return max(0, before - rss_bytes())

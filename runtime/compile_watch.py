"""Triton compiles under the engine (CUDA): each is timed and counted through Triton's JIT hooks.  Before the
engine serves (its start-up warm-up, runtime/warmup.py) compiles are expected; after it, every compile is a stall
that every running request waited on, so it is logged as a warning naming the kernel and its specialization and
counted (``Engine.info()["compiles_after_warmup"]``): the step shape the warm-up did not reach, in one line.

The hooks are process-wide and only ever called on a compile (a cache miss), so they cost nothing per launch;
hooks someone else installed are kept and called first.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

__all__ = ["CompileWatch", "install_compile_watch"]

log = logging.getLogger("kvbench.runtime")


class CompileWatch:
    def __init__(self) -> None:
        self.serving = False
        self.during_warmup = 0  # compiles while no engine serves (graph capture, the warm-up: its note counts them)
        self.after_warmup = 0
        self.after_warmup_s = 0.0
        self._started: dict[str, float] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _name(kw: dict) -> str:
        text = str(kw.get("repr") or getattr(kw.get("fn"), "name", "?"))
        return text if len(text) <= 600 else text[:600] + "…"

    def before(self, **kw) -> bool:
        with self._lock:
            self._started[self._name(kw)] = time.perf_counter()
        return False  # never skips the compile

    def after(self, **kw) -> bool:
        name = self._name(kw)
        with self._lock:
            took = time.perf_counter() - self._started.pop(name, time.perf_counter())
            if not self.serving:
                self.during_warmup += 1
                return False
            self.after_warmup += 1
            self.after_warmup_s += took
        log.warning("a kernel compiled while serving (%.2f s, every running request waited): %s — a step shape "
                    "the start-up warm-up did not reach (runtime/warmup.py)", took, name)
        return False


_WATCH: Optional[CompileWatch] = None


def install_compile_watch() -> Optional[CompileWatch]:
    """The process's watch, its hooks installed on first use; None where Triton has no JIT hooks."""
    global _WATCH
    if _WATCH is not None:
        return _WATCH
    try:
        from triton import knobs
        rt = knobs.runtime
        prev_before, prev_after = rt.jit_cache_hook, rt.jit_post_compile_hook
    except Exception:  # noqa: BLE001 - an older Triton: no watch
        return None
    watch = CompileWatch()

    def before(**kw):
        if prev_before is not None and prev_before(**kw):
            return True
        return watch.before(**kw)

    def after(**kw):
        if prev_after is not None:
            prev_after(**kw)
        return watch.after(**kw)

    rt.jit_cache_hook, rt.jit_post_compile_hook = before, after
    _WATCH = watch
    return watch

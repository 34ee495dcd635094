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
        self._serving: set = set()  # the engines of this process that serve (``serve`` / ``release``)
        self._variants: dict[str, list[dict[str, str]]] = {}  # kernel name -> the specializations compiled
        self.during_warmup = 0  # compiles while no engine serves (graph capture, the warm-up: its note counts them)
        self.after_warmup = 0
        self.after_warmup_s = 0.0
        self._started: dict[str, float] = {}
        self._lock = threading.Lock()

    @property
    def serving(self) -> bool:
        """A compile now stalls a serving engine: some engine of the process serves (its warm-up done)."""
        return bool(self._serving)

    def serve(self, owner) -> None:
        """``owner`` (an engine) serves from now on: compiles are stalls until it is ``release``d.  Another engine
        constructed or warming up meanwhile does not change that: its compiles stall this one's requests too."""
        with self._lock:
            self._serving.add(id(owner))

    def release(self, owner) -> None:
        with self._lock:
            self._serving.discard(id(owner))

    @staticmethod
    def _name(kw: dict) -> str:
        text = str(kw.get("repr") or getattr(kw.get("fn"), "name", "?"))
        return text if len(text) <= 600 else text[:600] + "…"

    @staticmethod
    def _kernel(kw: dict) -> str:
        return str(getattr(kw.get("fn"), "name", None) or str(kw.get("repr") or "?").split("[")[0])

    @staticmethod
    def specialization(kw: dict) -> dict[str, str]:
        """Argument name -> what this compile fixed: a constexpr's value, or a run-time argument's type with
        ``÷16`` where Triton specialized it as divisible by 16 (a pointer's alignment, an integer); {} where the
        hook's arguments are not the expected ones."""
        try:
            c = kw.get("compile") or {}
            sig = c.get("signature") or {}
            consts = {k[0] if isinstance(k, tuple) and len(k) == 1 else k: v
                      for k, v in (c.get("constants") or {}).items()}
            attrs = (c.get("configs") or [{}])[0] or {}
            div16 = set()
            for k, v in attrs.items():
                idx = k[0] if isinstance(k, tuple) and len(k) == 1 else k
                if any(isinstance(a, (list, tuple)) and a and a[0] == "tt.divisibility" for a in v):
                    div16.add(idx)
            out = {}
            for i, (name, ty) in enumerate(sig.items()):
                if i in consts or name in consts:
                    out[name] = repr(consts.get(i, consts.get(name)))
                else:
                    out[name] = f"{ty}÷16" if i in div16 else str(ty)
            return out
        except Exception:  # noqa: BLE001 - a Triton whose hook passes other shapes: no detail
            return {}

    def _describe(self, kw: dict) -> str:
        """The compile's kernel and how its specialization differs from the nearest one compiled before (the
        argument whose class or constexpr a serving step changed), else the hook's text."""
        name, spec = self._kernel(kw), self.specialization(kw)
        seen = self._variants.setdefault(name, [])
        text = self._name(kw)
        if spec and seen:
            near = min(seen, key=lambda o: sum(o.get(k) != v for k, v in spec.items()))
            diff = [f"{k}={v} (was {near.get(k)})" for k, v in spec.items() if near.get(k) != v]
            text = f"{name}: {', '.join(diff) or 'same arguments as an earlier variant'}"
        elif spec:
            text = f"{name} (its first variant)"
        if spec:
            seen.append(spec)
        return text

    @classmethod
    def _compile_id(cls, kw: dict) -> str:
        """One compile's key, the same in both hooks: the kernel and its specialization key (the hook's text
        alone, ``(Q: ()``, is the same for every variant of a kernel)."""
        return f"{cls._kernel(kw)}|{kw.get('key')!r}"

    def before(self, **kw) -> bool:
        with self._lock:
            self._started[self._compile_id(kw)] = time.perf_counter()
        return False  # never skips the compile

    def after(self, **kw) -> bool:
        with self._lock:
            took = time.perf_counter() - self._started.pop(self._compile_id(kw), time.perf_counter())
            what = self._describe(kw)
            if not self.serving:
                self.during_warmup += 1
                return False
            self.after_warmup += 1
            self.after_warmup_s += took
        log.warning("a kernel compiled while serving (%.2f s, every running request waited): %s — a step shape "
                    "the start-up warm-up did not reach (runtime/warmup.py)", took, what)
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

"""Backend registry: name -> implementation, and the (backend, kv format, phase) support check.

Which backend runs which format in which phase is declared in ``kvbench.core.backends`` (the table the
config, the CLI and ``kvbench formats`` read too); this module attaches an implementation to each of its
names and checks engines against it.  Implementations are imported only when asked for, so looking at the
registry costs nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvbench.core import BACKEND_SPECS, backend_names
from kvbench.core import format_names
from kvbench.runtime.attention.base import PHASES, BackendOptions, UnsupportedBackend

if TYPE_CHECKING:
    from kvbench.runtime.attention.base import AttentionBackend

__all__ = ["backend_paths", "backend_class", "supports", "support_table", "check_supported", "create_backend"]



def backend_paths() -> dict[str, str]:
    """The implementation of each backend of the table, "kvbench.runtime.attention.<module>:Class" from its
    ``BackendSpec.impl`` (a module of this package), table order."""
    return {name: f"{__package__}.{spec.impl}" for name, spec in BACKEND_SPECS.items() if spec.impl}


def backend_class(name: str) -> type:
    path = backend_paths().get(name)
    if path is None:
        if name in backend_names():
            raise UnsupportedBackend(f"attention backend {name!r} is in the backend table (kvbench.core.backends) but has "
                                     "implementation (BackendSpec.impl)")
        raise UnsupportedBackend(f"unknown attention backend {name!r}; known: {', '.join(backend_paths())}")
    mod, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise UnsupportedBackend(f"attention backend {name!r} cannot be loaded ({path}): {e}") from e


def supports(name: str, kv_dtype: str, phase: str, mla: bool = False) -> bool:
    """``mla``: the model uses MLA attention (backends say so with ``supports_mla``; absent = no)."""
    try:
        cls = backend_class(name)
    except UnsupportedBackend:
        return False
    if mla:
        check = getattr(cls, "supports_mla", None)
        return bool(check and check(kv_dtype, phase))
    return bool(cls.supports(kv_dtype, phase))


def support_table(kv_dtypes=None, mla: bool = False) -> dict[str, dict[str, list[str]]]:
    """``{backend: {phase: [kv formats]}}`` of the supported combinations (of MLA models with ``mla``)."""
    kv_dtypes = kv_dtypes or format_names()
    return {b: {p: [f for f in kv_dtypes if supports(b, f, p, mla)] for p in PHASES} for b in backend_paths()}


def _table_text(mla: bool = False) -> str:
    rows = []
    for b, phases in support_table(mla=mla).items():
        for p, fmts in phases.items():
            none = "(none: no MLA path)" if mla else "(none: backend not loadable here)"
            rows.append(f"  {b:<11} {p:<8} {', '.join(fmts) or none}")
    return "\n".join(rows)


def check_supported(prefill_backend: str, decode_backend: str, kv_dtype: str, mla: bool = False) -> None:
    """Raise UnsupportedBackend naming the supported combinations, or a missing dependency.
    ``mla``: the model uses MLA attention (a smaller set of backends runs it)."""
    for phase, name in (("prefill", prefill_backend), ("decode", decode_backend)):
        cls = backend_class(name)  # clear error for unknown / unimportable names
        if not supports(name, kv_dtype, phase, mla):
            what = "an MLA model with " if mla else ""
            raise UnsupportedBackend(
                f"backend {name!r} does not support {what}kv_dtype={kv_dtype!r} for {phase}.\n"
                f"Supported{' for MLA models' if mla else ''} (backend, phase, formats):\n{_table_text(mla)}"
            )
        ok, why = cls.available()
        if not ok:
            raise UnsupportedBackend(f"backend {name!r} is not available here: {why}")


def create_backend(prefill_backend: str, decode_backend: str, opts: BackendOptions, mla: bool = False) -> "AttentionBackend":
    """The backend for an engine: one instance, or a hybrid when the two phases differ."""
    check_supported(prefill_backend, decode_backend, opts.kv_dtype, mla)
    if prefill_backend == decode_backend:
        return backend_class(prefill_backend)(opts)
    from kvbench.runtime.attention.hybrid import HybridBackend

    return HybridBackend(backend_class(prefill_backend)(opts), backend_class(decode_backend)(opts))

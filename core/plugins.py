"""Plugins: modules named in ``$KVBENCH_PLUGINS`` (comma-separated), imported once when the command line
starts, before any option or configuration is read.

A plugin adds vocabulary through the ordinary registration calls: a KV format
(``kvbench.core.formats.register_format`` + ``kvbench.kernels.formats.register_numerics``), the backends
that run it (``kvbench.core.backends.add_backend_formats``; the torch backend runs every format).  Nothing
is imported unless the variable names it.
"""

from __future__ import annotations

import importlib
import os

__all__ = ["PLUGINS_ENV", "PluginError", "plugin_names", "load_plugins"]

PLUGINS_ENV = "KVBENCH_PLUGINS"
_LOADED: list[str] = []


class PluginError(ImportError):
    """A module named in ``$KVBENCH_PLUGINS`` cannot be imported; the message names it."""


def plugin_names(value: str | None = None) -> list[str]:
    raw = os.environ.get(PLUGINS_ENV, "") if value is None else value
    return [p.strip() for p in raw.split(",") if p.strip()]


def load_plugins(value: str | None = None) -> list[str]:
    """Import every plugin module (each once); returns the names imported by this call."""
    done = []
    for name in plugin_names(value):
        if name in _LOADED:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:
            raise PluginError(f"{PLUGINS_ENV}: cannot import plugin {name!r}: {type(e).__name__}: {e}") from e
        _LOADED.append(name)
        done.append(name)
    return done

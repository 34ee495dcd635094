"""A package's entry point without the import cost: ``lazy_exports(__name__, {name: submodule})`` gives the
package its ``__all__`` and a module ``__getattr__`` (PEP 562) that imports a name's submodule the first time the
name is asked for, so ``from kvbench.runtime import EngineConfig`` loads ``runtime/config.py`` and nothing else
(no torch)."""

from __future__ import annotations

import importlib
import sys
from typing import Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, table: dict[str, str]) -> tuple[tuple[str, ...], Callable, Callable]:
    """``(__all__, __getattr__, __dir__)`` for ``package`` exporting ``table`` (name -> submodule, relative)."""

    def __getattr__(name: str):
        sub = table.get(name)
        if sub is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{sub}"), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(table) | set(vars(sys.modules[package])))

    return tuple(table), __getattr__, __dir__

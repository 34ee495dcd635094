"""Validation primitives of the sweep configuration (``sweep_config``): each checks one value and raises
``SweepConfigError`` naming the value's key path in the file and what is allowed.  No torch here."""

from __future__ import annotations

import math
from typing import Any

class SweepConfigError(ValueError):
    """The sweep configuration is invalid; the message names the key path and what is allowed."""


def _fail(path: str, msg: str) -> None:
    raise SweepConfigError(f"{path}: {msg}")


def _mapping(value: Any, path: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        _fail(path, f"expected a mapping, got {type(value).__name__} {value!r}")
    return value


def _check_keys(d: dict, allowed: tuple[str, ...], path: str) -> None:
    unknown = [k for k in d if k not in allowed]
    if unknown:
        _fail(path, f"unknown key {unknown[0]!r}; allowed keys: {', '.join(allowed)}")


def _choice(value: Any, allowed: tuple[str, ...], path: str) -> str:
    if value not in allowed:
        _fail(path, f"{value!r} is not allowed; choose one of: {', '.join(allowed)}")
    return value


def _int(value: Any, path: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(path, f"expected an integer >= {minimum}, got {value!r}")
    return value


def _num(value: Any, path: str, minimum: float = 0.0, allow_inf: bool = False) -> float:
    if isinstance(value, str) and allow_inf and value.strip().lower() in ("inf", "infinity"):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < minimum:
        _fail(path, f"expected a number >= {minimum}{' or inf' if allow_inf else ''}, got {value!r}")
    if math.isinf(value) and not allow_inf:
        _fail(path, f"expected a finite number, got {value!r}")
    return float(value)


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        _fail(path, f"expected true or false, got {value!r}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value.strip():
        _fail(path, f"expected a non-empty string, got {value!r}")
    return value


def _list(value: Any, path: str) -> list:
    if not isinstance(value, list) or not value:
        _fail(path, f"expected a non-empty list, got {value!r}")
    return value


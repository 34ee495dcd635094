"""Mixed per-layer KV formats: which layers keep a different format from the cache's own (``kv_dtype``).

Two spellings, both canonical strings so they can sit in a cell config and its key:

* ``kv_dtype_skip_layers`` (vLLM's ``--kv-cache-dtype-skip-layers``): layers kept in ``bf16`` — layer
  indices and ranges (``0,1,31``, ``0-3``) and the patterns ``sliding_window`` (every layer with a sliding
  window; ``sliding``, ``swa`` and ``local`` are accepted as the same) and ``full_attention`` (every layer
  without one; ``full``, ``global``: Gemma 3's global layers).  Canonical form: ascending indices with runs of
  three or more as ``a-b``, then the patterns: ``0,1,28-31,sliding_window``.
* ``kv_layer_dtypes``: any format per layer group, ``LAYERS:FORMAT`` groups joined by ``;``
  (``0-3:fp8_e4m3;31:bf16``; LAYERS as above, patterns included).  Canonical form: groups in the order of
  their first layer, each format once.

``resolve_layer_dtypes`` turns them into one format name per layer for a model (its layer count and
sliding windows); an unknown layer, format or pattern, or a layer named twice, is a ``ValueError`` that
says which.  No torch here.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from kvbench.core.formats import canonical_format, format_names, get_spec

__all__ = [
    "SKIP_FORMAT",
    "LAYER_PATTERNS",
    "parse_layer_set",
    "canonical_skip_layers",
    "canonical_layer_dtypes",
    "resolve_layer_dtypes",
    "layer_dtypes_summary",
    "mixed_bytes_per_token",
    "format_layer_list",
]

SKIP_FORMAT = "bf16"  # what a skipped layer keeps (the engines keep the model's dtype; bf16 is ours)
# pattern name -> accepted spellings
LAYER_PATTERNS: dict[str, tuple[str, ...]] = {
    "sliding_window": ("sliding_window", "sliding", "swa", "local"),
    "full_attention": ("full_attention", "full", "global"),
}
_PATTERN_OF = {alias: name for name, aliases in LAYER_PATTERNS.items() for alias in aliases}


def _tokens(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, bool):
        raise ValueError(f"expected layer indices, ranges or {', '.join(LAYER_PATTERNS)}, got {value!r}")
    if isinstance(value, int):
        return [str(value)]
    if isinstance(value, str):
        return [t.strip() for t in value.replace(" ", ",").split(",") if t.strip()]
    if isinstance(value, (list, tuple)):
        out: list[str] = []
        for v in value:
            out.extend(_tokens(v))
        return out
    raise ValueError(f"expected layer indices, ranges or {', '.join(LAYER_PATTERNS)}, got {type(value).__name__} {value!r}")


def parse_layer_set(value) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(indices, patterns)`` of a layer list (``"0,1,28-31,sliding_window"``, a list, or an int):
    indices sorted and unique, patterns by their canonical name.  Syntax only (no model needed)."""
    idx: set[int] = set()
    pats: list[str] = []
    for t in _tokens(value):
        low = t.lower()
        if low in _PATTERN_OF:
            if _PATTERN_OF[low] not in pats:
                pats.append(_PATTERN_OF[low])
            continue
        a, sep, b = t.partition("-")
        try:
            lo = int(a)
            hi = int(b) if sep else lo
        except ValueError:
            raise ValueError(f"{t!r} is not a layer index, a range a-b or a pattern ({', '.join(LAYER_PATTERNS)})") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"{t!r} is not a layer index or range (indices count from 0; a range is low-high)")
        idx.update(range(lo, hi + 1))
    return tuple(sorted(idx)), tuple(p for p in LAYER_PATTERNS if p in pats)


def format_layer_list(indices: Iterable[int], patterns: Iterable[str] = ()) -> str:
    """Canonical text of a layer set: ascending indices, runs of 3+ as ``a-b``, then the patterns."""
    xs = sorted(set(int(i) for i in indices))
    parts: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{xs[i]}-{xs[j]}")
        else:
            parts.extend(str(x) for x in xs[i : j + 1])
        i = j + 1
    parts.extend(p for p in LAYER_PATTERNS if p in set(patterns))
    return ",".join(parts)


def canonical_skip_layers(value) -> Optional[str]:
    """The canonical ``kv_dtype_skip_layers`` string, or None for nothing skipped (None, "", [])."""
    idx, pats = parse_layer_set(value)
    return format_layer_list(idx, pats) or None


def _groups(value) -> list[tuple[str, str]]:
    """``[(layers, format)]`` from ``"0-3:fp8_e4m3;31:bf16"`` or a mapping ``{layers: format}``."""
    if value is None or value == "" or value == {}:
        return []
    if isinstance(value, dict):
        return [(str(k), str(v)) for k, v in value.items()]
    if not isinstance(value, str):
        raise ValueError(f"expected LAYERS:FORMAT groups joined by ';' (e.g. 0-3:fp8_e4m3;31:bf16), got {value!r}")
    out = []
    for g in value.split(";"):
        g = g.strip()
        if not g:
            continue
        layers, sep, fmt = g.rpartition(":")
        if not sep or not layers.strip() or not fmt.strip():
            raise ValueError(f"{g!r} is not LAYERS:FORMAT (e.g. 0-3:fp8_e4m3)")
        out.append((layers.strip(), fmt.strip()))
    return out


def _format(name: str) -> str:
    try:
        return canonical_format(name)
    except ValueError:
        raise ValueError(f"{name!r} is not a KV format; choose one of: {', '.join(format_names())}") from None


def canonical_layer_dtypes(value) -> Optional[str]:
    """The canonical ``kv_layer_dtypes`` string (None when empty): one group per format, in the order of
    each format's first layer; a layer given twice is an error."""
    by_fmt: dict[str, tuple[set, list]] = {}
    seen: dict[int, str] = {}
    for layers, fmt in _groups(value):
        f = _format(fmt)
        idx, pats = parse_layer_set(layers)
        if not idx and not pats:
            raise ValueError(f"{layers!r}:{fmt} names no layer")
        for i in idx:
            if i in seen and seen[i] != f:
                raise ValueError(f"layer {i} is given two formats ({seen[i]} and {f})")
            seen[i] = f
        s, p = by_fmt.setdefault(f, (set(), []))
        s.update(idx)
        p.extend(x for x in pats if x not in p)
    if not by_fmt:
        return None
    first = {f: (min(s) if s else 10**9) for f, (s, _p) in by_fmt.items()}
    return ";".join(f"{format_layer_list(s, p)}:{f}" for f, (s, p) in sorted(by_fmt.items(), key=lambda kv: first[kv[0]]))


def _expand(indices, patterns, num_layers: int, windows: Sequence, what: str) -> list[int]:
    out = set()
    bad = [i for i in indices if i >= num_layers]
    if bad:
        raise ValueError(f"{what}: layer {bad[0]} is not a layer of this model (it has {num_layers}: 0..{num_layers - 1})")
    out.update(indices)
    for p in patterns:
        if p == "sliding_window":
            hits = [i for i in range(num_layers) if windows[i] is not None]
        else:
            hits = [i for i in range(num_layers) if windows[i] is None]
        if not hits:
            raise ValueError(f"{what}: the pattern {p} matches no layer of this model "
                             f"({'no layer has a sliding window' if p == 'sliding_window' else 'every layer has a sliding window'})")
        out.update(hits)
    return sorted(out)


def resolve_layer_dtypes(kv_dtype: str, num_layers: int, skip_layers=None, layer_dtypes=None,
                         sliding_windows: Optional[Sequence] = None) -> list[str]:
    """One format name per layer: ``kv_dtype`` everywhere, ``bf16`` on the skipped layers, and the groups of
    ``layer_dtypes``.  A layer both skipped and given a format is an error (say it once)."""
    kv_dtype = _format(kv_dtype)
    windows = list(sliding_windows) if sliding_windows else [None] * num_layers
    if len(windows) != num_layers:
        raise ValueError(f"sliding_windows has {len(windows)} entries for {num_layers} layers")
    out = [kv_dtype] * num_layers
    skipped = set(_expand(*parse_layer_set(skip_layers), num_layers, windows, "kv_dtype_skip_layers"))
    for i in skipped:
        out[i] = SKIP_FORMAT
    given: dict[int, str] = {}
    for layers, fmt in _groups(layer_dtypes):
        f = _format(fmt)
        for i in _expand(*parse_layer_set(layers), num_layers, windows, f"kv_layer_dtypes {layers}:{fmt}"):
            if i in skipped:
                raise ValueError(f"layer {i} is in kv_dtype_skip_layers and kv_layer_dtypes; give it once")
            if i in given and given[i] != f:
                raise ValueError(f"kv_layer_dtypes gives layer {i} two formats ({given[i]} and {f})")
            given[i] = f
            out[i] = f
    return out


def layer_dtypes_summary(layer_dtypes: Sequence[str], kv_dtype: Optional[str] = None) -> str:
    """``"fp8_e4m3 (bf16 on 0,1,31)"``: the main format (the most common, or ``kv_dtype``) and the layers
    that differ, per format."""
    if not layer_dtypes:
        return kv_dtype or ""
    main = kv_dtype or max(set(layer_dtypes), key=list(layer_dtypes).count)
    other: dict[str, list[int]] = {}
    for i, f in enumerate(layer_dtypes):
        if f != main:
            other.setdefault(f, []).append(i)
    if not other:
        return main
    return f"{main} (" + "; ".join(f"{f} on {format_layer_list(ix)}" for f, ix in other.items()) + ")"


def mixed_bytes_per_token(layer_dtypes: Sequence[str], num_kv_heads: int, head_dim: int, planes: int = 2) -> float:
    """KV bytes one token occupies over all layers, each in its own format (scales included)."""
    return float(sum(planes * num_kv_heads * get_spec(f).bytes_per_token(head_dim) for f in layer_dtypes))

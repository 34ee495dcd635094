"""The cells' KV error diagnostics (``RUN/cells/<key>/diagnostics.json``, schema ``kvbench:diagnostics:v1``,
loaded into ``CellData.diagnostics``) in the machine-readable report (``reports.export``):

* ``diagnostics_rows(cells)``: the rows of ``tables/diagnostics.csv`` (and ``report.json``'s
  ``tables.diagnostics``), one per (diagnosed cell, layer), columns ``DIAGNOSTICS_COLUMNS``:

  - ``cell_key``, ``cell`` (the report's short label), ``run``, ``kv_dtype`` (the diagnosed cache format);
  - ``layer``, ``format`` (the layer's KV format: ``bf16`` for a layer kept in bf16), ``sliding_window``;
  - ``k_rel_err_mean``, ``v_rel_err_mean``, ``attn_rel_err_mean``: relative error of K, of V and of the
    attention output, averaged over the layer's kv heads;
  - ``k_saturated_max``, ``v_saturated_max``, ``k_flushed_max``, ``v_flushed_max``: the largest share over
    the kv heads of K / V values clipped at the format's largest value / flushed to zero;
  - ``kl_loo`` (KL with only that layer in bf16) and ``kl_contribution`` (full KL minus ``kl_loo``), nats/token.

* ``diagnostics_entries(cells)``: ``report.json``'s top-level ``diagnostics`` list, one entry per diagnosed
  cell::

    {"cell_key", "cell", "run", "kv_dtype", "kv_dtype_skip_layers", "kl_full", "top1_agree", "tokens",
     "top_layers": [{"layer", "kl_contribution"}, ...],      # up to 3, largest contribution first
     "suggestion": null | {"skip_layers", "kl", "limit", "met",
                           "capacity": {"context_len", "budget_bytes",
                                        "rows": [{"name", "bytes_per_token", "tokens", "max_concurrency"}]}}}

Values are the file's own numbers (means and maxima computed here); a missing or non-finite value is None.
A cell whose file is malformed is left out with a warning (as its report section is).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Optional

__all__ = ["DIAGNOSTICS_TABLE", "DIAGNOSTICS_COLUMNS", "TOP_LAYERS", "diagnosed_cells", "diagnostics_rows",
           "diagnostics_entries"]

log = logging.getLogger("kvbench.report")

DIAGNOSTICS_TABLE = "diagnostics"  # tables/diagnostics.csv, report.json tables.diagnostics
DIAGNOSTICS_COLUMNS = ("cell_key", "cell", "run", "kv_dtype", "layer", "format", "sliding_window",
                       "k_rel_err_mean", "v_rel_err_mean", "attn_rel_err_mean", "k_saturated_max",
                       "v_saturated_max", "k_flushed_max", "v_flushed_max", "kl_loo", "kl_contribution")
TOP_LAYERS = 3  # top_layers of a report.json entry
_CAPACITY_ROW = ("name", "bytes_per_token", "tokens", "max_concurrency")


def _num(v: Any) -> Optional[float]:
    """A finite float, or None (missing, non-numeric, NaN, infinite)."""
    if v is None or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _int(v: Any) -> Optional[int]:
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    x = _num(v)
    return int(x) if x is not None and x == int(x) else None


def _plain_num(v: Any) -> Any:
    """An int stays an int, a finite float a float; anything else numeric-looking is a float; else None."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    return _num(v)


def _head_values(row: dict, part: str, key: str) -> list[float]:
    vals = row.get("attn_rel_err") if part == "attn" else (row.get(part) or {}).get(key)
    if not isinstance(vals, (list, tuple)):
        return []
    return [x for x in (_num(v) for v in vals) if x is not None]


def _mean(vals: list[float]) -> Optional[float]:
    return math.fsum(vals) / len(vals) if vals else None


def _max(vals: list[float]) -> Optional[float]:
    return max(vals) if vals else None


def _layers(diag: dict) -> list[dict]:
    rows = diag.get("layers") or []
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError("'layers' is not a list of objects")
    return sorted(rows, key=lambda r: int(r.get("layer", 0)))


def _format(diag: dict, row: dict) -> Optional[str]:
    if row.get("format"):
        return str(row["format"])
    fmts = diag.get("layer_dtypes") or []
    i = int(row.get("layer", 0))
    if isinstance(fmts, list) and 0 <= i < len(fmts) and fmts[i]:
        return str(fmts[i])
    return None if diag.get("kv_dtype") is None else str(diag["kv_dtype"])


def _kv_dtype(cell, diag: dict) -> Optional[str]:
    kv = diag.get("kv_dtype") or (cell.config or {}).get("kv_dtype")
    return None if kv is None else str(kv)


def diagnosed_cells(cells: Iterable) -> list:
    """The cells holding a diagnostics file (a dict in ``CellData.diagnostics``), in the given order."""
    return [c for c in cells if isinstance(getattr(c, "diagnostics", None), dict)]


def _cell_rows(cell) -> list[dict]:
    diag = cell.diagnostics
    kv = _kv_dtype(cell, diag)
    out = []
    for r in _layers(diag):
        row = {"cell_key": cell.key, "cell": cell.short or cell.label, "run": cell.run, "kv_dtype": kv,
               "layer": int(r.get("layer", 0)), "format": _format(diag, r),
               "sliding_window": _int(r.get("sliding_window")),
               "k_rel_err_mean": _mean(_head_values(r, "k", "rel_err")),
               "v_rel_err_mean": _mean(_head_values(r, "v", "rel_err")),
               "attn_rel_err_mean": _mean(_head_values(r, "attn", "")),
               "k_saturated_max": _max(_head_values(r, "k", "saturated")),
               "v_saturated_max": _max(_head_values(r, "v", "saturated")),
               "k_flushed_max": _max(_head_values(r, "k", "flushed")),
               "v_flushed_max": _max(_head_values(r, "v", "flushed")),
               "kl_loo": _num(r.get("kl_loo")), "kl_contribution": _num(r.get("kl_contribution"))}
        out.append(row)
    return out


def diagnostics_rows(cells: Iterable) -> list[dict]:
    """One flat dict per (diagnosed cell, layer), keys ``DIAGNOSTICS_COLUMNS`` in that order; [] when no cell
    has diagnostics."""
    out: list[dict] = []
    for cell in diagnosed_cells(cells):
        try:
            out += _cell_rows(cell)
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a malformed file costs its rows only
            log.warning("diagnostics of cell %s not exported: %s", cell.key, e)
    return out


def _top_layers(diag: dict, n: int = TOP_LAYERS) -> list[dict]:
    """The ``n`` layers with the largest measured KL contribution (ties: lower layer first)."""
    contrib = [(int(r.get("layer", 0)), _num(r.get("kl_contribution"))) for r in _layers(diag)]
    top = sorted(((layer, c) for layer, c in contrib if c is not None), key=lambda t: (-t[1], t[0]))[:n]
    return [{"layer": layer, "kl_contribution": c} for layer, c in top]


def _suggestion(diag: dict) -> Optional[dict]:
    sug = diag.get("suggestion")
    if not isinstance(sug, dict):
        return None
    cap = sug.get("capacity") if isinstance(sug.get("capacity"), dict) else {}
    rows = [r for r in (cap.get("rows") or []) if isinstance(r, dict)]
    skip = sug.get("skip_layers")
    return {"skip_layers": None if skip is None else str(skip), "kl": _num(sug.get("kl")),
            "limit": _num(sug.get("limit")), "met": None if sug.get("met") is None else bool(sug.get("met")),
            "capacity": {"context_len": _plain_num(cap.get("context_len")),
                         "budget_bytes": _plain_num(cap.get("budget_bytes")),
                         "rows": [{"name": None if r.get("name") is None else str(r["name"]),
                                   **{k: _plain_num(r.get(k)) for k in _CAPACITY_ROW[1:]}} for r in rows]}}


def _entry(cell) -> dict:
    diag = cell.diagnostics
    kl = diag.get("kl") if isinstance(diag.get("kl"), dict) else {}
    texts = diag.get("texts") if isinstance(diag.get("texts"), dict) else {}
    tokens = kl.get("tokens") if kl.get("tokens") is not None else texts.get("tokens")
    skip = diag.get("kv_dtype_skip_layers")
    return {"cell_key": cell.key, "cell": cell.short or cell.label, "run": cell.run, "kv_dtype": _kv_dtype(cell, diag),
            "kv_dtype_skip_layers": None if skip is None else str(skip), "kl_full": _num(kl.get("full")),
            "top1_agree": _num(kl.get("top1_agree")), "tokens": _int(tokens),
            "top_layers": _top_layers(diag), "suggestion": _suggestion(diag)}


def diagnostics_entries(cells: Iterable) -> list[dict]:
    """One summary dict per diagnosed cell (the module docstring's shape); [] when no cell has diagnostics."""
    out: list[dict] = []
    for cell in diagnosed_cells(cells):
        try:
            out.append(_entry(cell))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            log.warning("diagnostics of cell %s not exported: %s", cell.key, e)
    return out

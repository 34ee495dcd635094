"""Machine-readable report tables: one ``pandas.DataFrame`` per section of ``reports.analysis.Analysis``,
written as ``tables/<name>.csv`` and all together as ``report.json`` next to ``report.md``.

Load them in one line::

    tables = kvbench.reports.export.load_tables("runs/demo/report/report.json")   # {name: DataFrame}
    acc = pd.DataFrame(json.load(open("runs/demo/report/report.json"))["tables"]["accuracy"]["rows"])
    acc = pd.read_csv("runs/demo/report/tables/accuracy.csv")

``report.json`` (strict JSON: no NaN/Infinity tokens)::

    {"schema_version": "kvbench.report/1", "generated_by": "kvbench",
     "meta": {"confidence": 0.95, "baseline": {"cell_key", "cell", "run"} | null, "warnings": [...], ...},
     "tables": {name: {"columns": [column names in order], "rows": [{column: value, ...}, ...]}},
     "diagnostics": [{"cell_key", "cell", "run", "kv_dtype", "kl_full", "top_layers", "suggestion", ...}]}

Every section table (``SECTIONS``) is present in ``tables`` (an empty one has ``"rows": []``); a CSV is
written for each non-empty table only (a CSV left by an earlier report for a table that is now empty or gone
is removed).  When some cell holds a ``diagnostics.json`` (KV error anatomy), ``tables`` also has a
``diagnostics`` table (``tables/diagnostics.csv``: one row per cell and layer, K/V/attention-output errors,
saturated/flushed shares, leave-one-out KL) and the document a top-level ``diagnostics`` list (one summary
per cell: full KL, top layers, skip-layer suggestion); without any, neither the table nor the key exists.
Both are described in ``reports.diagnostics_export``.

Values are raw numbers, never the formatted strings of ``reports.tables``: accuracies, rates and deltas are
fractions (0.125, not "12.5%"), latencies are milliseconds as numbers (the ``_ms`` columns), KL in nats.  A
missing value (None, NaN) and a non-finite one (an unknown one-sided bound, −∞ in the report tables; an
infinite ratio) is ``null`` in JSON and an empty field in CSV.

Each row names its cell by ``cell_key``, ``cell`` (the short label of the report), ``run``, and the cell's
config keys as columns (model, target, prefill_backend, decode_backend, kv_dtype, kv_scales, concurrency,
any other config key, then aa_control); a config value that is a dict or a list (e.g. engine options) is
its JSON text.  Comparison tables add ``baseline_key``, ``baseline_cell`` and ``baseline_run``.

The fields of each row dataclass and the items of each dict are flattened generically, so fields added
later appear as columns without changes here:

* ``stats.Estimate`` (accuracy, and lengths per context length): mean → ``accuracy``, lo/hi →
  ``ci_low``/``ci_high``, n → ``n_questions``, method → ``interval_method``;
* ``stats.PairedDelta`` (deltas, aa, recovery per length): base_mean/cand_mean → ``baseline_mean``/
  ``cell_mean``, ci_lo/ci_hi → ``ci_low``/``ci_high``, base_only/cand_only → ``n_lost``/``n_gained``
  (null when not a K=1 0/1 comparison), any other ``base_``/``cand_`` prefix → ``baseline_``/``cell_``;
* long-context AUC (lengths): ``auc``, ``auc_ci_low``, ``auc_ci_high``, repeated on each length row of the
  (cell, suite); recovery: per length ``baseline_mean``, ``cell_mean``, ``ratio``, ``ratio_ci_low``/``_high``
  and that length's paired delta, then the AUC comparison as ``baseline_auc``, ``cell_auc``, ``auc_delta``,
  ``auc_delta_ci_low``/``_high``, ``auc_delta_lower_bound``, ``auc_ratio``, ``auc_ratio_ci_low``/``_high``...;
* a nested dataclass of another type: its fields prefixed with the field's name; a dict: its items
  (nested dicts prefixed, e.g. the serving ``slo`` dict → ``slo_ttft_ms``); a 2-tuple of numbers whose
  name ends in ``ci``: ``<name>_low``/``<name>_high``; read-only properties that return a scalar
  (``mismatched``, ``auc_ratio``, ``label``) as well.

Skipped (non-scalar values that do not flatten into one row): the ``CellData`` fields (replaced by the
identity columns above); ``LengthRow.by_length``, ``RecoveryRow.deltas``, ``PairedAuc``'s per-length tuples
and ``PositionRow.buckets`` (expanded into one row per context length or position bucket instead); the
``lengths`` tuples of the AUC objects (the rows' ``context_length``); lists and other tuples anywhere in the
analysis sections.  In ``extra`` tables a list or tuple value is kept as its JSON text.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd

from kvbench.core import atomic_write_text
from kvbench.reports.stats import paired as stats
from kvbench.reports.analysis import Analysis
from kvbench.reports.diagnostics_export import (DIAGNOSTICS_COLUMNS, DIAGNOSTICS_TABLE, diagnostics_entries,
                                                diagnostics_rows)
from kvbench.reports.load import CellData
from kvbench.suites import primary_metric
from kvbench.reports.long_context import AucEstimate, PairedAuc

__all__ = ["SCHEMA_VERSION", "SECTIONS", "frames", "write_exports", "load_tables", "to_document"]

SCHEMA_VERSION = "kvbench.report/1"
SECTIONS = ("cells", "accuracy", "deltas", "aa", "fidelity", "fidelity_positions", "serving", "capacity", "lengths",
            "recovery")
_CONFIG_ORDER = ("model", "target", "prefill_backend", "decode_backend", "kv_dtype", "kv_scales", "concurrency")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

# column names of nested dataclasses: field -> column (None: left out); (names, prefix of other fields)
_EST = {"mean": "accuracy", "lo": "ci_low", "hi": "ci_high", "n": "n_questions", "method": "interval_method"}
_DELTA = {"ci_lo": "ci_low", "ci_hi": "ci_high", "base_only": "n_lost", "cand_only": "n_gained"}
_AUC = {"value": "auc", "lo": "auc_ci_low", "hi": "auc_ci_high", "lengths": None, "confidence": None}
_PAUC = {"lengths": None, "base_means": None, "cand_means": None, "ratio_ci": None, "confidence": None,
         "delta": "auc_delta", "ci_lo": "auc_delta_ci_low", "ci_hi": "auc_delta_ci_high",
         "lower_bound": "auc_delta_lower_bound", "mismatched": None}
_NESTED: dict[type, tuple[dict, str]] = {stats.Estimate: (_EST, ""), stats.PairedDelta: (_DELTA, ""),
                                         AucEstimate: (_AUC, "auc_"), PairedAuc: (_PAUC, "auc_")}
_SENTINEL_NEG = {"n_lost", "n_gained"}  # -1 means "not applicable" in PairedDelta


# ------------------------------------------------------------------------------ flattening


def _scalar(v: Any) -> tuple[bool, Any]:
    """(is a scalar, its plain Python value); non-finite floats become None."""
    if isinstance(v, np.generic):
        v = v.item()
    if v is None or isinstance(v, (bool, str)):
        return True, v
    if isinstance(v, int):
        return True, v
    if isinstance(v, float):
        return True, (v if math.isfinite(v) else None)
    return False, None


def _default_name(name: str, prefix: str) -> str:
    for old, new in (("base_", "baseline_"), ("cand_", "cell_")):
        if name.startswith(old):
            name = new + name[len(old):]
    return name if not prefix or prefix.rstrip("_") in name.split("_") else prefix + name


def _expand(name: str, v: Any, lists_as_json: bool = False) -> list[tuple[str, Any]]:
    ok, x = _scalar(v)
    if ok:
        return [(name, x)]
    if isinstance(v, CellData):
        return []
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        names, prefix = _NESTED.get(type(v), ({}, f"{name}_"))
        return _flatten(v, names, prefix)
    if isinstance(v, Mapping):
        return [kv for k, x in v.items() if isinstance(k, str) for kv in _expand(f"{name}_{k}", x, lists_as_json)]
    if isinstance(v, (tuple, list)):
        if name.endswith("ci") and len(v) == 2 and all(_scalar(x)[0] and not isinstance(x, (str, bool)) for x in v):
            return [(f"{name}_low", _scalar(v[0])[1]), (f"{name}_high", _scalar(v[1])[1])]
        if lists_as_json:
            return [(name, json.dumps(_plain(v), allow_nan=False))]
    return []  # not flattenable: left out (see the module docstring)


def _properties(cls: type) -> list[str]:
    out: list[str] = []
    for klass in reversed(cls.__mro__):
        out += [n for n, m in vars(klass).items() if isinstance(m, property) and n not in out]
    return out


def _flatten(obj: Any, names: Optional[dict] = None, prefix: str = "") -> list[tuple[str, Any]]:
    """(column, value) pairs of a dataclass's fields, then of its scalar read-only properties."""
    names = names or {}
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        col = names.get(f.name, _default_name(f.name, prefix))
        if col is not None:
            out += _expand(col, getattr(obj, f.name))
    for p in _properties(type(obj)):
        col = names.get(p, _default_name(p, prefix))
        if col is None:
            continue
        try:
            ok, x = _scalar(getattr(obj, p))
        except Exception:  # a property that cannot be computed for this object is no column
            continue
        if ok:
            out.append((col, x))
    return [(c, None if c in _SENTINEL_NEG and isinstance(x, int) and x < 0 else x) for c, x in out]


class _Row(dict):
    def put(self, key: str, value: Any, alt_prefix: str) -> None:
        """Set a column; a name already taken by a different value goes under ``alt_prefix + key``."""
        if key in self and self[key] != value:
            key = alt_prefix + key
        if key not in self:
            self[key] = value

    def put_all(self, pairs, alt_prefix: str) -> "_Row":
        for k, v in pairs:
            self.put(k, v, alt_prefix)
        return self


def _config_keys(cells: list[CellData]) -> list[str]:
    present = {k for c in cells for k in c.config} - {"aa_control"}
    return [k for k in _CONFIG_ORDER if k in present] + sorted(present - set(_CONFIG_ORDER)) + ["aa_control"]


def _config_value(v: Any) -> Any:
    ok, x = _scalar(v)
    return x if ok else json.dumps(v, sort_keys=True, default=str)


def _identity(cell: CellData, keys: list[str]) -> _Row:
    row = _Row(cell_key=cell.key, cell=cell.short, run=cell.run)
    for k in keys:
        row[k] = cell.aa_control if k == "aa_control" else _config_value(cell.config.get(k))
    return row


def _with_base(row: _Row, base: CellData) -> _Row:
    row.update(baseline_key=base.key, baseline_cell=base.short, baseline_run=base.run)
    return row


# ------------------------------------------------------------------------------ frames


def _column(values: list) -> pd.Series:
    """A column whose dtype follows the Python values: boolean, Int64, float64, else pandas' inference."""
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return pd.Series(values, dtype="boolean")
    if present and all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return pd.Series(values, dtype="Int64")
    if present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return pd.Series([math.nan if v is None else float(v) for v in values], dtype="float64")
    if not present:
        return pd.Series(values, dtype=object)
    return pd.Series(values)


def _frame(rows: list[dict], columns: Optional[list[str]] = None) -> pd.DataFrame:
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    return pd.DataFrame({c: _column([r.get(c) for r in rows]) for c in columns}, columns=columns)


def _rows(a: Analysis) -> dict[str, list[dict]]:
    keys = _config_keys(a.cells)
    ident = lambda c: _identity(c, keys)  # noqa: E731
    out: dict[str, list[dict]] = {name: [] for name in SECTIONS}
    for c in a.cells:
        out["cells"].append(ident(c).put_all([
            ("label", c.label), ("status", c.status), ("done", c.done), ("is_baseline", c is a.baseline),
            ("n_items", len(c.items)), ("n_requests", len(c.requests)), ("error", c.error)], "cell_"))
    for r in a.accuracy:
        row = ident(r.cell).put_all(_flatten(r), "accuracy_")
        row.put("primary_metric", r.metric == primary_metric(r.suite), "accuracy_")
        out["accuracy"].append(row)
    for r in a.deltas:
        out["deltas"].append(_with_base(ident(r.cell), r.base).put_all(_flatten(r), "delta_"))
    for r in a.aa:
        out["aa"].append(_with_base(ident(r.cell), r.base).put_all(_flatten(r), "aa_"))
    for r in a.fidelity:
        out["fidelity"].append(ident(r.cell).put_all(_flatten(r), "fidelity_"))
    for r in a.positions:
        head = _flatten(r, {"buckets": None})
        for b in r.buckets:
            out["fidelity_positions"].append(ident(r.cell).put_all(
                head + _flatten(b, {"lo": "position_lo", "hi": "position_hi", "label": "bucket"}), "bucket_"))
    for cell, s in a.serving:
        out["serving"].append(ident(cell).put_all(_dict_items(s), "serving_"))
    for cell, cap, ratio in a.capacity:
        row = ident(cell).put_all(_dict_items(cap), "capacity_")
        row.put("tokens_vs_baseline", _scalar(ratio)[1], "capacity_")
        out["capacity"].append(row)
    for r in a.lengths:
        head = _flatten(r, {"by_length": None})
        for n in sorted(r.by_length):
            pairs = [("suite", r.suite), ("metric", r.metric), ("context_length", n), *_flatten(r.by_length[n], _EST)]
            out["lengths"].append(ident(r.cell).put_all(pairs + head, "length_"))
    for r in a.recovery:
        p = r.paired
        head = _flatten(r, {"deltas": None})
        for i, n in enumerate(p.lengths):
            lo, hi = p.ratio_ci[i]
            pairs = [("suite", r.suite), ("context_length", n), ("baseline_mean", _scalar(p.base_means[i])[1]),
                     ("cell_mean", _scalar(p.cand_means[i])[1]), ("ratio", _scalar(p.ratio(i))[1]),
                     ("ratio_ci_low", _scalar(lo)[1]), ("ratio_ci_high", _scalar(hi)[1])]
            d = r.deltas.get(n)
            per_len = _flatten(d, _DELTA) if d is not None else []
            row = _with_base(ident(r.cell), r.base).put_all(pairs, "length_")
            row.put_all(per_len, "delta_").put_all(head, "recovery_")
            out["recovery"].append(row)
    return out


def _dict_items(d: Mapping) -> list[tuple[str, Any]]:
    return [kv for k, v in d.items() if isinstance(k, str) for kv in _expand(k, v)]


def frames(a: Analysis, extra: Optional[dict[str, list[dict]]] = None) -> dict[str, pd.DataFrame]:
    """{name: DataFrame} of every section of ``a`` (``SECTIONS``, in that order; empty frames included),
    then ``diagnostics`` (one row per diagnosed cell and layer; only when some cell holds a diagnostics file),
    then every ``extra`` table (a list of flat dicts: one row each; nested dicts are flattened)."""
    out = {name: _frame(rows) for name, rows in _rows(a).items()}
    diag = diagnostics_rows(a.cells)
    if diag:
        out[DIAGNOSTICS_TABLE] = _frame(diag, list(DIAGNOSTICS_COLUMNS))
    for name, rows in (extra or {}).items():
        if not _NAME_RE.match(name) or name in out or name == DIAGNOSTICS_TABLE:
            raise ValueError(f"extra table name {name!r} is not a plain file name or is a section name")
        flat = [dict(kv for k, v in r.items() for kv in _expand(str(k), v, lists_as_json=True)) for r in rows]
        out[name] = _frame(flat)
    return out


# ------------------------------------------------------------------------------ files


def _json_value(v: Any) -> Any:
    if v is None or v is pd.NA or v is pd.NaT:
        return None
    if isinstance(v, float) and not math.isfinite(v):
        return None
    try:
        if pd.isna(v):
            return None
    except (TypeError, ValueError):
        pass
    return v.item() if isinstance(v, np.generic) else v


def _plain(obj: Any) -> Any:
    """``obj`` with JSON-safe values only (non-finite floats → None, paths and others → str)."""
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    ok, x = _scalar(obj)
    return x if ok else str(obj)


def to_document(tables: dict[str, pd.DataFrame], meta: Optional[dict] = None) -> dict:
    """The report.json document of ``tables`` (records orient, column order kept in ``columns``)."""
    doc_tables = {}
    for name, df in tables.items():
        cols = [str(c) for c in df.columns]
        rows = [{c: _json_value(v) for c, v in zip(cols, rec)} for rec in df.astype(object).itertuples(index=False)]
        doc_tables[name] = {"columns": cols, "rows": rows}
    return {"schema_version": SCHEMA_VERSION, "generated_by": "kvbench", "meta": _plain(meta or {}),
            "tables": doc_tables}


def _analysis_meta(a: Analysis) -> dict:
    b = a.baseline
    return {"confidence": a.confidence, "warnings": list(a.warnings),
            "baseline": None if b is None else {"cell_key": b.key, "cell": b.short, "run": b.run}}


def write_exports(a: Analysis, out_dir: Path | str, extra: Optional[dict[str, list[dict]]] = None,
                  meta: Optional[dict] = None) -> dict[str, Path]:
    """Write ``out_dir/tables/<name>.csv`` for every non-empty frame and ``out_dir/report.json`` (last),
    each atomically; returns {"json": path, "<name>.csv": path, ...}.  ``meta`` entries are added to the
    document's ``meta`` after the analysis' own (confidence, baseline, warnings); the document gets a
    ``diagnostics`` list when some cell holds a diagnostics file."""
    out_dir = Path(out_dir)
    tdir = out_dir / "tables"
    tdir.mkdir(parents=True, exist_ok=True)
    tables = frames(a, extra)
    json_path = out_dir / "report.json"
    stale = set(SECTIONS) | {DIAGNOSTICS_TABLE}
    try:
        stale |= set(json.loads(json_path.read_text()).get("tables") or {})
    except (OSError, ValueError, AttributeError):
        pass
    written: dict[str, Path] = {}
    for name, df in tables.items():
        if len(df):
            path = tdir / f"{name}.csv"
            atomic_write_text(path, df.to_csv(index=False))
            written[f"{name}.csv"] = path
    for name in stale:  # a CSV of an earlier report whose table is empty or gone now
        path = tdir / f"{name}.csv"
        if f"{name}.csv" not in written and _NAME_RE.match(name) and path.is_file():
            path.unlink()
    doc = to_document(tables, {**_analysis_meta(a), **(meta or {})})
    entries = diagnostics_entries(a.cells)
    if entries:  # one summary per diagnosed cell (reports.diagnostics_export); no key when no cell has one
        doc["diagnostics"] = _plain(entries)
    atomic_write_text(json_path, json.dumps(doc, indent=1, allow_nan=False) + "\n")
    written["json"] = json_path
    return written


def load_tables(path: Path | str) -> dict[str, pd.DataFrame]:
    """{name: DataFrame} from a report.json (or the report directory holding one); the columns keep their
    order and the dtypes ``frames`` gives them.  Raises ValueError for a document of another schema."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    doc = json.loads(path.read_text())
    version = str(doc.get("schema_version") or "")
    if version.split(".")[0:2] != SCHEMA_VERSION.split(".")[0:2]:  # "kvbench.report/1" or "kvbench.report/1.x"
        raise ValueError(f"{path}: schema_version {version!r} is not {SCHEMA_VERSION!r}")
    return {name: _frame(t.get("rows") or [], list(t.get("columns") or [])) for name, t in doc["tables"].items()}

"""Read a run directory (through ``core/store.py``) into plain objects for reports and the gate.

Nothing here runs a model: a ``CellData`` is the records a sweep left in ``RUN/cells/<key>/``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from kvbench.core import format_names, plain_names
from kvbench.core import kv_option_names, list_valued_options, options_text
from kvbench.core import RunStore, StoreError, matches, parse_selector

__all__ = [
    "RunLoadError",
    "CellData",
    "RunData",
    "load_run",
    "select",
    "FIDELITY_SUITE",
    "SERIES_EXCLUDE",
    "resolve_baseline",
    "selector_text",
]

FIDELITY_SUITE = "fidelity"
# config keys that do not distinguish one "format series" from another in plots and capacity tables
SERIES_EXCLUDE = ("concurrency", "aa_control")
_LABEL_ORDER = ("model", "target", "prefill_backend", "decode_backend", "kv_dtype", "kv_scales", "concurrency")


class RunLoadError(RuntimeError):
    """The run directory is missing, malformed, or a selector does not resolve."""


@dataclass
class CellData:
    key: str
    label: str
    config: dict
    status: Optional[str]
    items: list[dict] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)
    capacity: Optional[dict] = None
    summary: Optional[dict] = None
    run: str = ""  # name of the run this cell came from
    short: str = ""  # compact label over the config keys that vary in the run(s); set by the loader
    diagnostics: Optional[dict] = None  # RUN/cells/<key>/diagnostics.json (KV error anatomy), when the cell has one

    @property
    def done(self) -> bool:
        return self.status == "done"

    @property
    def aa_control(self) -> bool:
        return bool(self.config.get("aa_control"))

    @property
    def concurrency(self) -> Optional[int]:
        c = self.config.get("concurrency")
        return int(c) if c is not None else None

    @property
    def series_config(self) -> dict:
        return {k: v for k, v in self.config.items() if k not in SERIES_EXCLUDE}

    @property
    def error(self) -> Optional[str]:
        return (self.summary or {}).get("error")


@dataclass
class RunData:
    path: Path
    name: str
    manifest: dict
    cells: list[CellData]

    @property
    def config(self) -> dict:
        return self.manifest.get("config") or {}

    @property
    def done_cells(self) -> list[CellData]:
        return [c for c in self.cells if c.done]


def _varying_keys(cells: list[CellData]) -> list[str]:
    keys: list[str] = []
    for k in list(_LABEL_ORDER) + sorted({k for c in cells for k in c.config} - set(_LABEL_ORDER)):
        if k == "aa_control":
            continue
        if len({repr(c.config.get(k)) for c in cells}) > 1 and k not in keys:
            keys.append(k)
    if "prefill_backend" in keys and all(c.config.get("prefill_backend") == c.config.get("decode_backend") for c in cells):
        keys = [k for k in keys if k != "decode_backend"]  # one backend for both phases in every cell: say it once
    return keys


def kv_text(config: dict, capacity: Optional[dict] = None) -> str:
    """The KV format of a cell with its per-layer formats: ``fp8_e4m3 skip 0,1,31``.  The capacity record
    (the engine's, when it ran mixed) wins over the cell config."""
    cap = capacity or {}
    opts = config.get("options") or {}
    layers = {o: cap.get(o) or opts.get(o) for o in list_valued_options()}
    text = options_text({o: v for o, v in layers.items() if v})
    kv = cap.get("kv_dtype") or config.get("kv_dtype") or ""
    return f"{kv} {text}" if text else str(kv)


def short_label(cell: CellData, keys: list[str], with_run: bool = False) -> str:
    parts = []
    for k in keys:
        v = cell.config.get(k)
        if v is None:
            continue
        if k == "concurrency":
            parts.append(f"c={v}")
        elif isinstance(v, dict):  # engine options of a KV entry, e.g. {"quantize_query": true}
            text = options_text(v) or "-"
            if "kv_dtype" not in keys and any(v.get(o) for o in list_valued_options()):  # "fp8_e4m3 skip 0,1", not "skip 0,1"
                text = f"{cell.config.get('kv_dtype')} {text}"
            parts.append(text)
        else:
            parts.append(str(v))
    label = " ".join(parts) or cell.config.get("kv_dtype") or cell.label
    if cell.aa_control:
        label += " (A/A)"
    return f"{cell.run}: {label}" if with_run else label


def assign_short_labels(cells: list[CellData], with_run: bool = False) -> None:
    keys = _varying_keys(cells)
    if not keys and cells:
        keys = ["kv_dtype"]
    for c in cells:
        c.short = short_label(c, keys, with_run)


def load_run(path: Path | str, name: Optional[str] = None) -> RunData:
    """Load every cell of a run (done or not; callers decide what to use)."""
    path = Path(path)
    if not path.is_dir():
        raise RunLoadError(f"run directory not found: {path}")
    store = RunStore(path)
    try:
        manifest = store.manifest()
        refs = store.cells()
    except (StoreError, ValueError) as e:  # ValueError covers json.JSONDecodeError
        raise RunLoadError(f"cannot read run {path}: {e}") from None
    run_name = name or path.resolve().name
    cells = []
    for ref in refs:
        try:
            cells.append(
                CellData(
                    key=ref.key,
                    label=ref.label,
                    config=dict(ref.config),
                    status=ref.status,
                    items=store.read_items(ref.key),
                    requests=store.read_requests(ref.key),
                    capacity=store.read_json(ref.key, "capacity"),
                    summary=store.read_json(ref.key, "summary"),
                    run=run_name,
                    diagnostics=_read_diagnostics(store, ref.key),
                )
            )
        except (StoreError, ValueError) as e:
            raise RunLoadError(f"cannot read cell {ref.key} of {path}: {e}") from None
    cells.sort(key=_order_key([c.get("key") for c in manifest.get("cells") or [] if isinstance(c, dict)]))
    assign_short_labels(cells)
    return RunData(path=path, name=run_name, manifest=manifest, cells=cells)


def _read_diagnostics(store: RunStore, key: str) -> Optional[dict]:
    """The cell's diagnostics.json; an unreadable one is left out with a warning (it only adds a report section)."""
    try:
        d = store.read_json(key, "diagnostics")
    except (OSError, ValueError) as e:
        logging.getLogger("kvbench.report").warning("cell %s: diagnostics.json not read: %s", key, e)
        return None
    return d if isinstance(d, dict) else None


def _order_key(manifest_order: list):
    """Cells in the manifest's matrix order; cells it does not list follow, ordered by config."""
    pos = {k: i for i, k in enumerate(manifest_order)}
    fmt_order = format_names()  # the format table's order (kvbench.core.formats)

    def key(c: CellData):
        cfg = c.config
        kv = cfg.get("kv_dtype")
        return (pos.get(c.key, len(pos)), str(cfg.get("model")), str(cfg.get("target")), str(cfg.get("prefill_backend")),
                str(cfg.get("decode_backend")), fmt_order.index(kv) if kv in fmt_order else len(fmt_order),
                str(kv), str(cfg.get("kv_scales")), c.aa_control, int(cfg.get("concurrency") or 0), c.key)

    return key


def select(cells: list[CellData], selector: str | dict, *, need_items: bool = False) -> list[CellData]:
    """Done cells matching ``key=value[,key=value]``.

    A/A control cells match only when the selector names ``aa_control``; with ``need_items`` only
    cells holding accuracy or fidelity records are kept.  Unknown keys raise ``RunLoadError``."""
    try:
        sel = parse_selector(selector) if isinstance(selector, str) else {k: str(v) for k, v in selector.items()}
    except ValueError as e:
        raise RunLoadError(str(e)) from None
    if not cells:
        raise RunLoadError("the run has no cells yet: none has started (was the sweep killed before its first cell?)")
    known = {k for c in cells for k in c.config} | {"aa_control"} | set(kv_option_names())
    unknown = sorted(set(sel) - known)
    if unknown:
        raise RunLoadError(f"unknown selector key(s) {', '.join(unknown)}; cell config keys: {', '.join(sorted(known))}")
    norm = {k: (v.lower() if v.lower() in ("true", "false") else v) for k, v in sel.items()}
    out = []
    for c in cells:
        cfg = dict(c.config)
        cfg["aa_control"] = "true" if c.aa_control else "false"
        if "aa_control" not in norm and c.aa_control:
            continue
        if not matches({k: (str(v).lower() if isinstance(v, bool) else v) for k, v in cfg.items()}, norm):
            continue
        if c.done and (not need_items or c.items):
            out.append(c)
    return out


def same_but_batching(a: dict, b: dict) -> bool:
    """Two cell configs that differ at most in concurrency and ``aa_control``: a cell and its A/A control."""
    skip = ("aa_control", "concurrency")
    return {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}


def original_of(cells: list["CellData"], control: "CellData") -> Optional["CellData"]:
    """The cell an A/A control reruns: done, with items, not a control, same run and config but batching."""
    for c in cells:
        if (c.done and c.items and not c.aa_control and c.run == control.run
                and same_but_batching(c.config, control.config)):
            return c
    return None


def selector_text(sel: str | dict) -> str:
    return sel if isinstance(sel, str) else ",".join(f"{k}={v}" for k, v in sel.items())


def resolve_baseline(run: RunData, selector: Optional[str | dict] = None) -> Optional[CellData]:
    """The run's baseline cell: ``selector``, else the config's ``baseline``, else the first done bf16 (or
    fp16) cell with item records, else the first done cell with item records; None when no cell has items.  In a
    run without item records (serving only) a selector may name a series (cells that differ only in concurrency):
    its lowest-concurrency cell is the baseline that the serving ratios divide by.

    Raises ``RunLoadError`` when an explicit or configured selector matches no cell or several."""
    sel = selector if selector else run.config.get("baseline")
    with_items = [c for c in run.done_cells if c.items and not c.aa_control]
    if sel:
        found = select(run.cells, sel, need_items=True)
        if len(found) == 1:
            return found[0]
        if not found:
            if not with_items:  # a serving-only run: the selector names the series the serving ratios divide by
                series = select(run.cells, sel)
                if series and len({json.dumps(c.series_config, sort_keys=True, default=str) for c in series}) == 1:
                    return min(series, key=lambda c: c.concurrency or 0)
                if selector is None:
                    return None
            raise RunLoadError(f"baseline {selector_text(sel)!r} matches no done cell with item records")
        raise RunLoadError(f"baseline {selector_text(sel)!r} matches {len(found)} cells "
                           f"({'; '.join(c.short for c in found)}); add keys to make it unique")
    for dtype in plain_names():  # the first unquantized format of the table that has items
        for c in with_items:
            if c.config.get("kv_dtype") == dtype:
                return c
    return with_items[0] if with_items else None

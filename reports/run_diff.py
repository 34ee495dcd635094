"""Two runs side by side (``kvbench compare RUN_A RUN_B``): cells matched by configuration, accuracy and
serving deltas per matched cell, the runs' configuration differences, and the cells with no partner.

Matching: a cell's *match configuration* is its config without the keys that are run-specific, i.e. keys
that hold one value across every cell of each run (``model``, ``target``, ... when a run has only one).
What differs between the runs on those keys is reported in the configuration diff instead, so run A's
``bf16 c=4`` pairs with run B's ``bf16 c=4`` even when B used another model path or target name.  Keys that
vary inside a run (the sweep's axes: kv_dtype, backends, concurrency, the A/A control) must agree.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from kvbench.core import options_text
from kvbench.reports.load import CellData, RunData
from kvbench.reports.item_records import accuracy_suites, item_scores

__all__ = ["CellPair", "RunDiff", "match_keys", "match_id", "config_diff", "diff_runs", "format_diff",
           "SERVING_METRICS"]

# (serving_summary key, column label, higher is better)
SERVING_METRICS = (("output_throughput", "out tok/s", True), ("request_throughput", "req/s", True),
                   ("median_ttft_ms", "TTFT p50 ms", False), ("median_tpot_ms", "TPOT p50 ms", False))


@dataclass
class CellPair:
    label: str  # the match configuration as short text
    a: CellData
    b: CellData


@dataclass
class RunDiff:
    a: RunData
    b: RunData
    keys: list[str]  # the config keys cells are matched on
    pairs: list[CellPair] = field(default_factory=list)
    only_a: list[CellData] = field(default_factory=list)
    only_b: list[CellData] = field(default_factory=list)
    config: list[tuple[str, Any, Any]] = field(default_factory=list)  # (path, value in a, value in b)


def match_keys(runs: list[RunData]) -> list[str]:
    """Config keys that vary inside at least one run (``aa_control`` always): the keys cells match on."""
    keys = sorted({k for r in runs for c in r.cells for k in c.config})
    varying = [k for k in keys if any(len({_canon(c.config.get(k)) for c in r.cells}) > 1 for r in runs)]
    return sorted(set(varying) | {"aa_control"})


def _canon(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def match_id(cell: CellData, keys: list[str]) -> str:
    """The cell's match configuration as a canonical string (absent keys and False ``aa_control`` alike)."""
    cfg = {k: cell.config.get(k) for k in keys}
    if not cfg.get("aa_control"):
        cfg.pop("aa_control", None)
    return _canon({k: v for k, v in cfg.items() if v is not None})


_ORDER = ("model", "target", "prefill_backend", "decode_backend", "kv_dtype", "kv_scales", "concurrency")


def _label(cell: CellData, keys: list[str]) -> str:
    parts = []
    for k in sorted(keys, key=lambda k: (_ORDER.index(k) if k in _ORDER else len(_ORDER), k)):
        v = cell.config.get(k)
        if v is None or k == "aa_control":
            continue
        if k == "options" and isinstance(v, dict):  # a KV entry's engine options (per-layer formats as "skip 0,1")
            parts.append(options_text(v) or "-")
            continue
        parts.append(f"c={v}" if k == "concurrency" else f"{k}={v}" if isinstance(v, (dict, list)) else str(v))
    label = " ".join(parts) or cell.config.get("kv_dtype") or cell.label
    return label + (" (A/A)" if cell.aa_control else "")


def config_diff(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """Every place two configs differ, as ``(path, a, b)``: ``engine.kv_budget_gb``, ``axes.kv[1].scales``;
    a key missing on one side has the value None there."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += config_diff(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += config_diff(x, y, f"{path}[{i}]")
        return out
    return [] if _canon(a) == _canon(b) else [(path or "(config)", a, b)]


def diff_runs(a: RunData, b: RunData) -> RunDiff:
    """Match the cells of two runs by configuration (module docstring) and diff their configs."""
    keys = match_keys([a, b])
    d = RunDiff(a=a, b=b, keys=keys, config=config_diff(a.config, b.config))
    by_b: dict[str, CellData] = {}
    for c in b.cells:
        by_b.setdefault(match_id(c, keys), c)
    used: set[str] = set()
    for c in a.cells:
        mid = match_id(c, keys)
        partner = by_b.get(mid)
        if partner is None or mid in used:
            d.only_a.append(c)
            continue
        used.add(mid)
        d.pairs.append(CellPair(_label(c, keys), c, partner))
    d.only_b = [c for c in b.cells if match_id(c, keys) not in used]
    return d


# ------------------------------------------------------------------------------ rows


def accuracy_rows(pair: CellPair) -> list[dict]:
    """Per accuracy suite of a matched pair: mean score in each run, the difference (b - a) over every
    answered item, and over the (item, repeat) keys both runs answered (``paired``)."""
    rows = []
    suites = list(dict.fromkeys(accuracy_suites(pair.a) + accuracy_suites(pair.b)))
    for s in suites:
        sa, sb = item_scores(pair.a, s), item_scores(pair.b, s)
        shared = sorted(set(sa) & set(sb))
        ma = sum(sa.values()) / len(sa) if sa else None
        mb = sum(sb.values()) / len(sb) if sb else None
        paired = (sum(sb[k] - sa[k] for k in shared) / len(shared)) if shared else None
        rows.append({"suite": s, "a": ma, "b": mb, "n_a": len(sa), "n_b": len(sb), "paired_n": len(shared),
                     "delta": None if ma is None or mb is None else mb - ma, "paired_delta": paired})
    return rows


def serving_rows(pair: CellPair) -> list[dict]:
    """Per serving metric of a matched pair with request records on both sides: values, ratio b / a."""
    if not (pair.a.requests and pair.b.requests):
        return []
    from kvbench.reports.serving_summary import serving_summary

    sa, sb = serving_summary(pair.a), serving_summary(pair.b)
    rows = []
    for key, label, higher in SERVING_METRICS:
        va, vb = _num(sa.get(key)), _num(sb.get(key))
        ratio = vb / va if va not in (None, 0.0) and vb is not None else None
        rows.append({"metric": key, "label": label, "a": va, "b": vb, "ratio": ratio, "higher_is_better": higher})
    return rows


def _num(v: Any) -> Optional[float]:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
        return float(v)
    return None


# ------------------------------------------------------------------------------ text


def _pct(x: Optional[float]) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _pts(x: Optional[float]) -> str:
    return "—" if x is None else f"{100 * x:+.1f} pts"


def _g(x: Optional[float]) -> str:
    return "—" if x is None else f"{x:.4g}"


def _ratio(x: Optional[float]) -> str:
    return "—" if x is None else f"×{x:.3f}"


def _val(v: Any) -> str:
    return "(absent)" if v is None else _canon(v) if isinstance(v, (dict, list)) else str(v)


def _cell_text(c: CellData) -> str:
    return f"{c.label} [{c.key}]" + ("" if c.done else f" ({c.status or 'not started'})")


def format_diff(d: RunDiff) -> str:
    """The comparison as Markdown: configuration diff, accuracy and serving per matched cell, unmatched cells."""
    a, b = d.a.name, d.b.name
    out = [f"# kvbench compare: {a} vs {b}", "",
           f"Cells are matched on {', '.join(k for k in d.keys if k != 'aa_control') or 'their A/A role alone'}; "
           f"deltas are {b} − {a}.", "", "## Configuration differences", ""]
    if d.config:
        out += [f"| path | {a} | {b} |", "|---|---|---|"]
        out += [f"| `{p}` | {_val(x)} | {_val(y)} |" for p, x, y in d.config]
    else:
        out.append("The two runs' sweep configurations are identical.")
    out += ["", f"## Accuracy ({len(d.pairs)} matched cells)", ""]
    acc = [(p, r) for p in d.pairs for r in accuracy_rows(p)]
    if acc:
        out += [f"| cell | suite | {a} | {b} | Δ | paired Δ (pairs) |", "|---|---|---|---|---|---|"]
        out += [f"| {p.label} | {r['suite']} | {_pct(r['a'])} (n={r['n_a']}) | {_pct(r['b'])} (n={r['n_b']}) | "
                f"{_pts(r['delta'])} | {_pts(r['paired_delta'])} ({r['paired_n']}) |" for p, r in acc]
    else:
        out.append("No matched cell holds accuracy records in both runs.")
    out += ["", "## Serving", ""]
    srv = [(p, serving_rows(p)) for p in d.pairs]
    srv = [(p, rows) for p, rows in srv if rows]
    if srv:
        labels = [label for _, label, _ in SERVING_METRICS]
        out += ["| cell | " + " | ".join(f"{lab} ({a} → {b})" for lab in labels) + " |",
                "|---|" + "---|" * len(labels)]
        for p, rows in srv:
            cells = [f"{_g(r['a'])} → {_g(r['b'])} ({_ratio(r['ratio'])})" for r in rows]
            out.append(f"| {p.label} | " + " | ".join(cells) + " |")
    else:
        out.append("No matched cell holds load-test records in both runs.")
    out += ["", "## Cells with no partner", ""]
    if d.only_a or d.only_b:
        out += [f"- only in {a}: {_cell_text(c)}" for c in d.only_a]
        out += [f"- only in {b}: {_cell_text(c)}" for c in d.only_b]
    else:
        out.append("Every cell has a partner.")
    return "\n".join(out) + "\n"

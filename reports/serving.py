"""Serving metrics of a cell for reports (docs/design.md §9, §10): ``serving_summary`` and the two serving tables.

``serving_summary(cell)`` is one flat dict per cell:

- recomputed from the cell's ``requests.jsonl`` (``core.serving_metrics.summarize``), so the numbers match the
  records: completed/failed, throughputs, peak output throughput, peak concurrency (most requests the client
  had in flight at once), TTFT/TPOT/ITL/E2E statistics, and goodput at the SLO the load test recorded
  (``summary.json`` ``load.slo``);
- copied from ``summary.json``'s ``load`` entry: the arrival settings (``request_rate``, ``burstiness``,
  ``max_concurrency``, ``num_prompts``, dataset and lengths; stores from before they were recorded there
  fall back to ``load.config``) and the server's ``/metrics`` samples (``load.server_metrics``: most requests
  running, most running while none waited, peak KV usage, preemptions during the run).

With repeated load tests (``load.repeats``; each request record carries its ``repeat``) every repeat is
recomputed from its own records and the repeats are combined (``core.serving_repeats``): medians, counts added
up, ``spread[key] = {min, max}`` and ``repeats``; ``machine_load`` is the worst repeat's machine load (load
averages, share of the CPU other processes took).  A store from before repeats is one repeat.

Unknown values are None.  ``request_rate`` and ``max_concurrency`` are ``math.inf`` when the run had no limit
(``"inf"`` and None in the store).
"""

from __future__ import annotations

import math
from typing import Optional

from kvbench.core.serving_metrics import summarize
from kvbench.core.serving_repeats import combine_machine, combine_summaries, group_by_repeat
from kvbench.reports.analysis import Analysis
from kvbench.reports.load import CellData
from kvbench.reports.serving_spread import (WarnedTable, fmt_ratio, machine_text, machine_warning, single_repeat_warning,
                                            slo_unmet, spread_warning)
from kvbench.reports.tables import Table, _series, fmt_num, fmt_pct

__all__ = ["serving_summary", "serving_tables", "LATENCY_METRICS", "LATENCY_STATS", "SETTING_KEYS", "SERVER_KEYS"]

LATENCY_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))
LATENCY_STATS = ("mean", "median", "p90", "p95", "p99")
SETTING_KEYS = ("request_rate", "burstiness", "max_concurrency", "num_prompts", "dataset", "input_len", "output_len")
SERVER_KEYS = ("max_running", "max_running_without_queueing", "max_waiting", "kv_usage_max", "preemptions")


def _setting(load: dict, key: str) -> tuple[bool, object]:
    """(recorded, value) of a load setting: the load summary's own key, else its ``config`` copy."""
    for src in (load, load.get("config") or {}):
        if isinstance(src, dict) and key in src:
            return True, src[key]
    return False, None


def _number(v) -> Optional[float]:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, str):
        return math.inf if v.strip().lower() in ("inf", "infinity") else None
    return float(v) if isinstance(v, (int, float)) else None


def _duration(load: dict, records: list[dict]) -> float:
    d = _number(load.get("duration_s"))
    if d and d > 0 and math.isfinite(d):
        return d
    spans = [(float(r["start_s"]), float(r["start_s"]) + float(r["latency_s"])) for r in records
             if r.get("start_s") is not None and r.get("latency_s") is not None]
    d = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
    return d if d > 0 else 1e-9


def _per_repeat_loads(load: dict) -> list[dict]:
    per = load.get("per_repeat")
    return [p if isinstance(p, dict) else {} for p in per] if isinstance(per, list) else []


def _combined(records: list[dict], load: dict, slo: Optional[dict], bucket_s: float) -> dict:
    """Each repeat recomputed from its own records (its duration from ``load.per_repeat``), then combined
    (``core.serving_repeats.combine_summaries``); a store from before repeats is one repeat."""
    groups = group_by_repeat(records) or {0: []}
    per_load = _per_repeat_loads(load)
    sums = []
    for i, recs in groups.items():
        own = per_load[i] if i < len(per_load) else (load if len(groups) == 1 else {})
        sums.append(summarize(recs, _duration(own, recs), slo, bucket_s))
    out = combine_summaries(sums)
    machine = [p.get("machine_load") for p in per_load]
    if not any(isinstance(m, dict) for m in machine):
        machine = [load.get("machine_load")]  # one load test's record (kvbench load), or none (older stores)
    out["machine_load"] = combine_machine(machine)
    return out


def serving_summary(cell: CellData) -> dict:
    """One flat dict of a cell's serving metrics (see the module docstring; None = unknown)."""
    records = list(cell.requests or [])
    load = (cell.summary or {}).get("load") or {}
    slo = load.get("slo") if isinstance(load.get("slo"), dict) else None
    slo = {k: v for k, v in (slo or {}).items() if v is not None} or None
    _, bucket = _setting(load, "bucket_s")
    bucket_s = _number(bucket) or 1.0
    out = _combined(records, load, slo, bucket_s)
    target = (cell.summary or {}).get("target")
    if out["machine_load"] and isinstance(target, dict) and target.get("type") == "endpoint":
        out["machine_load"]["others_include_server"] = True  # a server kvbench did not start is not its own CPU
    out["slo"] = dict(slo) if slo else None
    out.setdefault("good_requests", None)
    out.setdefault("request_goodput", None)

    recorded, rate = _setting(load, "request_rate")
    out["request_rate"] = _number(rate) if recorded else None
    recorded, burst = _setting(load, "burstiness")
    out["burstiness"] = _number(burst) if recorded else None
    recorded, cap = _setting(load, "max_concurrency")
    cap = math.inf if cap is None else _number(cap)  # None in the store: no cap
    out["max_concurrency"] = (int(cap) if cap is not None and math.isfinite(cap) else cap) if recorded else None
    for key in ("num_prompts", "input_len", "output_len"):
        v = _setting(load, key)[1]
        out[key] = int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
    dataset = _setting(load, "dataset")[1]
    out["dataset"] = str(dataset) if dataset is not None else None

    sm = load.get("server_metrics") or {}
    for key in SERVER_KEYS:
        out[key] = sm.get(key) if sm.get("available") else None
    return out


# ------------------------------------------------------------------------------ tables


def _limit(x: Optional[float], digits: str = "g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return "∞" if math.isinf(x) else format(x, digits)


def _conc(cell: CellData, s: dict) -> str:
    if s.get("max_concurrency") is not None:
        return _limit(s["max_concurrency"])
    return str(cell.concurrency) if cell.concurrency is not None else "—"


def _slo_text(slo: dict) -> str:
    names = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "e2el_ms": "E2E"}
    return ", ".join(f"{names.get(k, k)} ≤ {v:g} ms" for k, v in sorted(slo.items()))


def _ordered(a: Analysis) -> list[tuple[CellData, dict]]:
    return sorted(a.serving, key=lambda t: (t[0].run, _series(t[0], False), t[0].concurrency or 0))


def _baseline_of(a: Analysis, cell: CellData) -> Optional[dict]:
    """The baseline series' serving dict at ``cell``'s concurrency in its run (None for the baseline's own cells)."""
    base = a.baseline
    if base is None or cell.aa_control or cell.series_config == base.series_config:
        return None
    return next((s for c, s in a.serving if c.run == cell.run and not c.aa_control
                 and c.series_config == base.series_config and c.concurrency == cell.concurrency), None)


def _with_range(s: dict, key: str, digits: int) -> str:
    sp = (s.get("spread") or {}).get(key) or {}
    text = fmt_num(s.get(key), digits)
    if (s.get("repeats") or 1) > 1 and sp.get("min") is not None and sp.get("max") is not None:
        text += f" ({fmt_num(sp['min'], digits)}–{fmt_num(sp['max'], digits)})"
    return text


def _load_warnings(a: Analysis) -> list[str]:
    out = [w for w in (single_repeat_warning(s for _, s in a.serving),) if w]
    for cell, s in _ordered(a):
        base = _baseline_of(a, cell)
        if base is not None:
            out += [w for w in (spread_warning(_conc(cell, s), base, s, f" for {_series(cell, False)}"),) if w]
            unmet = slo_unmet(base, s)
            if unmet and s.get("request_goodput") is not None:
                out.append(f"serving: goodput at c={_conc(cell, s)} for {_series(cell, False)}: {unmet}; "
                           "no goodput ratio is shown")
    loaded = machine_warning((cell.short, s) for cell, s in _ordered(a))
    return list(dict.fromkeys(out + ([loaded] if loaded else [])))


def load_table(a: Analysis) -> Table:
    rows = []
    for cell, s in _ordered(a):
        base = _baseline_of(a, cell)
        rows.append([
            _series(cell, False), _conc(cell, s), _limit(s.get("request_rate")), _limit(s.get("burstiness")),
            f"{s['completed']}/{s['failed']}", _with_range(s, "request_throughput", 2), _with_range(s, "output_throughput", 1),
            "—" if base is None else fmt_ratio(base, s, "output_throughput"),
            fmt_num(s["total_token_throughput"]), fmt_num(s.get("request_goodput"), 2),
            fmt_num(s.get("peak_concurrency")), fmt_num(s.get("max_running_without_queueing"), 0),
            fmt_pct(s.get("kv_usage_max")), fmt_num(s.get("preemptions"), 0), str(s.get("repeats") or 1), machine_text(s),
        ])
    slos = {tuple(sorted(s["slo"].items())) for _, s in a.serving if s.get("slo")}
    if len(slos) == 1:
        goodput = f"requests per second meeting the run's SLO ({_slo_text(dict(next(iter(slos))))})"
    elif slos:
        goodput = "requests per second meeting the SLO each cell's load test recorded"
    else:
        goodput = "needs an SLO (none was recorded)"
    return WarnedTable(
        "Serving: load and throughput",
        ["series", "conc.", "rate (req/s)", "burstiness", "ok/failed", "req/s", "out tok/s", "out tok/s × base",
         "total tok/s", "goodput req/s", "peak conc.", "max running w/o queue", "peak KV", "preemptions", "repeats",
         "machine load"], rows,
        note="conc.: the load test's concurrency cap; rate: configured arrival rate (∞ = all requests at once); "
             "burstiness: gamma shape of the inter-arrival times (1 = Poisson). Throughputs, goodput and peak "
             f"concurrency (most requests in flight at the client) are recomputed from requests.jsonl; goodput: {goodput}. "
             "With several repeats (load.repeats) a figure is the median over the repeats, with the lowest and highest "
             "repeat in parentheses, and ok/failed adds the repeats up; × base: median / the baseline's median at the "
             "same concurrency, with the range over every pairing of a repeat with a baseline repeat. "
             "Max running w/o queue (most requests running while none waited), peak KV usage and preemptions during "
             "the run come from the server's /metrics samples (— when it exports none). Machine load: the largest "
             "share of the CPU other processes took during a repeat (/proc/stat minus this process and its servers) "
             "and the highest 1-minute load average over the CPU count (it counts the engine's own threads too).",
        warnings=_load_warnings(a))


def latency_table(a: Analysis) -> Table:
    rows = []
    for cell, s in _ordered(a):
        for key, name in LATENCY_METRICS:
            digits = 2 if key in ("tpot", "itl") else 1
            rows.append([_series(cell, False), _conc(cell, s), name,
                         *(fmt_num(s.get(f"{stat}_{key}_ms"), digits) for stat in LATENCY_STATS)])
    return Table(
        "Serving: latency (ms)", ["series", "conc.", "metric", *LATENCY_STATS], rows,
        note="Recomputed from requests.jsonl over successful requests. TTFT: request sent to first streamed output; "
             "TPOT = (latency − TTFT)/(output tokens − 1); ITL: every gap between streamed chunks, pooled; "
             "E2E: request sent to end of stream. Percentiles interpolate linearly.")


def serving_tables(a: Analysis) -> list[Table]:
    """"Serving: load and throughput" (one row per cell) and "Serving: latency (ms)" (one row per cell and metric)."""
    return [load_table(a), latency_table(a)]

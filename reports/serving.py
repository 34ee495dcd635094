"""The serving tables of a report (docs/design.md §9, §10): load and throughput, and latency, one row per load
cell, from ``serving_summary`` (reports/serving_summary.py says what it holds; it is re-exported here)."""

from __future__ import annotations

import math
from typing import Optional

from kvbench.reports.analysis import Analysis
from kvbench.reports.load import CellData
from kvbench.reports.serving_summary import LATENCY_METRICS, LATENCY_STATS, SERVER_KEYS, SETTING_KEYS, serving_summary
from kvbench.reports.serving_spread import (WarnedTable, fmt_ratio, machine_text, machine_warning, single_repeat_warning,
                                            slo_unmet, spread_warning)
from kvbench.reports.tables import Table, fmt_num, series_label, fmt_pct

__all__ = ["serving_summary", "serving_tables", "LATENCY_METRICS", "LATENCY_STATS", "SETTING_KEYS", "SERVER_KEYS"]

def _limit(x: Optional[float], digits: str = "g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return "∞" if math.isinf(x) else format(x, digits)


def _conc(cell: CellData, s: dict) -> str:
    if s.get("replica_load"):  # data-parallel replicas: the concurrency each one got
        per, n = s.get("concurrency_per_replica"), s.get("replicas")
        text = "∞" if per is None else _limit(per)
        return f"{text} × {n} replica{'s' if n != 1 else ''}" + (", each" if s.get("replica_load") == "each" else "")
    if s.get("max_concurrency") is not None:
        return _limit(s["max_concurrency"])
    return str(cell.concurrency) if cell.concurrency is not None else "—"


def _slo_text(slo: dict) -> str:
    names = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "e2el_ms": "E2E"}
    return ", ".join(f"{names.get(k, k)} ≤ {v:g} ms" for k, v in sorted(slo.items()))


def _ordered(a: Analysis) -> list[tuple[CellData, dict]]:
    return sorted(a.serving, key=lambda t: (t[0].run, series_label(t[0]), t[0].concurrency or 0))


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
            out += [w for w in (spread_warning(_conc(cell, s), base, s, f" for {series_label(cell)}"),) if w]
            unmet = slo_unmet(base, s)
            if unmet and s.get("request_goodput") is not None:
                out.append(f"serving: goodput at c={_conc(cell, s)} for {series_label(cell)}: {unmet}; "
                           "no goodput ratio is shown")
    loaded = machine_warning((cell.short, s) for cell, s in _ordered(a))
    return list(dict.fromkeys(out + ([loaded] if loaded else [])))


def _replica_note(a: Analysis) -> str:
    if not any(s.get("replica_load") for _, s in a.serving):
        return ""
    return (" (\"c × N replicas\": c requests in flight on each of N data-parallel replicas of one server configuration; "
            "one load test over all of them at once, num_prompts and rate × N, throughputs their sum; \", each\": one "
            "replica at a time, figures pooled over them, throughputs the mean per replica; no failover: a request "
            "that fails on a replica is counted failed, never sent to another)")


def load_table(a: Analysis) -> Table:
    rows = []
    for cell, s in _ordered(a):
        base = _baseline_of(a, cell)
        rows.append([
            series_label(cell), _conc(cell, s), _limit(s.get("request_rate")), _limit(s.get("burstiness")),
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
        note="conc.: the load test's concurrency cap" + _replica_note(a) + "; rate: configured arrival rate (∞ = all requests at once); "
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
            rows.append([series_label(cell), _conc(cell, s), name,
                         *(fmt_num(s.get(f"{stat}_{key}_ms"), digits) for stat in LATENCY_STATS)])
    return Table(
        "Serving: latency (ms)", ["series", "conc.", "metric", *LATENCY_STATS], rows,
        note="Recomputed from requests.jsonl over successful requests. TTFT: request sent to first streamed output; "
             "TPOT = (latency − TTFT)/(output tokens − 1); ITL: every gap between streamed chunks, pooled; "
             "E2E: request sent to end of stream. Percentiles interpolate linearly.")


def serving_tables(a: Analysis) -> list[Table]:
    """"Serving: load and throughput" (one row per cell) and "Serving: latency (ms)" (one row per cell and metric)."""
    return [load_table(a), latency_table(a)]

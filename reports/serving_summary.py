"""``serving_summary(cell)``: a cell's serving metrics as one flat dict, for every report that shows them
(reports/serving.py's tables, the analysis, the verdict cards).  docs/design.md §9, §10.

``serving_summary(cell)`` is one flat dict per cell:

- recomputed from the cell's ``requests.jsonl`` (``core.serving_metrics.summarize``), so the numbers match the
  records: completed/failed, throughputs, peak output throughput, peak concurrency (most requests the client
  had in flight at once), TTFT/TPOT/ITL/E2E statistics, and goodput at the SLO the load test recorded
  (``summary.json`` ``load.slo``);
- copied from ``summary.json``'s ``load`` entry: the arrival settings (``request_rate``, ``burstiness``,
  ``max_concurrency``, ``num_prompts``, dataset and lengths; stores from before they were recorded there
  fall back to ``load.config``) and the server's ``/metrics`` samples (``load.server_metrics``: most requests
  running, most running while none waited, peak KV usage, preemptions during the run);
- on a target of data-parallel replicas only: ``replicas`` (N, those in rotation), ``replica_load`` (``aggregate``: one
  load test over all of them at once; ``each``: one at a time) and ``concurrency_per_replica``.

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

from kvbench.core import summarize
from kvbench.core import combine_machine, combine_summaries, group_by_repeat
from kvbench.reports.load import CellData

__all__ = ["serving_summary", "LATENCY_METRICS", "LATENCY_STATS", "SETTING_KEYS", "SERVER_KEYS"]

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
    if load.get("replica_urls"):  # data-parallel replicas (docs/scale-out.md); N may be 1 when the others left rotation
        out.update({k: load.get(k) for k in ("replicas", "replica_load", "concurrency_per_replica")})
    return out


# ------------------------------------------------------------------------------ tables

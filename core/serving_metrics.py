"""Serving metrics from per-request load-test records (docs/design.md §9).

Everything here is a pure function of the records (the ``requests.jsonl`` schema of docs/design.md §10), so
reports can recompute a summary from the store without re-running anything:

- TTFT: time from sending the request to the first streamed chunk carrying output.
- TPOT: ``(latency - ttft) / (output_tokens - 1)`` per request with more than one output token.
- ITL: every gap between consecutive output chunks of every request (pooled).
- E2E latency: time from sending the request to the end of its stream.
- Statistics: mean, median, p90, p95, p99 (linear interpolation) and max, in milliseconds.
- Throughputs over the benchmark duration; peak output throughput = most output tokens completed in
  any ``bucket_s`` window aligned to the start (each chunk counts ``output_tokens / chunks`` tokens;
  the window shrinks to the duration for runs shorter than ``bucket_s``);
  peak concurrency = most requests in flight at one instant.
- Goodput: successful requests that meet every given SLO (``ttft_ms``, ``tpot_ms``, ``e2el_ms``) per second.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

PERCENTILES = (50, 90, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method), NaN for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe_ms(values_s: Iterable[float], name: str) -> dict:
    """``{mean_<name>_ms, median_<name>_ms, p90_..., p95_..., p99_..., max_<name>_ms}`` from seconds."""
    xs = [float(v) * 1000.0 for v in values_s]
    out = {
        f"mean_{name}_ms": (sum(xs) / len(xs)) if xs else math.nan,
        f"median_{name}_ms": percentile(xs, 50),
    }
    for q in PERCENTILES[1:]:
        out[f"p{q}_{name}_ms"] = percentile(xs, q)
    out[f"max_{name}_ms"] = max(xs) if xs else math.nan
    return out


def chunk_times(rec: dict) -> list[float]:
    """Arrival times (seconds since the benchmark start) of a request's output chunks."""
    if rec.get("ttft_s") is None:
        return []
    t = float(rec["start_s"]) + float(rec["ttft_s"])
    times = [t]
    for gap in rec.get("itl_s") or ():
        t += float(gap)
        times.append(t)
    return times


def peak_output_throughput(records: Sequence[dict], bucket_s: float = 1.0) -> float:
    """Most output tokens per second within any ``bucket_s`` window aligned to the benchmark start."""
    buckets: dict[int, float] = {}
    for rec in records:
        if not rec.get("success"):
            continue
        times = chunk_times(rec)
        if not times:
            continue
        per_chunk = float(rec.get("output_tokens") or 0) / len(times)
        for t in times:
            b = int(t // bucket_s)
            buckets[b] = buckets.get(b, 0.0) + per_chunk
    return max(buckets.values()) / bucket_s if buckets else 0.0


def peak_concurrency(records: Sequence[dict]) -> int:
    """Most requests in flight at one instant (a request ending exactly when another starts is not overlap)."""
    events = []
    for rec in records:
        if rec.get("start_s") is None or rec.get("latency_s") is None:
            continue
        s = float(rec["start_s"])
        events.append((s, 1))
        events.append((s + float(rec["latency_s"]), -1))
    events.sort(key=lambda e: (e[0], e[1]))  # ends (-1) before starts (+1) at the same instant
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def tpot_of(rec: dict) -> Optional[float]:
    n = int(rec.get("output_tokens") or 0)
    if not rec.get("success") or rec.get("ttft_s") is None or n < 2:
        return None
    return (float(rec["latency_s"]) - float(rec["ttft_s"])) / (n - 1)


def meets_slo(rec: dict, slo: dict) -> bool:
    checks = {"ttft_ms": rec.get("ttft_s"), "tpot_ms": rec.get("tpot_s"), "e2el_ms": rec.get("latency_s")}
    for key, limit in slo.items():
        if limit is None:
            continue
        if key not in checks:
            raise ValueError(f"unknown SLO {key!r}; known: {', '.join(checks)}")
        value = checks[key]
        if key == "tpot_ms" and value is None:
            continue  # single-token outputs have no TPOT; they are judged on the other SLOs
        if value is None or float(value) * 1000.0 > float(limit):
            return False
    return True


def summarize(records: Sequence[dict], duration_s: float, slo: Optional[dict] = None, bucket_s: float = 1.0) -> dict:
    """The metric summary of one load run (the ``load`` entry of a cell's summary.json)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    ok = [r for r in records if r.get("success")]
    input_tokens = sum(int(r.get("prompt_tokens") or 0) for r in ok)
    output_tokens = sum(int(r.get("output_tokens") or 0) for r in ok)
    out: dict = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "input_throughput": input_tokens / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "peak_output_throughput": peak_output_throughput(records, min(bucket_s, duration_s)),
        "peak_concurrency": peak_concurrency(records),
    }
    out.update(describe_ms([r["ttft_s"] for r in ok if r.get("ttft_s") is not None], "ttft"))
    out.update(describe_ms([t for t in (tpot_of(r) for r in ok) if t is not None], "tpot"))
    out.update(describe_ms([g for r in ok for g in (r.get("itl_s") or ())], "itl"))
    out.update(describe_ms([r["latency_s"] for r in ok], "e2el"))
    slo = {k: v for k, v in (slo or {}).items() if v is not None}
    if slo:
        good = sum(1 for r in ok if meets_slo(r, slo))
        out["slo"] = dict(slo)
        out["good_requests"] = good
        out["request_goodput"] = good / duration_s
    return out

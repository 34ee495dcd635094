"""Load tests repeated: per-repeat summaries combined into one, with their spread, and the machine load of
every repeat combined.  Pure functions, used by the load generator (``harness/loadgen/repeats.py``) and by the
reports, which recompute each repeat from its request records (the records' ``repeat`` index).

Combined figures (``combine_summaries``), over the repeats of one cell:

- counts add up (``COUNT_KEYS``: requests completed, failed and meeting the SLO, tokens in and out);
- ``peak_concurrency`` is the most any repeat reached;
- every other metric of ``serving_metrics.summarize`` (throughputs, goodput, duration, latency statistics) is the
  median of the per-repeat values;
- ``spread[key] = {"min", "max"}`` of the per-repeat values of every metric (min = max with one repeat);
- ``repeats``: how many there were.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

from kvbench.core.serving_metrics import summarize

__all__ = ["COUNT_KEYS", "metric_keys", "combine_summaries", "combine_machine", "group_by_repeat"]

COUNT_KEYS = ("completed", "failed", "good_requests", "total_input_tokens", "total_output_tokens")
_MAX_KEYS = ("peak_concurrency",)


def metric_keys() -> list[str]:
    """The numeric keys of a ``summarize`` result (goodput ones included)."""
    return [k for k, v in summarize([], 1.0, {"ttft_ms": 1.0}).items() if not isinstance(v, dict)]


def _numbers(values) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]


def combine_summaries(summaries: Sequence[dict]) -> dict:
    """The combined metric keys of several repeats' summaries, ``spread`` and ``repeats`` (module docstring).
    A metric no repeat has a number for is NaN (None in JSON), without a spread entry."""
    if not summaries:
        raise ValueError("no summaries to combine")
    out: dict = {}
    spread: dict = {}
    for key in metric_keys():
        if not any(key in s for s in summaries):
            continue
        vals = _numbers(s.get(key) for s in summaries)
        if not vals:
            out[key] = math.nan
            continue
        if key in COUNT_KEYS:
            v = sum(vals)
            out[key] = int(v) if all(isinstance(x, int) for x in vals) else v
        elif key in _MAX_KEYS:
            out[key] = max(vals)
        else:
            out[key] = statistics.median(vals)
        spread[key] = {"min": min(vals), "max": max(vals)}
    out["spread"] = spread
    out["repeats"] = len(summaries)
    return out


def combine_machine(records: Sequence[Optional[dict]]) -> Optional[dict]:
    """One machine-load record for several repeats: the worst of each (the highest load averages and share
    of CPU taken by others), own CPU seconds and wall time added up; None when no repeat recorded one."""
    recs = [r for r in records if isinstance(r, dict) and r]
    if not recs:
        return None

    def most(key: str) -> Optional[float]:
        vals = _numbers(r.get(key) for r in recs)
        return max(vals) if vals else None

    def load1(key: str) -> Optional[float]:
        """The 1-minute figure of ``loadavg_<when>``: a load test's list, or a combined record's ``_1m``."""
        vals = _numbers((r.get(key) or [None])[0] if isinstance(r.get(key), list) else r.get(f"{key}_1m")
                        for r in recs)
        return max(vals) if vals else None

    return {"repeats": sum(int(r.get("repeats") or 1) for r in recs), "cpu_count": most("cpu_count"), "loadavg_before_1m": load1("loadavg_before"),
            "loadavg_after_1m": load1("loadavg_after"), "others_cpu_share": most("others_cpu_share"),
            "busy_share": most("busy_share"), "own_cpu_share": most("own_cpu_share"),
            "own_cpu_s": sum(_numbers(r.get("own_cpu_s") for r in recs)),
            "wall_s": sum(_numbers(r.get("wall_s") for r in recs))}


def group_by_repeat(records: Sequence[dict]) -> dict[int, list[dict]]:
    """{repeat index: records}; records without a ``repeat`` (stores from before repeats) are repeat 0."""
    out: dict[int, list[dict]] = {}
    for r in records:
        rep = r.get("repeat")
        out.setdefault(int(rep) if isinstance(rep, int) and not isinstance(rep, bool) else 0, []).append(r)
    return dict(sorted(out.items()))

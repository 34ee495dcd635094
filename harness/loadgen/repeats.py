"""One load test run ``repeats`` times: the same prompts (same seed and salt) each time, so the repeats differ
only by run-to-run noise, which is what their spread measures.

``run_repeats(base_url, model, cfg, repeats)`` returns ``(summary, records)``:

- every record carries ``repeat`` (0-based); its ``start_s`` counts from its own repeat's start;
- the summary is the first repeat's run facts (model, config, load settings, SLO, token-count source) with the
  metrics combined over the repeats (``core.serving_repeats.combine_summaries``: medians, counts added up,
  ``spread`` min/max per metric, ``repeats``), ``per_repeat`` (each repeat's own summary, its
  ``machine_load`` included), ``machine_load`` combined (the worst repeat's load averages and share of CPU taken
  by other processes) and ``server_metrics`` with the most any repeat saw.

``between(i)`` runs before every repeat after the first (the sweep flushes a server's prefix cache there, so a
repeat does not find the previous one's prompts cached).
"""

from __future__ import annotations

from typing import Callable, Optional

from kvbench.core import combine_machine, combine_summaries
from kvbench.harness.loadgen.run import LoadConfig, jsonable, run_load
from kvbench.harness.replica_set import ReplicaURL

__all__ = ["run_repeats", "combine_run_summaries", "spread_lines", "machine_line"]

# run facts that differ per repeat: kept in ``per_repeat`` only
_PER_REPEAT_ONLY = ("t0_monotonic", "machine_load", "client_lag_ms", "server_metrics", "first_errors", "per_replica")
# the same for every repeat: not copied into ``per_repeat`` (the replica facts: harness/loadgen/replicas.py)
_HEADER = ("base_url", "model", "config", "replicas", "replica_urls", "replica_load", "concurrency_per_replica")


def _server_metrics(per: list[dict]) -> dict:
    avail = [s.get("server_metrics") for s in per if (s.get("server_metrics") or {}).get("available")]
    if not avail:
        return (per[0].get("server_metrics") if per else None) or {"available": False}
    out = dict(avail[0])
    for key in out:
        vals = [m.get(key) for m in avail if isinstance(m.get(key), (int, float)) and not isinstance(m.get(key), bool)]
        if vals:
            out[key] = max(vals)  # the most any repeat saw (samples, running, waiting, KV usage, preemptions)
    out["repeats"] = len(avail)
    return out


def combine_run_summaries(per: list[dict]) -> dict:
    """The summary of a repeated load test from its repeats' ``run_load`` summaries (module docstring)."""
    if not per:
        raise ValueError("no repeats to combine")
    out = {k: v for k, v in per[0].items() if k not in _PER_REPEAT_ONLY}
    out.update(combine_summaries(per))
    out["per_repeat"] = [{k: v for k, v in s.items() if k not in _HEADER} for s in per]
    out["machine_load"] = combine_machine([s.get("machine_load") for s in per])
    out["server_metrics"] = _server_metrics(per)
    lags = [s.get("client_lag_ms") or {} for s in per]
    out["client_lag_ms"] = {k: max((x.get(k) for x in lags if isinstance(x.get(k), (int, float))), default=None)
                            for k in ("mean", "p99", "max")}
    out["first_errors"] = [e for s in per for e in (s.get("first_errors") or [])][:5]
    if len(per) == 1 and per[0].get("per_replica") is not None:  # one repeat: its replicas' figures stay in view
        out["per_replica"] = per[0]["per_replica"]
    return jsonable(out)


def run_repeats(base_url: str, model: Optional[str], cfg: LoadConfig, repeats: int = 1,
                between: Optional[Callable[[int], None]] = None,
                run: Callable = run_load) -> tuple[dict, list[dict]]:
    """Run the load test ``repeats`` times (module docstring); ``run`` is ``run_load`` (tests pass fakes)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if run is run_load and isinstance(base_url, ReplicaURL):  # replicas (harness/loadgen/replicas.py)
        from kvbench.harness.loadgen.replicas import run_replicas

        run = run_replicas
    per, records = [], []
    for i in range(repeats):
        if i and between is not None:
            between(i)
        summary, recs = run(base_url, model, cfg)
        model = model or summary.get("model")  # discovered once
        per.append(summary)
        records.extend({**r, "repeat": i} for r in recs)
    return combine_run_summaries(per), records


def _range(summary: dict, key: str, digits: int) -> str:
    v, sp = summary.get(key), (summary.get("spread") or {}).get(key) or {}
    if not isinstance(v, (int, float)):
        return "n/a"
    if sp.get("min") is None or sp.get("max") is None or sp["min"] == sp["max"]:
        return f"{v:.{digits}f}"
    return f"{v:.{digits}f} ({sp['min']:.{digits}f}–{sp['max']:.{digits}f})"


def machine_line(m: Optional[dict]) -> Optional[str]:
    """The machine's load during a load test, in words (None when it was not recorded)."""
    if not m:
        return None
    cpus = m.get("cpu_count")
    before = m.get("loadavg_before_1m", (m.get("loadavg_before") or [None])[0])
    after = m.get("loadavg_after_1m", (m.get("loadavg_after") or [None])[0])
    parts = [f"{cpus} CPUs" if cpus else "CPUs unknown"]
    if before is not None and after is not None:
        parts.append(f"load average {before:.2f} → {after:.2f} (1 min)")
    if m.get("others_cpu_share") is not None:
        parts.append(f"other processes (the server too, unless kvbench started it) took "
                     f"{100 * m['others_cpu_share']:.0f}% of the CPU")
    if m.get("own_cpu_s") is not None:
        parts.append(f"this process and its servers {m['own_cpu_s']:.1f} CPU s")
    return "Machine: " + ", ".join(parts)


def spread_lines(summary: dict) -> list[str]:
    """Console lines after the result block: the spread across repeats and the machine's load."""
    n = int(summary.get("repeats") or 1)
    if n < 2:
        lines = ["One repeat: no run-to-run spread measured (--repeats N measures it)."]
    else:
        lines = [f"Across {n} repeats, median (min–max): output {_range(summary, 'output_throughput', 1)} tok/s, "
                 f"requests {_range(summary, 'request_throughput', 2)}/s, TTFT p50 {_range(summary, 'median_ttft_ms', 0)} ms, "
                 f"TPOT p50 {_range(summary, 'median_tpot_ms', 0)} ms"]
    line = machine_line(summary.get("machine_load"))
    return lines + ([line] if line else [])

"""Samples of a server's Prometheus ``/metrics`` during a load run (kvbench, vLLM and SGLang names).

The names, as the engines define them: vLLM ``vllm/v1/metrics/loggers.py`` (``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0.9+; ``vllm:gpu_cache_usage_perc`` before, and
in V0), the counter ``vllm:num_preemptions`` exported as ``vllm:num_preemptions_total``; labels ``model_name``,
``engine``); SGLang ``python/sglang/srt/metrics/collector.py`` (``sglang:num_running_reqs``,
``sglang:num_queue_reqs``, ``sglang:token_usage``, the counter ``sglang:num_retracted_requests_total``; served
only with ``--enable-metrics``).  Label sets are summed (data-parallel engines each report their own queue),
KV usage ratios averaged.

Gauges (running, waiting, KV usage) are summarized by their maxima; the preemption counter by its increase
over the run (kvbench ``kvbench_preemptions_total``, vLLM ``vllm:num_preemptions_total``, SGLang
``sglang:num_retracted_requests_total``: requests retracted to free KV memory).  kvbench's server also counts the
kernels it compiled while serving (``kvbench_kernel_compiles_total`` and ``_seconds_total``; runtime/compile_watch.py):
their increase over the run says whether compile stalls are inside the measurement.  And where its step loop's
time went (``kvbench_engine_<kind>_steps_total``, ``_step_seconds_total``, ``_step_tokens_total`` for the kinds
prefill, mixed, decode; ``runtime/engine_api.py`` STEP_KINDS): their increase over the samples (a restart of the
server counts from zero again, as ``counter_increase``), with the window's length, gives ``engine_steps`` (seconds per kind, the rest of the window being the
loop waiting for work).
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from kvbench.runtime.engine_api import STEP_KINDS

RUNNING = ("kvbench_num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("kvbench_num_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("kvbench_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
# counters (Prometheus text names, with their ``_total`` suffix)
PREEMPTIONS = ("kvbench_preemptions_total", "vllm:num_preemptions_total", "sglang:num_retracted_requests_total")
# kvbench's embedded server only: kernels compiled mid-run (each a stall of every running request)
COMPILES = ("kvbench_kernel_compiles_total",)
COMPILE_S = ("kvbench_kernel_compile_seconds_total",)
_RATIOS = frozenset(KV_USAGE)
_STEP_FIELDS = (("steps", "steps_total"), ("seconds", "step_seconds_total"), ("tokens", "step_tokens_total"))


def engine_steps(scrapes: list[dict[str, float]], window_s: float) -> Optional[dict]:
    """kvbench's step-time counters over a run's scrapes (their increase, restart-aware as ``counter_increase``):
    ``{kind: {steps, seconds, tokens, ms_per_step}, ..., "window_s", "busy_fraction"}``; None where the server
    exports none."""
    out: dict = {}
    for kind in STEP_KINDS:
        row = {}
        for key, suffix in _STEP_FIELDS:
            name = f"kvbench_engine_{kind}_{suffix}"
            if scrapes and name in scrapes[-1]:
                row[key] = counter_increase([s.get(name, 0.0) for s in scrapes])
        if row.get("steps"):
            row["steps"], row["tokens"] = int(round(row["steps"])), int(round(row.get("tokens", 0)))
            row["ms_per_step"] = 1000 * row.get("seconds", 0.0) / row["steps"]
            out[kind] = row
    if not out:
        return None
    out["window_s"] = window_s
    out["busy_fraction"] = (sum(out[k].get("seconds", 0.0) for k in STEP_KINDS if k in out) / window_s
                            if window_s > 0 else None)
    return out


def parse_prometheus(text: str) -> dict[str, float]:
    """Metric name -> value summed over label sets (one per data-parallel engine or rank), except the KV usage
    ratios, which are averaged (each engine's share of its own pool); comments and unparsable lines are skipped."""
    out: dict[str, float] = {}
    seen: dict[str, int] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        name = name.strip()
        out[name] = out.get(name, 0.0) + value
        seen[name] = seen.get(name, 0) + 1
    for name in _RATIOS.intersection(out):
        out[name] /= seen[name]
    return out


def counter_increase(values) -> Optional[float]:
    """Increase of a counter over its samples (None values skipped); a drop is a restart of the counter,
    after which it counts from zero again.  None when fewer than one sample holds a value."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    total = 0.0
    for prev, cur in zip(xs, xs[1:]):
        total += cur - prev if cur >= prev else cur
    return total


def _first(values: dict[str, float], names) -> Optional[float]:
    for n in names:
        if n in values:
            return values[n]
    return None


class MetricsSampler:
    """Polls ``path`` every ``interval_s`` until stopped; a failing first poll turns sampling off."""

    def __init__(self, pool, path: str, interval_s: float, t0: float):
        self.pool, self.path, self.interval_s, self.t0 = pool, path, interval_s, t0
        # (t_s, running, waiting, kv_usage, preemptions counter, kernel compiles counter, compile seconds counter)
        self.samples: list[tuple[Optional[float], ...]] = []
        self.available = True
        self._stop = asyncio.Event()
        self._engine: list[tuple[float, dict[str, float]]] = []  # (t_s, kvbench_engine_* counters): first, last

    async def _poll(self) -> bool:
        try:
            status, text = await self.pool.get_text(self.path)
            if status != 200:
                return False
            values = parse_prometheus(text)
        except Exception:  # noqa: BLE001 - a server without /metrics is fine
            return False
        t = time.perf_counter() - self.t0
        eng = {k: v for k, v in values.items() if k.startswith("kvbench_engine_")}
        if eng:  # keep the first scrape and the latest
            self._engine[min(1, len(self._engine)):] = [(t, eng)]
        self.samples.append(
            (t, _first(values, RUNNING), _first(values, WAITING), _first(values, KV_USAGE),
             _first(values, PREEMPTIONS), _first(values, COMPILES), _first(values, COMPILE_S))
        )
        return True

    async def run(self) -> None:
        first = True
        while not self._stop.is_set():
            ok = await self._poll()
            if first and not ok:
                self.available = False
                return
            first = False
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
        await self._poll()  # the counters as the run ends (the last periodic poll may be up to interval_s old)

    def stop(self) -> None:
        self._stop.set()

    def summary(self) -> dict:
        if not self.available or not self.samples:
            return {"available": False}
        running = [s[1] for s in self.samples if s[1] is not None]
        waiting = [s[2] for s in self.samples if s[2] is not None]
        kv = [s[3] for s in self.samples if s[3] is not None]
        no_queue = [s[1] for s in self.samples if s[1] is not None and s[2] is not None and s[2] == 0]
        preempted = counter_increase(s[4] for s in self.samples)
        compiles, compile_s = counter_increase(s[5] for s in self.samples), counter_increase(s[6] for s in self.samples)
        return {
            "available": True,
            "samples": len(self.samples),
            "interval_s": self.interval_s,
            "max_running": max(running) if running else None,
            "max_waiting": max(waiting) if waiting else None,
            "max_running_without_queueing": max(no_queue) if no_queue else None,
            "kv_usage_max": max(kv) if kv else None,
            "kv_usage_mean": sum(kv) / len(kv) if kv else None,
            "preemptions": None if preempted is None else int(round(preempted)),  # None: the server exports no counter
            # kvbench's server: kernels compiled during the run and the seconds they took (None elsewhere)
            "kernel_compiles": None if compiles is None else int(round(compiles)),
            "kernel_compile_s": compile_s,
            # kvbench's server: its step loop's seconds per step kind between the first and last sample
            "engine_steps": (engine_steps([v for _, v in self._engine], self._engine[-1][0] - self._engine[0][0])
                             if len(self._engine) > 1 else None),
            # [t_s, running, waiting, kv_usage, preemptions counter, kernel compiles counter, compile seconds counter]
            "timeline": [list(s) for s in self.samples],
        }

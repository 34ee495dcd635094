"""Load tests over data-parallel replicas (an endpoint target whose ``base_url`` lists several servers of one
configuration; harness/replica_set.py).  ``run_replicas(base_url, model, cfg)`` is ``run_load`` for a
``ReplicaURL`` (a plain URL goes to ``run_load`` unchanged; a ``ReplicaURL`` of one URL, what is left of a
target whose other replicas were taken out of rotation, runs as one replica with the replica fields).  The
cell's concurrency applies to each replica:

* ``aggregate`` (the default): one load test over every replica at once, N copies of the cell's single-server
  load merged: ``num_prompts × N`` prompts, at most ``max_concurrency`` in flight on each replica (``× N`` in
  all), the arrival rate ``× N``; each request goes to the replica with the fewest in flight (round robin among
  equals).  Throughputs are the replicas' sum.  Every replica is warmed up first (a replica that is down fails
  the run there, named); one that fails later fails the requests sent to it (``success`` false, its URL in the
  error), the run goes on.
* ``each``: the cell's load test against one replica at a time, in order; the records are laid end to end
  (``start_s`` continues where the previous replica's run ended), so the figures are pooled over the replicas:
  throughputs are the mean per replica, latencies their distribution over all replicas' requests.

Neither mode fails over, on purpose: the load test measures serving, so a request that fails on a replica is
counted failed there (``success`` false, the replica's URL in ``error``) and is never sent to another replica,
and no replica leaves the test while it runs; the summary says so (``replica_failover: false``), as do the
console block and the serving report's note.  (Accuracy suites do fail over: harness/replica_client.py.)

Both start by reading every replica's ``/v1/models`` (``check_same_model``: a replica that is down or serves
another model is an error naming it).  Every request record carries ``replica`` (its replica's base URL); the
summary adds ``replicas`` (N), ``replica_urls``, ``replica_load`` (the mode), ``concurrency_per_replica``,
``replica_failover`` (always false, above) and
``per_replica`` (each replica's figures: in ``aggregate`` recomputed from its share of the records, in ``each``
its own run's summary), and ``server_metrics`` combines every replica's ``/metrics`` samples (running and
waiting requests: the sum of the replicas' maxima in ``aggregate``, the largest in ``each``; peak KV usage: the
largest; preemptions: the sum; each replica's own under ``per_replica``).  The settings the summary records
(``num_prompts``, ``max_concurrency``, ``request_rate``) are what the whole test ran; ``config`` is the cell's
(per replica).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import asdict, replace
from typing import Optional

from kvbench.core import combine_machine, summarize
from kvbench.harness.loadgen.run import (LoadConfig, _lag_monitor, dispatch, _summary, _warm_up, jsonable, run_load, run_measured,
                                         server_root)
from kvbench.harness.replica_set import ReplicaURL, check_same_model, replica_mode, replica_urls
from kvbench.runtime.engine_api import STEP_KINDS

__all__ = ["run_replicas", "combine_server_metrics"]

_BRIEF = ("completed", "failed", "duration_s", "request_throughput", "output_throughput", "peak_concurrency",
          "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_e2el_ms")


def run_replicas(base_url: str, model: Optional[str], cfg: LoadConfig) -> tuple[dict, list[dict]]:
    """The load test of ``base_url``'s replicas (module docstring); one URL: ``run_load``."""
    urls = list(replica_urls(base_url))
    if not isinstance(base_url, ReplicaURL):  # one server (a ReplicaURL of one: the last replica in rotation)
        return run_load(base_url, model, cfg)
    model = check_same_model(urls, model, cfg.api_key)
    mode = replica_mode(base_url)
    summary, records = _run_each(urls, model, cfg) if mode == "each" else _run_aggregate(urls, model, cfg)
    conf = asdict(cfg)
    conf.pop("api_key", None)
    conf["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    facts = {"replicas": len(urls), "replica_urls": urls, "replica_load": mode,
             "concurrency_per_replica": cfg.max_concurrency, "replica_failover": False}
    return jsonable({"base_url": urls[0], "model": model, "config": conf, **summary, **facts}), records


# ------------------------------------------------------------------------------ aggregate
class _Slots:
    """Per-replica concurrency slots: ``acquire()`` waits until a replica has fewer than ``cap`` in flight and
    takes the least-loaded one (round robin among equals); waiters are served first come, first served."""

    def __init__(self, n: int, cap: Optional[int]):
        self.load, self.cap, self._next = [0] * n, cap, 0
        self._waiters: deque = deque()

    def _free(self) -> bool:
        return self.cap is None or min(self.load) < self.cap

    def _take(self) -> int:
        n, low = len(self.load), min(self.load)
        i = next((self._next + k) % n for k in range(n) if self.load[(self._next + k) % n] == low)
        self._next = (i + 1) % n
        self.load[i] += 1
        return i

    async def acquire(self) -> int:
        if not self._waiters and self._free():
            return self._take()
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return await fut

    def release(self, i: int) -> None:
        self.load[i] -= 1
        while self._waiters and self._free():
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(self._take())


def _run_aggregate(urls: list[str], model: str, cfg: LoadConfig) -> tuple[dict, list[dict]]:
    from kvbench.harness.loadgen.tokenizer import resolve_tokenizer

    n = len(urls)
    total = replace(cfg, num_prompts=cfg.num_prompts * n, request_rate=cfg.request_rate * n,
                    max_concurrency=None if cfg.max_concurrency is None else cfg.max_concurrency * n)
    tokenizer = resolve_tokenizer(cfg.tokenizer, server_root(urls[0]), cfg.api_key)
    return run_measured(total, tokenizer,
                        lambda items: _run_async(urls, model, total, cfg.max_concurrency, items, tokenizer))


async def _run_async(urls: list[str], model: str, cfg: LoadConfig, per_cap: Optional[int], items: list,
                     tokenizer) -> tuple[dict, list[dict]]:
    from kvbench.harness.loadgen.http import HttpPool, build_payload

    path = "/v1/chat/completions" if cfg.api == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    payloads = [build_payload(cfg.api, model, it.prompt, it.output_len, cfg.temperature, cfg.ignore_eos) for it in items]
    roots = [server_root(u) for u in urls]
    pools = [HttpPool(r, headers, cfg.timeout_s) for r in roots]
    sides = [HttpPool(r, headers, 30.0) for r in roots]  # /metrics polls never queue behind requests
    try:
        for pool, root in zip(pools, roots):  # every replica warmed up (a replica that is down fails here, named)
            await _warm_up(pool, root, path, payloads, cfg)
        work = list(zip(items[cfg.warmup:], payloads[cfg.warmup:]))
        share = -(-len(work) // len(urls))
        wave = max(1, min(per_cap or share, share, 512 // len(urls)))
        await asyncio.gather(*(p.preconnect(wave) for p in pools))
        outcomes, served, t0, duration, lags, samplers = await _send_all(pools, sides, path, work, cfg, per_cap)
    finally:
        for p in (*pools, *sides):
            p.close()
    for oc, i in zip(outcomes, served):
        if oc.error is not None:
            oc.error = f"replica {urls[i]}: {oc.error}"
    summary, records = _summary(work, outcomes, t0, duration, lags, samplers[0], cfg, tokenizer)
    for rec, i in zip(records, served):
        rec["replica"] = urls[i]
    metrics = [s.summary() if cfg.metrics_interval_s > 0 else {"available": False} for s in samplers]
    summary["server_metrics"] = combine_server_metrics(metrics, urls, concurrent=True)
    summary["per_replica"] = [{"url": u, **_brief(summarize([r for r in records if r["replica"] == u], duration,
                                                           cfg.slo, cfg.bucket_s))} for u in urls]
    return summary, records


async def _send_all(pools, sides, path: str, work: list, cfg: LoadConfig, per_cap: Optional[int]):
    """``run._send_all`` over several replicas: each request takes a replica slot (``_Slots``) on its arrival
    schedule → ``(outcomes, replica index per request, t0, duration, lags, samplers)``."""
    from kvbench.harness.loadgen.http import parse_stream, send_stream
    from kvbench.harness.loadgen.server_metrics import MetricsSampler

    prefix = cfg.salt or "load"
    slots = _Slots(len(pools), per_cap)
    served = [0] * len(work)

    async def one(i: int, payload: dict):
        r = await slots.acquire()
        try:
            sent = await send_stream(pools[r], path, payload, cfg.api, f"{prefix}-{i}")
        finally:
            slots.release(r)  # the slot is free the moment the response ends: parsing comes after
        served[i] = r
        await asyncio.sleep(0)
        return parse_stream(sent)

    stop = asyncio.Event()
    lags: list[float] = []
    t0 = time.perf_counter()
    samplers = [MetricsSampler(s, "/metrics", cfg.metrics_interval_s, t0) for s in sides]
    side = [asyncio.create_task(_lag_monitor(stop, lags))]
    if cfg.metrics_interval_s > 0:
        side += [asyncio.create_task(s.run()) for s in samplers]
    outcomes = await dispatch(work, cfg, t0, one)
    duration = time.perf_counter() - t0
    stop.set()
    for s in samplers:
        s.stop()
    await asyncio.gather(*side)
    return outcomes, served, t0, duration, lags, samplers


# ------------------------------------------------------------------------------ each
def _run_each(urls: list[str], model: str, cfg: LoadConfig) -> tuple[dict, list[dict]]:
    """The cell's load test on each replica in turn, records laid end to end (module docstring)."""
    parts, records, offset = [], [], 0.0
    for url in urls:
        s, recs = run_load(url, model, cfg)
        for r in recs:
            err = r.get("error")
            records.append({**r, "start_s": float(r["start_s"]) + offset, "replica": url,
                            "error": f"replica {url}: {err}" if err else err})
        offset += float(s.get("duration_s") or 0.0)
        parts.append(s)
    summary = summarize(records, max(offset, 1e-9), cfg.slo, cfg.bucket_s)
    settings = ("request_rate", "burstiness", "max_concurrency", "num_prompts", "dataset", "input_len", "output_len",
                "range_ratio")
    summary.update({k: parts[0][k] for k in settings if k in parts[0]})
    sources = {x for p in parts for x in str(p.get("token_count_source") or "").split("+") if x}
    summary["token_count_source"] = "+".join(sorted(sources))
    summary["t0_monotonic"] = parts[0].get("t0_monotonic")
    lags = [p.get("client_lag_ms") or {} for p in parts]
    summary["client_lag_ms"] = {k: max((x.get(k) for x in lags if isinstance(x.get(k), (int, float))), default=None)
                                for k in ("mean", "p99", "max")}
    summary["server_metrics"] = combine_server_metrics([p.get("server_metrics") for p in parts], urls, concurrent=False)
    summary["first_errors"] = [r["error"] for r in records if r.get("error")][:5]
    summary["machine_load"] = combine_machine([p.get("machine_load") for p in parts])
    summary["per_replica"] = [{"url": u, **{k: v for k, v in p.items() if k not in ("base_url", "model", "config")}}
                              for u, p in zip(urls, parts)]
    return summary, records


# ------------------------------------------------------------------------------ shared
def _brief(s: dict) -> dict:
    return {k: s.get(k) for k in _BRIEF}


def _sum_engine_steps(rows: list) -> Optional[dict]:
    """Replicas' step-time summaries (server_metrics.engine_steps) added per kind; ``busy_fraction`` is the
    replicas' mean (each is one engine's share of its own window)."""
    rows = [r for r in rows if isinstance(r, dict)]
    if not rows:
        return None
    out: dict = {}
    for kind in STEP_KINDS:
        got = [r[kind] for r in rows if kind in r]
        if got:
            k = {f: sum(g.get(f, 0) for g in got) for f in ("steps", "seconds", "tokens")}
            k["ms_per_step"] = 1000 * k["seconds"] / k["steps"] if k["steps"] else None
            out[kind] = k
    out["window_s"] = max(r.get("window_s") or 0.0 for r in rows)
    busy = [r["busy_fraction"] for r in rows if r.get("busy_fraction") is not None]
    out["busy_fraction"] = sum(busy) / len(busy) if busy else None
    return out


def combine_server_metrics(metrics: list, urls: list[str], concurrent: bool) -> dict:
    """Every replica's ``/metrics`` summary as one (module docstring); ``available`` when any replica exported
    them (``replicas_reporting`` says how many), each replica's own under ``per_replica``."""
    avail = [m for m in metrics if isinstance(m, dict) and m.get("available")]
    if not avail:
        return {"available": False}

    def nums(key: str) -> list:
        return [m[key] for m in avail if isinstance(m.get(key), (int, float)) and not isinstance(m.get(key), bool)]

    out: dict = {"available": True, "samples": sum(nums("samples")), "interval_s": avail[0].get("interval_s"),
                 "replicas_reporting": len(avail)}
    for key in ("max_running", "max_waiting", "max_running_without_queueing"):
        vals = nums(key)
        out[key] = (sum(vals) if concurrent else max(vals)) if vals else None
    kv, mean, pre = nums("kv_usage_max"), nums("kv_usage_mean"), nums("preemptions")
    out["kv_usage_max"] = max(kv) if kv else None
    out["kv_usage_mean"] = sum(mean) / len(mean) if mean else None
    out["preemptions"] = int(sum(pre)) if pre else None
    comp = nums("kernel_compiles")
    out["kernel_compiles"] = int(sum(comp)) if comp else None
    out["engine_steps"] = _sum_engine_steps([m.get("engine_steps") for m in avail])
    out["per_replica"] = [{"url": u, **(m if isinstance(m, dict) else {"available": False})} for u, m in zip(urls, metrics)]
    return out

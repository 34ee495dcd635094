"""Serving load generator against any OpenAI-compatible endpoint (docs/design.md §9).

``run_load(base_url, model, LoadConfig)`` sends a seeded dataset of streamed requests with gamma
inter-arrivals (``burstiness`` 1 = Poisson; ``request_rate`` inf = all at once) under an optional
concurrency cap, after ``warmup`` untimed requests, and returns ``(summary, records)``: the metric summary
of ``loadgen_metrics.summarize`` plus run facts, and one record per request in the ``requests.jsonl``
schema (docs/design.md §10).  Token counts come from the server's ``usage``, else from a tokenizer, else from the
number of streamed chunks (``summary["token_count_source"]`` says which).  The client's own event-loop
lag is sampled during the run (``client_lag_ms``) so a saturated client shows up in the numbers, and the
machine's load around it (``machine_load``: load averages, own CPU time, the share other processes took).
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from kvbench.harness.loadgen.datasets import DATASETS, LoadItem, custom_items, random_items, sharegpt_items
from kvbench.harness.loadgen.machine import MachineProbe
from kvbench.core import describe_ms, summarize, tpot_of
from kvbench.runtime.engine_api import STEP_KINDS

APIS = ("completions", "chat")


@dataclass
class LoadConfig:
    num_prompts: int = 64
    max_concurrency: Optional[int] = None  # None = unbounded
    request_rate: float = math.inf  # requests per second; inf = all at once
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1 = Poisson
    dataset: str = "random"  # random | fixed | sharegpt | custom
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    dataset_path: Optional[str] = None
    api: str = "completions"
    ignore_eos: bool = True
    temperature: float = 0.0
    warmup: int = 1
    seed: int = 0
    salt: str = ""  # varies prompts between cells (defeats a prefix cache carried across cells)
    slo_ttft_ms: Optional[float] = None
    slo_tpot_ms: Optional[float] = None
    slo_e2el_ms: Optional[float] = None
    metrics_interval_s: float = 0.5  # /metrics sampling period; 0 = off
    timeout_s: float = 600.0  # per request
    tokenizer: Optional[str] = None  # path, "server", "none", or None = the server's when offered
    vocab_size: Optional[int] = None
    api_key: Optional[str] = None
    progress: bool = False
    bucket_s: float = 1.0  # window of the peak output throughput

    def __post_init__(self) -> None:
        if self.num_prompts <= 0:
            raise ValueError(f"num_prompts must be positive, got {self.num_prompts}")
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"max_concurrency must be positive, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive (inf = all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset={self.dataset!r}; choose one of {', '.join(DATASETS)}")
        if self.dataset in ("sharegpt", "custom") and not self.dataset_path:
            raise ValueError(f"the {self.dataset} dataset needs dataset_path (--dataset-path)")
        if self.api not in APIS:
            raise ValueError(f"api={self.api!r}; choose one of {', '.join(APIS)}")
        if self.warmup < 0 or self.timeout_s <= 0 or self.metrics_interval_s < 0 or self.bucket_s <= 0:
            raise ValueError("warmup, metrics_interval_s must be >= 0; timeout_s, bucket_s > 0")

    @property
    def slo(self) -> dict:
        return {"ttft_ms": self.slo_ttft_ms, "tpot_ms": self.slo_tpot_ms, "e2el_ms": self.slo_e2el_ms}


def server_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def discover_model(base_url: str, api_key: Optional[str] = None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(server_root(base_url) + "/v1/models", headers=headers, timeout=30.0)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])


def build_items(cfg: LoadConfig, tokenizer) -> list[LoadItem]:
    n = cfg.num_prompts + cfg.warmup
    if cfg.dataset == "sharegpt":
        return sharegpt_items(
            cfg.dataset_path, n, cfg.seed, cfg.salt, tokenizer, cfg.output_len if tokenizer is None else None
        )
    if cfg.dataset == "custom":
        return custom_items(cfg.dataset_path, n, cfg.output_len, cfg.salt, tokenizer)
    vocab = cfg.vocab_size or (tokenizer.vocab_size if tokenizer is not None else 32000)
    ratio = 0.0 if cfg.dataset == "fixed" else cfg.range_ratio
    return random_items(
        n, cfg.input_len, cfg.output_len, ratio, cfg.seed, cfg.salt, vocab, tokenizer, as_text=cfg.api == "chat"
    )


def _record(outcome, item: LoadItem, t0: float, tokenizer) -> tuple[dict, str]:
    usage = outcome.usage or {}
    source = "usage"
    out_tokens = usage.get("completion_tokens")
    if out_tokens is None:
        if tokenizer is not None and outcome.text:
            out_tokens, source = len(tokenizer.encode(outcome.text)), "tokenizer"
        else:
            out_tokens, source = len(outcome.chunk_times), "chunks"
    prompt_tokens = usage.get("prompt_tokens", item.prompt_len)
    times = outcome.chunk_times
    rec = {
        "request_id": outcome.request_id,
        "success": outcome.error is None,
        "error": outcome.error,
        "prompt_tokens": int(prompt_tokens) if prompt_tokens is not None else 0,
        "output_tokens": int(out_tokens),
        "start_s": outcome.start - t0,
        "ttft_s": (times[0] - outcome.start) if times else None,
        "latency_s": outcome.end - outcome.start,
        "itl_s": [b - a for a, b in zip(times, times[1:])],
        "tpot_s": None,
    }
    rec["tpot_s"] = tpot_of(rec)
    return rec, source


async def dispatch(work: list, cfg: "LoadConfig", t0: float, one) -> list:
    """Start ``one(i, payload)`` for every request of ``work`` at its arrival time (``cfg.request_rate`` and
    ``burstiness``; all at once for an infinite rate) and gather the outcomes in order."""
    import random

    rng = random.Random(cfg.seed)
    tasks, due = [], t0
    for i, (_, payload) in enumerate(work):
        if i and math.isfinite(cfg.request_rate):
            # arrivals on an absolute schedule: a late wake-up does not delay every later request
            due += rng.gammavariate(cfg.burstiness, 1.0 / (cfg.request_rate * cfg.burstiness))
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, payload)))
    return await asyncio.gather(*tasks)


async def _lag_monitor(stop: asyncio.Event, lags: list[float], period: float = 0.005) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(max(0.0, time.perf_counter() - t - period))


def load_settings(cfg: LoadConfig, tokenizer=None) -> dict:
    """The arrival and dataset settings a load summary records next to its metrics.

    ``request_rate`` is the string ``"inf"`` for all-at-once arrivals (JSON has no infinity);
    ``max_concurrency`` None means no cap.  A length the dataset does not fix is None: ShareGPT prompts
    keep their own lengths, and their outputs too when a tokenizer measures them.
    """
    sharegpt = cfg.dataset in ("sharegpt", "custom")  # lengths are the file's
    return {
        "request_rate": "inf" if math.isinf(cfg.request_rate) else float(cfg.request_rate),
        "burstiness": float(cfg.burstiness),
        "max_concurrency": cfg.max_concurrency,
        "num_prompts": cfg.num_prompts,
        "dataset": cfg.dataset,
        "input_len": None if sharegpt else cfg.input_len,
        "output_len": None if sharegpt and tokenizer is not None else cfg.output_len,
        "range_ratio": 0.0 if cfg.dataset == "fixed" else (None if sharegpt else cfg.range_ratio),
    }


async def _run_async(base_url: str, model: str, cfg: LoadConfig, items: list[LoadItem], tokenizer) -> tuple[dict, list[dict]]:
    from kvbench.harness.loadgen.http import HttpPool, build_payload

    root = server_root(base_url)
    path = "/v1/chat/completions" if cfg.api == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    payloads = [build_payload(cfg.api, model, it.prompt, it.output_len, cfg.temperature, cfg.ignore_eos) for it in items]
    pool = HttpPool(root, headers, cfg.timeout_s)
    side_pool = HttpPool(root, headers, 30.0)  # /metrics polls never queue behind requests
    try:
        await _warm_up(pool, root, path, payloads, cfg)
        work = list(zip(items[cfg.warmup :], payloads[cfg.warmup :]))
        # connections for the first wave, opened before the clock starts (at most 512)
        await pool.preconnect(min(cfg.max_concurrency or len(work), len(work), 512))
        outcomes, t0, duration, lags, sampler = await _send_all(pool, side_pool, path, work, cfg)
    finally:
        pool.close()
        side_pool.close()
    return _summary(work, outcomes, t0, duration, lags, sampler, cfg, tokenizer)


async def _warm_up(pool, root: str, path: str, payloads: list[dict], cfg: LoadConfig) -> None:
    """The untimed warm-up requests, one after another; a failed one stops the run."""
    from kvbench.harness.loadgen.http import stream_request

    for i in range(cfg.warmup):
        res = await stream_request(pool, path, payloads[i], cfg.api, f"warmup-{i}")
        if res.error is not None:
            raise RuntimeError(f"warm-up request to {root}{path} failed: {res.error}")


async def _send_all(pool, side_pool, path: str, work: list, cfg: LoadConfig):
    """The timed run: every request of ``work`` on its arrival schedule under the concurrency cap, with the
    event-loop lag and ``/metrics`` sampled beside it → ``(outcomes, t0, duration, lags, sampler)``."""
    from kvbench.harness.loadgen.http import parse_stream, send_stream
    from kvbench.harness.loadgen.server_metrics import MetricsSampler

    prefix = cfg.salt or "load"
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(work), desc=f"load c={cfg.max_concurrency or 'inf'}", leave=False)

    async def one(i: int, payload: dict):
        if sem is None:
            sent = await send_stream(pool, path, payload, cfg.api, f"{prefix}-{i}")
        else:
            async with sem:  # the slot is free the moment the response ends: parsing comes after
                sent = await send_stream(pool, path, payload, cfg.api, f"{prefix}-{i}")
            await asyncio.sleep(0)  # the request waiting for the slot goes out before this one is parsed
        res = parse_stream(sent)
        if bar is not None:
            bar.update(1)
        return res

    stop = asyncio.Event()
    lags: list[float] = []
    t0 = time.perf_counter()
    sampler = MetricsSampler(side_pool, "/metrics", cfg.metrics_interval_s, t0)
    side = [asyncio.create_task(_lag_monitor(stop, lags))]
    if cfg.metrics_interval_s > 0:
        side.append(asyncio.create_task(sampler.run()))
    outcomes = await dispatch(work, cfg, t0, one)
    duration = time.perf_counter() - t0
    stop.set()
    sampler.stop()
    await asyncio.gather(*side)
    if bar is not None:
        bar.close()
    return outcomes, t0, duration, lags, sampler


def _summary(work: list, outcomes, t0: float, duration: float, lags: list[float], sampler, cfg: LoadConfig,
             tokenizer) -> tuple[dict, list[dict]]:
    """The run's metric summary and run facts, and its request records (``_run_async``'s result)."""
    records, sources = [], set()
    for (item, _), oc in zip(work, outcomes):
        rec, src = _record(oc, item, t0, tokenizer)
        records.append(rec)
        sources.add(src)
    summary = summarize(records, duration, cfg.slo, cfg.bucket_s)
    summary.update(load_settings(cfg, tokenizer))
    summary["token_count_source"] = "+".join(sorted(sources))
    summary["t0_monotonic"] = t0  # time.perf_counter() at start_s = 0 (CLOCK_MONOTONIC on Linux)
    lag = describe_ms(lags, "lag")
    summary["client_lag_ms"] = {"mean": lag["mean_lag_ms"], "p99": lag["p99_lag_ms"], "max": lag["max_lag_ms"]}
    summary["server_metrics"] = sampler.summary() if cfg.metrics_interval_s > 0 else {"available": False}
    errors = [r["error"] for r in records if r["error"]]
    summary["first_errors"] = errors[:5]
    return summary, records


def run_measured(cfg: LoadConfig, tokenizer, make_run) -> tuple[dict, list[dict]]:
    """Build ``cfg``'s requests and run ``make_run(items)`` (a coroutine giving ``(summary, records)``) on a new
    event loop, with the machine's load measured around it (``summary["machine_load"]``); closes ``tokenizer``.

    Objects alive before the run (a loaded torch, a tokenizer, test fixtures) move to the permanent generation,
    so the collector's pauses during the run stay short: they would otherwise stall the event loop and show up
    as client-side latency in TTFT / ITL."""
    try:
        items = build_items(cfg, tokenizer)
        gc.collect()
        gc.freeze()
        probe = MachineProbe.start()  # load averages and CPU shares around the test (harness/loadgen/machine.py)
        try:
            summary, records = asyncio.run(make_run(items))
        finally:
            gc.unfreeze()
        summary["machine_load"] = probe.stop()
        return summary, records
    finally:
        if tokenizer is not None:
            tokenizer.close()


def run_load(base_url: str, model: Optional[str], cfg: LoadConfig) -> tuple[dict, list[dict]]:
    """Run one load test; ``model=None`` takes the first id of ``/v1/models``."""
    from kvbench.harness.loadgen.tokenizer import resolve_tokenizer

    model = model or discover_model(base_url, cfg.api_key)
    tokenizer = resolve_tokenizer(cfg.tokenizer, server_root(base_url), cfg.api_key)
    summary, records = run_measured(cfg, tokenizer, lambda items: _run_async(base_url, model, cfg, items, tokenizer))
    conf = asdict(cfg)
    conf.pop("api_key", None)
    conf["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    summary = {"base_url": base_url, "model": model, "config": conf, **summary}
    return jsonable(summary), records


def format_block(summary: dict) -> str:
    """The familiar "Serving Benchmark Result" console block."""
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]

    def row(label: str, value, fmt: str = ".2f") -> None:
        v = "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)
        lines.append(f"{label:<40}{v:<10}")

    conf = summary.get("config", {})
    row("Maximum request concurrency:", conf.get("max_concurrency") or "inf", "")
    if summary.get("replicas"):  # data-parallel replicas: the concurrency above is each replica's
        row("Replicas (concurrency is per replica):", f"{summary['replicas']}, {summary.get('replica_load')}", "")
        row("Replica failover:", "none (a failed request counts as failed)", "")
    row("Successful requests:", summary["completed"], "d")
    row("Failed requests:", summary["failed"], "d")
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"], "d")
    row("Total generated tokens:", summary["total_output_tokens"], "d")
    row("Request throughput (req/s):", summary["request_throughput"])
    if "request_goodput" in summary:
        row("Request goodput (req/s):", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Peak output token throughput (tok/s):", summary["peak_output_throughput"])
    row("Peak concurrent requests:", summary["peak_concurrency"], "d")
    row("Total Token throughput (tok/s):", summary["total_token_throughput"])
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        name = key.upper()
        row(f"Mean {name} (ms):", summary[f"mean_{key}_ms"])
        row(f"Median {name} (ms):", summary[f"median_{key}_ms"])
        for q in (90, 95, 99):
            row(f"P{q} {name} (ms):", summary[f"p{q}_{key}_ms"])
        row(f"Max {name} (ms):", summary[f"max_{key}_ms"])
    sm = summary.get("server_metrics") or {}
    if sm.get("available"):
        lines.append("{s:{c}^{n}}".format(s="Server /metrics", n=w, c="-"))
        row("Max running requests:", sm.get("max_running"), ".0f")
        row("Max running without queueing:", sm.get("max_running_without_queueing"), ".0f")
        row("Max KV cache usage:", sm.get("kv_usage_max"), ".3f")
        row("Preemptions:", sm.get("preemptions"), "d")
        if sm.get("kernel_compiles") is not None:
            row("Kernel compiles (stalls):", sm.get("kernel_compiles"), "d")
        es = sm.get("engine_steps") or {}
        if es:
            row("Engine busy (fraction of the run):", es.get("busy_fraction"), ".3f")
            for kind in STEP_KINDS:
                if kind in es:
                    k = es[kind]
                    row(f"{kind.capitalize()} steps (n, ms each, tok each):",
                        f"{k['steps']}, {k['ms_per_step']:.2f}, {k['tokens'] / k['steps']:.0f}", "")
    lines.append("=" * w)
    return "\n".join(lines)


def write_outputs(out_dir: str, summary: dict, records: list[dict]) -> None:
    """``out_dir/summary.json`` and ``out_dir/requests.jsonl`` (one record per line), each written atomically."""
    from kvbench.core import atomic_write_json, atomic_write_jsonl

    d = Path(out_dir)
    atomic_write_jsonl(d / "requests.jsonl", records)
    atomic_write_json(d / "summary.json", jsonable(summary))


def jsonable(summary: dict) -> dict:
    """NaN -> None recursively (JSON has no NaN)."""
    if isinstance(summary, dict):
        return {k: jsonable(v) for k, v in summary.items()}
    if isinstance(summary, list):
        return [jsonable(v) for v in summary]
    if isinstance(summary, float) and not math.isfinite(summary):
        return None
    return summary

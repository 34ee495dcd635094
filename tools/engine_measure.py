"""The engine measurements of ``engine_perf`` (docs/performance.md): the device's copy bandwidth, decode steps
(timed whole and taken apart, ``step_anatomy``), a step's GPU kernels by name, a prefill step's kernels by kind
(``prefill_breakdown``), and the concurrency a KV budget serves.  ``engine_perf`` runs them as its sections and re-exports them."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from kvbench.core import SamplingParams
from kvbench.runtime import ScheduledBatch, Sequence


def _sync(dev):
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, gib: float = 2.0) -> float:
    n = int(gib * 2**30) // 4
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    _sync(device)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        b.copy_(a)
        _sync(device)
        times.append(time.perf_counter() - t)
    del a, b
    return 2 * n * 4 / statistics.median(times)


def decode_step(engine, batch: int, ctx: int, iters: int = 20) -> float:
    """Median seconds of one decode step of ``batch`` sequences with ``ctx`` tokens in the cache."""
    return decode_step_times(engine, batch, ctx, iters)["step_s"]


def decode_step_times(engine, batch: int, ctx: int, iters: int = 20) -> dict:
    """``{"step_s", "host_s"}``: median seconds of one decode step of ``batch`` sequences with ``ctx`` tokens
    in the cache (call to synchronised end), and of its host part (call until the step's work is queued;
    the device idles for it, since every step here starts after the previous one ended)."""
    with _decode_batch(engine, batch, ctx) as b:
        for _ in range(3):
            engine.runner.run(b)
        _sync(engine.device)
        times, host = [], []
        for _ in range(iters):
            t = time.perf_counter()
            engine.runner.run(b)
            host.append(time.perf_counter() - t)
            _sync(engine.device)
            times.append(time.perf_counter() - t)
        return {"step_s": statistics.median(times), "host_s": statistics.median(host)}


def served_decode_step(engine, batch: int, ctx: int, steps: int = 64) -> dict:
    """The decode step as the engine serves: ``batch`` greedy requests run through ``generate`` (the engine's own
    loop: steps launched ahead where it does that, CUDA graphs where it has them), timed by its step counters
    (``EngineStats.step_seconds``, each decode step from the step before it being done to its own tokens being
    done).  Two runs, of ``steps // 4`` and of ``steps`` tokens per request, are subtracted, so the prefill and the
    first and last decode steps fall out; the prompts are ``ctx - 5 · steps / 8`` tokens, so the steps counted
    attend over ``ctx`` cached tokens on average.  ``{"step_s", "steps"}``: mean seconds per decode step and how many
    steps the mean is over."""
    short = max(steps // 4, 2)
    prompt = [(7 * i) % 97 + 3 for i in range(ctx - (short + steps) // 2)]  # ids below 100: any vocabulary

    def run(n: int) -> tuple[float, int]:
        s0 = engine.stats()
        outs = engine.generate([[i] + prompt for i in range(batch)], SamplingParams(max_tokens=n, ignore_eos=True))
        s1 = engine.stats()
        if any(len(o.token_ids) != n for o in outs):
            raise RuntimeError("a request ended early")
        return (s1.step_seconds.get("decode", 0.0) - s0.step_seconds.get("decode", 0.0),
                s1.step_counts.get("decode", 0) - s0.step_counts.get("decode", 0))

    run(short)  # warm-up
    (ta, na), (tb, nb) = run(short), run(steps)
    if nb <= na:
        raise RuntimeError(f"no decode steps to time ({na} then {nb})")
    return {"step_s": (tb - ta) / (nb - na), "steps": nb - na}


@contextlib.contextmanager
def _decode_batch(engine, batch: int, ctx: int):
    """A decode batch of ``batch`` sequences with ``ctx - 1`` tokens cached (their pages freed afterwards)."""
    cache = engine.cache
    seqs = []
    for i in range(batch):
        s = Sequence(f"bench{i}", [1] * (ctx - 1), SamplingParams(max_tokens=2))
        s.output_ids = [1]
        s.pages = cache.allocator.allocate(-(-ctx // cache.page_size))
        s.num_cached = ctx - 1
        s.status = "running"
        seqs.append(s)
    try:
        yield ScheduledBatch("decode", seqs, [1] * batch)
    finally:
        for s in seqs:
            cache.allocator.free(s.pages)


def step_anatomy(engine, batch: int, ctx: int, iters: int = 20) -> dict:
    """Where a graphed decode step's wall time goes (CUDA only), medians in ms over ``iters`` steps:
    host parts (``inputs_ms``: StepInputs, ``stage_ms``: the staging-buffer writes, ``run_ms``: the whole
    ``DecodeGraphs.run`` call (the staging again, the replay's launch, whose graph copies the inputs), ``replay_call_ms``: the replay's
    launch alone, ``logits_call_ms``); device parts timed back to back with the device never idle
    (``graph_gpu_ms``: one replay, ``logits_gpu_ms``); ``step_ms`` as ``decode_step_times`` times it, and
    ``idle_ms`` = step − graph − logits, the time the device waits on the host or sits between them."""
    from kvbench.runtime import StepInputs

    r = engine.runner
    g = r.graphs
    if g is None:
        return {"error": "no CUDA graphs for this engine"}
    cache = engine.cache
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    with _decode_batch(engine, batch, ctx) as b:
        for _ in range(3):
            r.run(b)
        torch.cuda.synchronize()
        parts: dict = {k: [] for k in ("inputs", "stage", "run", "replay_call", "logits_call", "step")}
        for _ in range(iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            inp = StepInputs(b, cache.page_size, cache.scratch_page)
            t1 = time.perf_counter()
            g.stage(inp)  # idempotent: run() writes the same rows again
            t2 = time.perf_counter()
            hidden = g.run(inp)
            t3 = time.perf_counter()
            r.model.logits(hidden)
            t4 = time.perf_counter()
            torch.cuda.synchronize()
            parts["inputs"].append(t1 - t0)
            parts["stage"].append(t2 - t1)
            parts["run"].append(t3 - t2)
            parts["logits_call"].append(t4 - t3)
            t = time.perf_counter()
            r.run(b)
            torch.cuda.synchronize()
            parts["step"].append(time.perf_counter() - t)
        bs = g._bucket(batch)
        graph = g.graphs[bs]
        for _ in range(iters):
            torch.cuda.synchronize()
            t = time.perf_counter()
            graph.replay()
            parts["replay_call"].append(time.perf_counter() - t)
        torch.cuda.synchronize()
        out = {k + "_ms": med(v) for k, v in parts.items()}
        hidden = g.outputs[bs][:batch]
        for name, fn in (("graph_gpu_ms", graph.replay), ("logits_gpu_ms", lambda: r.model.logits(hidden))):
            fn()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(iters):
                fn()
            e1.record()
            torch.cuda.synchronize()
            out[name] = e0.elapsed_time(e1) / iters
        out["idle_ms"] = out["step_ms"] - out["graph_gpu_ms"] - out["logits_gpu_ms"]
        return out


def _kernel_times(prof) -> dict:
    """A torch profile's GPU kernels: name -> [total µs, launches]."""
    agg: dict = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(ev, "device_time_total", None)
            a = agg.setdefault(ev.name, [0.0, 0])
            a[0] += ev.cuda_time_total if us is None else us
            a[1] += 1
    return agg


def kernel_breakdown(engine, batch: int, ctx: int, steps: int = 3, top: int = 18) -> dict:
    """GPU kernel time of one decode step by kernel name (torch profiler over ``steps`` steps after the
    warm-up): ``{"kernel_ms_per_step": total, "kernels": [{"name", "ms_per_step", "launches_per_step"}, …]}``,
    the ``top`` longest first.  Run it on an eager engine: a CUDA graph shows up as one replay."""
    from torch.profiler import ProfilerActivity, profile

    decode_step(engine, batch, ctx, iters=2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_step(engine, batch, ctx, iters=steps)
    runs = 3 + steps  # decode_step's three warm-up steps are inside the profile too
    agg = _kernel_times(prof)
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])
    return {"kernel_ms_per_step": sum(v[0] for v in agg.values()) / runs / 1e3,
            "kernels": [{"name": k[:120], "ms_per_step": v[0] / runs / 1e3, "launches_per_step": v[1] // runs}
                        for k, v in rows[:top]]}


# kernel names by kind (the GEMM libraries' kernels, the attention kernels of every backend)
_GEMM_NAMES = ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul")
_ATTN_NAMES = ("prefill", "attn", "attention", "flash", "_fwd")


def kernel_kind(name: str) -> str:
    low = name.lower()
    if any(k in low for k in _GEMM_NAMES):
        return "gemm"
    if any(k in low for k in _ATTN_NAMES):
        return "attention"
    return "other"


@contextlib.contextmanager
def _prefill_batch(engine, seqs: int, prompt: int):
    """A prefill step of ``seqs`` prompts of ``prompt`` tokens, nothing cached (pages freed afterwards)."""
    cache = engine.cache
    vocab = engine.parts.loaded.config.vocab_size
    batch = []
    for i in range(seqs):
        s = Sequence(f"prefill{i}", [(i * 131 + j * 7) % vocab for j in range(prompt)], SamplingParams(max_tokens=2))
        s.pages = cache.allocator.allocate(-(-prompt // cache.page_size))
        s.status = "running"
        batch.append(s)
    try:
        yield ScheduledBatch("prefill", batch, [prompt] * seqs)
    finally:
        for s in batch:
            cache.allocator.free(s.pages)


def prefill_breakdown(engine, seqs: int, prompt: int, iters: int = 5, top: int = 10) -> dict:
    """One prefill step of ``seqs`` x ``prompt`` new tokens (forward and the sampled rows' logits): its median
    wall time, its GPU kernel time by kind (GEMMs, attention, the rest) and longest kernels (torch profiler over
    two steps), and the GEMMs' rate in TFLOP/s (2 x linear weights x tokens)."""
    from torch.profiler import ProfilerActivity, profile

    dev = engine.device
    with _prefill_batch(engine, seqs, prompt) as b:
        for _ in range(2):
            engine.runner.run(b)
        _sync(dev)
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            engine.runner.run(b)
            _sync(dev)
            times.append(time.perf_counter() - t)
        acts = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]  # no kernels on a CPU
        with profile(activities=acts) as prof:
            for _ in range(2):
                engine.runner.run(b)
            _sync(dev)
    agg = {name: us / 2 for name, (us, _) in _kernel_times(prof).items()}  # per step: two were profiled
    kinds: dict = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for name, us in agg.items():
        kinds[kernel_kind(name)] += us / 1e3
    model = engine.runner.model
    linear = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "lm_head" not in n)
    tokens = seqs * prompt
    step_ms = statistics.median(times) * 1e3
    return {"seqs": seqs, "prompt": prompt, "tokens": tokens, "step_ms": step_ms,
            "kernel_ms": sum(kinds.values()), **{f"{k}_ms": v for k, v in kinds.items()},
            "gemm_TFLOPs": 2 * linear * tokens / (kinds["gemm"] * 1e-3) / 1e12 if kinds["gemm"] else None,
            "tokens_per_s": tokens / (step_ms * 1e-3),
            "kernels": [{"name": k[:100], "kind": kernel_kind(k), "ms": v / 1e3}
                        for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[:top]]}


def weight_bytes_read_per_step(model) -> int:
    """All parameters except the embedding table (decode reads only its rows); a tied table is read
    once as the LM head."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        e = model.model.embed_tokens.weight
        total -= e.numel() * e.element_size()
    return total


def peak_concurrency(engine, n_requests: int, prompt_len: int, gen_len: int) -> dict:
    """Serve ``n_requests`` at once (stepping the engine in this thread); the largest running count."""
    vocab = min(engine.parts.loaded.config.vocab_size, 200)
    p = SamplingParams(max_tokens=gen_len, ignore_eos=True)
    for i in range(n_requests):
        engine.add_request([(i * 7 + j) % vocab for j in range(prompt_len)], p)
    peak = 0
    steps = 0
    while engine.scheduler.has_work() or engine._inbox:
        engine.step()
        steps += 1
        peak = max(peak, len(engine.scheduler.running))
    return {"peak_running": peak, "preemptions": engine.scheduler.num_preemptions, "steps": steps}

"""Engine performance checks behind docs/performance.md (run on a GPU; parts run on CPU too).

    python -m kvbench.tools.engine_perf --out perf.json [--model synthetic:llama-3-8b] [--formats ...] [--skip ...]

1. copy bandwidth of the device (read + write bytes of a large tensor copy / time);
2. decode step (forward + logits) of a model at batch B x context L, eager and with CUDA graphs,
   against the roofline (weight bytes + KV bytes) / copy bandwidth; MLA models (``--model
   synthetic:deepseek-v2-lite``) count their latent cache (one ``rank + rope`` plane per layer, scales
   included) as the KV bytes; a graphed step's row carries its ``anatomy`` (``step_anatomy``: host and
   device parts, and the time the device idles);
3. max concurrent sequences without queueing per KV format at a fixed KV budget (measured from the
   scheduler's running count while requests of a fixed length are served);
4. every KV format x backend pair generates (tokens/s, greedy agreement with bf16 on torch).

Each row is printed (one JSON object after its section's name) as soon as it is measured, with a progress
line on stderr (``streaming.py``); ``--out`` is rewritten after every row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

from kvbench.core.client import SamplingParams
from kvbench.core.formats import format_names
from kvbench.runtime.config import EngineConfig
from kvbench.runtime.scheduler import ScheduledBatch, Sequence
from kvbench.tools.common import bench_formats
from kvbench.tools.streaming import Step, stream_rows


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
    from kvbench.runtime.models.runner import StepInputs

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


def kernel_breakdown(engine, batch: int, ctx: int, steps: int = 3, top: int = 18) -> dict:
    """GPU kernel time of one decode step by kernel name (torch profiler over ``steps`` steps after the
    warm-up): ``{"kernel_ms_per_step": total, "kernels": [{"name", "ms_per_step", "launches_per_step"}, …]}``,
    the ``top`` longest first.  Run it on an eager engine: a CUDA graph shows up as one replay."""
    from torch.profiler import ProfilerActivity, profile

    decode_step(engine, batch, ctx, iters=2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode_step(engine, batch, ctx, iters=steps)
    runs = 3 + steps  # decode_step's three warm-up steps are inside the profile too
    agg: dict = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(ev, "device_time_total", None)
            us = ev.cuda_time_total if us is None else us
            a = agg.setdefault(ev.name, [0.0, 0])
            a[0] += us
            a[1] += 1
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])
    return {"kernel_ms_per_step": sum(v[0] for v in agg.values()) / runs / 1e3,
            "kernels": [{"name": k[:120], "ms_per_step": v[0] / runs / 1e3, "launches_per_step": v[1] // runs}
                        for k, v in rows[:top]]}


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


def generate_check(loaded, fmt: str, pre: str, dec: str, prompts, n_tok: int, device: str, budget_gb: float) -> dict:
    scales = "unit" if fmt in ("bf16", "fp16") else "calibrate"
    cfg = EngineConfig(kv_dtype=fmt, kv_scales=scales, prefill_backend=pre, decode_backend=dec, device=device,
                       kv_budget_gb=budget_gb, max_running=len(prompts), calibration_prompts=8)

    def run(e) -> dict:
        e.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up / capture
        t = time.perf_counter()
        outs = e.generate(prompts, SamplingParams(max_tokens=n_tok, ignore_eos=True))
        dt = time.perf_counter() - t
        ok = all(o.finish_reason == "length" for o in outs)
        return {"tokens": [o.token_ids for o in outs], "tok_s": sum(len(o.token_ids) for o in outs) / dt, "ok": ok,
                "graphs": e.runner.graphs is not None}

    return _with_engine(cfg, run, loaded=loaded)


def iter_format_matrix(model_name, device, prompts_text, n_tok, budget_gb, pairs):
    """Every registered format × (prefill, decode) backend pair: a row each as it is measured (an unsupported
    pair is reported, not hidden)."""
    from kvbench.runtime.models.loader import load_model

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    loaded = load_model(model_name, device=device, dtype=dtype)
    prompts = [loaded.tokenizer.encode(t) for t in prompts_text]
    ref = generate_check(loaded, "bf16", "torch", "torch", prompts, n_tok, device, budget_gb)["tokens"]
    for fmt in format_names():
        for pre, dec in pairs:
            try:
                r = generate_check(loaded, fmt, pre, dec, prompts, n_tok, device, budget_gb)
            except Exception as e:  # an unsupported pair is reported, not hidden
                yield {"model": loaded.model_id, "kv": fmt, "backend": f"{pre}+{dec}", "error": f"{type(e).__name__}: {e}"[:200]}
                continue
            same = sum(a == b for a, b in zip(r["tokens"], ref))
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n_tok) for a, b in zip(r["tokens"], ref)]
            yield {"model": loaded.model_id, "kv": fmt, "backend": f"{pre}+{dec}", "ok": r["ok"], "tok_s": round(r["tok_s"], 1),
                   "identical_to_bf16_torch": f"{same}/{len(prompts)}", "mean_first_divergence": round(sum(first) / len(first), 1),
                   "cuda_graphs": r["graphs"]}
    del loaded


def format_matrix(*a, **k) -> list[dict]:
    return list(iter_format_matrix(*a, **k))


def concurrent_check(device: str, n: int = 16, n_tok: int = 256) -> dict:
    """Default model: ``n`` requests of ``n_tok`` greedy tokens at once; all finish, and two of them
    equal the same requests run alone (first divergence reported)."""
    from kvbench.runtime.engine import Engine

    e = Engine(EngineConfig(device=device, kv_budget_gb=0.5, max_running=n))
    try:
        prompts = [e.tokenizer.encode(PROMPTS[i % len(PROMPTS)] + f" ({i})") for i in range(n)]
        p = SamplingParams(max_tokens=n_tok, ignore_eos=True)
        t = time.perf_counter()
        outs = e.generate(prompts, p)
        dt = time.perf_counter() - t
        solo = [e.generate([prompts[i]], p)[0] for i in (0, n - 1)]
        first = [next((j for j, (a, b) in enumerate(zip(o.token_ids, s_.token_ids)) if a != b), n_tok)
                 for o, s_ in zip((outs[0], outs[-1]), solo)]
        return {"requests": n, "tokens_each": n_tok, "all_finished": all(len(o.token_ids) == n_tok for o in outs),
                "seconds": round(dt, 1), "tok_s": round(n * n_tok / dt, 1), "preemptions": e.stats().preemptions,
                "solo_first_divergence": first, "pages_used_after": e.cache.allocator.num_used}
    finally:
        e.shutdown()


PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Question: What is 12 times 7?\nAnswer:",
    "Once upon a time", "The three laws of thermodynamics are", "import numpy as np\n", "List of prime numbers: 2, 3, 5,",
    "Translate to French: good morning",
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvbench.tools.engine_perf")
    ap.add_argument("--out", default="perf.json")
    ap.add_argument("--model", default="synthetic:llama-3-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--decode-backend", default="triton")
    ap.add_argument("--capacity-budget-gb", type=float, default=2.0)
    ap.add_argument("--formats", default="", help="comma list of KV formats for the decode and profile rows (default: one per element width)")
    ap.add_argument("--skip", default="", help="comma list of: bandwidth,decode,anatomy (of the graphed steps),profile,capacity,matrix,default,concurrent")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    formats = tuple(filter(None, args.formats.split(","))) or bench_formats()

    res: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                 "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "model": args.model}

    def save():
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, args.out)

    def bandwidth():
        res["copy_bandwidth_GBs"] = copy_bandwidth(args.device) / 1e9
        return ("bandwidth", {"copy_bandwidth_GBs": res["copy_bandwidth_GBs"]})

    def decode(fmt, eager):
        cfg = EngineConfig(model=args.model, kv_dtype=fmt, prefill_backend="torch", decode_backend=args.decode_backend,
                           device=args.device, max_running=args.batch, max_model_len=args.ctx + 16,
                           kv_budget_gb=args.batch * (args.ctx + 16) * 1.05 * _bpt(args.model, fmt) / 2**30,
                           enforce_eager=eager)

        def step_row(e) -> dict:
            tt = decode_step_times(e, args.batch, args.ctx)
            t = tt["step_s"]
            wb = weight_bytes_read_per_step(e.runner.model)
            kvb = args.batch * args.ctx * e.cache.bytes_per_token
            row = {"kv": fmt, "cuda_graphs": e.runner.graphs is not None, "step_ms": t * 1e3,
                   "host_ms": tt["host_s"] * 1e3,
                   "weight_GB": wb / 1e9, "kv_GB": kvb / 1e9, "mla": e.cache.spec.mla}
            if "copy_bandwidth_GBs" in res:
                roof = (wb + kvb) / (res["copy_bandwidth_GBs"] * 1e9)
                row.update(roofline_ms=roof * 1e3, ratio=t / roof)
            if e.runner.graphs is not None and "anatomy" not in skip:
                row["anatomy"] = step_anatomy(e, args.batch, args.ctx)
            return row

        try:
            row = _with_engine(cfg, step_row)
        except Exception as ex:
            row = {"kv": fmt, "eager": eager, "error": f"{type(ex).__name__}: {ex}"[:300]}
        res.setdefault("decode", []).append(row)
        return ("decode", row)

    def profile_step(fmt):
        """Where an eager decode step's GPU time goes, by kernel (torch profiler)."""
        cfg = EngineConfig(model=args.model, kv_dtype=fmt, prefill_backend="torch", decode_backend=args.decode_backend,
                           device=args.device, max_running=args.batch, max_model_len=args.ctx + 16,
                           kv_budget_gb=args.batch * (args.ctx + 16) * 1.05 * _bpt(args.model, fmt) / 2**30,
                           enforce_eager=True)
        row = {"kv": fmt, **_with_engine(cfg, lambda e: kernel_breakdown(e, args.batch, args.ctx))}
        res.setdefault("profile", []).append(row)
        return ("profile", row)

    def capacity(fmt):
        cfg = EngineConfig(model=args.model, kv_dtype=fmt, device=args.device, prefill_backend="torch",
                           decode_backend=args.decode_backend, kv_budget_gb=args.capacity_budget_gb, max_running=256,
                           max_model_len=2048, enforce_eager=True)

        def capacity_row(e) -> dict:
            plan = e.cache.capacity(1024)
            try:
                r = peak_concurrency(e, n_requests=min(4 * plan.max_concurrency + 4, 256), prompt_len=1000, gen_len=24)
            except Exception as ex:
                r = {"error": f"{type(ex).__name__}: {ex}"[:300]}
            return {"kv": fmt, "budget_GiB": args.capacity_budget_gb, "bytes_per_token": e.cache.bytes_per_token,
                    "planned_at_1024": plan.max_concurrency, **r}

        row = _with_engine(cfg, capacity_row)
        res.setdefault("capacity", []).append(row)
        return ("capacity", row)

    def matrix(key, model, budget):
        for row in iter_format_matrix(model, args.device, PROMPTS, 32, budget, pairs):
            res.setdefault(key, []).append(row)
            yield (key, row)

    def concurrent():
        res["concurrent"] = concurrent_check(args.device)
        return ("concurrent", res["concurrent"])

    pairs = [("triton", "triton"), ("torch", "triton"), ("triton", "torch")]
    from kvbench.runtime.attention.registry import backend_class

    try:
        if backend_class("flashinfer").available()[0]:
            pairs += [("flashinfer", "flashinfer"), ("triton", "flashinfer")]
    except Exception as e:
        print("flashinfer not used:", e, flush=True)
    steps = []
    if "bandwidth" not in skip:
        steps.append(Step("copy bandwidth", bandwidth))
    if "decode" not in skip:
        steps += [Step(f"decode step {fmt} B={args.batch} L={args.ctx} {'eager' if eager else 'CUDA graphs'}",
                       lambda fmt=fmt, eager=eager: decode(fmt, eager))
                  for fmt in formats for eager in (True, False)]
    if "profile" not in skip and args.device.startswith("cuda"):
        steps += [Step(f"kernel breakdown {fmt} B={args.batch} L={args.ctx} eager", lambda fmt=fmt: profile_step(fmt))
                  for fmt in formats]
    if "capacity" not in skip:
        steps += [Step(f"capacity {fmt} {args.capacity_budget_gb} GiB", lambda fmt=fmt: capacity(fmt)) for fmt in format_names()]
    if "matrix" not in skip:
        steps.append(Step(f"format x backend matrix {args.model}", lambda: matrix("matrix", args.model, 8.0)))
    if "default" not in skip:
        steps.append(Step("format x backend matrix, default model", lambda: matrix("matrix_default", None, 1.0)))
    if "concurrent" not in skip:
        steps.append(Step("16 concurrent requests, default model", concurrent))
    for _ in stream_rows(steps, fmt=lambda kr: f"{kr[0]:<14} {json.dumps(kr[1])}",
                         header=f"{'section':<14} row (JSON)"):
        save()


def _with_engine(cfg: EngineConfig, fn, loaded=None):
    """``fn(engine)`` on a fresh engine, which is shut down and its memory returned afterwards (even on error),
    so the next configuration starts from an empty device."""
    from kvbench.runtime.engine import Engine

    e = Engine(cfg, loaded=loaded)
    try:
        return fn(e)
    finally:
        e.shutdown()
        del e
        _free()


def _free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _bpt(model: str, fmt: str) -> float:
    """KV bytes per token of a synthetic model (latent plane for MLA), for sizing the decode budget."""
    from kvbench.runtime.kv_cache import bytes_per_token
    from kvbench.runtime.models.synthetic import parse_synthetic

    cfg = parse_synthetic(model) if model and model.startswith("synthetic:") else None
    if cfg is None:
        return 2 * 32 * 8 * 128 * 2.0
    return bytes_per_token(cfg.kv_spec(fmt, 16))


if __name__ == "__main__":
    main()

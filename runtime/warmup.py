"""Kernel warm-up before an engine serves HTTP (``Engine.prepare_to_serve``, called as the server starts: `kvbench
serve`, a sweep's load test; on a GPU by default): dummy requests stepped through the engine, so the kernel
variants a serving load reaches are compiled before the first real request.  Engines that only score or generate
in-process (eval, diagnose, fidelity references) skip it: their latencies are not measured.

Triton compiles a kernel per set of constexprs and per class of its integer arguments (equal to 1, divisible by
16); a serving load reaches variants one at a time (the first prompt chunked over a cached prefix, the first
mixed step with five decode rows, ...), and each first time stalls every running request for the compile (up
to 4 s per stall measured on an H200 under load, docs/performance.md).  Decode steps run as CUDA graphs, one per
batch-size bucket, each captured on first use: the warm-up captures every bucket up to ``max_running``.
The rounds below reach, for the step budget and context of this engine: a prompt
filling a step, short prompts of lengths on and off multiples of 16, more prompt tokens than one step takes
(later chunks read a cached prefix), shrinking decode batches over short and long contexts (one split count per
batch size), and with ``mixed_prefill`` decode rows of every count from 16 down to 1 riding in prefill steps of
long and of short prompts.

``EngineConfig.extra["warmup"]``: ``"auto"`` (default: on a CUDA device), ``True`` or ``False``.  Afterwards
every page is back in the pool; the engine restores its counters, request ids and preemption count.
"""

from __future__ import annotations

import copy
import itertools
import logging
import random
import time

from kvbench.core import SamplingParams

__all__ = ["warmup_wanted", "warmup_rounds", "warm_up", "prepare_to_serve"]

log = logging.getLogger("kvbench.runtime")


_STUCK_STEPS = 3  # steps in a row that schedule nothing while requests wait: the warm-up stops


class _Stuck(Exception):
    pass


def warmup_wanted(extra: dict, device_type: str) -> bool:
    want = (extra or {}).get("warmup", "auto")
    if want not in (True, False, "auto"):
        from kvbench.runtime.config import ConfigError

        raise ConfigError(f"extra.warmup must be true, false or auto, got {want!r}", "extra")
    return device_type == "cuda" if want == "auto" else bool(want)


def warmup_rounds(budget: int, max_len: int, max_running: int) -> list[list[tuple[int, int]]]:
    """Rounds of ``(prompt length, max_tokens)``, each submitted at once and run to the end."""
    cap = max(1, max_len - 8)

    def clip(reqs):
        return [(max(1, min(n, cap)), k) for n, k in reqs]

    return [
        clip([(budget, 2)]),  # a prompt that fills a step: the long-prompt tiles
        clip([(5, 4), (33, 4), (100, 4), (128, 4)]),  # short prompts, on and off multiples of 16
        clip([(budget - 24, 6), (200, 6), (77, 6), (2 * budget + 40, 3)]),  # chunks over a cached prefix
        clip([(9 + 3 * i, 30 + i) for i in range(min(max_running, 24))]),  # decode batches 24 .. 1
        # decode batches 12 .. 1 over long contexts: split across programs, then merged (split counts by batch)
        clip([(min(1000, cap // 2) + 7 * i, 3 + i) for i in range(min(max_running, 12))]),
    ]


def _mixed_round(engine, add, drain_steps, context: int, prompt: int) -> None:
    """Decoders over ``context``-token prompts, staggered, and a new ``prompt``-token prompt before every step:
    each prefill step carries the decoders still running as decode rows, one fewer every two steps (16 .. 1)."""
    n = min(16, engine.config.max_running - 1)
    if n < 1:
        return
    cap = max(1, engine.max_model_len - 8 - 2 * n)
    for i in range(n):
        add(max(1, min(context + i, cap)), 8 + 2 * i)
    while engine.scheduler.waiting or engine._inbox:  # their prompts (they outlive them)
        drain_steps(1)
    for _ in range(2 * n + 4):
        add(max(1, min(prompt, cap)), 1)
        drain_steps(1)
    drain_steps(None)


def _capture_graphs(engine) -> int:
    """Capture every decode-graph bucket the rounds did not reach (``runtime/graphs.py`` captures a bucket on its
    first step otherwise: a capture and its first compile mid-load, up to 3 s under load on an H200); returns how
    many.  A capture that fails turns graphs off, as a failed capture while serving does."""
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is None:
        return 0
    todo = [bs for bs in graphs.buckets if bs not in graphs.graphs]
    try:
        for bs in todo:
            graphs.capture(bs)
    except Exception as e:  # noqa: BLE001 - as ModelRunner.run_rows does with GraphUnavailable
        log.warning("CUDA-graph capture of decode failed (%s: %s); decoding eagerly", type(e).__name__, e)
        engine.runner.graphs = None
        return 0
    if todo:
        log.info("warm-up: captured %d more decode graphs (batch sizes %s)", len(todo), todo)
    return len(todo)


def warm_up(engine) -> float:
    """Run the rounds on ``engine`` (stepped here, its step thread stopped; ``Engine.prepare_to_serve`` keeps the
    counters as they were); returns the seconds taken."""
    from kvbench.runtime.step_notes import Step

    t0 = time.monotonic()
    note = Step("warming up the kernels on dummy requests")
    cfg = engine.config
    vocab = engine.parts.loaded.config.vocab_size
    rng = random.Random(0)
    steps = [0]
    watch = getattr(engine, "_compiles", None)  # runtime/compile_watch.py (a GPU engine's)
    compiled0 = watch.during_warmup if watch is not None else 0

    def compiled() -> str:
        return "" if watch is None else f", {watch.during_warmup - compiled0} kernels compiled"

    def add(n: int, k: int) -> None:
        engine.add_request([rng.randrange(vocab) for _ in range(n)],
                           SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))

    def drain_steps(limit) -> None:
        taken, idle = 0, 0
        while (limit is None or taken < limit) and (engine.scheduler.has_work() or engine._inbox):
            idle = 0 if engine.step() else idle + 1
            if idle >= _STUCK_STEPS:  # nothing else runs here to free pages: it never will
                raise _Stuck()
            taken += 1
        steps[0] += taken

    try:
        for rnd in warmup_rounds(cfg.max_num_batched_tokens, engine.max_model_len, cfg.max_running):
            for n, k in rnd:
                add(n, k)
            drain_steps(None)
        if cfg.mixed_prefill:  # short decoders with long prompts, then long decoders (split) with short prompts
            budget = cfg.max_num_batched_tokens
            _mixed_round(engine, add, drain_steps, 7, budget // 2)
            _mixed_round(engine, add, drain_steps, min(1000, engine.max_model_len // 2), min(1000, budget // 4))
    except _Stuck:  # a KV pool too small for the rounds: stop them, serve anyway (what ran is compiled)
        for rid in list(engine._seqs):
            engine.abort(rid)
        engine.step()
        note.done(f"stopped after {steps[0]} steps{compiled()}: the KV cache cannot hold its requests")
        log.warning("warm-up stopped after %d steps: the engine could not schedule its dummy requests (%d KV pages); "
                    "kernels for larger steps compile on first use", steps[0], engine.cache.num_pages)
    except BaseException:
        note.fail()
        raise
    else:
        note.done(f"{steps[0]} steps{compiled()}")
    _capture_graphs(engine)
    if engine.device.type == "cuda":
        import torch

        torch.cuda.synchronize(engine.device)
    if engine.cache.allocator.num_used:
        raise RuntimeError(f"warm-up left {engine.cache.allocator.num_used} pages in use")
    took = time.monotonic() - t0
    log.info("warm-up: %d steps in %.1f s (kernels compiled for the step shapes a load reaches)", steps[0], took)
    return took


def prepare_to_serve(engine) -> None:
    """``Engine.prepare_to_serve``: the warm-up (on a GPU unless ``extra.warmup`` is false) with the step thread
    paused and the counters, request ids and preemptions restored after it; then the engine's compiles count as
    stalls (runtime/compile_watch.py).  Once per engine; skipped with requests in flight."""
    if engine._serving:
        return
    engine._serving = True
    if warmup_wanted(engine.config.extra, engine.device.type):
        if engine._seqs or engine._inbox:
            log.warning("warm-up skipped: the engine has requests in flight")
        else:
            running = engine._thread is not None and engine._thread.is_alive()
            if running:
                engine.shutdown()
            stats, preempted, next_id = copy.deepcopy(engine._stats), engine.scheduler.num_preemptions, next(engine._ids)
            try:
                engine.warmup_s = warm_up(engine)
            finally:
                engine._stats, engine.scheduler.num_preemptions = stats, preempted
                engine._ids = itertools.count(next_id)
                if running:
                    engine.start()
    watch = engine._compiles
    if watch is not None:
        watch.serve(engine)
        engine._compiles_base = (watch.after_warmup, watch.after_warmup_s)

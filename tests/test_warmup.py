"""The engine's start-up warm-up (runtime/warmup.py): dummy requests reach the step shapes a serving load reaches
(a full-budget prompt, short prompts, chunks over a cached prefix, shrinking decode batches and, with mixed
steps, prefill steps carrying 16 .. 1 decode rows), then the engine is as if new: no page used, counters and
request ids from zero, the same greedy tokens as an engine that did not warm up."""

from __future__ import annotations

import pytest
import torch

from kvbench.core import SamplingParams
from kvbench.runtime.config import ConfigError, EngineConfig
from kvbench.runtime.engine import Engine
from kvbench.runtime.scheduler import Scheduler
from kvbench.runtime.warmup import warmup_rounds, warmup_wanted

MODEL = "synthetic:llama-3-8b,layers=1,hidden=64,heads=2,kv_heads=1,head_dim=32,intermediate_size=64,vocab=300"


@pytest.fixture(scope="module")
def loaded():
    from kvbench.runtime.models.loader import load_model

    return load_model(MODEL, device="cpu", dtype=torch.float32, seed=1)


def _engine(loaded, warmup, **kw):
    """An engine as the server starts it (``prepare_to_serve``: the warm-up, when ``warmup``)."""
    e = Engine(EngineConfig(device="cpu", kv_budget_gb=0.01, max_model_len=512, max_num_batched_tokens=64,
                            max_running=32, extra={"warmup": warmup}, **kw), loaded=loaded)
    assert e.warmup_s is None  # nothing at construction: engines that only score never warm up
    e.prepare_to_serve()
    return e


def test_warmup_wanted():
    assert warmup_wanted({}, "cuda") and not warmup_wanted({}, "cpu")
    assert warmup_wanted({"warmup": True}, "cpu") and not warmup_wanted({"warmup": False}, "cuda")
    with pytest.raises(ConfigError, match="extra.warmup must be true, false or auto"):
        warmup_wanted({"warmup": "yes"}, "cpu")


def test_rounds_stay_inside_the_context():
    for rnd in warmup_rounds(8192, 300, 4):
        assert all(1 <= n <= 292 and k >= 2 for n, k in rnd)
    assert len(warmup_rounds(64, 512, 4)[-1]) == 4  # no more decoders at once than may run


@pytest.mark.parametrize("mixed", [False, True])
def test_warmup_reaches_the_load_shapes_and_leaves_the_engine_new(loaded, monkeypatch, mixed):
    seen = []
    real = Scheduler.schedule

    def watch(self):
        b = real(self)
        if b is not None:
            rows = list(zip(b.seqs, b.q_lens))[b.decode_rows:] if b.phase == "prefill" else []
            seen.append((b.phase, b.decode_rows if b.phase == "prefill" else len(b.seqs), b.num_tokens,
                         any(s.num_cached > 0 for s, _q in rows)))
        return b

    monkeypatch.setattr(Scheduler, "schedule", watch)
    e = _engine(loaded, True, mixed_prefill=mixed)
    monkeypatch.setattr(Scheduler, "schedule", real)
    try:
        assert e.warmup_s is not None and e.info()["warmup_s"] is not None
        assert any(p == "prefill" and n == 64 for p, _d, n, _c in seen)  # a step filled with one prompt
        assert any(p == "prefill" and c for p, _d, _n, c in seen)  # a chunk over a cached prefix
        decode_sizes = {d for p, d, _n, _c in seen if p == "decode"}
        mixed_rows = {d for p, d, _n, _c in seen if p == "prefill" and d > 0}
        # decode batches of 24 .. 1 (with mixed steps the larger ones ride in the prefill steps of their prompts)
        assert set(range(1, 25)) <= decode_sizes | mixed_rows, sorted(decode_sizes | mixed_rows)
        assert set(range(1, 25)) <= decode_sizes, sorted(decode_sizes)
        if mixed:
            assert set(range(1, 17)) <= mixed_rows, sorted(mixed_rows)
        else:
            assert not mixed_rows
        # as new
        assert e.cache.allocator.num_used == 0 and not e.scheduler.has_work()
        st = e.stats()
        assert (st.prompt_tokens, st.generation_tokens, st.requests_finished, st.preemptions) == (0, 0, 0, 0)
        assert e.add_request([1, 2, 3], SamplingParams(max_tokens=1)) == "req-0"
        assert st.kernel_compiles is None and e.info()["compiles_after_warmup"] is None  # not watched on the CPU
    finally:
        e.shutdown()


def test_warmed_engine_generates_what_a_cold_one_does(loaded):
    prompts = [[(7 * i + j) % 300 for j in range(20 + 9 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for warm in (False, True):
        e = _engine(loaded, warm, mixed_prefill=True)
        try:
            assert (e.warmup_s is not None) == warm
            outs[warm] = [o.token_ids for o in e.generate(prompts, params)]
        finally:
            e.shutdown()
    assert outs[True] == outs[False]


def test_compile_watch_counts_and_names_compiles_after_the_warmup(monkeypatch, caplog):
    """Triton's JIT hooks (called on a compile only): compiles before the engine serves are counted quietly, later
    ones logged as a warning with the kernel's specialization; a hook installed before is still called, and
    the compile is never skipped."""
    import logging

    from triton import knobs

    from kvbench.runtime import compile_watch as cw

    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append(("before", kw["repr"])) and False)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append(("after", kw["repr"])))
    monkeypatch.setattr(cw, "_WATCH", None)
    w = cw.install_compile_watch()
    assert cw.install_compile_watch() is w
    before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    assert before(repr="_decode_split_kernel[num_warps=4](Q: *bf16)") is False
    after(repr="_decode_split_kernel[num_warps=4](Q: *bf16)")
    assert (w.during_warmup, w.after_warmup) == (1, 0)
    w.serving = True
    with caplog.at_level(logging.WARNING, logger="kvbench.runtime"):
        assert before(repr="_decode_reduce_kernel(S_PAD: 16)") is False
        after(repr="_decode_reduce_kernel(S_PAD: 16)")
    assert w.after_warmup == 1 and w.after_warmup_s >= 0
    assert "compiled while serving" in caplog.text and "_decode_reduce_kernel(S_PAD: 16)" in caplog.text
    assert [c[0] for c in calls] == ["before", "after", "before", "after"]


MLA = ("synthetic:deepseek-v3,layers=2,q_lora_rank=48,hidden=128,heads=4,kv_lora_rank=64,qk_rope_head_dim=32,"
       "qk_nope_head_dim=16,v_head_dim=16,intermediate_size=192,vocab=256")
OSS = "synthetic:gpt-oss-20b,layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,vocab=300,intermediate_size=64,window=6"


def _kinds(tmp_path_factory):
    """Engines whose pages or attention differ: Gemma 3's layer groups, Mistral's windowed pages (every layer
    slides), an MLA latent cache, sliding windows with attention sinks."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_models import save_tiny

    g = tmp_path_factory.mktemp("gemma3w")
    save_tiny(g, "gemma3", {"head_dim": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": 6,
                            "layer_types": ["sliding_attention", "full_attention"]})
    m = tmp_path_factory.mktemp("mistralw")
    save_tiny(m, "mistral", {"sliding_window": 6, "head_dim": 16})
    return {"gemma3": str(g), "mistral": str(m), "mla": MLA, "gpt-oss": OSS}


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    return _kinds(tmp_path_factory)


@pytest.mark.parametrize("kind,mixed", [("gemma3", True), ("mistral", False), ("mistral", True), ("mla", True),
                                        ("gpt-oss", True)])
def test_warmup_on_every_engine_kind_returns_every_page(kinds, kind, mixed):
    """The warm-up is on by default on a GPU for every model: on the engines whose page bookkeeping differs it
    must finish and hand every page back (it raises otherwise), and leave them generating as a cold engine does."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[(5 * i + j) % 250 for j in range(10 + 7 * i)] for i in range(4)]
    outs = {}
    for warm in (False, True):
        e = Engine(EngineConfig(model=kinds[kind], device="cpu", kv_budget_gb=0.01, max_model_len=256, page_size=4,
                                max_num_batched_tokens=32, max_running=24, mixed_prefill=mixed,
                                extra={"warmup": warm}))
        e.prepare_to_serve()
        try:
            if kind == "gemma3":
                assert e.cache.spec.groups is not None
            if kind == "mistral":
                assert e.scheduler.window is not None
            assert (e.warmup_s is not None) == warm and e.cache.allocator.num_used == 0
            outs[warm] = [o.token_ids for o in e.generate(prompts, params)]
        finally:
            e.shutdown()
    assert outs[True] == outs[False]


def test_warmup_that_cannot_schedule_stops_and_leaves_the_engine_clean(loaded, monkeypatch, caplog):
    """A pool too small for the rounds (simulated: the scheduler admits nothing after its first steps) must not
    hang the engine's start: the warm-up stops with a warning, aborts its requests, and the engine serves."""
    import logging

    real, calls = Scheduler.schedule, [0]

    def starved(self):
        calls[0] += 1
        return real(self) if calls[0] <= 5 else None

    monkeypatch.setattr(Scheduler, "schedule", starved)
    with caplog.at_level(logging.WARNING, logger="kvbench.runtime"):
        e = _engine(loaded, True)
    monkeypatch.setattr(Scheduler, "schedule", real)
    try:
        assert "warm-up stopped after" in caplog.text
        assert e.cache.allocator.num_used == 0 and not e.scheduler.has_work() and not e._seqs
        assert e.stats().requests_aborted == 0
        out = e.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 4
    finally:
        e.shutdown()


def test_the_server_warms_a_running_engine_up_before_its_first_request(loaded, caplog):
    """The app's start (runtime/server.py) calls ``prepare_to_serve``: an engine whose step thread already runs (a
    sweep's embedded target) is paused, warmed up and resumed; a second start does not warm up again; an engine
    with requests in flight is not warmed up."""
    import logging

    from fastapi.testclient import TestClient

    from kvbench.runtime import create_app

    e = Engine(EngineConfig(device="cpu", kv_budget_gb=0.01, max_model_len=512, max_num_batched_tokens=64,
                            max_running=32, extra={"warmup": True}), loaded=loaded)
    try:
        e.start()
        with TestClient(create_app(e)) as client:
            assert e.warmup_s is not None and e._thread.is_alive()
            assert client.get("/health").status_code == 200
            r = client.post("/v1/completions", json={"model": e.model_id, "prompt": [1, 2, 3], "max_tokens": 3,
                                                     "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        first = e.warmup_s
        e.prepare_to_serve()
        assert e.warmup_s == first
    finally:
        e.shutdown()
    busy = Engine(EngineConfig(device="cpu", kv_budget_gb=0.01, max_model_len=512, extra={"warmup": True}),
                  loaded=loaded)
    try:
        busy.add_request([1, 2, 3], SamplingParams(max_tokens=2))
        with caplog.at_level(logging.WARNING, logger="kvbench.runtime"):
            busy.prepare_to_serve()
        assert busy.warmup_s is None and "warm-up skipped" in caplog.text
    finally:
        busy.shutdown()

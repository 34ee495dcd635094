"""The engine's start-up warm-up (runtime/warmup.py): dummy requests reach the step shapes a serving load reaches
(a full-budget prompt, short prompts, chunks over a cached prefix, shrinking decode batches and, with mixed
steps, prefill steps carrying 16 .. 1 decode rows), then the engine is as if new: no page used, counters and
request ids from zero, the same greedy tokens as an engine that did not warm up."""

from __future__ import annotations

import time

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
        assert st.step_counts == st.step_seconds == st.step_tokens == {}  # the warm-up's steps are not counted
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
    w.serve(object())
    with caplog.at_level(logging.WARNING, logger="kvbench.runtime"):
        assert before(repr="_decode_reduce_kernel(S_PAD: 16)") is False
        after(repr="_decode_reduce_kernel(S_PAD: 16)")
    assert w.after_warmup == 1 and w.after_warmup_s >= 0
    assert "compiled while serving" in caplog.text and "_decode_reduce_kernel(S_PAD: 16)" in caplog.text
    assert [c[0] for c in calls] == ["before", "after", "before", "after"]


def _hook_kw(seq_aligned: bool, no_prefix: bool) -> dict:
    """What Triton's ``_call_hook`` passes (triton/runtime/jit.py): ``compile`` holds the signature (name -> type,
    constexprs included), the constexpr values keyed by argument path and the specialization attributes."""
    sig = {"Q": "*bf16", "SEQ_LENS": "*i32", "spt_b": "i32", "NO_PREFIX": "constexpr"}
    attrs = {(0,): [["tt.divisibility", 16]]}
    if seq_aligned:
        attrs[(1,)] = [["tt.divisibility", 16]]
    fn = type("Info", (), {"name": "_prefill_kernel"})()
    return {"key": object(), "repr": "_prefill_kernel[num_warps=8](Q: ()", "fn": fn,
            "compile": {"signature": sig, "constants": {(3,): no_prefix}, "configs": [attrs]}}


def test_compile_watch_names_what_changed_from_the_nearest_variant(monkeypatch, caplog):
    """A compile while serving names the arguments whose class or constexpr differ from the nearest variant
    compiled before (Triton's own text says nothing useful there: ``Q: ()``)."""
    import logging

    from triton import knobs

    from kvbench.runtime import compile_watch as cw

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(cw, "_WATCH", None)
    w = cw.install_compile_watch()
    before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    assert w.specialization(_hook_kw(True, True)) == {"Q": "*bf16÷16", "SEQ_LENS": "*i32÷16", "spt_b": "i32",
                                                       "NO_PREFIX": "True"}
    for kw in (_hook_kw(True, True), _hook_kw(True, False)):  # the warm-up's variants
        before(**kw)
        after(**kw)
    w.serve(object())
    with caplog.at_level(logging.WARNING, logger="kvbench.runtime"):
        kw = _hook_kw(False, False)
        before(**kw)
        after(**kw)
    assert "_prefill_kernel: SEQ_LENS=*i32 (was *i32÷16)" in caplog.text
    assert "NO_PREFIX" not in caplog.text  # the nearest variant had the same constexprs
    assert w.specialization({"compile": {"signature": 3}}) == {}  # other hook shapes: no detail, no error


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


@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed"])
def test_step_time_is_counted_per_step_kind(loaded, mixed):
    """EngineStats.step_counts / step_seconds / step_tokens: every step the engine ran, by kind, its tokens adding
    up to the prompt tokens plus the decode rows; prometheus exports them (server_protocol.prometheus_text)."""
    from kvbench.runtime.server_protocol import prometheus_text

    e = _engine(loaded, False, mixed_prefill=mixed)
    try:
        seen = []
        real = e.scheduler.schedule

        def watch():
            b = real()
            if b is not None:
                seen.append("decode" if b.phase == "decode" else "mixed" if b.decode_rows else "prefill")
            return b

        e.scheduler.schedule = watch
        prompts = [[(5 * i + j) % 300 for j in range(30 + 40 * i)] for i in range(4)]
        t = time.perf_counter()
        outs = e.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        e.shutdown()  # the last step is counted once it ends, after its tokens reached the requests
        wall = time.perf_counter() - t
        st = e.stats()
        # steps launched ahead overlap: each is timed from the later of its launch and the step before it being
        # done, so the times never add up to more than the wall time
        assert sum(st.step_seconds.values()) <= wall
        assert st.step_counts == {k: seen.count(k) for k in set(seen)}
        assert ("mixed" in st.step_counts) == mixed and st.step_counts["prefill"] >= 1 and st.step_counts["decode"] >= 1
        prompt_toks = sum(len(p) for p in prompts)
        # each request's first token comes from its last prefill chunk; the other 5 from decode rows
        assert sum(st.step_tokens.values()) == prompt_toks + 5 * len(prompts) == st.prompt_tokens + 5 * len(outs)
        assert all(st.step_seconds[k] > 0 for k in st.step_counts)
        text = prometheus_text(st, "m")
        for k, n in st.step_counts.items():
            assert f'kvbench_engine_{k}_steps_total{{model_name="m"}} {float(n)}' in text
            assert f"kvbench_engine_{k}_step_seconds_total" in text and f"kvbench_engine_{k}_step_tokens_total" in text
    finally:
        e.shutdown()


def test_warmup_captures_every_decode_graph_bucket(loaded):
    """The decode graphs (runtime/graphs.py) are captured per batch-size bucket on first use; the warm-up
    captures the buckets its rounds did not reach, so no capture lands mid-load; a capture that fails turns
    graphs off as it would while serving."""
    from kvbench.runtime.graphs import bucket_sizes
    from kvbench.runtime.warmup import _capture_graphs

    class FakeGraphs:
        def __init__(self, fail_at=None):
            self.buckets, self.graphs, self.fail_at, self.captured = bucket_sizes(40), {1: "g", 16: "g"}, fail_at, []

        def capture(self, bs):
            if bs == self.fail_at:
                raise RuntimeError("capture failed")
            self.captured.append(bs)
            self.graphs[bs] = "g"

    e = _engine(loaded, False)
    try:
        e.runner.graphs = FakeGraphs()
        assert _capture_graphs(e) == 5 and e.runner.graphs.captured == [2, 4, 8, 32, 40]
        assert sorted(e.runner.graphs.graphs) == bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
        assert _capture_graphs(e) == 0
        e.runner.graphs = FakeGraphs(fail_at=8)
        assert _capture_graphs(e) == 0 and e.runner.graphs is None
    finally:
        e.shutdown()


def test_server_shortens_the_gil_switch_interval_while_it_runs(loaded, monkeypatch):
    """The server sets the interpreter's switch interval (runtime/server.py ``gil_switch_s``: 0.5 ms, or
    KVBENCH_GIL_SWITCH_MS) while it runs and restores it after; ``off`` leaves it; a bad value is refused."""
    import sys

    from fastapi.testclient import TestClient

    from kvbench.runtime import create_app
    from kvbench.runtime.server import gil_switch_s

    before = sys.getswitchinterval()
    assert gil_switch_s() == pytest.approx(0.0005)
    e = _engine(loaded, False)
    try:
        for env, inside in (("", 0.0005), ("2", 0.002), ("off", before)):
            monkeypatch.setenv("KVBENCH_GIL_SWITCH_MS", env)
            with TestClient(create_app(e)) as client:
                assert client.get("/health").status_code == 200
                assert sys.getswitchinterval() == pytest.approx(inside)
            assert sys.getswitchinterval() == pytest.approx(before)
        for bad in ("fast", "0", "-1"):
            monkeypatch.setenv("KVBENCH_GIL_SWITCH_MS", bad)
            with pytest.raises(ValueError, match="KVBENCH_GIL_SWITCH_MS must be"):
                gil_switch_s()
    finally:
        e.shutdown()


def test_compile_watch_counts_stalls_while_any_engine_serves():
    """The watch is the process's: a second engine constructed or warming up while the first serves does not turn
    the counting off (its compiles stall the first one's requests); an engine shut down no longer counts."""
    from kvbench.runtime.compile_watch import CompileWatch

    w = CompileWatch()
    e1, e2 = object(), object()
    kw = {"key": 1, "repr": "_k(Q: *bf16)"}

    def compile_once():
        w.before(**kw)
        w.after(**kw)

    compile_once()  # nobody serves: a warm-up compile
    w.serve(e1)
    compile_once()
    assert (w.during_warmup, w.after_warmup) == (1, 1)
    w.serve(e2)
    w.release(e2)  # the second engine's life ends; the first still serves
    compile_once()
    assert w.serving and w.after_warmup == 2
    w.release(e1)
    compile_once()
    assert not w.serving and (w.during_warmup, w.after_warmup) == (2, 2)

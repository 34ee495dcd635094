"""The step thread records a step's tokens at once and emits their text and deltas during the next step
(``runtime/step_outputs.py``): the deltas of a step leave after the next step's device work is launched, a stop
string still ends its sequence with the same tokens and text (one dropped row), aborts and failures lose no
final delta, and no page leaks."""

from __future__ import annotations

import pytest

from kvbench.core import SamplingParams
from kvbench.runtime.config import EngineConfig
from kvbench.runtime.engine import Engine
from kvbench.runtime.models.loader import load_model

TINY = "synthetic:llama-3-8b,layers=2,hidden=64,heads=2,kv_heads=1,head_dim=32,intermediate_size=128,vocab=300"
PROMPT = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]


@pytest.fixture(scope="module")
def loaded():
    return load_model(TINY)


def _engine(loaded) -> Engine:
    return Engine(EngineConfig(model=TINY, device="cpu", kv_budget_gb=0.01, max_model_len=256), loaded=loaded)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _drive(e: Engine, prompt, params, on_run=None):
    """Run one request on this thread; its deltas and how many of them had arrived at each ``run_rows``."""
    deltas, at_launch, real = [], [], e.runner.run_rows

    def run_rows(batch):
        at_launch.append((len(deltas), [s.request_id for s in batch.seqs]))
        if on_run is not None:
            on_run(len(at_launch))
        return real(batch)

    e.runner.run_rows = run_rows
    e.add_request(prompt, params, request_id="r", on_delta=deltas.append)
    while e.step():
        pass
    return deltas, at_launch


def test_a_steps_deltas_leave_after_the_next_step_is_launched(loaded):
    e = _engine(loaded)
    deltas, at_launch = _drive(e, PROMPT, _greedy(6))
    assert [n for n, _ in at_launch] == [0, 0, 1, 2, 3, 4]  # step i>=1 launches with i-1 tokens out, not i
    assert [len(d.token_ids) for d in deltas] == [1] * 6 and deltas[-1].finish_reason == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert e.cache.allocator.num_used == 0 and not e.rows.pending


def test_a_stop_string_ends_with_the_same_tokens_and_text_and_one_dropped_row(loaded):
    e = _engine(loaded)
    ref = e.generate([PROMPT], _greedy(12))[0]
    e.shutdown()
    text = ref.text
    stop = text[4:6]
    cut = text.find(stop)
    assert cut >= 0 and stop
    # the token count at which the text first holds the stop string: where the sequence must end
    detok = e.tokenizer.decode
    k = next(n for n in range(1, 13) if stop in detok(ref.token_ids[:n]))
    e2 = _engine(loaded)
    deltas, at_launch = _drive(e2, PROMPT, _greedy(12, stop=[stop]))
    assert deltas[-1].finish_reason == "stop"
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == ref.token_ids[:k]
    assert "".join(d.text for d in deltas) == text[:cut]
    # k rows sampled (the prompt's and k-1 decode rows), then the step in flight when the string was found
    assert len(at_launch) == k + 1
    assert e2.cache.allocator.num_used == 0 and not e2.rows.pending


def test_an_abort_with_a_row_pending_sends_one_final_delta(loaded):
    e = _engine(loaded)
    deltas = []
    e.add_request(PROMPT, _greedy(20), request_id="r", on_delta=deltas.append)
    e.step()  # prefill: first token recorded, pending
    e.step()  # decode: the first token's delta out, the second pending
    assert len(deltas) == 1
    e.abort("r")
    while e.step():
        pass
    assert [d.finish_reason for d in deltas] == [None, "abort"]
    assert e.cache.allocator.num_used == 0 and not e.rows.pending


def test_a_failed_step_emits_the_rows_already_recorded_then_fails_the_rest(loaded):
    e = _engine(loaded)
    real, calls = e.runner.run_rows, []

    def run_rows(batch):
        calls.append(len(batch.seqs))
        if len(calls) == 3:  # after "a" ended by length in the second step, before its delta went out
            raise RuntimeError("device lost")
        return real(batch)

    e.runner.run_rows = run_rows
    try:
        a, b = e.generate([PROMPT, PROMPT[:5]], [_greedy(2), _greedy(10)])
    finally:
        e.shutdown()
    assert a.finish_reason == "length" and len(a.token_ids) == 2
    assert b.finish_reason == "error" and len(b.token_ids) == 2
    assert e.cache.allocator.num_used == 0 and not e.rows.pending


def test_record_and_emit_are_append(loaded):
    """``append`` is ``record`` then ``emit``; a stop string after "length" makes it "stop"."""
    e = _engine(loaded)
    seq_of = {}

    def seq(rid, params):
        e.add_request(PROMPT, params, request_id=rid)
        seq_of[rid] = e._seqs[rid]
        return seq_of[rid]

    s = seq("x", _greedy(2, stop=["ab"]))
    assert e.out.record(s, 97, -0.1, None, None, True) is None
    assert e.out.emit(s, 97, -0.1, None, None, None)[0] is None
    reason = e.out.record(s, 98, -0.2, None, None, True)
    assert reason == "length"
    reason, delta = e.out.emit(s, 98, -0.2, None, None, reason)
    assert reason == "stop" and delta.text == "" and s.state["text"] == ""
    t = seq("y", _greedy(5))
    assert e.out.append(t, 99, -0.3, None, None, True)[0] is None and t.output_ids == [99]


def _workload(e: Engine, overlap: bool, mixed: bool):
    """Greedy requests that end by stop id, by length and by the context, under preemption; each request's
    tokens and log-probs, the deltas' tokens, and in how many steps a step was left in flight."""
    e.config.overlap_schedule = overlap
    e.scheduler.mixed = mixed
    prompts = [[(7 * k + 3 * i) % 250 + 1 for i in range(5 + 9 * k)] for k in range(6)]
    params = [_greedy(n) for n in (3, 40, 17, 70, 9, 33)]  # r3: the context (96) ends it
    # drawn rows with their own seeds, top-k / top-p, log-prob lists, banned ids until min_tokens
    params[1] = SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True)
    params[2] = _greedy(17, logprobs=3)
    params[4] = SamplingParams(max_tokens=9, temperature=1.0, top_k=20, top_p=0.9, seed=7, ignore_eos=True,
                               min_tokens=5, stop_token_ids=[1, 2, 3], logprobs=2)
    deltas: dict = {}
    for k, (ids, p) in enumerate(zip(prompts, params)):
        e.add_request(ids, p, request_id=f"r{k}", on_delta=lambda d: deltas.setdefault(d.request_id, []).append(d))
    flights = 0
    while e.step():
        flights += e.rows.inflight is not None
    return deltas, flights


@pytest.mark.parametrize("mixed", [False, True])
def test_steps_launched_ahead_give_the_same_outputs(loaded, mixed):
    """Overlap on and off: the same tokens, log-probs and top log-probs for every request (greedy and drawn rows,
    banned ids, stop ids, lengths, preemption, chunked prompts), no placeholder in any delta, no page left; with
    overlap on, most steps were left in flight."""
    runs = {}
    for overlap in (False, True):
        e = Engine(EngineConfig(model=TINY, device="cpu", kv_budget_gb=0.00003, max_model_len=96, page_size=4,
                                max_num_batched_tokens=24), loaded=loaded)
        runs[overlap] = _workload(e, overlap, mixed)
        assert e.cache.allocator.num_used == 0 and not e.rows.pending and e.rows.inflight is None
        assert e.scheduler.num_preemptions > 0  # the budget forces recomputation
    (off, f_off), (on, f_on) = runs[False], runs[True]
    assert f_off == 0 and f_on > 20
    assert sorted(off) == sorted(on) == [f"r{k}" for k in range(6)]
    for rid in off:
        toks = [t for d in on[rid] for t in d.token_ids]
        assert toks == [t for d in off[rid] for t in d.token_ids] and min(toks) >= 0
        # the batches differ (a row dropped after a stop seen late, other preemption points), so the bf16 K/V
        # rounding and the log-probs may differ slightly; the top ids are the same
        for a, b in zip(on[rid], off[rid]):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-2)
            assert [list(x) for x in a.top_logprobs or []] == [list(x) for x in b.top_logprobs or []]
            assert [list(x.values()) for x in a.top_logprobs or []] == \
                [pytest.approx(list(x.values()), abs=1e-2) for x in b.top_logprobs or []]
        assert on[rid][-1].finish_reason == off[rid][-1].finish_reason
        assert "".join(d.text for d in on[rid]) == "".join(d.text for d in off[rid])


def test_a_stop_id_found_in_flight_drops_the_next_row(loaded):
    """A stop id is only seen when its step's tokens reach the host: the sequence was already scheduled into the
    next step, whose row is dropped; the output ends at the stop id."""
    e = _engine(loaded)
    ref = e.generate([PROMPT], _greedy(12))[0]
    e.shutdown()
    stop_tok = ref.token_ids[5]
    k = ref.token_ids.index(stop_tok) + 1
    e2 = _engine(loaded)
    deltas, at_launch = _drive(e2, PROMPT, _greedy(12, stop_token_ids=[stop_tok]))
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids[:k] and deltas[-1].finish_reason == "stop"
    assert len(at_launch) == k + 1  # the row after the stop id was launched, then dropped
    assert e2.cache.allocator.num_used == 0


def test_overlapping_steps_are_timed_from_the_step_before_being_done():
    """A step launched before the one before it was done is timed from that one being done: the times add up to
    the busy wall time; an idle gap before a launch is not counted."""
    from types import SimpleNamespace

    from kvbench.runtime.engine_api import EngineStats
    from kvbench.runtime.step_outputs import StepOutputs

    stats = EngineStats()
    rows = StepOutputs(SimpleNamespace(_stats=stats))
    rows.done("prefill", 10.0, 100, ended=10.5)
    rows.done("decode", 10.2, 4, ended=10.6)  # launched while the prefill ran: 0.1 s of its own
    rows.done("decode", 20.0, 4, ended=20.3)  # launched after an idle gap: from its launch
    assert stats.step_counts == {"prefill": 1, "decode": 2} and stats.step_tokens == {"prefill": 100, "decode": 8}
    assert stats.step_seconds == pytest.approx({"prefill": 0.5, "decode": 0.4})

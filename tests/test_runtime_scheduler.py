"""Scheduler invariants without a model: admission by free pages, token budget, max running,
preemption by recompute, and every page back in the pool at the end (hypothesis-driven)."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from kvbench.core.client import SamplingParams
from kvbench.runtime.kv_cache import PageAllocator
from kvbench.runtime.scheduler import Scheduler, Sequence


def _sim(sched: Scheduler, seqs, max_steps=5000, abort_at=None):
    """Drive the scheduler like the engine does (without a model): sampled tokens are dummies."""
    abort_at = abort_at or {}
    for step in range(max_steps):
        for s in [s for s in seqs if abort_at.get(s.request_id) == step]:
            sched.finish(s, "abort")
        batch = sched.schedule()
        if batch is None:
            if not sched.has_work():
                return step
            raise AssertionError("scheduler stalled with work left")
        assert batch.num_tokens <= sched.max_batched_tokens or batch.phase == "decode"
        assert len(sched.running) <= sched.max_running
        owned = [p for s in sched.running for p in s.pages + sum(s.group_pages, []) if p != sched.scratch_page]
        assert len(owned) == len(set(owned)), "a page owned twice"
        assert all(not s.pages for s in sched.waiting), "waiting sequences own no pages"
        for s, q in zip(batch.seqs, batch.q_lens):
            assert q >= 1 and s.num_cached + q <= len(s.pages) * sched.page_size
            for pages, w in zip([s.pages, *s.group_pages], sched.windows or []):
                assert len(pages) == len(s.pages)  # every list has the same logical length
                if w is None:
                    assert sched.scratch_page not in pages
                    continue
                # windowed pages: the window's pages and the chunk's, nothing more
                live = [p for p in pages if p != sched.scratch_page]
                assert len(live) <= -(-(w + q - 1) // sched.page_size) + 1, (len(live), q)
                first_live = max(0, s.num_cached - w + 1) // sched.page_size
                assert all(p != sched.scratch_page for p in pages[first_live:])
            if batch.phase == "decode":
                assert q == 1 and s.pending == 1
            s.num_cached += q
            if s.num_cached == s.num_tokens:
                s.output_ids.append(7)
                if len(s.output_ids) >= s.params.max_tokens:
                    sched.finish(s, "length")
    raise AssertionError("did not finish")


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20)), min_size=1, max_size=10),
    pages=st.integers(6, 30),
    budget=st.integers(1, 64),
    max_running=st.integers(1, 6),
    abort=st.lists(st.integers(0, 60), max_size=3),
)
def test_scheduler_finishes_everything_without_leaks(lens, pages, budget, max_running, abort):
    ps = 4
    alloc = PageAllocator(pages)
    sched = Scheduler(alloc, ps, max_running, budget)
    seqs = []
    for i, (p, n) in enumerate(lens):
        p = min(p, pages * ps - n)  # the engine rejects requests that can never fit
        s = Sequence(f"r{i}", list(range(1, p + 1)), SamplingParams(max_tokens=n))
        seqs.append(s)
        sched.add(s)
    aborts = {f"r{i}": t for i, t in enumerate(abort)}
    _sim(sched, seqs, abort_at=aborts)
    assert alloc.num_free == pages
    for s in seqs:
        assert s.status == "finished" and not s.pages
        if s.finish_reason == "length":
            assert len(s.output_ids) == s.params.max_tokens


def test_admission_waits_for_pages_and_preempts_newest():
    alloc = PageAllocator(4)
    sched = Scheduler(alloc, 4, 8, 64)
    a = Sequence("a", [1] * 6, SamplingParams(max_tokens=8))
    b = Sequence("b", [1] * 6, SamplingParams(max_tokens=8))
    c = Sequence("c", [1] * 6, SamplingParams(max_tokens=8))
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["a", "b"]  # c waits: 2 pages each, 4 in total
    assert list(sched.waiting) == [c] and alloc.num_free == 0
    for s in batch.seqs:
        s.num_cached = 6
        s.output_ids.append(5)
    for _ in range(3):  # decode past 8 tokens: a needs a third page -> preempt b (the newest)
        batch = sched.schedule()
        for s in batch.seqs:
            s.num_cached += 1
            s.output_ids.append(5)
    assert sched.num_preemptions == 1 and b.status == "waiting" and b.num_cached == 0 and not b.pages
    assert list(sched.waiting)[:2] == [b, c]  # back at the front of the queue, recomputed later


def test_chunked_prefill_respects_budget():
    alloc = PageAllocator(64)
    sched = Scheduler(alloc, 16, 8, 10)
    s = Sequence("a", list(range(25)), SamplingParams(max_tokens=2))
    sched.add(s)
    sizes = []
    while s.num_cached < 25:
        batch = sched.schedule()
        assert batch.phase == "prefill"
        sizes.append(batch.q_lens[0])
        s.num_cached += batch.q_lens[0]
    assert sizes == [10, 10, 5]


def test_sequence_status_is_an_enum_that_still_reads_as_its_word():
    from kvbench.runtime.scheduler import SeqStatus

    s = Sequence("x", [1, 2], SamplingParams(max_tokens=1))
    assert s.status is SeqStatus.WAITING and s.status == "waiting" and str(s.status) == "waiting"
    assert [m.value for m in SeqStatus] == ["waiting", "running", "finished"]


@settings(max_examples=30, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30)), min_size=1, max_size=8),
    pages=st.integers(8, 30),
    budget=st.integers(1, 24),
    window=st.integers(1, 13),
    max_running=st.integers(1, 5),
)
def test_windowed_pages_hold_only_the_window_and_leak_nothing(lens, pages, budget, window, max_running):
    """A model whose every layer slides: pages below the window go back before each step (the scratch page
    takes their entries), admission takes the first chunk's pages only, nothing leaks, nothing stalls."""
    ps = 4
    alloc = PageAllocator(pages)
    sched = Scheduler(alloc, ps, max_running, budget, window=window, scratch_page=pages)
    seqs = []
    for i, (p, n) in enumerate(lens):
        s = Sequence(f"r{i}", list(range(1, p + 1)), SamplingParams(max_tokens=n))
        seqs.append(s)
        sched.add(s)
    if -(-(window + budget - 1) // ps) + 1 > pages:
        return  # one chunk and its window do not fit the pool: the engine sizes pools far above this
    _sim(sched, seqs)
    assert alloc.num_free == pages
    assert all(s.status == "finished" and not s.pages and s.num_dead_pages == 0 for s in seqs)


@settings(max_examples=30, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30)), min_size=1, max_size=8),
    pages=st.integers(12, 60),
    budget=st.integers(1, 24),
    window=st.integers(1, 13),
    sliding_groups=st.integers(1, 4),
    max_running=st.integers(1, 5),
)
def test_layer_group_pages_leak_nothing(lens, pages, budget, window, sliding_groups, max_running):
    """Layer groups: one global list and sliding lists grow together; sliding lists drop their pages below the
    window; all pages come back; nothing stalls while one sequence's pages fit the pool."""
    ps = 4
    windows = [None] + [window] * sliding_groups
    alloc = PageAllocator(pages)
    sched = Scheduler(alloc, ps, max_running, budget, scratch_page=pages, group_windows=windows)
    seqs = []
    for i, (p, n) in enumerate(lens):
        longest = pages // len(windows) * ps  # the engine caps the context so that one sequence fits
        p = max(1, min(p, longest - n))
        if p + n > longest:
            continue
        s = Sequence(f"r{i}", list(range(1, p + 1)), SamplingParams(max_tokens=n))
        seqs.append(s)
        sched.add(s)
    _sim(sched, seqs)
    assert alloc.num_free == pages
    assert all(s.status == "finished" and not s.pages and not s.group_pages for s in seqs)

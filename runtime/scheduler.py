"""Continuous batching: waiting queue, admission by free pages, chunked prefill under a token budget,
preemption by recompute, a cap on running sequences.

Each step is either a **prefill** step (sequences whose cached tokens lag behind their known tokens:
new prompts, later chunks of long prompts, recomputation after preemption) or a **decode** step (every
running sequence whose prompt is cached and that has all but its newest token cached; a prompt's last
token is prefilled even when it is the only one left).  With ``mixed`` (``EngineConfig.mixed_prefill``) a
prefill step also carries every decoding sequence's next token (one row each, first in the token budget):
those rows have decode semantics (``ScheduledBatch.decode_rows`` -> ``AttentionMetadata.decode_rows``: the
attention backends run them through their decode path, or as round-trip rows where they run the step whole,
``runtime/attention/base.py``), so they read the cache as a decode step would, and decoding never waits for a
prompt chunk.

Teacher-forced scoring sequences carry ``score_from``: the prompt holds context + continuation, and a
prefill chunk never straddles ``score_from`` (the continuation chunks run with decode semantics, see
``attention/base.py``).  Prefill work goes first, so new requests
start as soon as pages allow; decode never waits more than one prefill step per chunk budget.

Admission reserves pages for all of a sequence's known tokens (so its chunked prefill never stalls); a
sequence that needs a page during decode preempts the most recently arrived running sequence, or itself
when it is the most recent, so the oldest running sequence always progresses (no livelock).

Invariant: a page is owned by at most one sequence; a finished or aborted sequence owns none.

Windowed pages (``window``: a model whose every layer has a sliding window of at least ``window`` tokens, on
backends that never read below a window): a page all of whose positions are at or below ``num_cached -
window`` is never read again (the next query, at ``num_cached`` or later, sees keys above ``q - window``), so
it goes back to the allocator before each step and its entry in the sequence's page list becomes the scratch
page (``scratch_page``; kept so that the list stays indexed by logical page).  Sequences are then admitted with
pages for their first chunk only, later chunks growing as decode does: a sequence holds at most
``ceil((window + chunk) / page_size) + 1`` pages while it prefills and ``ceil(window / page_size) + 1`` while it
decodes.

Layer groups (``group_windows``, one entry per page list; ``runtime/layer_groups.py``): a sequence holds one page
list per group, all of the same logical length (``pages`` is group 0's, ``group_pages`` the others'); every
growth takes the same number of pages for each list at once, and the lists of sliding groups drop their pages
below the window as above.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Optional

from kvbench.core import SamplingParams
from kvbench.runtime.kv_cache import PageAllocator, pages_needed

if TYPE_CHECKING:
    from kvbench.runtime.scoring import ScoreState

__all__ = ["Sequence", "SeqKind", "SeqStatus", "ScheduledBatch", "Scheduler"]


class SeqStatus(str, Enum):
    """Where a sequence is: queued (new, or preempted and to be recomputed), holding pages and stepping, or done.
    A ``str`` enum, so records and logs that print it keep the plain words."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"

    def __str__(self) -> str:
        return self.value


class SeqKind(str, Enum):
    """What a sequence is for: sampling new tokens, or scoring a given continuation by teacher forcing, one
    decode step per token (``SCORE_DECODE``) or in prefill chunks with decode semantics after ``score_from``
    (``SCORE_PREFILL``; ``runtime/scoring.py``)."""

    GENERATE = "generate"
    SCORE_DECODE = "score_decode"
    SCORE_PREFILL = "score_prefill"

    def __str__(self) -> str:
        return self.value


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: Optional[str] = None
    num_preemptions: int = 0
    order: int = -1  # admission priority (arrival order), set by the scheduler
    first_token_time: Optional[float] = None
    # teacher-forced scoring in prefill passes: token index where the continuation starts (chunks are cut
    # there); None for every other request
    score_from: Optional[int] = None
    finish_time: Optional[float] = None
    num_dead_pages: int = 0  # leading entries of ``pages`` that are the scratch page (windowed pages)
    group_pages: list = field(default_factory=list)  # layer groups 1..G-1: their page lists (module doc)
    group_dead: list = field(default_factory=list)  # and their leading scratch entries
    # per-request extras owned by the engine (callbacks, detokenizer, generator, per-row outputs)
    state: dict[str, Any] = field(default_factory=dict)
    on_delta: Optional[Callable] = None
    kind: SeqKind = SeqKind.GENERATE
    scoring: Optional["ScoreState"] = None  # the forced tokens and kept rows of a scoring sequence

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids ``start .. end-1`` without building the whole ``token_ids`` list (a decode step needs
        one token of each sequence)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def pending(self) -> int:
        """Known tokens not yet in the cache."""
        return self.num_tokens - self.num_cached

    @property
    def in_decode(self) -> bool:
        return self.status == SeqStatus.RUNNING and self.pending == 1 and self.num_cached >= len(self.prompt_ids) > 0

    def chunk_len(self, budget: int) -> int:
        """New tokens of this sequence's next prefill chunk under ``budget``: never past ``score_from``
        while the context is not yet cached."""
        n = min(self.pending, budget)
        if self.score_from is not None and self.num_cached < self.score_from:
            n = min(n, self.score_from - self.num_cached)
        return n


@dataclass
class ScheduledBatch:
    phase: str  # "prefill" | "decode"
    seqs: list[Sequence]
    q_lens: list[int]  # new tokens per sequence this step
    decode_rows: int = 0  # a mixed prefill step: its first sequences are decode rows (one token, decode semantics)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_running: int, max_batched_tokens: int,
                 window: Optional[int] = None, scratch_page: Optional[int] = None, group_windows: Optional[list] = None,
                 mixed: bool = False):
        windows = list(group_windows) if group_windows else ([window] if window is not None else None)
        if windows and (scratch_page is None or any(w is not None and w < 1 for w in windows)):
            raise ValueError("windowed pages need positive windows and the cache's scratch page")
        self.window = window
        self.windows = windows  # per page list: its window (None: keeps every page); None = one plain list
        self.lists = len(windows) if windows else 1
        self.lazy = bool(windows) and any(w is not None for w in windows)  # grow chunk by chunk
        self.scratch_page = scratch_page
        self.mixed = mixed
        self.allocator = allocator
        self.page_size = page_size
        self.max_running = max_running
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._next_order = 0

    # ------------------------------------------------------------------------------- queue ops
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        seq.order = self._next_order
        self._next_order += 1
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and free its pages (idempotent)."""
        if seq.status == SeqStatus.FINISHED:
            return
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()

    def _release(self, seq: Sequence) -> None:
        if seq.pages:
            self.allocator.free(seq.pages[seq.num_dead_pages:])
        for pages, dead in zip(seq.group_pages, seq.group_dead):
            self.allocator.free(pages[dead:])
        seq.pages, seq.group_pages, seq.group_dead = [], [], []
        seq.num_cached = 0
        seq.num_dead_pages = 0

    def _drop_dead_pages(self) -> None:
        """Windowed pages: free every running sequence's pages that no later query can see (module doc)."""
        ps = self.page_size
        for seq in self.running:
            dead_counts = [seq.num_dead_pages, *seq.group_dead]
            for k, (pages, w) in enumerate(zip([seq.pages, *seq.group_pages], self.windows)):
                if w is None:
                    continue
                dead = min(max(0, (seq.num_cached - w + 1) // ps), len(pages))
                if dead > dead_counts[k]:
                    self.allocator.free(pages[dead_counts[k]:dead])
                    pages[dead_counts[k]:dead] = [self.scratch_page] * (dead - dead_counts[k])
                    if k == 0:
                        seq.num_dead_pages = dead
                    else:
                        seq.group_dead[k - 1] = dead

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = pages_needed(num_tokens, self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need * self.lists):
            return False
        seq.pages.extend(self.allocator.allocate(need))
        if self.lists > 1:  # layer groups: every list grows by the same logical pages
            if not seq.group_pages:
                seq.group_pages, seq.group_dead = [[] for _ in range(self.lists - 1)], [0] * (self.lists - 1)
            for pages in seq.group_pages:
                pages.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, victim: Sequence) -> None:
        """Back to the waiting queue (in arrival order), to be recomputed from scratch."""
        self.running.remove(victim)
        self._release(victim)
        victim.status = SeqStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        i = 0
        while i < len(self.waiting) and self.waiting[i].order < victim.order:
            i += 1
        self.waiting.insert(i, victim)

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq`` to ``num_tokens``, preempting later arrivals as needed; if that is not enough,
        preempt ``seq`` itself.  The oldest running sequence therefore always makes progress."""
        while not self._grow(seq, num_tokens):
            later = [s for s in self.running if s.order > seq.order]
            if not later:
                self._preempt(seq)
                return False
            self._preempt(max(later, key=lambda s: s.order))
        return True

    def _fit_chunk(self, seq: Sequence, n: int) -> int:
        """Windowed pages: the longest next chunk of ``seq`` (up to ``n`` tokens) whose pages fit, preempting
        later arrivals first.  Unlike ``_make_room`` it never preempts ``seq``: recomputing a prompt that grows
        chunk by chunk would lose its progress every time, while the older sequences holding the pages decode
        and free them."""
        ps = self.page_size
        while True:
            room = (len(seq.pages) + self.allocator.num_free // self.lists) * ps - seq.num_cached
            if room >= n:
                break
            later = [s for s in self.running if s.order > seq.order]
            if not later:
                n = max(room, 0)
                break
            self._preempt(max(later, key=lambda s: s.order))
        if n and not self._grow(seq, seq.num_cached + n):
            raise AssertionError("a chunk that fits the free pages could not grow")
        return n

    # -------------------------------------------------------------------------------- schedule
    def schedule(self) -> Optional[ScheduledBatch]:
        if self.lazy:
            self._drop_dead_pages()
        if self.mixed:
            return self._schedule_mixed()
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_mixed(self) -> Optional[ScheduledBatch]:
        """Decode rows first (they may preempt), then prefill chunks in what is left of the budget; a decode
        row whose sequence a prefill chunk preempted (or readmitted) leaves the step."""
        if not any(not s.in_decode for s in self.running) and not self.waiting:
            return self._schedule_decode()
        dec = self._schedule_decode()
        dec_seqs = dec.seqs if dec is not None else []
        pre = self._schedule_prefill(self.max_batched_tokens - len(dec_seqs))
        if pre is None:
            return dec
        chunked = set(map(id, pre.seqs))
        dec_seqs = [s for s in dec_seqs if s.status == SeqStatus.RUNNING and s.in_decode and id(s) not in chunked]
        return ScheduledBatch("prefill", dec_seqs + pre.seqs, [1] * len(dec_seqs) + pre.q_lens, len(dec_seqs))

    def _schedule_prefill(self, budget: Optional[int] = None) -> Optional[ScheduledBatch]:
        budget = self.max_batched_tokens if budget is None else budget
        seqs: list[Sequence] = []
        q_lens: list[int] = []
        # 1) running sequences in the middle of a chunked prefill
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.in_decode or seq.pending <= 0:
                continue
            if seq.status != SeqStatus.RUNNING:
                continue  # preempted by an older sequence earlier in this loop
            n = seq.chunk_len(budget)
            if self.lazy:
                n = self._fit_chunk(seq, n)
                if n == 0:
                    continue  # older sequences hold the pages: they run (decode) and free them
            elif not self._make_room(seq, seq.num_cached + n):
                continue
            seqs.append(seq)
            q_lens.append(n)
            budget -= n
        # 2) admit from the waiting queue in arrival order while pages and slots last
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            n = seq.chunk_len(budget)
            # pages for every known token up front: a chunked prefill then never stalls half-way (windowed
            # pages: for the first chunk, later ones grow as they come)
            if not self._grow(seq, n if self.lazy else seq.num_tokens):
                break  # not enough free pages: wait for running sequences to finish
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            q_lens.append(n)
            budget -= n
        return ScheduledBatch("prefill", seqs, q_lens) if seqs else None

    def _schedule_decode(self) -> Optional[ScheduledBatch]:
        seqs: list[Sequence] = []
        for seq in list(self.running):
            if seq.status != SeqStatus.RUNNING or not seq.in_decode:
                continue
            if self._make_room(seq, seq.num_tokens):
                seqs.append(seq)
        seqs = [s for s in seqs if s.status == SeqStatus.RUNNING]
        if not seqs:
            return None
        return ScheduledBatch("decode", seqs, [1] * len(seqs))

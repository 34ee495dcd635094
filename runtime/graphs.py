"""CUDA-graph capture of decode steps.

One graph per batch-size bucket (1, 2, 4, 8, then multiples of 16 up to ``max_batch``), captured
lazily on first use.  All inputs live in static device buffers that the graph reads; a step copies its
inputs in and replays.  Padded rows (bucket size > batch) get slot −1 (written to the scratch page),
position 0, ``seq_len`` 1 and a page table of the scratch page, and their outputs are ignored.
``max_seqlen_k`` is fixed at ``max_model_len`` so shapes never change between replays; KV scales are
device tensors read by pointer, so recalibration does not invalidate graphs.

Host side of a step: the inputs go into pinned staging buffers through numpy views and reach the device
in five asynchronous copies.  The page table's staging rows are rewritten only where they changed: each row
remembers the page list it last held (the object itself, so its identity cannot be reused) and how many of
its pages were written; the scheduler only ever extends a sequence's page list or replaces it with a new
one, so a row holding the same list needs only its new pages.  Before the staging buffers are written
again, the previous step's copies out of them must have run (an event, normally long done).

The decode backend must be capturable (``graph_safe = True``: no host syncs in ``plan``/``forward``);
otherwise the engine runs decode eagerly.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvbench.runtime.attention.base import AttentionMetadata

if TYPE_CHECKING:
    from kvbench.runtime.models.runner import ModelRunner, StepInputs

__all__ = ["DecodeGraphs", "GraphUnavailable", "bucket_sizes", "graph_safe"]

log = logging.getLogger("kvbench.runtime")


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def graph_safe(backend) -> bool:
    """False only when the decode backend says it cannot be captured; backends that do not say are
    tried, and a failed capture falls back to eager decode (``DecodeGraphs.run`` raises GraphUnavailable)."""
    dec = getattr(backend, "decode", backend)  # hybrid: the decode half is what gets captured
    return getattr(dec, "graph_safe", None) is not False


class GraphUnavailable(RuntimeError):
    """Capturing the decode step failed; the caller decodes eagerly from now on."""


class DecodeGraphs:
    def __init__(self, runner: "ModelRunner", max_batch: int, max_model_len: int):
        self.runner = runner
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        cache = runner.cache
        self.page_size = cache.page_size
        self.max_pages = -(-max_model_len // cache.page_size)
        self.buckets = bucket_sizes(max_batch)
        dev = runner.device
        i64, i32 = dict(dtype=torch.int64, device=dev), dict(dtype=torch.int32, device=dev)
        B, P = max_batch, self.max_pages
        self.ids = torch.zeros(B, **i64)
        self.pos = torch.zeros(B, **i64)
        self.slots = torch.full((B,), -1, **i64)
        self.table = torch.full((B, P), cache.scratch_page, **i32)
        self.seq_lens = torch.ones(B, **i32)
        self.cu = torch.arange(B + 1, **i32)
        # host staging: one pinned buffer per input, one copy each (pageable on a machine without CUDA,
        # where only the staging is exercised)
        pin = dict(pin_memory=torch.cuda.is_available())
        self._h_ids = torch.zeros(B, dtype=torch.int64, **pin)
        self._h_pos = torch.zeros(B, dtype=torch.int64, **pin)
        self._h_slots = torch.zeros(B, dtype=torch.int64, **pin)
        self._h_table = torch.full((B, P), cache.scratch_page, dtype=torch.int32, **pin)
        self._h_lens = torch.zeros(B, dtype=torch.int32, **pin)
        self._np = {k: getattr(self, "_h_" + k).numpy() for k in ("ids", "pos", "slots", "table", "lens")}
        self._rows: list = [(None, 0)] * B  # per staging row: (page list last written, pages written)
        self._copied = None  # event after the last step's host-to-device copies
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metas: dict[int, AttentionMetadata] = {}
        self.pool = None

    def can_run(self, inp: "StepInputs") -> bool:
        return len(inp.seq_lens) <= self.max_batch and inp.max_pages_used <= self.max_pages

    def stage(self, inp: "StepInputs") -> None:
        """Write a step's inputs into the host staging buffers (rows ``0 .. n-1``)."""
        n = len(inp.seq_lens)
        h = self._np
        h["ids"][:n] = inp.ids
        h["pos"][:n] = inp.pos
        h["slots"][:n] = inp.slots
        h["lens"][:n] = inp.seq_lens
        table, rows, pad = h["table"], self._rows, self.runner.cache.scratch_page
        for i, seq in enumerate(inp.seqs):
            pages = seq.pages
            held, done = rows[i]
            k = len(pages)
            if held is pages and done <= k:
                if done < k:
                    table[i, done:k] = pages[done:]
            else:
                table[i, :k] = pages
                table[i, k:] = pad
            rows[i] = (pages, k)

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            phase="decode", positions=self.pos[:bs], slot_mapping=self.slots[:bs], page_table=self.table[:bs],
            seq_lens=self.seq_lens[:bs], cu_seqlens_q=self.cu[: bs + 1], max_seqlen_q=1,
            max_seqlen_k=self.max_model_len, page_size=self.page_size, rope=self.runner.rope,
        )

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        r = self.runner
        r.backend.plan(meta, r.cache)
        return r.model(self.ids[:bs], r.backend, r.cache, meta)

    @torch.inference_mode()
    def capture(self, bs: int) -> None:
        self._reset_padding(0)
        meta = self._meta(bs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up (autotuning, lazy allocations) outside the graph
                self._forward(bs, meta)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self._forward(bs, meta)
        self.pool = g.pool()
        self.graphs[bs], self.outputs[bs], self.metas[bs] = g, out, meta
        log.info("captured decode CUDA graph for batch %d", bs)

    def _reset_padding(self, start: int) -> None:
        self.slots[start:].fill_(-1)
        self.pos[start:].zero_()
        self.ids[start:].zero_()
        self.seq_lens[start:].fill_(1)
        self.table[start:].fill_(self.runner.cache.scratch_page)

    @torch.inference_mode()
    def run(self, inp: "StepInputs") -> torch.Tensor:
        n = len(inp.seq_lens)
        bs = self._bucket(n)
        if bs not in self.graphs:
            try:
                self.capture(bs)
            except Exception as e:
                log.warning("CUDA-graph capture of decode failed (%s: %s); decoding eagerly", type(e).__name__, e)
                torch.cuda.synchronize()
                raise GraphUnavailable(str(e)) from e
        if self._copied is not None:
            self._copied.synchronize()
        self.stage(inp)
        self.ids[:n].copy_(self._h_ids[:n], non_blocking=True)
        self.pos[:n].copy_(self._h_pos[:n], non_blocking=True)
        self.slots[:n].copy_(self._h_slots[:n], non_blocking=True)
        self.seq_lens[:n].copy_(self._h_lens[:n], non_blocking=True)
        self.table[:n].copy_(self._h_table[:n], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        if n < bs:
            self._reset_padding(n)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

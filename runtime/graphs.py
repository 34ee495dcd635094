"""CUDA-graph capture of decode steps.

One graph per batch-size bucket (1, 2, 4, 8, then multiples of 16 up to ``max_batch``), captured
lazily on first use; a server's engine captures them all before it serves (``runtime/warmup.py``).  All inputs live in static device buffers that the graph reads; a step copies its
inputs in and replays.  Padded rows (bucket size > batch) get slot −1 (written to the scratch page),
position 0, ``seq_len`` 1 and a page table of the scratch page, and their outputs are ignored.
``max_seqlen_k`` is fixed at ``max_model_len`` so shapes never change between replays; KV scales are
device tensors read by pointer, so recalibration does not invalidate graphs.

Host side of a step: the inputs go into one pinned staging buffer through numpy views and reach the
device in one copy of the buffer's prefix that the step's bucket reads (the page tables come last, so a
bucket of ``bs`` rows ends at its ``bs``-th table row).  The copy is captured as the graph's first node,
so a step's host work is the staging and the replay's launch; where it cannot be captured, it is issued
before each replay.  Padded rows are staged on the host as well, so the device needs no fills between
steps.  Before the staging buffer is written again, the previous step's replay must have run (an event,
normally long done: the caller reads its output).

Layer groups (``KVCacheSpec.groups``, ``runtime/layer_groups.py``): every group's slot mapping and page table
are staged.  The slots are laid out ``[G, B]`` (group ``k``'s slots of a bucket are the contiguous
``slots[k, :bs]``) and the tables ``[B, G, P]``, so group ``k``'s table of a bucket is the strided row view
``tables[:bs, k]`` (``[bs, P]``, row stride ``G * P``: the Triton kernels take ``stride(0)``, the torch plan
copies it to int64) and a bucket's rows of all groups still end at its ``bs``-th row.  Without groups
``G = 1`` and the layout is the plain one (``table`` contiguous ``[B, P]``).

The page tables' staging rows are rewritten only where they changed: each row remembers, per group, the page
list it last held (the object itself, so its identity cannot be reused), how many of its pages were written
and how many of its leading entries were the scratch page then (``Sequence.num_dead_pages`` / ``group_dead``).
The scheduler changes a list it keeps in only two ways: it extends it, and before a step it replaces the
entries of a sliding list's pages below the window by the scratch page *in place* (the leading entries, its
dead count growing).  So a row holding the same list rewrites its entries from the old dead count to the new
one and its new pages; any other list (a new one after preemption, another sequence) rewrites the whole row.

Fed ids (steps launched ahead, ``EngineConfig.overlap_schedule``, ``runtime/step_outputs.py``): a step may be
launched before the previous step's tokens reach the host; its rows then take their input id from ``fed``, where
the previous step's sampling wrote its tokens on the device.  The graph reads its ids through one gather,
``flat[src]`` over the device buffer seen as int64: ``src[i]`` is ``i`` (the staged id) or ``fed``'s offset plus
the previous step's row (``StepInputs.feed``).  ``fed`` lies after the tables, so no staging copy overwrites it.
With steps launched ahead the staging copy runs before each replay (``copy_outside``): the host buffer is free
again once that copy ran, while the step before may still be running.

The decode backend must be capturable (``graph_safe = True``: no host syncs in ``plan``/``forward``);
otherwise the engine runs decode eagerly.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
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
        groups = getattr(getattr(cache, "spec", None), "groups", None)
        self.num_groups = G = 1 if groups is None else groups.num_groups
        dev = runner.device
        B, P = max_batch, self.max_pages
        self.pad = {"ids": 0, "pos": 0, "slots": -1, "lens": 1, "table": cache.scratch_page}
        # every input is a view of one buffer, on the host (pinned staging) and on the device, so a step
        # is one copy: ids, positions, slots [G, B] (int64), seq_lens (int32, padded to 8 bytes), then the
        # page tables [B, G, P] int32 last, so the rows of a bucket of bs sequences end the prefix a step copies
        # then ``src`` (int64, before the tables: staged) and ``fed`` (after them: never copied, module doc "Fed ids")
        fields = (("ids", torch.int64, B), ("pos", torch.int64, B), ("slots", torch.int64, G * B),
                  ("lens", torch.int32, B + (B & 1)), ("src", torch.int64, B), ("table", torch.int32, B * G * P + (B * G * P & 1)),
                  ("fed", torch.int64, B))
        off, self._off = 0, {}
        for name, dt, n in fields:
            self._off[name] = (off, dt, n)
            off += n * torch.empty((), dtype=dt).element_size()
        self._table_off = self._off["table"][0]
        self._nbytes = off
        pin = dict(pin_memory=torch.cuda.is_available())  # pageable without CUDA, where only staging runs
        self._h_buf = torch.zeros(off, dtype=torch.uint8, **pin)
        self._d_buf = torch.zeros(off, dtype=torch.uint8, device=dev)
        h, d = self._views(self._h_buf), self._views(self._d_buf)
        self.ids, self.pos, self.seq_lens = d["ids"], d["pos"], d["lens"][:B]
        self.group_slots = d["slots"].view(G, B)  # [G, B]: row k is group k's slot mapping
        self.tables = d["table"][: B * G * P].view(B, G, P)  # [B, G, P]: tables[:, k] is group k's page table
        self.src, self.fed = d["src"], d["fed"]
        self._flat = self._d_buf.view(torch.int64)  # ids are its first B entries, fed its last B
        self._fed_at = self._off["fed"][0] // 8
        self.slots, self.table = self.group_slots[0], self.tables[:, 0]  # group 0's (the only one without groups)
        self.cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self._np = {k: h[k].numpy() for k in ("ids", "pos", "slots", "lens", "src", "table")}
        self._np["lens"] = self._np["lens"][:B]
        self._np["slots"] = self._np["slots"].reshape(G, B)
        self._np["table"] = self._np["table"][: B * G * P].reshape(B, G, P)
        for k, v in self.pad.items():
            self._np[k][...] = v
        self._iota = np.arange(B, dtype=np.int64)  # a row's own id: src's value where no fed id replaces it
        self._np["src"][...] = self._iota
        self._d_buf.copy_(self._h_buf)
        # per group and staging row: (page list last written, pages written, leading scratch entries then)
        self._rows: list = [[(None, 0, 0)] * B for _ in range(G)]
        self._live = 0  # staging rows 0 .. _live-1 may hold a sequence; the rest hold the padding
        self.copy_in_graph: dict[int, bool] = {}  # per bucket: its graph copies the staged inputs itself
        self.copy_outside = False  # copy before each replay (set before any capture: steps launched ahead)
        self._copied = None  # event after the last step's replay (its copy out of the staging buffer done)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metas: dict[int, AttentionMetadata] = {}
        self.pool = None

    def can_run(self, inp: "StepInputs") -> bool:
        return len(inp.seq_lens) <= self.max_batch and inp.max_pages_used <= self.max_pages

    def _views(self, buf: torch.Tensor) -> dict:
        return {k: buf[o : o + n * torch.empty((), dtype=dt).element_size()].view(dt) for k, (o, dt, n) in self._off.items()}

    def stage(self, inp: "StepInputs") -> None:
        """Write a step's inputs into the host staging buffer: rows ``0 .. n-1`` from the step (every layer
        group's slots and page table), rows a previous, larger step left behind back to the padding (slot −1,
        position 0, ``seq_len`` 1, the scratch page), so a bucket's rows can be copied whole."""
        n = len(inp.seq_lens)
        G = self.num_groups
        if len(inp.group_slots) != G - 1:
            raise ValueError(f"the step has {len(inp.group_slots) + 1} layer groups' slots, the graphs stage {G}")
        h = self._np
        h["ids"][:n] = inp.ids
        src = h["src"]
        src[:n] = self._iota[:n]
        for row, j in inp.feed:  # the id the previous step sampled on the device, ``fed[j]``
            src[row] = self._fed_at + j
        h["pos"][:n] = inp.pos
        slots = h["slots"]
        slots[0, :n] = inp.slots
        for k, s in enumerate(inp.group_slots, 1):
            slots[k, :n] = s
        h["lens"][:n] = inp.seq_lens
        table, pad, seqs = h["table"], self.pad["table"], inp.seqs
        for g in range(G):
            if g == 0:
                lists, deads = [s.pages for s in seqs], [s.num_dead_pages for s in seqs]
            else:
                lists, deads = [s.group_pages[g - 1] for s in seqs], [s.group_dead[g - 1] for s in seqs]
            rows, tg = self._rows[g], table[:, g]
            for i, pages in enumerate(lists):
                old, done, old_dead = rows[i]
                dead, k = deads[i], len(pages)
                if old is pages and done <= k and old_dead <= dead:
                    if old_dead < dead:  # entries the scheduler turned into the scratch page in place
                        tg[i, old_dead:dead] = pages[old_dead:dead]
                    if done < k:
                        tg[i, done:k] = pages[done:]
                else:
                    tg[i, :k] = pages
                    tg[i, k:] = pad
                rows[i] = (pages, k, dead)
        if self._live > n:
            live = self._live
            for k in ("ids", "pos", "lens", "table"):
                h[k][n:live] = self.pad[k]
            src[n:live] = self._iota[n:live]
            slots[:, n:live] = self.pad["slots"]
            for rows in self._rows:
                rows[n:live] = [(None, 0, 0)] * (live - n)
        self._live = n

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _meta(self, bs: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            phase="decode", positions=self.pos[:bs], slot_mapping=self.slots[:bs], page_table=self.table[:bs],
            seq_lens=self.seq_lens[:bs], cu_seqlens_q=self.cu[: bs + 1], max_seqlen_q=1,
            max_seqlen_k=self.max_model_len, page_size=self.page_size, rope=self.runner.rope,
        )
        if self.num_groups > 1:  # group 0's are page_table / slot_mapping (the same views)
            meta.group_page_tables = [meta.page_table] + [self.tables[:bs, k] for k in range(1, self.num_groups)]
            meta.group_slot_mappings = [meta.slot_mapping] + [self.group_slots[k, :bs] for k in range(1, self.num_groups)]
        return meta

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        r = self.runner
        r.backend.plan(meta, r.cache)
        return r.model(self._flat[self.src[:bs]], r.backend, r.cache, meta)  # staged ids, or fed ones

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
        h, d = self._prefix(bs)
        for inside in ((False,) if self.copy_outside else (True, False)):  # the inputs' copy as the graph's first node; else before each replay
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g, pool=self.pool):
                    if inside:
                        d.copy_(h, non_blocking=True)
                    out = self._forward(bs, meta)
                break
            except Exception as e:
                if not inside:
                    raise
                log.info("decode graph for batch %d: input copy outside the graph (%s: %s)", bs, type(e).__name__, e)
                torch.cuda.synchronize()
        self.copy_in_graph[bs] = inside
        self.pool = g.pool()
        self.graphs[bs], self.outputs[bs], self.metas[bs] = g, out, meta
        log.info("captured decode CUDA graph for batch %d", bs)

    def _prefix(self, bs: int) -> tuple:
        """The staging buffer's prefix that a bucket of ``bs`` rows reads: (host, device)."""
        end = self._table_off + bs * self.num_groups * self.max_pages * 4
        return self._h_buf[:end], self._d_buf[:end]

    def _reset_padding(self, start: int) -> None:
        """Device rows ``start ..`` to the padding (before a capture, whose warm-up runs on them)."""
        for name, t in (("pos", self.pos), ("ids", self.ids), ("lens", self.seq_lens), ("table", self.tables)):
            t[start:].fill_(self.pad[name])
        self.src[start:].copy_(torch.from_numpy(self._iota[start:]))
        self.group_slots[:, start:].fill_(self.pad["slots"])

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
        if inp.feed and self.runner.fed is not self.fed:
            raise RuntimeError("fed ids are read from the graphs' own buffer: the runner's fed must be graphs.fed")
        if self._copied is not None:
            self._copied.synchronize()
        self.stage(inp)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        if not self.copy_in_graph[bs]:
            h, d = self._prefix(bs)
            d.copy_(h, non_blocking=True)
            self._copied.record()  # the staging buffer is free once this copy ran (not the whole step)
        self.graphs[bs].replay()
        if self.copy_in_graph[bs]:
            self._copied.record()  # one event, recorded again each step: synchronize() waits for the latest record
        return self.outputs[bs][:n]

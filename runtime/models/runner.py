"""Model runner: turns a scheduled batch into flat tensors + AttentionMetadata, runs the model, and
returns the final hidden states (or logits) of the rows that produce a next token.  Decode steps go
through CUDA graphs when a ``DecodeGraphs`` is attached (``runtime/graphs.py``).

Sampled rows: a sequence's last row when the step caches all its known tokens; for a teacher-forced
scoring sequence (``Sequence.score_from``) every row from position ``score_from - 1`` on (the last context
row predicts the first continuation token, each continuation row the next one), and its continuation
chunks are flagged round-trip (``AttentionMetadata.roundtrip_*``: decode semantics in one extend).

A mixed step (``ScheduledBatch.decode_rows``, ``EngineConfig.mixed_prefill``) is one prefill step whose first
sequences are decode rows: ``AttentionMetadata.decode_rows`` says how many (backends that split the step run
them through their decode path, ``attention/base.py``), and they are flagged round-trip too, for the backends
that run the step whole.  The linear layers run once over every row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvbench.runtime.attention.base import AttentionBackend, AttentionMetadata, RopeCache, to_device
from kvbench.runtime.kv_cache import PagedKVCache
from kvbench.runtime.models.llama import LlamaForCausalLM
from kvbench.runtime.scheduler import ScheduledBatch

__all__ = ["ModelRunner", "StepInputs", "StepRows"]


class StepInputs:
    """Host-built inputs of one step (lists first, one transfer to the device).  The padded page table is
    built on first use of ``table``: the CUDA-graph path writes each sequence's pages into its own staging
    buffer and never needs the list of lists."""

    def __init__(self, batch: ScheduledBatch, page_size: int, scratch_page: int, max_pages: Optional[int] = None,
                 _general: bool = False):
        """``_general``: build a decode step the general way too (tests compare the two)."""
        self.seqs = batch.seqs
        self.q_lens = batch.q_lens
        self._scratch = scratch_page
        self._table: Optional[list[list[int]]] = None
        self.roundtrip: list[bool] = []
        self.decode_rows = batch.decode_rows if batch.phase == "prefill" else 0  # a mixed step's leading decode rows
        self.group_slots: list[list[int]] = []  # layer groups 1..G-1: each one's slot of every row
        # (row, j): the row's input id is the token the previous step sampled in its row j, still on the device
        # (a placeholder ``-(j + 1)`` in ``output_ids``; ``runtime/step_outputs.py``); its staged id is 0
        self.feed: list[tuple[int, int]] = []
        if _general or batch.phase != "decode" or not self._decode(batch.seqs, page_size):
            self._general(batch, page_size)
            self.max_pages_used = max(len(s.pages) for s in batch.seqs)
        self._width = max(max_pages or 0, self.max_pages_used)

    def _decode(self, seqs, page_size: int) -> bool:
        """A decode step's inputs (one new token per sequence) in one pass with bound appends: this runs on
        the host before every graphed step while the device waits.  False (nothing set) when a sequence is
        scored (``score_from``), which the general path handles."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        done: list[int] = []
        add_id, add_pos, add_slot, add_len = ids.append, pos.append, slots.append, lens.append
        groups = len(seqs[0].group_pages) if seqs else 0  # layer groups 1..G-1: their slots as well
        group_slots: list[list[int]] = [[] for _ in range(groups)]
        widest = 0
        for i, s in enumerate(seqs):
            if s.score_from is not None or len(s.group_pages) != groups:
                return False
            t = s.num_cached
            prompt = s.prompt_ids
            n = len(prompt)
            add_id(prompt[t] if t < n else s.output_ids[t - n])
            add_pos(t)
            pages = s.pages
            if len(pages) > widest:
                widest = len(pages)
            lp, off = divmod(t, page_size)
            add_slot(pages[lp] * page_size + off)
            if groups:
                for gs, gp in zip(group_slots, s.group_pages):
                    gs.append(gp[lp] * page_size + off)
            add_len(t + 1)
            if t + 1 == n + len(s.output_ids):
                done.append(i)
        if min(ids, default=0) < 0:
            self._fed([i for i, t in enumerate(ids) if t < 0], ids)
        self.ids, self.pos, self.slots, self.seq_lens = ids, pos, slots, lens
        self.group_slots = group_slots
        self.cu = list(range(len(seqs) + 1))
        self.sample_rows, self.sample_idx = done, list(done)
        self.sample_pos = [pos[i] for i in done]
        self.max_pages_used = widest
        return True

    def _general(self, batch: ScheduledBatch, page_size: int) -> None:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        cu = [0]
        sample_rows: list[int] = []
        sample_idx: list[int] = []  # index into batch.seqs of each sampled row
        sample_pos: list[int] = []  # position (token index) of each sampled row in its sequence
        roundtrip: list[bool] = []  # per sequence: its new tokens read their own K/V as stored
        for i, (seq, q) in enumerate(zip(batch.seqs, batch.q_lens)):
            start = seq.num_cached
            ids.extend(seq.tokens(start, start + q))
            pages = seq.pages
            if q == 1:
                pos.append(start)
                slots.append(pages[start // page_size] * page_size + start % page_size)
            else:
                for p in range(start, start + q):
                    pos.append(p)
                    slots.append(pages[p // page_size] * page_size + p % page_size)
            seq_lens.append(start + q)
            cu.append(cu[-1] + q)
            sf = seq.score_from
            if sf is not None:
                if start < sf < start + q:
                    raise ValueError(f"{seq.request_id}: a chunk of tokens {start}..{start + q - 1} straddles the scoring boundary {sf}")
                roundtrip.append(start >= sf or i < batch.decode_rows)
                for p in range(max(start, sf - 1), start + q):
                    sample_rows.append(cu[-2] + p - start)
                    sample_idx.append(i)
                    sample_pos.append(p)
            else:
                roundtrip.append(i < batch.decode_rows)  # decode rows: flagged for backends that run the step whole
                if start + q == seq.num_tokens:
                    sample_rows.append(cu[-1] - 1)
                    sample_idx.append(i)
                    sample_pos.append(start + q - 1)
        # a placeholder is a sequence's last token (module doc of step_outputs.py): the last row of its chunk
        fed = [r - 1 for r in cu[1:] if ids[r - 1] < 0]
        if fed:
            self._fed(fed, ids)
        self.ids, self.pos, self.slots, self.seq_lens, self.cu = ids, pos, slots, seq_lens, cu
        self.sample_rows, self.sample_idx, self.sample_pos = sample_rows, sample_idx, sample_pos
        if batch.seqs[0].group_pages:  # layer groups: the same positions in each group's pages
            rows = [i for i, q in enumerate(batch.q_lens) for _ in range(q)]
            self.group_slots = [[batch.seqs[i].group_pages[k][p // page_size] * page_size + p % page_size
                                 for i, p in zip(rows, pos)] for k in range(len(batch.seqs[0].group_pages))]
        self.roundtrip = roundtrip if batch.phase == "prefill" and any(roundtrip) else []

    def _fed(self, rows: list[int], ids: list[int]) -> None:
        """Rows whose id is a placeholder: fed from the device, staged as 0."""
        self.feed = [(r, -ids[r] - 1) for r in rows]
        for r in rows:
            ids[r] = 0

    @property
    def table(self) -> list[list[int]]:
        """Each sequence's pages, padded with the scratch page to the batch's widest row."""
        if self._table is None:
            w, pad = self._width, self._scratch
            self._table = [s.pages + [pad] * (w - len(s.pages)) for s in self.seqs]
        return self._table

    def group_table(self, k: int) -> list[list[int]]:
        """Layer group ``k + 1``'s pages of each sequence, padded as ``table``."""
        w, pad = self._width, self._scratch
        return [s.group_pages[k] + [pad] * (w - len(s.group_pages[k])) for s in self.seqs]

    @property
    def all_rows_sampled(self) -> bool:
        """Every row of the step is sampled (sampled rows are strictly increasing, so then they are
        0 .. N-1 in order and the hidden states need no gather)."""
        return len(self.sample_rows) == self.cu[-1]


@dataclass
class StepRows:
    """What one step produced: the final hidden states ``[N, hidden]`` of its sampled rows, the index in
    ``batch.seqs`` and the position of each row."""

    hidden: torch.Tensor
    seq_idx: list[int]
    positions: list[int]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: PagedKVCache,
        backend: AttentionBackend,
        rope: RopeCache,
        device: torch.device,
    ):
        self.model = model
        self.cache = cache
        self.backend = backend
        self.rope = rope
        self.device = device
        self.graphs = None  # DecodeGraphs, attached by the engine on GPU
        # the tokens a step sampled on the device, read by the next step's fed rows (``StepInputs.feed``); set by
        # the engine (the graphs' ``fed`` when it has graphs); None: steps are not launched ahead
        self.fed: Optional[torch.Tensor] = None

    def metadata(self, phase: str, inp: StepInputs) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's ids and metadata on the device; every copy is non-blocking (``to_device``), so building a
        step never waits for the one in flight."""
        dev, i64, i32 = self.device, torch.int64, torch.int32
        meta = AttentionMetadata(
            phase=phase,
            positions=to_device(inp.pos, i64, dev),
            slot_mapping=to_device(inp.slots, i64, dev),
            page_table=to_device(inp.table, i32, dev),
            seq_lens=to_device(inp.seq_lens, i32, dev),
            cu_seqlens_q=to_device(inp.cu, i32, dev),
            max_seqlen_q=max(inp.q_lens),
            max_seqlen_k=max(inp.seq_lens),
            page_size=self.cache.page_size,
            rope=self.rope,
            seq_lens_cpu=list(inp.seq_lens),
            q_lens_cpu=list(inp.q_lens),
        )
        if inp.group_slots:
            meta.group_page_tables = [meta.page_table] + [to_device(inp.group_table(k), i32, dev) for k in range(len(inp.group_slots))]
            meta.group_slot_mappings = [meta.slot_mapping] + [to_device(s, i64, dev) for s in inp.group_slots]
        meta.decode_rows = inp.decode_rows
        if inp.roundtrip:
            meta.roundtrip_seqs_cpu = list(inp.roundtrip)
            flags = [f for f, q in zip(inp.roundtrip, inp.q_lens) for _ in range(q)]
            meta.roundtrip_rows = to_device(flags, torch.bool, dev)
        return to_device(inp.ids, i64, dev), meta

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[Optional[torch.Tensor], list[int]]:
        """Logits ``[N, vocab]`` float32 of the sampled rows (None if none) and their sequence indices."""
        rows = self.run_rows(batch)
        if rows is None:
            return None, []
        return self.model.logits(rows.hidden), rows.seq_idx

    @torch.inference_mode()
    def run_rows(self, batch: ScheduledBatch) -> Optional[StepRows]:
        """Run one step; the sampled rows' hidden states (None if the step samples nothing).  The caller
        turns them into logits (``model.logits``) in slices, so a long scored chunk never holds
        ``[N, vocab]`` at once."""
        inp = StepInputs(batch, self.cache.page_size, self.cache.scratch_page)
        hidden = None
        if batch.phase == "decode" and self.graphs is not None and self.graphs.can_run(inp):
            from kvbench.runtime.graphs import GraphUnavailable

            try:
                hidden = self.graphs.run(inp)
            except GraphUnavailable:
                self.graphs = None
        if hidden is None:
            ids, meta = self.metadata(batch.phase, inp)
            if inp.feed:
                rows, src = zip(*inp.feed)
                ids[to_device(rows, torch.int64, ids.device)] = self.fed[to_device(src, torch.int64, ids.device)]
            self.backend.plan(meta, self.cache)
            hidden = self.model(ids, self.backend, self.cache, meta)
        if not inp.sample_rows:
            return None
        if inp.all_rows_sampled:  # every decode step: no index tensor (whose host-to-device copy would wait for the step)
            return StepRows(hidden, inp.sample_idx, inp.sample_pos)
        rows = to_device(inp.sample_rows, torch.int64, hidden.device)
        return StepRows(hidden[rows], inp.sample_idx, inp.sample_pos)

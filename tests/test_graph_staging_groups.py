"""The CUDA-graph decode path with layer groups (Gemma 3: sliding and global layers over one page pool), on the
CPU: a real engine on a tiny Gemma 3 decodes through ``DecodeGraphs`` with the graph replay replaced by its
forward on the staged views (``HostGraphs``: stage, copy the bucket's prefix into a device buffer whose rest is
garbage, run the model on ``_meta(bs)``, where a graph-safe backend's forward must do nothing a capture refuses).  Every decode step's staged host inputs — every group's page table and
slot mapping, the padding rows — must equal what the eager runner builds for the same step
(``ModelRunner.metadata``), through steps where sliding pages fall below the window (the scheduler rewrites those
entries in place to the scratch page), batches that shrink and grow, and mixed prefill steps that advance a
sequence outside the graphs; and the generated tokens and decode-mode scores must equal an eager engine's."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import engine, prompts, save_tiny  # noqa: E402

from kvbench.core import SamplingParams  # noqa: E402
from kvbench.runtime.graphs import DecodeGraphs  # noqa: E402
from kvbench.runtime.models.runner import StepInputs  # noqa: E402
from kvbench.runtime.scheduler import ScheduledBatch  # noqa: E402

# one global and three sliding layers: four layer groups of one layer (window 6 over pages of 4 tokens)
SHAPE = dict(head_dim=64, num_attention_heads=2, num_key_value_heads=1, sliding_window=6, query_pre_attn_scalar=64,
             num_hidden_layers=4, layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
LENGTHS = (23, 9, 17, 12)
MAX_TOKENS = (18, 5, 11, 7)


class HostWork(TorchDispatchMode):
    """The aten calls of a forward that a CUDA-graph capture refuses: ``torch.tensor(data)`` (``lift_fresh``)
    and ``.item()`` (``_local_scalar_dense``)."""

    BAD = ("aten.lift_fresh", "aten._local_scalar_dense")

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.BAD):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class HostGraphs(DecodeGraphs):
    """``DecodeGraphs`` whose replay is its captured forward run directly (no CUDA): the real staging, the real
    prefix copy and the real views, checked against the eager inputs of every step."""

    def __init__(self, runner, max_batch: int, max_model_len: int):
        super().__init__(runner, max_batch, max_model_len)
        self.sizes: list[int] = []
        self.dead_rewrites = 0  # (row, group) entries rewritten because the scheduler scratched them in place
        self.full_rewrites = 0
        self.steps = 0

    def run(self, inp: StepInputs) -> torch.Tensor:
        n = len(inp.seq_lens)
        bs = self._bucket(n)
        before = [list(rows) for rows in self._rows]  # per group and row: (list, pages written, dead entries)
        self.stage(inp)
        self._count(inp, before)
        check_staged(self, inp)
        # what a bucket does not copy must not be read: 0x55555555 is no page id (but ``fed``, after the tables, holds
        # the tokens the last step sampled there, for the rows of steps launched ahead)
        self._d_buf[: self._off["fed"][0]].fill_(0x55)
        h, d = self._prefix(bs)
        d.copy_(h)
        meta = self._meta(bs)
        check_views(self, meta, inp)
        self.sizes.append(n)
        self.steps += 1
        if not getattr(self.runner.backend, "graph_safe", False):  # the engine would not capture this backend
            return self._forward(bs, meta)[:n]
        with HostWork() as seen:
            out = self._forward(bs, meta)
        # what a CUDA graph cannot capture: a tensor made from host data (a host-to-device copy) or a read
        # of a device value on the host (a sync), anywhere in the model's forward
        assert not seen.ops, f"host work inside the forward a graph captures: {seen.ops}"
        return out[:n]

    def _count(self, inp: StepInputs, before: list) -> None:
        for i, seq in enumerate(inp.seqs):
            lists = (seq.pages, *seq.group_pages)
            deads = (seq.num_dead_pages, *seq.group_dead)
            for g, (pages, dead) in enumerate(zip(lists, deads)):
                old, _done, old_dead = before[g][i]
                if old is pages and old_dead < dead:
                    self.dead_rewrites += 1
                elif old is not pages:
                    self.full_rewrites += 1


def check_staged(g: DecodeGraphs, inp: StepInputs) -> None:
    """The host staging of one step against the eager runner's metadata of the same step."""
    ids, meta = g.runner.metadata("decode", inp)
    n, scratch, h = len(inp.seq_lens), g.pad["table"], g._np
    tables = meta.group_page_tables or [meta.page_table]
    slots = meta.group_slot_mappings or [meta.slot_mapping]
    assert len(tables) == len(slots) == g.num_groups
    w = tables[0].shape[1]
    for k in range(g.num_groups):
        np.testing.assert_array_equal(h["table"][:n, k, :w], tables[k].numpy(), err_msg=f"group {k} table")
        assert (h["table"][:n, k, w:] == scratch).all(), f"group {k}: columns past the widest row"
        np.testing.assert_array_equal(h["slots"][k, :n], slots[k].numpy(), err_msg=f"group {k} slots")
        assert (h["slots"][k, n:] == -1).all()
    assert (h["table"][n:] == scratch).all()
    assert h["ids"][:n].tolist() == ids.tolist() and h["pos"][:n].tolist() == meta.positions.tolist()
    assert h["lens"][:n].tolist() == meta.seq_lens.tolist()
    assert (h["ids"][n:] == 0).all() and (h["pos"][n:] == 0).all() and (h["lens"][n:] == 1).all()
    # the decode fast path of StepInputs builds the groups' slots as the general construction does
    general = StepInputs(ScheduledBatch("decode", inp.seqs, inp.q_lens), g.page_size, scratch, _general=True)
    for key in ("ids", "pos", "slots", "seq_lens", "group_slots", "max_pages_used", "sample_rows"):
        assert getattr(inp, key) == getattr(general, key), key


def check_views(g: DecodeGraphs, meta, inp: StepInputs) -> None:
    """The device views a bucket's graph reads (after the prefix copy) hold the step's inputs."""
    n = len(inp.seq_lens)
    assert len(meta.group_page_tables) == len(meta.group_slot_mappings) == g.num_groups
    assert meta.group_page_tables[0] is meta.page_table and meta.group_slot_mappings[0] is meta.slot_mapping
    ref_tables = [inp.table] + [inp.group_table(k) for k in range(g.num_groups - 1)]
    ref_slots = [inp.slots] + inp.group_slots
    for k in range(g.num_groups):
        t = meta.group_page_tables[k]
        assert t.shape == (g._bucket(n), g.max_pages) and t.stride() == (g.num_groups * g.max_pages, 1)
        w = len(ref_tables[k][0])
        assert t[:n, :w].tolist() == ref_tables[k], k
        assert (t[n:] == g.pad["table"]).all() and (t[:, w:] == g.pad["table"]).all()
        assert meta.group_slot_mappings[k][:n].tolist() == ref_slots[k]
        assert (meta.group_slot_mappings[k][n:] == -1).all()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3_groups")

    def distinct(hf):  # smaller tied embeddings, a larger final norm: no near-ties in greedy choices
        hf.model.embed_tokens.weight.mul_(0.5)
        hf.model.norm.weight.add_(4.0)

    save_tiny(d, "gemma3", SHAPE, post=distinct)
    return str(d)


def _engine(path: str, backend: str, graphs: bool, **kw):
    e = engine(path, backend, max_num_batched_tokens=8, max_running=3, **kw)
    if graphs:
        e.runner.graphs = HostGraphs(e.runner, max_batch=e.config.max_running, max_model_len=e.max_model_len)
        e.runner.fed = e.runner.graphs.fed  # as engine_setup wires them: the sampler writes where the graphs read
    e.decode_steps = 0
    schedule = e.scheduler.schedule

    def count():
        batch = schedule()
        e.decode_steps += batch is not None and batch.phase == "decode"
        return batch

    e.scheduler.schedule = count
    return e


def _run(e):
    """Greedy tokens of four requests, the first one alone for a few steps before the others arrive (the
    batch grows, then shrinks as they end and grows as the last is admitted), and a score through decode steps."""
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=1) for m in MAX_TOKENS]
    ps = prompts(256, LENGTHS)
    seqs = [e._seqs[e.add_request(ps[0], params[0])]]
    while len(seqs[0].output_ids) < 3:
        e.step()
    seqs += [e._seqs[e.add_request(p, q)] for p, q in zip(ps[1:], params[1:])]
    while e.step():
        pass
    assert all(s.finish_reason == "length" for s in seqs)
    ctx = prompts(256, (21,), seed=3)[0]
    score = e.score(ctx[:13], ctx[13:], full_distribution=True, mode="decode")
    return [list(s.output_ids) for s in seqs], score


@pytest.mark.parametrize("backend,mixed", [("torch", False), ("torch", True), ("triton", False)])
def test_graph_staging_with_layer_groups_equals_eager_every_step(gemma3, backend, mixed):
    eager = _engine(gemma3, backend, False, mixed_prefill=mixed)
    try:
        want = _run(eager)
    finally:
        eager.shutdown()
    e = _engine(gemma3, backend, True, mixed_prefill=mixed)
    try:
        groups = e.cache.spec.groups
        assert groups is not None and groups.windows == (None, 6, 6, 6)
        g = e.runner.graphs
        assert isinstance(g, HostGraphs) and g.num_groups == 4
        got = _run(e)
        assert e.runner.graphs is g and g.steps == e.decode_steps >= 15  # every decode step ran on the staged views
    finally:
        e.shutdown()
    assert got[0] == want[0] and [len(t) for t in got[0]] == list(MAX_TOKENS)
    # triton: the graphs' decode sees max_seqlen_k = max_model_len, so its split-K count (and the order of its
    # float32 sums) differs from the eager step's; a wrong page or position moves log-probs by far more
    tol = 1e-4 if backend == "torch" else 1e-3
    diff = float((got[1].full_logprobs - want[1].full_logprobs).abs().max())
    assert diff < tol, diff
    # the run exercised what could go wrong: sliding entries scratched in place under a held list, rows
    # rewritten whole (another sequence, a new list), batches that shrink and grow
    assert g.dead_rewrites >= 5 and g.full_rewrites >= 5, (g.dead_rewrites, g.full_rewrites)
    shrink = any(b < a for a, b in zip(g.sizes, g.sizes[1:]))
    grow = any(b > a for a, b in zip(g.sizes, g.sizes[1:]))
    assert shrink and grow, g.sizes


def test_staged_sliding_entries_follow_in_place_scratching(gemma3):
    """A row that keeps its page lists while the scheduler scratches a sliding list's entries in place (the
    list object unchanged, its dead count grown) has those entries rewritten: the staged table never keeps a
    page the allocator got back (another sequence may own it by the next step)."""
    e = engine(gemma3, "torch", max_num_batched_tokens=8)
    try:
        g = DecodeGraphs(e.runner, max_batch=4, max_model_len=e.max_model_len)
        seen = []
        schedule = e.scheduler.schedule

        def watch():
            batch = schedule()
            if batch is not None and batch.phase == "decode":
                inp = StepInputs(batch, e.cache.page_size, e.cache.scratch_page)
                g.stage(inp)
                check_staged(g, inp)
                seen.append((id(batch.seqs[0].group_pages[0]), batch.seqs[0].group_dead[0]))
            return batch

        e.scheduler.schedule = watch
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        seq = e._seqs[e.add_request(prompts(256, (10,))[0], params)]
        while e.step():  # on this thread: a failed check fails the test
            pass
        assert seq.finish_reason == "length" and len(seq.output_ids) == 12
    finally:
        e.shutdown()
    lists = {step[0] for step in seen}
    deads = [step[1] for step in seen]
    assert len(lists) == 1 and deads[0] < deads[-1], (lists, deads)  # one list object, scratched in place
    scratch = e.cache.scratch_page
    assert (g._np["table"][0, 1, : deads[-1]] == scratch).all()

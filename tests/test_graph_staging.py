"""The CUDA-graph decode path's host staging (``DecodeGraphs.stage``): rows rewritten only where a
sequence's pages changed must still equal the full padded page table of every step, whatever the batch's
order, growth, preemption (a new page list), windowed entries scratched in place or shrinking batch; the layer
groups' staging layout; and ``StepInputs`` built without the whole token list gives the same inputs as the
straightforward construction."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from kvbench.core.client import SamplingParams
from kvbench.runtime.graphs import DecodeGraphs
from kvbench.runtime.models.runner import StepInputs
from kvbench.runtime.scheduler import ScheduledBatch, Sequence

PAGE, SCRATCH, MAX_LEN, B = 4, 999, 64, 8


def _graphs() -> DecodeGraphs:
    cache = SimpleNamespace(page_size=PAGE, scratch_page=SCRATCH)
    return DecodeGraphs(SimpleNamespace(cache=cache, device="cpu"), max_batch=B, max_model_len=MAX_LEN)


def _seq(rid: str, n_prompt: int, n_out: int, rng: random.Random, next_page: list) -> Sequence:
    s = Sequence(rid, [rng.randrange(1000) for _ in range(n_prompt)], SamplingParams(max_tokens=MAX_LEN))
    s.output_ids = [rng.randrange(1000) for _ in range(n_out)]
    s.num_cached = s.num_tokens - 1
    s.pages = []
    _grow(s, next_page)
    s.status = "running"
    return s


def _grow(s: Sequence, next_page: list) -> None:
    need = -(-s.num_tokens // PAGE) - len(s.pages)
    s.pages.extend(range(next_page[0], next_page[0] + need))
    next_page[0] += need


def _reference(batch: ScheduledBatch) -> dict:
    """The inputs built the plain way: whole token lists, one slot per token, padded table rows."""
    ids, pos, slots, lens, table = [], [], [], [], []
    for s in batch.seqs:
        p = s.num_cached
        ids.append(s.token_ids[p])
        pos.append(p)
        slots.append(s.pages[p // PAGE] * PAGE + p % PAGE)
        lens.append(p + 1)
        table.append(s.pages + [SCRATCH] * (MAX_LEN // PAGE - len(s.pages)))
    return {"ids": ids, "pos": pos, "slots": slots, "lens": lens, "table": table}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_staged_rows_equal_the_full_table_every_step(seed):
    rng = random.Random(seed)
    g = _graphs()
    next_page = [0]
    pool = [_seq(f"s{i}", rng.randrange(1, 12), rng.randrange(0, 6), rng, next_page) for i in range(12)]
    rewrites = partial = scratched = 0
    for step in range(200):
        n = rng.randrange(1, B + 1)
        if rng.random() < 0.7:  # usually the same running set in the same order, as in steady decode
            batch_seqs = pool[:n]
        else:
            batch_seqs = rng.sample(pool, n)
        batch = ScheduledBatch("decode", batch_seqs, [1] * n)
        inp = StepInputs(batch, PAGE, SCRATCH)
        before = list(g._rows[0])  # per row: (page list, pages written, dead entries) of its last step
        g.stage(inp)
        ref = _reference(batch)
        assert g._np["ids"][:n].tolist() == ref["ids"] == inp.ids
        assert g._np["pos"][:n].tolist() == ref["pos"] == inp.pos
        assert g._np["slots"][0, :n].tolist() == ref["slots"] == inp.slots
        assert g._np["lens"][:n].tolist() == ref["lens"] == inp.seq_lens
        np.testing.assert_array_equal(g._np["table"][:n, 0], np.array(ref["table"], dtype=np.int32))
        # rows past the batch hold the padding, since a step copies its bucket's rows whole
        assert (g._np["ids"][n:] == 0).all() and (g._np["pos"][n:] == 0).all()
        assert (g._np["slots"][:, n:] == -1).all() and (g._np["lens"][n:] == 1).all()
        assert (g._np["table"][n:] == SCRATCH).all()
        _same_inputs(inp, StepInputs(batch, PAGE, SCRATCH, _general=True))
        for i, s in enumerate(batch_seqs):
            if before[i][0] is s.pages and before[i][1] < len(s.pages):
                partial += 1
            elif before[i][0] is not s.pages:
                rewrites += 1
            if before[i][0] is s.pages and before[i][2] < s.num_dead_pages:
                scratched += 1
        for s in batch_seqs:  # the step's token: appended, cached, and sometimes a preemption
            s.output_ids.append(rng.randrange(1000))
            s.num_cached += 1
            if rng.random() < 0.05:
                s.pages, s.num_dead_pages = [], 0  # preempted and re-admitted: a new page list, other pages
                next_page[0] += 3
            elif rng.random() < 0.15 and s.num_dead_pages < len(s.pages) - 1:
                # a windowed sequence: its oldest live page back to the allocator, its entry the scratch page
                # in place (the same list object, as the scheduler does)
                s.pages[s.num_dead_pages] = SCRATCH
                s.num_dead_pages += 1
            _grow(s, next_page)
        for k, s in enumerate(pool):  # a finished sequence's place goes to a new, shorter one
            if s.num_tokens >= MAX_LEN - 1:
                pool[k] = _seq(f"s{step}.{k}", rng.randrange(1, 12), 0, rng, next_page)
    # the incremental rewrite (new pages, entries scratched in place) and the full one were all exercised
    assert partial > 20 and rewrites > 20 and scratched > 20, (partial, rewrites, scratched)


def _same_inputs(a: StepInputs, b: StepInputs) -> None:
    for k in ("ids", "pos", "slots", "seq_lens", "cu", "q_lens", "sample_rows", "sample_idx", "sample_pos", "roundtrip",
              "max_pages_used", "table", "group_slots"):
        assert getattr(a, k) == getattr(b, k), k


def test_staging_views_share_one_buffer():
    """Every device input is a view of the one buffer a step copies, and a bucket's prefix ends at its last
    table row."""
    g = _graphs()
    base = g._d_buf.data_ptr()
    for t in (g.ids, g.pos, g.slots, g.seq_lens, g.src, g.table, g.fed):
        assert base <= t.data_ptr() < base + g._nbytes
    table_end = g.table.data_ptr() + g.table.numel() * 4
    assert table_end == base + g._table_off + B * g.max_pages * 4 == base + g._prefix(B)[1].numel()
    # the fed ids lie after every bucket's prefix (no staging copy overwrites them), the staged src inside it
    assert g.fed.data_ptr() >= table_end and g.fed.data_ptr() + B * 8 == base + g._nbytes
    assert g.src.data_ptr() + B * 8 <= base + g._table_off
    assert g._flat[g._fed_at:].data_ptr() == g.fed.data_ptr() and g._flat[:B].data_ptr() == g.ids.data_ptr()
    g._np["slots"][0, 3] = 77
    g._np["table"][2, 0, 1] = 5
    g._d_buf.copy_(g._h_buf)
    assert g.slots[3].item() == 77 and g.table[2, 1].item() == 5 and g.seq_lens.tolist() == [1] * B


def test_layer_group_views_end_in_the_bucket_prefix():
    """Layer groups: slots ``[G, B]`` before the tables ``[B, G, P]``, so every group's slots and table rows of a
    bucket lie in the prefix its step copies, and each group's table is a row view with row stride ``G * P``."""
    G = 3
    cache = SimpleNamespace(page_size=PAGE, scratch_page=SCRATCH, spec=SimpleNamespace(groups=SimpleNamespace(num_groups=G)))
    g = DecodeGraphs(SimpleNamespace(cache=cache, device="cpu"), max_batch=B, max_model_len=MAX_LEN)
    P, base = g.max_pages, g._d_buf.data_ptr()
    table_bytes = B * G * P * 4
    assert g.num_groups == G and g._nbytes == g._table_off + table_bytes + table_bytes % 8 + B * 8  # then fed ids
    for bs in g.buckets:
        h, d = g._prefix(bs)
        end = base + d.numel()
        for k in range(G):
            t, s = g.tables[:bs, k], g.group_slots[k, :bs]
            assert t.shape == (bs, P) and t.stride() == (G * P, 1) and s.is_contiguous()
            assert base <= s.data_ptr() and s.data_ptr() + bs * 8 <= g._table_off + base
            assert t[-1, -1].data_ptr() + 4 <= end  # the bucket's last row of every group is copied
        assert end == base + g._table_off + bs * G * P * 4
    g._np["table"][1, 2, 3] = 7
    g._np["slots"][2, 1] = 55
    g._d_buf.copy_(g._h_buf)
    assert g.tables[:, 2][1, 3].item() == 7 and g.group_slots[2, 1].item() == 55 and g.table[1, 3].item() == SCRATCH


def test_decode_inputs_match_the_general_path():
    """The decode fast path of ``StepInputs`` against the general construction, including sequences whose
    step does not reach their last token (nothing sampled) and scored sequences (which take the general path)."""
    rng, next_page = random.Random(7), [0]
    seqs = [_seq(f"s{i}", rng.randrange(1, 12), rng.randrange(0, 6), rng, next_page) for i in range(6)]
    seqs[2].num_cached -= 2  # a step that does not reach the end: no sampled row
    batch = ScheduledBatch("decode", seqs, [1] * 6)
    fast, slow = StepInputs(batch, PAGE, SCRATCH), StepInputs(batch, PAGE, SCRATCH, _general=True)
    _same_inputs(fast, slow)
    assert fast.sample_idx == [0, 1, 3, 4, 5] and not fast.all_rows_sampled
    seqs[4].score_from = 3
    _same_inputs(StepInputs(batch, PAGE, SCRATCH), StepInputs(batch, PAGE, SCRATCH, _general=True))


def test_tokens_slices_like_the_whole_list():
    s = Sequence("x", list(range(10)), SamplingParams())
    s.output_ids = list(range(100, 105))
    for a in range(16):
        for b in range(a, 16):
            assert s.tokens(a, b) == s.token_ids[a:b]


def test_step_inputs_table_and_identity_rows():
    rng, next_page = random.Random(5), [0]
    seqs = [_seq(f"s{i}", 3 + i, 2, rng, next_page) for i in range(3)]
    inp = StepInputs(ScheduledBatch("decode", seqs, [1, 1, 1]), PAGE, SCRATCH)
    assert inp.all_rows_sampled and inp.sample_rows == [0, 1, 2]
    w = max(len(s.pages) for s in seqs)
    assert inp.max_pages_used == w
    assert inp.table == [s.pages + [SCRATCH] * (w - len(s.pages)) for s in seqs]
    # a prefill chunk that does not reach its sequence's end samples nothing: not every row
    p = Sequence("p", list(range(9)), SamplingParams())
    p.pages = [50, 51, 52]
    p.status = "running"
    inp = StepInputs(ScheduledBatch("prefill", [p, seqs[0]], [4, 1]), PAGE, SCRATCH)
    assert inp.sample_rows == [4] and not inp.all_rows_sampled
    assert inp.ids[:4] == [0, 1, 2, 3] and inp.slots[:4] == [200, 201, 202, 203]

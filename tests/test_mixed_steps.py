"""Mixed steps (``AttentionMetadata.decode_rows``, runtime/attention/base.py): a prefill step whose first
sequences are decode rows.  The torch, triton and hybrid backends run those rows through their decode path
and the others through their prefill path, after one append of every row's K/V.

Backend level: many decode rows of different lengths on scattered pages next to a chunked prefill over a
cached prefix, a fresh prompt and a round-trip (scored continuation) chunk, every page poisoned with NaN
before the valid tokens are written, against the float64 reference of tests/test_runtime_attention_chunked.py
(decode rows read their own K/V as stored).  A decode row that reads another sequence's pages, a wrong
length or position, or its own K/V before the append, moves its output or makes it NaN.  Spies show which
kernels ran: the Triton decode kernel over exactly the decode rows, the prefill kernel over the rest.

Engine level (a small synthetic Llama, CPU, float32): mixed engines give the tokens and log-probs of separate
steps for bf16, fp8_e4m3 and nvfp4 caches on the torch, triton and hybrid backends, with several decode rows of
different lengths beside a chunked prefill and a scored continuation in the same steps."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_runtime_attention_chunked import _build, _reference  # noqa: E402

from kvbench.core.client import SamplingParams  # noqa: E402
from kvbench.runtime.attention.base import BackendOptions  # noqa: E402
from kvbench.runtime.attention.hybrid import HybridBackend  # noqa: E402
from kvbench.runtime.attention.mixed import mixed_parts  # noqa: E402
from kvbench.runtime.attention.torch_backend import TorchBackend  # noqa: E402
from kvbench.runtime.attention.triton_backend import TritonBackend  # noqa: E402

# five decode rows (prefix, 1) of different lengths, then a chunk over a cached prefix, a fresh prompt and a
# scored continuation chunk (round-trip)
SEQS = [(6, 1), (17, 1), (1, 1), (30, 1), (9, 1), (13, 11), (0, 7), (10, 5)]
DEC = 5
RT = [True] * DEC + [False, False, True]
FORMATS = ["bf16", "fp8_e4m3", "nvfp4"]


def _mixed(kv, flagged: bool, window=None, sinks=False):
    """A mixed step; ``flagged``: the decode rows are also flagged round-trip (as the runner does) or only
    counted in ``decode_rows`` (a splitting backend must not need the flags).  Returns the step and the
    reference metadata (decode rows flagged: their semantics)."""
    cache, ref_meta, q, k, v, layer, prefixes = _build(kv, SEQS, 4, 2, 32, window, sinks, seed=7, roundtrip=RT)
    cache2, meta, *_ = _build(kv, SEQS, 4, 2, 32, window, sinks, seed=7, roundtrip=RT if flagged else [False] * DEC + RT[DEC:])
    meta.decode_rows = DEC
    return cache, cache2, ref_meta, meta, q, k, v, layer, prefixes


class _Spy:
    """Wraps ``kvbench.kernels.paged_decode`` / ``paged_prefill`` and records the rows each call got."""

    def __init__(self, monkeypatch):
        import kvbench.kernels as K

        self.calls = []
        dec, pre = K.paged_decode, K.paged_prefill

        def paged_decode(q, *a, **kw):
            self.calls.append(("decode", q.shape[0]))
            return dec(q, *a, **kw)

        def paged_prefill(q, k, v, cu, *a, **kw):
            self.calls.append(("prefill", q.shape[0], cu.tolist()))
            return pre(q, k, v, cu, *a, **kw)

        monkeypatch.setattr(K, "paged_decode", paged_decode)
        monkeypatch.setattr(K, "paged_prefill", paged_prefill)


def _backend(name: str, kv: str):
    opts = BackendOptions(kv_dtype=kv, fused_append=kv != "bf16")  # bf16: the interpreter's cast truncates
    make = {"torch": TorchBackend, "triton": TritonBackend}
    if "+" in name:
        pre, dec = name.split("+")
        return HybridBackend(make[pre](opts), make[dec](opts))
    return make[name](opts)


def test_mixed_parts_are_the_decode_and_prefill_steps():
    _c, _c2, _r, meta, *_ = _mixed("bf16", flagged=True)
    parts = mixed_parts(meta)
    d, p = parts.decode, parts.prefill
    assert parts.rows == DEC and mixed_parts(meta) is parts  # built once per step
    assert d.phase == "decode" and d.num_seqs == DEC and d.positions.tolist() == [6, 17, 1, 30, 9]
    assert d.seq_lens.tolist() == [7, 18, 2, 31, 10] and d.cu_seqlens_q.tolist() == list(range(DEC + 1))
    assert torch.equal(d.page_table, meta.page_table[:DEC]) and not d.roundtrip_seqs_cpu
    assert p.phase == "prefill" and p.cu_seqlens_q.tolist() == [0, 11, 18, 23] and p.max_seqlen_q == 11
    assert p.positions.tolist() == list(range(13, 24)) + list(range(7)) + list(range(10, 15))
    assert p.roundtrip_seqs_cpu == [False, False, True] and p.roundtrip_rows.tolist() == [False] * 18 + [True] * 5
    assert torch.equal(p.page_table, meta.page_table[DEC:]) and p.seq_lens.tolist() == [24, 7, 15]
    meta.decode_rows, meta.extra = 0, {}
    assert mixed_parts(meta) is None
    meta.decode_rows = DEC + 1  # the sixth sequence has 11 rows: not a decode row
    with pytest.raises(ValueError, match="one-token"):
        mixed_parts(meta)


@pytest.mark.parametrize("kv", FORMATS)
@pytest.mark.parametrize("name", ["triton", "torch", "torch+triton", "triton+torch"])
@pytest.mark.parametrize("flagged", [True, False])
def test_mixed_step_matches_the_reference(monkeypatch, kv, name, flagged):
    cache, cache2, ref_meta, meta, q, k, v, layer, prefixes = _mixed(kv, flagged)
    spy = _Spy(monkeypatch)
    be = _backend(name, kv)
    be.plan(meta, cache2)
    out = be.forward(q, k, v, layer, cache2, meta)
    assert torch.isfinite(out).all(), "a poisoned slot was read"
    ref = _reference(kv, ref_meta, q, k, v, layer, prefixes, cache)
    for rows in (slice(0, DEC), slice(DEC, None)):  # decode rows and prefill rows each
        err = ((out[rows].double() - ref[rows]).norm() / ref[rows].norm()).item()
        assert err < 1e-5, (rows, err)
    triton_calls = [c[:2] for c in spy.calls]
    want = {"triton": [("decode", DEC), ("prefill", 23)], "torch": [],
            "torch+triton": [("decode", DEC)], "triton+torch": [("prefill", 23)]}[name]
    assert triton_calls == want
    if want and want[-1][0] == "prefill":
        assert spy.calls[-1][2] == [0, 11, 18, 23]  # the prefill part's rows, rebased


@pytest.mark.parametrize("kv", ["fp8_e4m3", "nvfp4"])
def test_mixed_step_with_window_and_sinks(monkeypatch, kv):
    cache, cache2, ref_meta, meta, q, k, v, layer, prefixes = _mixed(kv, True, window=5, sinks=True)
    spy = _Spy(monkeypatch)
    out = _backend("triton", kv).forward(q, k, v, layer, cache2, meta)
    ref = _reference(kv, ref_meta, q, k, v, layer, prefixes, cache)
    assert torch.isfinite(out).all() and [c[0] for c in spy.calls] == ["decode", "prefill"]
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("mode", ["none", "prefill", "decode", "both"])
def test_mixed_step_query_quantization_per_phase(monkeypatch, mode):
    """fp8 queries per phase (``base.query_fp8``): the decode rows and the round-trip rows follow the decode
    setting, the plain prefill rows the prefill one; the triton split against the torch backend, and the mode
    must move the rows it names."""
    outs = {}
    for name in ("torch", "triton", "plain"):
        cache, cache2, ref_meta, meta, q, k, v, layer, prefixes = _mixed("fp8_e4m3", flagged=True)
        layer.q_scale = 0.05
        opts = BackendOptions(kv_dtype="fp8_e4m3", quantize_query="none" if name == "plain" else mode)
        be = TritonBackend(opts) if name == "triton" else TorchBackend(opts)
        outs[name] = be.forward(q, k, v, layer, cache2, meta)
    err = ((outs["triton"] - outs["torch"]).norm() / outs["torch"].norm()).item()
    assert err < 1e-5, err
    moved = [(outs["torch"][r] - outs["plain"][r]).abs().max().item() > 1e-4
             for r in (slice(0, DEC), slice(DEC, DEC + 18), slice(DEC + 18, None))]  # decode, plain, round-trip rows
    dec, pre = mode in ("decode", "both"), mode in ("prefill", "both")
    assert moved == [dec, pre, dec], (mode, moved)


def test_decode_rows_without_the_split_would_differ():
    """What the reference checks is not a no-op: the decode rows as plain prefill rows (own K/V in compute
    precision instead of as stored) move their outputs well past the tolerance above."""
    cache, cache2, ref_meta, meta, q, k, v, layer, prefixes = _mixed("fp8_e4m3", flagged=False)
    meta.decode_rows = 0
    out = _backend("torch", "fp8_e4m3").forward(q, k, v, layer, cache2, meta)
    ref = _reference("fp8_e4m3", ref_meta, q, k, v, layer, prefixes, cache)
    err = ((out[:DEC].double() - ref[:DEC]).norm() / ref[:DEC].norm()).item()
    assert err > 1e-3, err


# ------------------------------------------------------------------------------------ engine
MODEL = "synthetic:llama-3-8b,layers=2,hidden=128,heads=4,kv_heads=2,head_dim=32,vocab=256,intermediate_size=256"


@pytest.fixture(scope="module")
def loaded():
    from kvbench.runtime.models.loader import load_model

    return load_model(MODEL, seed=5)


def _drive(loaded, kv: str, backend: str, mixed: bool):
    """Requests arriving while others decode: three short prompts (their decode rows of different lengths),
    then a long prompt that prefills in chunks and a scored continuation, under a 12-token budget.  Returns each
    request's (token, log-prob) list and, per step, (phase, decode rows, q_lens, round-trip seqs)."""
    from kvbench.runtime.config import EngineConfig
    from kvbench.runtime.engine import Engine
    from kvbench.runtime.scoring import TokenScoreRequest

    pre, _, dec = backend.partition("+")
    e = Engine(EngineConfig(kv_dtype=kv, kv_scales="unit", prefill_backend=pre, decode_backend=dec or pre,
                            kv_budget_gb=0.01, max_model_len=256, max_num_batched_tokens=12, page_size=8,
                            fused_append=kv != "bf16", mixed_prefill=mixed), loaded=loaded)
    got: dict = {}
    steps: list = []
    real = e.scheduler.schedule

    def schedule():
        b = real()
        if b is not None:
            steps.append((b.phase, b.decode_rows, list(b.q_lens), [s.score_from is not None for s in b.seqs]))
        return b

    def on(k):
        return lambda d: got.setdefault(k, []).extend(zip(d.token_ids, d.logprobs or [None] * len(d.token_ids)))

    e.scheduler.schedule = schedule
    g = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)  # noqa: E731
    try:
        for k, (n, at) in enumerate([(5, 0), (9, 1), (3, 3)]):
            while len(steps) < at:
                e.step()
            e.add_request([(k * 31 + i * 7) % 256 for i in range(n)], g(10), request_id=f"d{k}", on_delta=on(f"d{k}"))
        e.step()
        e.add_request([(i * 13 + 1) % 256 for i in range(30)], g(4), request_id="long", on_delta=on("long"))
        ctx, cont = [(i * 5 + 2) % 256 for i in range(6)], [(i * 11 + 3) % 256 for i in range(12)]
        e.add_score_request(TokenScoreRequest(ctx, cont, top_k=1), request_id="score")
        scored = e._seqs_snapshot("score")
        while e.step():
            pass
        got["score"] = list(zip(cont, scored.state["logprobs"]))
        assert len(got["score"]) == len(cont)
        assert e.cache.allocator.num_used == 0
    finally:
        e.shutdown()
    return got, steps


@pytest.mark.slow  # the Triton interpreter runs every step's kernels
@pytest.mark.parametrize("kv", FORMATS)
@pytest.mark.parametrize("backend", ["torch", "triton", "torch+triton"])
def test_mixed_engine_matches_separate_steps(loaded, monkeypatch, kv, backend):
    sep, sep_steps = _drive(loaded, kv, backend, mixed=False)
    spy = _Spy(monkeypatch)
    mix, mix_steps = _drive(loaded, kv, backend, mixed=True)
    assert not any(d for _, d, _, _ in sep_steps)
    carried = [s for s in mix_steps if s[0] == "prefill" and s[1]]
    # several decode rows beside a chunk of the long prompt over its cached prefix, and beside a scored chunk
    assert any(d >= 3 and q[d:] and max(q[d:]) > 1 for _, d, q, _ in carried), mix_steps
    assert any(any(sc[d:]) for _, d, _, sc in carried), mix_steps
    assert len(mix_steps) < len(sep_steps)
    if "triton" in backend:  # the triton decode kernel took the decode rows of every mixed step
        rows = [c[1] for c in spy.calls if c[0] == "decode"]
        for _, d, _, _ in carried:
            assert d in rows
    assert sorted(mix) == sorted(sep) == ["d0", "d1", "d2", "long", "score"]
    diffs = {}
    for k in sep:
        assert [t for t, _ in mix[k]] == [t for t, _ in sep[k]], k
        diffs[k] = max(abs(a - b) for (_, a), (_, b) in zip(mix[k], sep[k]))
    # the same numbers up to the float rounding of other batch shapes in the linear layers, where the two runs
    # cut the same prefill chunks (short prompts: one chunk; the scored continuation reads its K/V as stored
    # however it is cut); the long prompt's chunks differ (decode rows take part of the budget), and a chunk's
    # own K/V enter its attention unquantized, so its numbers may move by a quantization step
    assert max(diffs[k] for k in ("d0", "d1", "d2", "score")) < 1e-4, diffs
    assert diffs["long"] < 5e-2, diffs

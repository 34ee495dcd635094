"""Scoring at prefill speed with decode semantics (Engine.score(mode="prefill"), the default) against the
token-by-token reference (mode="decode").

Two levels:
* attention: with identical q/k/v, one round-trip extend of N tokens equals N decode steps (float32
  tolerance), on the torch backend for every KV format and on the Triton backend (interpreter);
* engine: both score modes on small synthetic models agree in greedy flags, top-k ids and logprobs /
  full rows.  Here the model's linears see a batch of N rows in one mode and one row in the other, and a
  float32 GEMM is not row-invariant: the ~1e-7 differences can move a K element across a rounding
  boundary of the KV format, so an occasional row differs by a quantization step (a few 1e-3 in a
  logprob) while the rest agree to ~1e-6.  The bounds below say exactly that, and a control run with the
  round trip switched off shows they separate the two semantics for the quantized formats.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import logging
import math

import pytest
import torch

from kvbench.core.client import SamplingParams
from kvbench.runtime.attention.base import AttentionLayer, AttentionMetadata, BackendOptions, build_rope_cache
from kvbench.runtime.attention.torch_backend import TorchBackend
from kvbench.runtime.config import EngineConfig, KVCacheSpec
from kvbench.runtime.engine import Engine
from kvbench.runtime.kv_cache import PagedKVCache
from kvbench.runtime.models import runner as runner_mod
from kvbench.runtime.models.loader import load_model
from kvbench.runtime.scoring import TokenScoreRequest

FORMATS = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4"]
LLAMA = "synthetic:llama-3-8b,layers=2,hidden=128,heads=4,kv_heads=2,head_dim=32,vocab=300,intermediate_size=256"
OSS = "synthetic:gpt-oss-20b,layers=3,hidden=128,heads=4,kv_heads=2,head_dim=32,vocab=300,intermediate_size=128,window=6"
CTX = [(i * 13 + 5) % 300 for i in range(21)]
CONT = [(i * 7) % 300 for i in range(40)]


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)  # unit-scale warnings of the quantized formats
    yield
    logging.disable(logging.NOTSET)


# --------------------------------------------------------------------------------- attention level
PS = 4
H, HK, D = 4, 2, 32


def _meta(phase, seqs, tables, rope, roundtrip=False):
    """seqs: [(prefix, q_len)]"""
    pos, slots, cu, lens = [], [], [0], []
    for (p, q), tb in zip(seqs, tables):
        pos += list(range(p, p + q))
        slots += [tb[i // PS] * PS + i % PS for i in range(p, p + q)]
        cu.append(cu[-1] + q)
        lens.append(p + q)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        phase, torch.tensor(pos), torch.tensor(slots), torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32), max(q for _, q in seqs), max(lens), PS, rope,
        lens, [q for _, q in seqs],
    )
    if roundtrip:
        meta.roundtrip_seqs_cpu = [True] * len(seqs)
        meta.roundtrip_rows = torch.ones(cu[-1], dtype=torch.bool)
    return meta


def _extend_vs_decode(backend_cls, fmt, window=None, sinks=False, fused=True):
    g = torch.Generator().manual_seed(3)
    spec = KVCacheSpec(1, HK, D, fmt, PS)
    rope = build_rope_cache(D, 128, 10000.0)
    tables = [[5, 1, 9, 3, 7], [0, 8, 2, 6, 4]]
    prefix, n = [7, 12], [9, 6]
    layer = AttentionLayer(0, H, HK, D, D**-0.5, window, torch.randn(H, generator=g) if sinks else None)
    be = backend_cls(BackendOptions(kv_dtype=fmt, fused_append=fused))
    x_pre = [torch.randn(sum(prefix), h, D, generator=g) for h in (H, HK, HK)]
    x_new = [torch.randn(sum(n), h, D, generator=g) for h in (H, HK, HK)]
    outs = []
    for mode in ("extend", "decode"):
        cache = PagedKVCache(spec, 11)
        if fmt != "bf16" and fmt != "fp16":
            cache.set_scales(torch.tensor([0.03]), torch.tensor([0.02]))
        m = _meta("prefill", [(0, p) for p in prefix], tables, rope)
        be.forward(*x_pre, layer, cache, m)
        if mode == "extend":
            m = _meta("prefill", list(zip(prefix, n)), tables, rope, roundtrip=True)
            outs.append(be.forward(*x_new, layer, cache, m))
        else:  # the same tokens one decode step at a time (sequence 1 runs out first)
            rows = {}
            offs = [0, n[0]]
            for i in range(max(n)):
                live = [b for b in range(2) if i < n[b]]
                m = _meta("decode", [(prefix[b] + i, 1) for b in live], [tables[b] for b in live], rope)
                idx = torch.tensor([offs[b] + i for b in live])
                o = be.forward(*(x[idx] for x in x_new), layer, cache, m)
                for j, b in enumerate(live):
                    rows[offs[b] + i] = o[j]
            outs.append(torch.stack([rows[r] for r in range(sum(n))]))
    assert torch.isfinite(outs[0]).all()
    return ((outs[0] - outs[1]).norm() / outs[1].norm()).item()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("window,sinks", [(None, False), (5, True)])
def test_torch_roundtrip_extend_equals_decode_steps(fmt, window, sinks):
    assert _extend_vs_decode(TorchBackend, fmt, window, sinks) < 1e-6


@pytest.mark.parametrize("fmt,window,sinks", [("fp16", None, False), ("fp8_e4m3", 5, True), ("nvfp4", None, True)])
def test_triton_roundtrip_extend_equals_decode_steps(fmt, window, sinks):
    from kvbench.runtime.attention.triton_backend import TritonBackend

    assert _extend_vs_decode(TritonBackend, fmt, window, sinks) < 1e-5


# ------------------------------------------------------------------------------------ engine level
@pytest.fixture(scope="module")
def models():
    return {LLAMA: load_model(LLAMA, seed=3), OSS: load_model(OSS, seed=3)}


def _engine(loaded, fmt, backend="torch", **kw):
    kw.setdefault("max_num_batched_tokens", 16)  # context: 2 chunks, continuation: 3 chunks
    kw.setdefault("max_model_len", 256)
    return Engine(EngineConfig(kv_dtype=fmt, kv_budget_gb=0.01, prefill_backend=backend,
                               decode_backend=backend, kv_scales="unit" if fmt in ("bf16", "fp16") else "calibrate",
                               fused_append=fmt != "bf16", **kw), loaded=loaded)


def _kl_max(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p.exp() * (p - q)).sum(-1).max())


def _agree(a, b, kl_bound=2e-5):
    """The two results agree: same greedy flags and top-k ids, full rows within kl_bound, the median
    logprob to 1e-4 and every one to 1e-2 (a quantization-step flip, see the module doc)."""
    assert a.greedy == b.greedy and a.top_ids == b.top_ids
    assert a.full_logprobs.shape == b.full_logprobs.shape == (len(CONT), 300)
    assert torch.isfinite(b.full_logprobs).all()
    kl = _kl_max(a.full_logprobs, b.full_logprobs)
    d = torch.tensor(a.logprobs) - torch.tensor(b.logprobs)
    assert kl < kl_bound, kl
    assert float(d.abs().max()) < 1e-2 and float(d.abs().median()) < 1e-4, d
    return kl


def _no_roundtrip(monkeypatch):
    """Control: the runner stops flagging continuation chunks (plain prefill semantics)."""
    orig = runner_mod.ModelRunner.metadata

    def metadata(self, phase, inp):
        ids, meta = orig(self, phase, inp)
        meta.roundtrip_seqs_cpu, meta.roundtrip_rows = [], None
        return ids, meta

    monkeypatch.setattr(runner_mod.ModelRunner, "metadata", metadata)


@pytest.mark.parametrize("model", [LLAMA, OSS])
@pytest.mark.parametrize("fmt", FORMATS)
def test_score_modes_agree(models, model, fmt, monkeypatch):
    e = _engine(models[model], fmt)
    try:
        ref = e.score(CTX, CONT, top_k=5, full_distribution=True, mode="decode")
        steps_before = e.stats().prompt_tokens
        new = e.score(CTX, CONT, top_k=5, full_distribution=True)
        assert e.stats().prompt_tokens - steps_before == len(CTX) + len(CONT) - 1  # everything went through prefill
        kl = _agree(ref, new)
        assert new.token_ids == CONT and len(new.logprobs) == len(CONT) and len(new.top_ids[0]) == 5
        if fmt in ("fp8_e4m3", "fp8_e5m2", "nvfp4"):
            _no_roundtrip(monkeypatch)
            plain = e.score(CTX, CONT, top_k=5, full_distribution=True)
            assert _kl_max(ref.full_logprobs, plain.full_logprobs) > max(20 * kl, 1e-4)
        assert e.cache.allocator.num_used == 0
    finally:
        e.shutdown()


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4"])
def test_score_modes_agree_on_triton(models, fmt):
    e = _engine(models[LLAMA], fmt, backend="triton")
    try:
        ctx, cont = CTX[:9], CONT[:14]
        ref = e.score(ctx, cont, top_k=3, full_distribution=True, mode="decode")
        new = e.score(ctx, cont, top_k=3, full_distribution=True)
        assert ref.greedy == new.greedy and ref.top_ids == new.top_ids
        assert _kl_max(ref.full_logprobs, new.full_logprobs) < 2e-5
    finally:
        e.shutdown()


def test_scoring_shares_steps_with_generation(models):
    """A scoring sequence's context and continuation chunks run in the same steps as other requests'
    prefill (flagged and unflagged sequences in one step) and each result matches its solo run."""
    loaded = models[OSS]
    e = _engine(loaded, "fp8_e5m2", max_num_batched_tokens=32)
    batches = []
    sched = e.scheduler.schedule

    def schedule():
        b = sched()
        if b is not None:
            batches.append((b.phase, [s.request_id for s in b.seqs], [(s.num_cached, q) for s, q in zip(b.seqs, b.q_lens)]))
        return b

    e.scheduler.schedule = schedule
    try:
        gen_p, gen2_p = list(range(60, 70)), [7, 8, 9]
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        rid_g = e.add_request(gen_p, greedy, request_id="gen")
        rid_s = e.add_score_request(TokenScoreRequest(CTX, CONT, top_k=5, full_distribution=True, mode="prefill"),
                                    request_id="score")
        rid_g2 = e.add_request(gen2_p, greedy, request_id="gen2")
        seqs = {r: e._seqs_snapshot(r) for r in (rid_g, rid_s, rid_g2)}
        while e.scheduler.has_work() or e._inbox:
            e.step()
        # step 1: gen + the whole context (cut at the boundary) + 1 token of gen2; step 2: a continuation
        # chunk (round trip) over the whole budget; step 3: the rest of it next to gen2's plain prefill
        assert batches[0] == ("prefill", ["gen", "score", "gen2"], [(0, 10), (0, 21), (0, 1)])
        assert batches[1] == ("prefill", ["score"], [(21, 32)])
        assert batches[2] == ("prefill", ["score", "gen2"], [(53, len(CONT) - 1 - 32), (1, 2)])
        s = seqs[rid_s]
        assert s.status == "finished" and s.finish_reason == "length"
        solo_g = e.generate([gen_p, gen2_p], greedy)
        assert [seqs[rid_g].output_ids, seqs[rid_g2].output_ids] == [o.token_ids for o in solo_g]
        solo = e.score(CTX, CONT, top_k=5, full_distribution=True)
        assert s.state["greedy"] == solo.greedy and s.state["top_ids"] == solo.top_ids
        full = s.scoring.full_rows  # one [T, V] tensor, filled row by row
        assert _kl_max(solo.full_logprobs, full) < 2e-5
        out = e.out.request_output(s, type("D", (), {"finish_reason": "length"})())
        assert out.prompt_token_ids == CTX and out.token_ids == CONT and len(out.logprobs) == len(CONT)
        assert e.cache.allocator.num_used == 0
    finally:
        e.shutdown()


def test_context_limits_and_modes(models):
    e = _engine(models[LLAMA], "bf16", max_model_len=32)
    try:
        assert e.max_model_len == 32
        # a prompt of exactly max_model_len tokens gets one token (the last sampled token needs no KV slot)
        out = e.generate([list(range(1, 33))], SamplingParams(max_tokens=5, ignore_eos=True))[0]
        assert len(out.token_ids) == 1 and out.finish_reason == "length"
        with pytest.raises(ValueError, match="context"):
            e.add_request(list(range(1, 34)), SamplingParams(max_tokens=1))
        # scoring: context + continuation - 1 tokens are cached
        for mode in ("prefill", "decode"):
            r = e.score(list(range(1, 21)), list(range(30, 43)), mode=mode)
            assert len(r.logprobs) == 13 and all(math.isfinite(x) for x in r.logprobs)
            with pytest.raises(ValueError, match="exceed"):
                e.score(list(range(1, 21)), list(range(30, 44)), mode=mode)
        with pytest.raises(ValueError, match="score mode"):
            e.score([1, 2], [3], mode="fast")
        with pytest.raises(ValueError, match="non-empty continuation"):
            e.score([1, 2], [])
        one = e.score([1, 2, 3], [4])  # a one-token continuation: only the context's last row is scored
        ref = e.score([1, 2, 3], [4], mode="decode")
        assert one.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        assert e.cache.allocator.num_used == 0
    finally:
        e.shutdown()


MLA = ("synthetic:deepseek-v2-lite,layers=2,hidden=128,heads=4,kv_lora_rank=64,qk_rope_head_dim=32,"
       "qk_nope_head_dim=16,v_head_dim=16,intermediate_size=192,vocab=300")


@pytest.mark.parametrize("backend,fmt", [("torch", "nvfp4"), ("torch", "fp8_e5m2"), ("triton", "fp8_e4m3")])
def test_score_modes_agree_on_mla(backend, fmt, monkeypatch):
    """MLA: the latent of round-trip rows is read back as stored (torch: from the pages; triton: passed
    to mla_prefill as the new tokens' latent)."""
    e = _engine(load_model(MLA, seed=1), fmt, backend=backend)
    try:
        ctx, cont = CTX[:12], CONT[:20]
        ref = e.score(ctx, cont, top_k=3, full_distribution=True, mode="decode")
        new = e.score(ctx, cont, top_k=3, full_distribution=True)
        assert ref.greedy == new.greedy and ref.top_ids == new.top_ids
        kl = _kl_max(ref.full_logprobs, new.full_logprobs)
        assert kl < 2e-5, kl
        _no_roundtrip(monkeypatch)
        plain = e.score(ctx, cont, top_k=3, full_distribution=True)
        assert _kl_max(ref.full_logprobs, plain.full_logprobs) > max(20 * kl, 1e-5)
    finally:
        e.shutdown()

"""GPU: the engine on a small synthetic Llama (bf16 compute) — decode replayed as CUDA graphs against eager
decode, the hybrid backend pairs (one backend's prefill, another's decode) and the flashinfer backend against
the torch reference backend on the same KV format.  Scores are teacher-forced through decode steps
(``score(mode="decode")``: the context runs through the prefill backend, every continuation token through
the decode backend), compared as the largest per-token KL divergence of the full distributions.  Run with
``pytest -m gpu`` on a CUDA device; skipped elsewhere (tests/conftest.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from kvbench.core.client import SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from gpu_checks import kl_max, need_flashinfer  # noqa: E402

pytestmark = pytest.mark.gpu

MODEL = "synthetic:llama-3-8b,layers=2,hidden=512,heads=8,kv_heads=2,head_dim=64,vocab=512,intermediate_size=1024"
CTX = [(i * 13 + 5) % 512 for i in range(150)]
CONT = [(i * 7 + 3) % 512 for i in range(40)]
PROMPTS = [CTX[:37], CTX[:90], CTX]
# two bf16 runs of the same model whose attention differs only in rounding stay far below this (about 1e-5 to
# 1e-4 expected); a wrong page, scale or position moves the distributions by orders of magnitude more
KL_MAX = 2e-3


@pytest.fixture(autouse=True)
def _quiet(quiet_gpu):
    yield


@pytest.fixture(scope="module")
def loaded():
    from kvbench.runtime.models.loader import load_model

    return load_model(MODEL, device="cuda", dtype=torch.bfloat16, seed=3)


def _engine(loaded, kv="bf16", pre="torch", dec="torch", eager=True, **kw):
    from kvbench.runtime.config import EngineConfig
    from kvbench.runtime.engine import Engine

    return Engine(EngineConfig(kv_dtype=kv, kv_scales="unit", prefill_backend=pre, decode_backend=dec, device="cuda",
                               enforce_eager=eager, kv_budget_gb=0.05, max_model_len=256, max_running=8, **kw),
                  loaded=loaded)


def _score(e):
    return e.score(CTX, CONT, full_distribution=True, mode="decode")


def _close(ref, got) -> float:
    assert torch.isfinite(got.full_logprobs).all()
    kl = kl_max(ref.full_logprobs, got.full_logprobs)
    agree = sum(a == b for a, b in zip(ref.full_logprobs.argmax(-1).tolist(), got.full_logprobs.argmax(-1).tolist()))
    assert kl < KL_MAX and agree >= 0.9 * len(CONT), (kl, agree)
    return kl


_REF: dict = {}


def _reference(loaded, kv):
    """The torch backend in both phases, eager (computed once per format)."""
    if kv not in _REF:
        e = _engine(loaded, kv)
        try:
            _REF[kv] = _score(e)
        finally:
            e.shutdown()
    return _REF[kv]


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3", "nvfp4"])
def test_cuda_graph_decode_matches_eager(loaded, kv):
    graphs = _engine(loaded, kv, "triton", "triton", eager=False, overlap_schedule=False)  # the copy in the graph
    eager = _engine(loaded, kv, "triton", "triton", eager=True)
    try:
        g, e = _score(graphs), _score(eager)
        assert graphs.runner.graphs is not None and graphs.runner.graphs.graphs, "no decode graph was captured"
        assert eager.runner.graphs is None
        _close(e, g)
        # a batch of three (a padded graph bucket of four) that shrinks to two and one as requests end (the
        # staged padding rows): the same greedy tokens while they agree
        p = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=1) for m in (16, 9, 5)]
        og, oe = graphs.generate(PROMPTS, p), eager.generate(PROMPTS, p)
        dg = graphs.runner.graphs
        assert {4, 2, 1} <= set(dg.graphs), sorted(dg.graphs)
        assert all(dg.copy_in_graph.values()), dg.copy_in_graph  # the input copy is the graph's own first node
        assert [len(o.token_ids) for o in og] == [16, 9, 5]
        # the fallback for a copy that cannot be captured (issued before each replay) gives the same steps
        for b in dg.copy_in_graph:
            dg.copy_in_graph[b] = False
        assert [o.token_ids for o in graphs.generate(PROMPTS, p)] == [o.token_ids for o in og]
        for a, b in zip(og, oe):
            same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
            assert same >= 4, (a.token_ids, b.token_ids)
            d = (torch.tensor(a.logprobs[:same]) - torch.tensor(b.logprobs[:same])).abs().max()
            assert float(d) < 0.05, float(d)
    finally:
        graphs.shutdown()
        eager.shutdown()


@pytest.mark.parametrize("kv,pre,dec", [
    ("bf16", "triton", "torch"), ("bf16", "torch", "triton"), ("bf16", "triton", "triton"),
    ("fp8_e4m3", "triton", "torch"), ("fp8_e4m3", "torch", "triton"),
    ("nvfp4", "triton", "torch"), ("nvfp4", "torch", "triton"),
])
def test_hybrid_backend_pairs_match_torch(loaded, kv, pre, dec):
    """A cache written by one backend's prefill is read by the other's decode: against torch in both phases."""
    e = _engine(loaded, kv, pre, dec)
    try:
        _close(_reference(loaded, kv), _score(e))
    finally:
        e.shutdown()


@pytest.mark.parametrize("kv,pre,dec", [("bf16", "flashinfer", "flashinfer"), ("bf16", "triton", "flashinfer"),
                                        ("fp8_e4m3", "torch", "flashinfer"), ("fp8_e5m2", "triton", "flashinfer")])
def test_flashinfer_matches_torch(loaded, kv, pre, dec):
    need_flashinfer()
    e = _engine(loaded, kv, pre, dec)
    try:
        _close(_reference(loaded, kv), _score(e))
    finally:
        e.shutdown()


def _score_in_mixed_steps(e):
    """``_score``'s teacher-forced decode scoring while prompts keep arriving and prefilling in chunks, stepped by
    hand: with ``mixed_prefill`` most scored tokens run as decode rows of prefill steps.  Returns the scores and
    how many steps carried the scored sequence as a decode row."""
    from kvbench.runtime.scoring import TokenScoreRequest, score_result

    req = TokenScoreRequest(CTX, CONT, full_distribution=True, mode="decode")
    last = {}
    rid = e.add_score_request(req, on_delta=lambda d: d.finish_reason and last.setdefault("d", d))
    seq = e._seqs_snapshot(rid)
    carried, real = [0], e.scheduler.schedule

    def schedule():
        b = real()
        if b is not None and b.phase == "prefill" and any(s is seq for s in b.seqs[:b.decode_rows]):
            carried[0] += 1
        return b

    e.scheduler.schedule = schedule
    n = 0
    while e.step():
        n += 1
        if n % 2 == 0 and n <= 80:  # prompts of 37 / 90 / 150 tokens: one to three chunks of 64 each
            e.add_request(PROMPTS[(n // 2) % 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while e.step():
        pass
    return score_result(req, e.out.request_output(seq, last["d"]), seq), carried[0]


def _greedy_run(e, params):
    """``PROMPTS`` with ``params`` through ``step()`` on this thread: each request's (tokens, log-probs) and in how
    many steps a step was left in flight."""
    got: dict = {}
    for k, (ids, p) in enumerate(zip(PROMPTS * 2, params)):
        e.add_request(ids, p, request_id=f"r{k}", on_delta=lambda d: got.setdefault(d.request_id, []).append(d))
    flights = 0
    while e.step():
        flights += e.rows.inflight is not None
    assert e.cache.allocator.num_used == 0 and e.rows.inflight is None
    return {r: ([t for d in ds for t in d.token_ids], [x for d in ds for x in d.logprobs],
                [d.top_logprobs for d in ds]) for r, ds in got.items()}, flights


@pytest.mark.parametrize("kv,eager", [("bf16", False), ("fp8_e4m3", False), ("nvfp4", False), ("fp8_e4m3", True)])
def test_steps_launched_ahead_match_steps_waited_for(loaded, kv, eager):
    """``overlap_schedule`` on the GPU (CUDA graphs reading their ids from the device, the copy before each replay;
    or eager steps with the ids fixed up on the device): the same tokens, log-probs and top log-probs, bit for bit,
    as steps whose tokens the host waited for, greedy and drawn rows; a stop id seen one step late ends its request
    at the same token."""
    on = _engine(loaded, kv, "triton", "triton", eager=eager, overlap_schedule=True)
    off = _engine(loaded, kv, "triton", "triton", eager=eager, overlap_schedule=False)
    try:
        p = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=0) for m in (16, 9, 5, 30, 12, 1)]
        # drawn rows (their own seeds, top-k / top-p) and top log-probs go through the device sampler too
        p[1] = SamplingParams(max_tokens=9, temperature=0.8, seed=3, ignore_eos=True, logprobs=0)
        p[4] = SamplingParams(max_tokens=12, temperature=1.0, top_k=40, top_p=0.9, seed=11, ignore_eos=True, logprobs=2)
        a, fa = _greedy_run(on, p)
        b, fb = _greedy_run(off, p)
        assert fa > 10 and fb == 0, (fa, fb)
        assert a == b
        if not eager:
            dg = on.runner.graphs
            assert dg is not None and dg.graphs and not any(dg.copy_in_graph.values()), dg.copy_in_graph
        stop = a["r3"][0][7]  # a stop id: the request ends there, its next row (already launched) dropped
        p[3] = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=0, stop_token_ids=[stop])
        c, _ = _greedy_run(on, p)
        k = a["r3"][0].index(stop) + 1
        assert c["r3"][0] == a["r3"][0][:k]
    finally:
        on.shutdown()
        off.shutdown()


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_triton_gemm_library_matches_cublas(loaded, kv, monkeypatch):
    """``gemm_library="triton"``: the decode steps' projections through ``kernels/skinny_gemm.py`` and every Triton
    kernel of the step launched as a programmatic dependent (inside CUDA graphs and eager) give the distributions of the cuBLAS engine within
    ``KL_MAX`` and its greedy tokens, with an engine of each library in one process (each step sets its own)."""
    from kvbench.kernels import skinny_gemm

    calls = []
    real = skinny_gemm.linear
    monkeypatch.setattr(skinny_gemm, "linear", lambda *a, **k: calls.append(k["p"]) or real(*a, **k))
    tri = _engine(loaded, kv, "triton", "triton", eager=False, overlap_schedule=False, gemm_library="triton")
    ref = _engine(loaded, kv, "triton", "triton", eager=True)
    try:
        from kvbench.kernels import _triton_utils

        r = _score(ref)
        assert not _triton_utils.pdl()
        t = _score(tri)
        assert _triton_utils.pdl()  # the step's own kernels launched as programmatic dependents too
        assert calls and all(p.pdl for p in calls), calls[:4]  # captured into the decode graphs
        assert tri.runner.graphs is not None and tri.runner.graphs.graphs
        _close(r, t)
        p = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (16, 9, 5)]
        for a, b in zip(tri.generate(PROMPTS, p), ref.generate(PROMPTS, p)):
            same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
            assert same >= 4, (a.token_ids, b.token_ids)
    finally:
        tri.shutdown()
        ref.shutdown()


@pytest.mark.parametrize("kv,pre,dec", [
    ("bf16", "triton", "triton"), ("fp8_e4m3", "triton", "triton"), ("nvfp4", "triton", "triton"),
    ("fp8_e4m3", "torch", "triton"), ("nvfp4", "triton", "torch"),
    ("bf16", "flashinfer", "flashinfer"), ("bf16", "triton", "flashinfer"),
])
def test_mixed_steps_match_graphed_decode(loaded, kv, pre, dec):
    """``mixed_prefill`` on the GPU: a scored sequence whose tokens run as decode rows of prefill steps (the
    decode rows through the decode backend's kernel; flashinfer alone runs the step whole with round-trip rows)
    against the same scoring in an engine of separate steps whose decode steps replay CUDA graphs."""
    if "flashinfer" in (pre, dec):
        need_flashinfer()
    # the same prefill chunks in both (a later chunk reads the earlier ones back from the cache: with nvfp4 that
    # alone moves the scores by a KL of ~0.03 against one unchunked prefill)
    ref_e = _engine(loaded, kv, "triton", "triton", eager=False, max_num_batched_tokens=64)
    mix_e = _engine(loaded, kv, pre, dec, eager=False, mixed_prefill=True, max_num_batched_tokens=64)
    try:
        ref = _score(ref_e)
        assert ref_e.runner.graphs is not None and ref_e.runner.graphs.graphs, "no decode graph was captured"
        got, carried = _score_in_mixed_steps(mix_e)
        assert carried >= len(CONT) // 2, carried
        _close(ref, got)
        assert mix_e.cache.allocator.num_used == 0
    finally:
        ref_e.shutdown()
        mix_e.shutdown()


@pytest.mark.parametrize("mode", ["prefill", "decode", "both"])
def test_query_quantization_per_phase_matches_torch(loaded, mode):
    """fp8 queries limited to one phase: the Triton kernels (q_scale passed for that phase only, or rows rounded
    in torch for mixed steps) against the torch backend in the same mode; and the mode must move the scores
    (a backend that ignored it would match ``none``)."""
    pre = "triton"
    ref_e = _engine(loaded, "fp8_e4m3", quantize_query=mode)
    tri_e = _engine(loaded, "fp8_e4m3", pre, "triton", quantize_query=mode)
    plain_e = _engine(loaded, "fp8_e4m3", pre, "triton", quantize_query="none")
    try:
        ref, got, plain = _score(ref_e), _score(tri_e), _score(plain_e)
    finally:
        for e in (ref_e, tri_e, plain_e):
            e.shutdown()
    _close(ref, got)
    # prefill-only rounds the context's queries: it moves the scores through the cache only where the
    # context's own attention feeds later layers; decode / both round every scored token's query
    moved = kl_max(plain.full_logprobs, got.full_logprobs)
    assert moved > 1e-7, (mode, moved)


@pytest.mark.parametrize("kv,skip,layer_dtypes,pre,dec,eager", [
    ("nvfp4", "0", None, "triton", "triton", True),
    ("nvfp4", "0", None, "triton", "triton", False),
    ("fp8_e4m3", None, "0:nvfp4", "triton", "triton", False),
    ("fp8_e4m3", "1", None, "triton", "flashinfer", True),
])
def test_mixed_layer_formats_match_torch(loaded, kv, skip, layer_dtypes, pre, dec, eager):
    """A cache whose layers differ in format (bf16 / fp8 / nvfp4 per layer): the Triton kernels (eager and in
    CUDA graphs) and flashinfer read each layer in its own format, against the torch backend on the same map;
    and the map must move the scores away from the uniform format's."""
    if "flashinfer" in (pre, dec):
        need_flashinfer()
    mixed = dict(kv_dtype_skip_layers=skip, kv_layer_dtypes=layer_dtypes)
    ref_e = _engine(loaded, kv, **mixed)
    got_e = _engine(loaded, kv, pre, dec, eager=eager, **mixed)
    try:
        assert [f.name for f in got_e.cache.formats] != [kv] * 2
        ref, got = _score(ref_e), _score(got_e)
    finally:
        ref_e.shutdown()
        got_e.shutdown()
    _close(ref, got)
    assert kl_max(_reference(loaded, kv).full_logprobs, got.full_logprobs) > 1e-7


MLA128 = "synthetic:deepseek-v3,layers=2,hidden=1024,intermediate_size=2048,q_lora_rank=256,vocab=512"


@pytest.mark.parametrize("kv,qq", [("bf16", "none"), ("fp8_e4m3", "none"), ("fp8_e4m3", "decode"), ("fp8_e5m2", "none")],
                         ids=["bf16", "fp8-split-query", "fp8-e4m3-query", "e5m2-split-query"])
def test_mla_engine_at_128_heads_decodes_on_the_hopper_kernel(monkeypatch, kv, qq):
    """DeepSeek-V3's attention shape (128 heads, latent 512 + rope 64) in a small two-layer model, a bf16 latent
    or an e4m3 one (bf16 queries, split into two e4m3 terms in the kernel; or e4m3 queries, ``quantize_query``), or
    an e5m2 one (the split bf16 queries),
    the engine's default pages of 16: the graphed decode steps run the Hopper MLA kernel (counted at capture),
    and their greedy tokens and log-probabilities agree with eager decode and with the Triton kernel's.  On a
    GPU other than sm_90 the kernel must not run, and graphed and eager decode must still agree."""
    from kvbench.kernels import mla_decode_wg
    from kvbench.runtime.models.loader import load_model

    hopper = torch.cuda.get_device_capability() == (9, 0)
    model = load_model(MLA128, device="cuda", dtype=torch.bfloat16, seed=3)
    calls = []
    real = mla_decode_wg.launch
    monkeypatch.setattr(mla_decode_wg, "launch", lambda *a, **k: (calls.append(a[0].shape[1]), real(*a, **k))[1])
    p = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=1) for m in (12, 7, 5)]

    def run(eager):
        e = _engine(model, kv, "triton", "triton", eager=eager, quantize_query=qq)
        try:
            assert e.cache.page_size == 16
            return e.generate(PROMPTS, p)
        finally:
            e.shutdown()

    graphed = run(False)
    assert (set(calls) == {128}) if hopper else not calls, calls
    n = len(calls)
    eager = run(True)
    assert len(calls) > n if hopper else not calls
    n = len(calls)
    monkeypatch.setattr(mla_decode_wg, "unsupported", lambda *a: "switched off for the comparison")
    triton_kernel = run(True)
    assert len(calls) == n
    for other in (eager, triton_kernel):
        for a, b in zip(graphed, other):
            assert len(a.token_ids) == len(b.token_ids)
            same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
            assert same >= 4, (a.token_ids, b.token_ids)
            d = (torch.tensor(a.logprobs[:same]) - torch.tensor(b.logprobs[:same])).abs().max()
            assert float(d) < 0.05, float(d)


def test_step_inputs_reach_the_device_without_waiting_for_the_stream():
    """``to_device`` (every host-built input of an eager step): the copy is queued behind the work in flight
    instead of waiting for it, as ``torch.tensor(..., device=...)`` does; the values arrive intact."""
    import time

    from kvbench.runtime.attention.base import to_device

    data = [(i * 7919) % 100003 for i in range(5000)]
    for waits in (False, True):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(1.5e9))  # about half a second of device time at H200 clocks
        t = time.perf_counter()
        x = torch.tensor(data, dtype=torch.int64, device="cuda") if waits else to_device(data, torch.int64, "cuda")
        dt = time.perf_counter() - t
        torch.cuda.synchronize()
        assert x.tolist() == data
        if waits:
            assert dt > 0.2, dt  # the plain copy waited for the sleep: the test can tell the two apart
        else:
            assert dt < 0.05, dt

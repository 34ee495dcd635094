"""DiagnosticProbe: per-layer / per-kv-head K, V and attention-output error statistics, driven through the
real torch backend and a real paged cache with hand-built step metadata."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvbench.kernels.formats import get_format
from kvbench.runtime.attention.base import (
    AttentionLayer, AttentionMetadata, BackendOptions, apply_rope, build_rope_cache,
)
from kvbench.runtime.attention.torch_backend import TorchBackend
from kvbench.runtime.config import KVCacheSpec
from kvbench.runtime.diagnostics_probe import DiagnosticProbe, ProbedBackend, reference_attention
from kvbench.runtime.graphs import graph_safe
from kvbench.runtime.kv_cache import PagedKVCache

D, PAGE, NPAGES = 32, 4, 16
ROPE = build_rope_cache(D, 128)


def meta_for(prefix: int, n: int, B: int = 1) -> AttentionMetadata:
    """One step of ``B`` identical sequences: ``n`` new tokens after ``prefix`` cached ones (slot = position)."""
    phase = "decode" if n == 1 and prefix > 0 else "prefill"
    pos = torch.arange(prefix, prefix + n)
    return AttentionMetadata(
        phase, pos.repeat(B), pos.repeat(B), torch.tensor([list(range(NPAGES))] * B, dtype=torch.int32),
        torch.tensor([prefix + n] * B, dtype=torch.int32), torch.arange(B + 1, dtype=torch.int32) * n,
        n, prefix + n, PAGE, ROPE, [prefix + n] * B, [n] * B,
    )


class Rig:
    def __init__(self, formats, H=2, Hq=8, windows=None, sinks=False, k_scale=None, v_scale=None):
        L = len(formats)
        self.L, self.H, self.Hq = L, H, Hq
        spec = KVCacheSpec(L, H, D, formats[0], PAGE, layer_dtypes=tuple(formats))
        self.cache = PagedKVCache(spec, NPAGES)
        if k_scale is not None or v_scale is not None:
            self.cache.set_scales(k_scale, v_scale)
        gen = torch.Generator().manual_seed(7)
        windows = windows or [None] * L
        self.layers = [
            AttentionLayer(i, Hq, H, D, D**-0.5, sliding_window=windows[i],
                           sinks=torch.randn(Hq, generator=gen) if sinks else None)
            for i in range(L)
        ]
        self.inner = TorchBackend(BackendOptions(kv_dtype=formats[0]))
        self.probe = DiagnosticProbe(L, H, D)
        self.backend = self.probe.wrap(self.inner)

    def data(self, S: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(self.L, S, self.Hq, D, generator=g)
        k = torch.randn(self.L, S, self.H, D, generator=g)
        v = torch.randn(self.L, S, self.H, D, generator=g)
        return q, k, v

    def run_text(self, q, k, v, chunks):
        """Steps of ``chunks`` new tokens; returns the backend's output per layer ``[L, S, Hq, D]``."""
        self.probe.begin_text()
        outs, p = [], 0
        for n in chunks:
            meta = meta_for(p, n)
            self.backend.plan(meta, self.cache)
            outs.append(torch.stack([
                self.backend.forward(q[i, p:p + n], k[i, p:p + n], v[i, p:p + n], self.layers[i], self.cache, meta)
                for i in range(self.L)]))
            p += n
        return torch.cat(outs, dim=1).reshape(self.L, p, self.Hq, D)


def hand_stats(fmt_name, x, scale, max_repr):
    """Expected stats of one plane: ``x [N, H, D]`` exact values, ``scale [H]``, ``max_repr [H]``."""
    stored = get_format(fmt_name).roundtrip(x, scale)
    rel = (((stored - x).double() ** 2).sum((0, 2)) / (x.double() ** 2).sum((0, 2))).sqrt()
    n = x.shape[0] * x.shape[2]
    sat = (x.abs() > max_repr[None, :, None]).sum((0, 2)).double() / n
    nz = x != 0
    flushed = (nz & (stored == 0)).sum((0, 2)).double() / nz.sum((0, 2))
    return rel, sat, flushed, x.abs().amax((0, 2))


def test_stats_match_hand_computation_fp8_and_nvfp4_over_two_texts():
    g6 = 6 * 448.0
    k_scale = torch.tensor([[0.004, 0.006], [1.5 / g6, 2.0 / g6]])  # layer 0 fp8_e4m3, layer 1 nvfp4
    v_scale = torch.tensor([[0.005, 0.005], [1.2 / g6, 1.2 / g6]])
    rig = Rig(["fp8_e4m3", "nvfp4"], k_scale=k_scale, v_scale=v_scale)
    texts = []
    for seed, S, chunks in ((1, 9, [5, 1, 1, 1, 1]), (2, 6, [3, 3])):
        q, k, v = rig.data(S, seed)
        k[:, 0, :, :4] = 1e-8  # position 0: RoPE is the identity, so these tiny K values reach the cache as is
        v[:, 3, :, :4] = 1e-9
        rig.run_text(q, k, v, chunks)
        texts.append((k, v))
    res = rig.probe.result()
    assert [r["format"] for r in res] == ["fp8_e4m3", "nvfp4"] and [r["layer"] for r in res] == [0, 1]
    json.dumps(res)  # plain Python values
    for i, (name, top) in enumerate((("fp8_e4m3", 448.0), ("nvfp4", g6))):
        for which, scale in (("k", k_scale[i]), ("v", v_scale[i])):
            xs = []
            for k, v in texts:
                S = k.shape[1]
                xs.append(apply_rope(k[i], torch.arange(S), ROPE) if which == "k" else v[i])
            x = torch.cat(xs)  # pooled over both texts: sums, not means of means
            max_repr = scale * top
            rel, sat, flushed, amax = hand_stats(name, x, scale, max_repr)
            got = res[i][which]
            assert got["values"] == x.shape[0] * D
            assert got["rel_err"] == pytest.approx(rel.tolist(), rel=1e-6)
            assert got["saturated"] == pytest.approx(sat.tolist(), abs=1e-9)
            assert got["flushed"] == pytest.approx(flushed.tolist(), abs=1e-9)
            assert got["amax"] == pytest.approx(amax.tolist(), rel=1e-7)
            assert got["scale"] == pytest.approx(scale.tolist(), rel=1e-7)
            assert got["max_repr"] == pytest.approx(max_repr.tolist(), rel=1e-6)
            # the test exercises saturation and flushing in every plane
            assert min(got["saturated"]) > 0 and min(got["flushed"]) > 0, (name, which, got)


def test_bf16_small_nonzero_error_and_e5m2_larger():
    rig = Rig(["bf16", "fp8_e5m2"])
    q, k, v = rig.data(12, 3)
    rig.run_text(q, k, v, [8, 1, 1, 1, 1])
    bf, e5 = rig.probe.result()
    for plane in ("k", "v"):
        assert all(1e-4 < e < 1e-2 for e in bf[plane]["rel_err"]), bf[plane]["rel_err"]
        assert all(e > 10 * b for e, b in zip(e5[plane]["rel_err"], bf[plane]["rel_err"]))
        assert bf[plane]["max_repr"] is None
        assert bf[plane]["saturated"] == [0.0, 0.0] and bf[plane]["flushed"] == [0.0, 0.0]
        assert e5[plane]["max_repr"] == [57344.0, 57344.0] and e5[plane]["scale"] == [1.0, 1.0]
        assert e5[plane]["saturated"] == [0.0, 0.0]
    # decode steps read the quantized cache: the attention output moves, more under e5m2
    assert all(0 < b < 1e-2 for b in bf["attn_rel_err"])
    assert all(e > 5 * b for e, b in zip(e5["attn_rel_err"], bf["attn_rel_err"]))


def test_prefill_reference_equals_backend_output_with_window_and_sinks():
    # one prefill step attends over the step's own K/V in compute precision: the backend's output is the
    # exact reference whatever the cache format
    rig = Rig(["fp8_e4m3", "fp8_e4m3"], windows=[3, None], sinks=True, k_scale=torch.full((2,), 0.01))
    q, k, v = rig.data(10, 4)
    rig.run_text(q, k, v, [10])
    for r in rig.probe.result():
        assert r["sliding_window"] == (3 if r["layer"] == 0 else None)
        assert max(r["attn_rel_err"]) < 1e-6, r["attn_rel_err"]
        assert min(r["k"]["rel_err"]) > 1e-3  # the stored values did change


def direct_attention64(qr, kr, vr, window, sinks, scale):
    """Float64 causal attention of every position over all earlier ones (window, sinks, GQA)."""
    S, Hq, _ = qr.shape
    g = Hq // kr.shape[1]
    kk, vv = kr.double().repeat_interleave(g, dim=1), vr.double().repeat_interleave(g, dim=1)
    logits = torch.einsum("qhd,khd->hqk", qr.double(), kk) * scale
    p = torch.arange(S)[:, None]
    j = torch.arange(S)[None, :]
    mask = j <= p
    if window is not None:
        mask &= j > p - window
    logits = logits.masked_fill(~mask, -math.inf)
    m = logits.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.double()[:, None, None])
    w = (logits - m).exp()
    denom = w.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + (sinks.double()[:, None, None] - m).exp()
    return torch.einsum("hqk,khd->qhd", w / denom, vv)


def test_attention_error_against_float64_reference_with_window_sinks_gqa():
    S = 14
    rig = Rig(["fp8_e4m3", "fp8_e4m3"], H=2, Hq=6, windows=[3, None], sinks=True)
    q, k, v = rig.data(S, 5)
    outs = rig.run_text(q, k, v, [4, 3, 1, 1, 1, 1, 1, 1, 1])  # prefill, chunked prefill, decode
    pos = torch.arange(S)
    for r, layer in zip(rig.probe.result(), rig.layers):
        i = layer.layer_idx
        qr, kr = apply_rope(q[i], pos, ROPE), apply_rope(k[i], pos, ROPE)
        ref = direct_attention64(qr, kr, v[i], layer.sliding_window, layer.sinks, layer.softmax_scale)
        d2 = ((outs[i].double() - ref) ** 2).reshape(S, 2, 3, D).sum((0, 2, 3))
        r2 = (ref**2).reshape(S, 2, 3, D).sum((0, 2, 3))
        want = (d2 / r2).sqrt()
        assert min(want) > 1e-3  # the fp8 cache matters in the non-first steps
        assert r["attn_rel_err"] == pytest.approx(want.tolist(), rel=1e-4)
        # the reference function itself against float64, on the whole sequence at once
        mine = reference_attention(qr, kr, v[i], 0, layer)
        assert torch.allclose(mine.double(), ref, atol=1e-5)


def test_planted_outliers_show_in_their_head():
    H = 4
    rig = Rig(["fp8_e4m3"], H=H, Hq=8, k_scale=torch.full((1,), 8.0 / 448), v_scale=torch.full((1,), 8.0 / 448))
    q, k, v = rig.data(12, 6)
    k[0, :, 2, 5] = 40.0  # RoPE mixes dim 5 with dim 21: both carry outliers after rotation
    rig.run_text(q, k, v, [6, 2, 1, 1, 1, 1])
    (r,) = rig.probe.result()
    kk = r["k"]
    assert max(range(H), key=lambda h: kk["rel_err"][h]) == 2
    assert kk["rel_err"][2] > 5 * max(kk["rel_err"][h] for h in (0, 1, 3))
    assert kk["saturated"][2] > 0 and all(kk["saturated"][h] == 0 for h in (0, 1, 3))
    assert kk["amax"][2] > 20 and all(kk["amax"][h] < 8 for h in (0, 1, 3))
    assert r["v"]["saturated"] == [0.0] * H
    assert kk["max_repr"] == pytest.approx([8.0] * H)


def test_wrapper_delegates_and_refuses_what_it_cannot_measure():
    rig = Rig(["fp8_e4m3", "bf16"])
    b = rig.backend
    assert isinstance(b, ProbedBackend) and b.name == "torch" and b.opts is rig.inner.opts
    assert b.supports("nvfp4", "decode") == rig.inner.supports("nvfp4", "decode")
    assert b.graph_safe is False and graph_safe(b) is False
    with pytest.raises(NotImplementedError, match="MLA"):
        b.forward_mla(None, None, None, None, rig.layers[0], rig.cache, None)
    q, k, v = rig.data(4)
    meta = meta_for(0, 2, B=2)
    b.plan(meta, rig.cache)
    with pytest.raises(ValueError, match="one text at a time"):
        b.forward(q[0], k[0], v[0], rig.layers[0], rig.cache, meta)
    rig.probe.begin_text()
    meta = meta_for(2, 2)
    b.plan(meta, rig.cache)
    with pytest.raises(ValueError, match="from position 0"):
        b.forward(q[0, 2:], k[0, 2:], v[0, 2:], rig.layers[0], rig.cache, meta)


def test_unseen_layers_are_reported_empty():
    probe = DiagnosticProbe(3, 2, D)
    res = probe.result()
    assert len(res) == 3 and res[1]["format"] is None and res[1]["k"]["values"] == 0
    assert res[1]["k"]["rel_err"] == [None, None] and res[1]["attn_rel_err"] == [None, None]
    json.dumps(res)


@pytest.mark.filterwarnings("ignore::kvbench.runtime.scales.UnitScaleWarning")
def test_engine_scoring_with_probe_and_a_bf16_layer():
    from kvbench.runtime.config import EngineConfig
    from kvbench.runtime.engine import Engine

    name = ("synthetic:gpt-oss-20b,layers=3,hidden=128,heads=4,kv_heads=2,head_dim=32,vocab=300,"
            "intermediate_size=128,window=6")
    e = Engine(EngineConfig(model=name, kv_dtype="fp8_e4m3", kv_dtype_skip_layers="1", kv_budget_gb=0.01,
                            max_model_len=256))
    try:
        m = e.runner.model.config
        probe = DiagnosticProbe(m.num_layers, m.num_kv_heads, m.head_dim)
        e.runner.backend = probe.wrap(e.runner.backend)
        tokens = 0
        for ctx, cont in (([5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23]), (list(range(30, 50)), [1, 2, 3])):
            probe.begin_text()
            e.score(ctx, cont, full_distribution=True)
            tokens += len(ctx) + len(cont) - 1  # the last continuation token is never fed
    finally:
        e.shutdown()
    res = probe.result()
    assert [r["format"] for r in res] == ["fp8_e4m3", "bf16", "fp8_e4m3"]
    assert [r["sliding_window"] for r in res] == [6, None, 6]
    assert all(r[p]["values"] == tokens * 32 for r in res for p in ("k", "v"))
    bf, fp8 = res[1], res[0]
    assert bf["k"]["max_repr"] is None and fp8["k"]["max_repr"] == [448.0, 448.0]
    # teacher-forced continuations read their K/V as stored: every layer's output moves, fp8 most
    assert all(0 < a < 1e-2 for a in bf["attn_rel_err"])
    assert min(fp8["attn_rel_err"]) > 3 * max(bf["attn_rel_err"])
    assert min(fp8["k"]["rel_err"]) > 5 * max(bf["k"]["rel_err"])

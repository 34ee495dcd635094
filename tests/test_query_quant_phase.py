"""fp8 queries per phase (``quantize_query``: none | prefill | decode | both).

* config: the values normalise to one canonical string (True = both, False = none); a bad value is a
  ``ConfigError`` naming the field, and a usage error naming ``--quantize-query`` on the command line;
* attention: on the torch backend and the Triton backend (interpreter), three steps on a paged fp8 cache
  (a prefill of two sequences, a mixed extend in which one sequence is plain and the other round-trip,
  a decode step) against a float64 reference written from ``runtime/attention/base.py``: each row's query
  is rounded through e4m3 exactly when its phase (round-trip rows: decode) is quantized; a phase that is not
  quantized gives the same bits as ``none``;
* engine: greedy generation with ``decode`` keeps the prefill's first token log-prob of ``none`` and moves
  the later ones, ``prefill`` the reverse; ``score(mode="prefill")`` under ``decode`` equals token-by-token
  decode scoring (and differs from ``none``), and ``both`` is the old ``True``;
* checkpoint query scales (``self_attn.q_scale``, ``self_attn.attn.q_scale``, ``q_proj.output_scale``)
  on a tiny safetensors checkpoint: loaded per layer, source ``checkpoint`` / ``checkpoint+unit`` / ``unit``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import logging

import pytest
import torch

from kvbench.core.client import SamplingParams
from kvbench.runtime.attention.base import AttentionLayer, AttentionMetadata, BackendOptions, apply_rope, build_rope_cache, query_fp8
from kvbench.runtime.attention.torch_backend import TorchBackend
from kvbench.runtime.config import ConfigError, EngineConfig, KVCacheSpec, QUERY_QUANT_MODES
from kvbench.runtime.engine import Engine
from kvbench.runtime.kv_cache import PagedKVCache
from kvbench.runtime.models.loader import load_model

MODES = ("none", "prefill", "decode", "both")
LLAMA = "synthetic:llama-3-8b,layers=2,hidden=128,heads=4,kv_heads=2,head_dim=32,vocab=300,intermediate_size=256"


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)  # unit-scale warnings of the fp8 cache
    yield
    logging.disable(logging.NOTSET)


# ------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("value,want", [(True, "both"), (False, "none"), ("prefill", "prefill"), ("Decode", "decode"),
                                        (" both ", "both"), ("none", "none")])
def test_config_normalises(value, want):
    c = EngineConfig(quantize_query=value)
    assert c.quantize_query == want and c.to_dict()["quantize_query"] == want
    assert BackendOptions(quantize_query=value).quantize_query == want
    assert EngineConfig().quantize_query == "none" and QUERY_QUANT_MODES == MODES


@pytest.mark.parametrize("bad", ["yes", "fp8", 1, 0, None, ["both"]])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ConfigError, match="quantize_query") as e:
        EngineConfig(quantize_query=bad)
    assert e.value.field == "quantize_query"


def test_cli_flag_takes_a_mode():
    import typer

    from kvbench.harness.options import ENGINE_PARAMS, build_engine_config

    defaults = {k: opt.default for k, (_, opt) in ENGINE_PARAMS.items()}
    assert defaults["quantize_query"] == "none"
    assert build_engine_config({**defaults, "quantize_query": "prefill"}).quantize_query == "prefill"
    with pytest.raises(typer.BadParameter, match="quantize_query") as e:
        build_engine_config({**defaults, "quantize_query": "sometimes"})
    assert e.value.param_hint == "'--quantize-query'"


# --------------------------------------------------------------------------------------- attention
PS, H, HK, D, QS = 4, 4, 2, 32, 0.05
TABLES = [[5, 1, 9, 3, 7, 10], [0, 8, 2, 6, 4, 11]]


def _meta(phase, seqs, rope, roundtrip=()):
    """seqs: [(prefix, q_len)] of sequences 0 and 1 (pages TABLES); ``roundtrip``: flagged sequences."""
    pos, slots, cu, lens = [], [], [0], []
    for (p, q), tb in zip(seqs, TABLES):
        pos += list(range(p, p + q))
        slots += [tb[i // PS] * PS + i % PS for i in range(p, p + q)]
        cu.append(cu[-1] + q)
        lens.append(p + q)
    meta = AttentionMetadata(phase, torch.tensor(pos), torch.tensor(slots), torch.tensor(TABLES, dtype=torch.int32),
                             torch.tensor(lens, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32),
                             max(q for _, q in seqs), max(lens), PS, rope, lens, [q for _, q in seqs])
    if roundtrip:
        meta.roundtrip_seqs_cpu = [b in roundtrip for b in range(len(seqs))]
        meta.roundtrip_rows = torch.tensor([b in roundtrip for b, (_, q) in enumerate(seqs) for _ in range(q)])
    return meta


# prefill of both sequences; an extend (sequence 0 plain, sequence 1 round-trip: a scored continuation);
# one decode step
STEPS = [("prefill", [(0, 7), (0, 5)], ()), ("prefill", [(7, 6), (5, 9)], (1,)), ("decode", [(13, 1), (14, 1)], ())]


def _run(backend_cls, mode):
    """The three steps on a fresh fp8_e4m3 cache; returns (outputs, step inputs, cache, rope, layer)."""
    g = torch.Generator().manual_seed(11)
    cache = PagedKVCache(KVCacheSpec(1, HK, D, "fp8_e4m3", PS), 12)
    cache.set_scales(torch.tensor([0.02]), torch.tensor([0.015]))
    rope = build_rope_cache(D, 64, 10000.0)
    layer = AttentionLayer(0, H, HK, D, D**-0.5, None, None, q_scale=QS)
    be = backend_cls(BackendOptions(kv_dtype="fp8_e4m3", quantize_query=mode))
    outs, inputs = [], []
    for phase, seqs, rt in STEPS:
        t = sum(q for _, q in seqs)
        q, k, v = torch.randn(t, H, D, generator=g), torch.randn(t, HK, D, generator=g), torch.randn(t, HK, D, generator=g)
        meta = _meta(phase, seqs, rope, rt)
        be.plan(meta, cache)
        outs.append(be.forward(q, k, v, layer, cache, meta))
        inputs.append((q, k, v))
    return outs, inputs, cache, rope


def _e4m3(x: torch.Tensor, s: float) -> torch.Tensor:
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s


def _reference(mode, inputs, cache, rope) -> list[torch.Tensor]:
    """float64 attention per base.py: plain prefill rows see their own K/V in compute precision, round-trip
    and decode rows read every K/V from the pages; a row's query goes through e4m3 when its phase is
    quantized (round-trip rows count as decode)."""
    pre_q, dec_q = mode in ("prefill", "both"), mode in ("decode", "both")
    res = []
    for (phase, seqs, rt), (q, k, v) in zip(STEPS, inputs):
        out = torch.zeros(q.shape[0], H * D, dtype=torch.float64)
        r0 = 0
        for b, (p, n) in enumerate(seqs):
            pos = torch.arange(p, p + n)
            as_decode = phase == "decode" or b in rt
            qr = apply_rope(q[r0 : r0 + n], pos, rope).double()
            if (dec_q if as_decode else pre_q):
                qr = _e4m3(qr, QS)
            slots = torch.tensor([TABLES[b][i // PS] * PS + i % PS for i in range(p + n)])
            ks, vs = (x.double() for x in cache.read_slots(0, slots, torch.float32))
            if not as_decode:  # the new tokens' own K/V in compute precision
                ks[p:], vs[p:] = apply_rope(k[r0 : r0 + n], pos, rope).double(), v[r0 : r0 + n].double()
            ks, vs = ks.repeat_interleave(H // HK, 1), vs.repeat_interleave(H // HK, 1)
            sc = torch.einsum("qhd,khd->hqk", qr, ks) * D**-0.5
            sc = sc.masked_fill(torch.arange(p + n)[None, None, :] > pos[None, :, None], float("-inf"))
            out[r0 : r0 + n] = torch.einsum("hqk,khd->qhd", sc.softmax(-1), vs).reshape(n, H * D)
            r0 += n
        res.append(out)
    return res


def _rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def _backends():
    from kvbench.runtime.attention.triton_backend import TritonBackend

    return [TorchBackend, TritonBackend]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_phases_against_float64_reference(backend):
    cls = dict(zip(("torch", "triton"), _backends()))[backend]
    runs = {m: _run(cls, m) for m in MODES}
    for mode, (outs, inputs, cache, rope) in runs.items():
        ref = _reference(mode, inputs, cache, rope)
        for i, (o, r) in enumerate(zip(outs, ref)):
            assert torch.isfinite(o).all()
            assert _rel(o, r) < 1e-5, (backend, mode, i, _rel(o, r))
        # the reference of the other treatment is far: the test tells quantized from plain queries
        other = _reference({"none": "both", "both": "none", "prefill": "decode", "decode": "prefill"}[mode], inputs, cache, rope)
        assert all(_rel(o, r) > 1e-3 for o, r in zip(outs, other)), mode
    none, both = runs["none"][0], runs["both"][0]
    pre, dec = runs["prefill"][0], runs["decode"][0]
    # a phase that is not quantized gives exactly the unquantized bits, a quantized one those of "both"
    assert torch.equal(pre[0], both[0]) and torch.equal(dec[0], none[0])  # plain prefill
    assert torch.equal(pre[2], none[2]) and torch.equal(dec[2], both[2])  # decode step
    # the mixed extend: sequence 0's rows (plain prefill) follow the prefill setting, sequence 1's
    # (round-trip) the decode setting
    n0 = STEPS[1][1][0][1]
    assert torch.equal(dec[1][:n0], none[1][:n0]) and torch.allclose(dec[1][n0:], both[1][n0:], rtol=0, atol=1e-6)
    assert torch.equal(pre[1][n0:], none[1][n0:]) and torch.allclose(pre[1][:n0], both[1][:n0], rtol=0, atol=1e-6)
    assert not torch.allclose(dec[1][n0:], none[1][n0:], atol=1e-4)


def test_query_fp8_per_step():
    rope = build_rope_cache(D, 64)
    for mode in MODES:
        o = BackendOptions(quantize_query=mode)
        p, d = mode in ("prefill", "both"), mode in ("decode", "both")
        assert query_fp8(o, _meta("prefill", STEPS[0][1], rope)) is p
        assert query_fp8(o, _meta("decode", STEPS[2][1], rope)) is d
        mixed = query_fp8(o, _meta("prefill", STEPS[1][1], rope, (1,)))
        assert mixed == (p if p == d else [p, d])
        assert query_fp8(o, _meta("prefill", STEPS[1][1], rope, (0, 1))) is d  # every row round-trip


# ------------------------------------------------------------------------------------------ engine
@pytest.fixture(scope="module")
def loaded():
    return load_model(LLAMA, seed=3)


def _engine(loaded, mode, **kw):
    kw.setdefault("max_num_batched_tokens", 16)
    return Engine(EngineConfig(kv_dtype="fp8_e4m3", kv_scales="calibrate", kv_budget_gb=0.01, max_model_len=256,
                               quantize_query=mode, **kw), loaded=loaded)


PROMPT = [(i * 13 + 5) % 300 for i in range(21)]
CTX, CONT = PROMPT, [(i * 7) % 300 for i in range(30)]


def _generate(loaded, mode):
    e = _engine(loaded, mode)
    try:
        out = e.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1))[0]
        assert e.info()["quantize_query"] == mode and e.capacity.extra["quantize_query"] == mode
        return out
    finally:
        e.shutdown()


def test_generation_per_phase(loaded):
    outs = {m: _generate(loaded, m) for m in MODES}
    lp = {m: torch.tensor(o.logprobs) for m, o in outs.items()}
    assert all(len(o.token_ids) == 12 for o in outs.values())
    # the first token comes from the prefill: decode-only quantization leaves it alone, prefill-only does not
    assert lp["decode"][0] == lp["none"][0] and lp["both"][0] == lp["prefill"][0]
    assert abs(float(lp["prefill"][0] - lp["none"][0])) > 1e-5
    # the decode steps: decode-only moves them (same greedy tokens compared while they agree)
    same = next((i for i, (a, b) in enumerate(zip(outs["decode"].token_ids, outs["none"].token_ids)) if a != b), 12)
    assert same > 1 and float((lp["decode"][1:same] - lp["none"][1:same]).abs().max()) > 1e-5


def _kl_max(p, q) -> float:
    return float((p.exp() * (p - q)).sum(-1).max())


@pytest.mark.parametrize("mode", ["decode", "prefill", "both"])
def test_prefill_scoring_follows_decode_setting(loaded, mode):
    """Scored continuation rows use the decode-phase setting: the fast (extend) scoring equals token-by-token
    decode scoring under every mode, and the decode setting shows in the numbers (control: none)."""
    e = _engine(loaded, mode)
    base = _engine(loaded, "none")
    try:
        ref = e.score(CTX, CONT, top_k=5, full_distribution=True, mode="decode")
        fast = e.score(CTX, CONT, top_k=5, full_distribution=True, mode="prefill")
        plain = base.score(CTX, CONT, top_k=5, full_distribution=True, mode="prefill")
    finally:
        e.shutdown()
        base.shutdown()
    assert torch.isfinite(fast.full_logprobs).all()
    kl = _kl_max(ref.full_logprobs, fast.full_logprobs)
    d = (torch.tensor(ref.logprobs) - torch.tensor(fast.logprobs)).abs()
    assert ref.greedy == fast.greedy and ref.top_ids == fast.top_ids
    assert kl < 2e-5 and float(d.median()) < 1e-4 and float(d.max()) < 1e-2, (kl, d)
    assert _kl_max(ref.full_logprobs, plain.full_logprobs) > max(20 * kl, 1e-5)


def test_both_is_the_old_true(loaded):
    a, b = _engine(loaded, True), _engine(loaded, "both")
    try:
        assert a.config.quantize_query == "both" and a.info()["quantize_query"] == "both"
        ra, rb = a.score(CTX, CONT[:10]), b.score(CTX, CONT[:10])
        assert ra.logprobs == rb.logprobs
    finally:
        a.shutdown()
        b.shutdown()


def test_triton_engine_scores_decode_setting(loaded):
    e = _engine(loaded, "decode", prefill_backend="triton", decode_backend="triton")
    try:
        ctx, cont = CTX[:9], CONT[:12]
        ref = e.score(ctx, cont, top_k=3, full_distribution=True, mode="decode")
        fast = e.score(ctx, cont, top_k=3, full_distribution=True)
        assert ref.greedy == fast.greedy and ref.top_ids == fast.top_ids
        assert _kl_max(ref.full_logprobs, fast.full_logprobs) < 2e-5
    finally:
        e.shutdown()


# ------------------------------------------------------------------------------ checkpoint q scales
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=128, rms_norm_eps=1e-6)


def _tiny_checkpoint(path, scales: dict) -> None:
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval().save_pretrained(path, safe_serialization=True)
    f = path / "model.safetensors"
    st = load_file(str(f))
    st.update({k: torch.tensor(v) for k, v in scales.items()})
    save_file(st, str(f), metadata={"format": "pt"})


def _engine_on(path, mode="both"):
    from kvbench.runtime.models.hf_loader import load_hf_dir
    from kvbench.runtime.models.loader import LoadedModel, model_class
    from kvbench.runtime.models.synthetic import ByteTokenizer

    cfg, state, scales = load_hf_dir(path)
    model = model_class(cfg).from_state(cfg, state, "cpu", torch.float32)
    model.eval()
    model.bind()
    loaded = LoadedModel("tiny", cfg, model, ByteTokenizer(cfg.vocab_size), scales, "hf")
    return Engine(EngineConfig(kv_dtype="fp8_e4m3", kv_budget_gb=0.01, max_model_len=64, quantize_query=mode), loaded=loaded)


@pytest.mark.parametrize("names,values,source", [
    (["model.layers.{i}.self_attn.q_scale"] * 3, [0.5, 0.25, 2.0], "checkpoint"),
    (["model.layers.{i}.self_attn.attn.q_scale", "model.layers.{i}.self_attn.q_proj.output_scale",
      "model.layers.{i}.self_attn.attn.q_scale"], [0.125, 0.75, 4.0], "checkpoint"),
    (["model.layers.{i}.self_attn.q_scale", None, None], [0.5, 1.0, 1.0], "checkpoint+unit"),
    ([None] * 3, [1.0] * 3, "unit"),
])
def test_query_scale_from_checkpoint(tmp_path, names, values, source):
    scales = {n.format(i=i): v for i, (n, v) in enumerate(zip(names, values)) if n is not None}
    scales["model.layers.0.self_attn.k_scale"] = 0.03  # k/v scales still read as before
    scales["model.layers.0.self_attn.v_scale"] = 0.02
    _tiny_checkpoint(tmp_path, scales)
    e = _engine_on(tmp_path)
    try:
        assert [layer.q_scale for layer in e.runner.model.attention_layers] == values
        assert e.capacity.extra["q_scale_source"] == source
        info = e.info()
        assert info["q_scale"] == {"source": source, "min": min(values), "max": max(values)}
        assert float(e.parts.loaded.scales.k[0]) == pytest.approx(0.03)
        out = e.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
        assert len(out.token_ids) == 4
    finally:
        e.shutdown()


def test_query_scale_changes_quantized_attention(tmp_path):
    """The checkpoint's q scale reaches the backends: a scale far below the query's range saturates e4m3
    (different logprobs), while with quantize_query none the scale is unused."""
    a, b = tmp_path / "a", tmp_path / "b"
    _tiny_checkpoint(a, {})
    _tiny_checkpoint(b, {f"model.layers.{i}.self_attn.q_scale": 1e-4 for i in range(3)})
    lps = {}
    for name, path in (("unit", a), ("tiny", b)):
        for mode in ("none", "both"):
            e = _engine_on(path, mode)
            try:
                lps[name, mode] = e.score([1, 2, 3, 4, 5, 6], [7, 8, 9, 10]).logprobs
            finally:
                e.shutdown()
    # unused: equal up to float32 rounding (two separately loaded models may differ in the last bit, since the
    # CPU kernels' vector paths depend on where the weights sit in memory), far below the saturated difference
    assert max(abs(x - y) for x, y in zip(lps["unit", "none"], lps["tiny", "none"])) < 1e-5
    assert max(abs(x - y) for x, y in zip(lps["unit", "both"], lps["tiny", "both"])) > 1e-3


def test_scale_names():
    from kvbench.runtime.models.hf_loader import scale_kind

    assert scale_kind("model.layers.3.self_attn.q_scale") == (3, "q_scale")
    assert scale_kind("model.layers.3.self_attn.attn.q_scale") == (3, "q_scale")
    assert scale_kind("model.layers.3.self_attn.q_proj.output_scale") == (3, "q_scale")
    assert scale_kind("model.layers.1.self_attn.k_proj.output_scale") == (1, "k_scale")
    assert scale_kind("model.layers.1.self_attn.v_proj.v_scale") == (1, "v_scale")
    assert scale_kind("model.layers.1.self_attn.kv_scale") == (1, "kv_scale")
    assert scale_kind("model.layers.1.self_attn.q_proj.weight") is None
    assert scale_kind("model.layers.1.mlp.q_scale") is None


# ------------------------------------------------------------------------------------------------ MLA
R, ROPE, NOPE, VD = 64, 32, 16, 16


def _mla_mixed(backend: str, mode: str) -> torch.Tensor:
    """The mixed extend of ``STEPS`` (sequence 1 round-trip) through an MLA layer on a fresh e4m3 latent cache."""
    from kvbench.runtime.attention.mla_base import MLAAttentionLayer
    from kvbench.runtime.attention.registry import create_backend

    g = torch.Generator().manual_seed(5)
    cache = PagedKVCache(KVCacheSpec(1, 1, R + ROPE, "fp8_e4m3", PS, mla=True), 12)
    cache.set_scales(torch.tensor([0.01]), None)
    rope = build_rope_cache(ROPE, 64, 10000.0)
    layer = MLAAttentionLayer(0, H, R, NOPE, ROPE, VD, (NOPE + ROPE) ** -0.5, w_uk=torch.randn(H, NOPE, R, generator=g) / 8,
                              w_uv=torch.randn(H, VD, R, generator=g) / 8, q_scale=QS)
    be = create_backend(backend, backend, BackendOptions(kv_dtype="fp8_e4m3", fused_append=False, quantize_query=mode), mla=True)
    out = None
    for phase, seqs, rt in STEPS[:2]:
        t = sum(q for _, q in seqs)
        x = (torch.randn(t, H, NOPE, generator=g), torch.randn(t, H, ROPE, generator=g), torch.randn(t, R, generator=g),
             torch.randn(t, ROPE, generator=g))
        meta = _meta(phase, seqs, rope, rt)
        be.plan(meta, cache)
        out = be.forward_mla(*x, layer, cache, meta)
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mla_mixed_step_per_sequence(backend):
    """MLA: in a step mixing a plain extend (sequence 0) and a round-trip continuation (sequence 1), each
    sequence's rows follow its own phase setting (the absorbed query through e4m3 or not)."""
    out = {m: _mla_mixed(backend, m) for m in MODES}
    n0 = STEPS[1][1][0][1]
    assert all(torch.isfinite(o).all() for o in out.values())
    tol = 0 if backend == "torch" else 1e-4
    for mode, (a, b) in {"decode": ("none", "both"), "prefill": ("both", "none")}.items():
        assert _rel(out[mode][:n0], out[a][:n0].double()) <= tol, (mode, "sequence 0")
        assert _rel(out[mode][n0:], out[b][n0:].double()) <= max(tol, 1e-6), (mode, "sequence 1")
    assert _rel(out["both"], out["none"].double()) > 1e-3  # fp8 absorbed queries are visible

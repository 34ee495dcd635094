"""Mixed per-layer KV formats in the engine: each layer's planes in its own format, exact capacity, per-format
calibrated scales, the same numbers on the torch and Triton backends, and one clear error per bad map."""

from __future__ import annotations

import pytest
import torch

from kvbench.core.formats import get_spec
from kvbench.kernels.formats import get_format
from kvbench.runtime.config import ConfigError, EngineConfig, KVCacheSpec
from kvbench.runtime.engine import Engine
from kvbench.runtime.kv_cache import PagedKVCache, bytes_per_token, plan_capacity
from kvbench.runtime.models.loader import load_model

MODEL = "synthetic:llama-3-8b,layers=4,hidden=128,heads=4,kv_heads=2,head_dim=32,vocab=300,intermediate_size=256"
OSS = "synthetic:gpt-oss-20b,layers=4,hidden=128,heads=4,kv_heads=2,head_dim=32,vocab=300,intermediate_size=128,window=6"


@pytest.fixture(scope="module")
def loaded():
    return load_model(MODEL, seed=5)


def _engine(loaded, **kw):
    kw.setdefault("kv_budget_gb", 0.01)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_batched_tokens", 16)
    return Engine(EngineConfig(**kw), loaded=loaded)


def _score(engine, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, 290, (10,), generator=g).tolist()
    cont = torch.randint(1, 290, (40,), generator=g).tolist()
    try:
        return engine.score(ctx, cont, full_distribution=True).full_logprobs
    finally:
        engine.shutdown()


def test_cache_lays_out_each_layer_in_its_format():
    fmts = ("bf16", "fp8_e4m3", "nvfp4", "fp8_e5m2")
    spec = KVCacheSpec(4, 2, 32, "fp8_e4m3", page_size=16, layer_dtypes=fmts)
    cache = PagedKVCache(spec, 3)
    for i, f in enumerate(fmts):
        fmt = get_format(f)
        assert cache.fmt_of(i).name == f
        assert cache.k_data[i].dtype == fmt.storage_dtype and cache.v_data[i].dtype == fmt.storage_dtype
        assert cache.k_data[i].shape[-1] == fmt.packed_dim(32)
        assert (cache.k_block_scale[i] is not None) == (f == "nvfp4")
    # bytes per token: each layer in its own format, K and V, 2 kv heads, head_dim 32
    want = sum(2 * 2 * get_spec(f).bytes_per_token(32) for f in fmts)
    assert bytes_per_token(spec) == pytest.approx(want)
    assert want == 2 * 2 * (64 + 32 + 16 + 2 + 32)  # bf16 64 B, fp8 32 B, nvfp4 16 B + 2 block scales
    plan = plan_capacity(spec, 2**20, 100)
    assert plan.tokens == int(2**20 // (want * 16)) * 16
    # writes and reads go through each layer's format
    x = torch.randn(5, 2, 32)
    slots = torch.arange(5)
    for i, f in enumerate(fmts):
        cache.write(i, slots, x, x)
        k, _ = cache.read_slots(i, slots)
        assert torch.equal(k, get_format(f).roundtrip(x, cache.k_scale[i]))


def test_uniform_map_collapses_and_bad_maps_are_refused():
    assert KVCacheSpec(2, 2, 32, "fp8_e4m3", layer_dtypes=("fp8_e4m3", "fp8_e4m3")).layer_dtypes is None
    with pytest.raises(ConfigError, match="entries for 2 layers"):
        KVCacheSpec(2, 2, 32, "fp8_e4m3", layer_dtypes=("bf16",))
    with pytest.raises(ConfigError, match="MLA"):
        KVCacheSpec(2, 1, 64, "fp8_e4m3", mla=True, layer_dtypes=("bf16", "fp8_e4m3"))
    with pytest.raises(ConfigError, match="kv_layer_dtypes: 'fp9' is not a KV format"):
        EngineConfig(kv_dtype="fp8_e4m3", kv_layer_dtypes="0:fp9")
    with pytest.raises(ConfigError, match="kv_dtype_skip_layers: 'x' is not a layer index"):
        EngineConfig(kv_dtype="fp8_e4m3", kv_dtype_skip_layers="0,x")
    assert EngineConfig(kv_dtype="fp8_e4m3", kv_dtype_skip_layers=[31, 0, 1]).kv_dtype_skip_layers == "0,1,31"


def test_unknown_layer_is_one_error_at_start(loaded):
    with pytest.raises(ConfigError, match=r"kv_dtype_skip_layers: layer 4 is not a layer of this model \(it has 4: 0..3\)"):
        _engine(loaded, kv_dtype="fp8_e4m3", kv_dtype_skip_layers="1,4")
    with pytest.raises(ConfigError, match="sliding_window matches no layer"):
        _engine(loaded, kv_dtype="fp8_e4m3", kv_dtype_skip_layers="sliding_window")
    with pytest.raises(ConfigError, match="in kv_dtype_skip_layers and kv_layer_dtypes"):
        _engine(loaded, kv_dtype="fp8_e4m3", kv_dtype_skip_layers="1", kv_layer_dtypes="1:nvfp4")


def test_every_layer_skipped_is_bf16_exactly(loaded):
    ref = _score(_engine(loaded, kv_dtype="bf16"))
    cand = _score(_engine(loaded, kv_dtype="fp8_e5m2", kv_scales="calibrate"))
    skipped = _score(_engine(loaded, kv_dtype="fp8_e5m2", kv_scales="calibrate", kv_dtype_skip_layers="0-3"))
    one = _score(_engine(loaded, kv_dtype="fp8_e5m2", kv_scales="calibrate", kv_dtype_skip_layers="2"))
    assert torch.equal(skipped, ref)
    kl = lambda p, q: float((p.exp() * (p - q)).sum(-1).mean())  # noqa: E731
    assert kl(ref, cand) > 1e-4  # the candidate really is lossy here
    assert 0 < kl(ref, one) < kl(ref, cand) * 1.5 and not torch.equal(one, cand)


def test_capacity_report_is_exact_and_names_the_map(loaded):
    e = _engine(loaded, kv_dtype="nvfp4", kv_scales="calibrate", kv_dtype_skip_layers="0", kv_layer_dtypes="3:fp8_e4m3")
    try:
        fmts = ["bf16", "nvfp4", "nvfp4", "fp8_e4m3"]
        assert [f.name for f in e.cache.formats] == fmts
        want = sum(2 * 2 * get_spec(f).bytes_per_token(32) for f in fmts)
        assert e.capacity.bytes_per_token == pytest.approx(want)
        ex = e.capacity.extra
        assert ex["kv_dtype_skip_layers"] == "0" and ex["kv_layer_dtypes"] == "3:fp8_e4m3"
        assert ex["layer_formats"] == {"nvfp4": 2, "bf16": 1, "fp8_e4m3": 1}
        assert "nvfp4 (bf16 on 0; fp8_e4m3 on 3)" in e.capacity.log_line()
        # calibrated scales follow each layer's format (test_calibrated_scale_per_layer_format): bf16 keeps 1
        assert float(e.scales.k[0]) == 1.0 and float(e.scales.k[1]) != 1.0
    finally:
        e.shutdown()


def test_calibrated_scale_per_layer_format():
    from kvbench.runtime.scales import AmaxObserver

    obs = AmaxObserver(3, 1)
    k = torch.tensor([[[1.0, -12.0]]])
    for layer in range(3):
        obs.observe(layer, k * (layer + 1), k)
    s = obs.scales("nvfp4", layer_dtypes=["bf16", "fp8_e4m3", "nvfp4"])
    assert s.k.tolist() == pytest.approx([1.0, 24.0 / 448, 36.0 / (6 * 448)])


def test_sliding_window_pattern_on_a_model_with_windows():
    oss = load_model(OSS, seed=1)
    wins = oss.config.sliding_windows
    e = Engine(EngineConfig(kv_dtype="fp8_e4m3", kv_dtype_skip_layers="sliding_window", kv_scales="calibrate", kv_budget_gb=0.01, max_model_len=64),
               loaded=oss)
    try:
        assert [f.name for f in e.cache.formats] == ["bf16" if w is not None else "fp8_e4m3" for w in wins]
        assert any(w is not None for w in wins) and any(w is None for w in wins)
    finally:
        e.shutdown()


def test_triton_backend_runs_a_mixed_cache_like_torch(loaded):
    """TRITON_INTERPRET on CPU: the Triton kernels read each layer in its own format (bf16, fp8, nvfp4)."""
    kw = dict(kv_dtype="nvfp4", kv_scales="calibrate", kv_dtype_skip_layers="0", kv_layer_dtypes="2:fp8_e4m3", max_model_len=64)
    ref = _score(_engine(loaded, **kw))
    tri = _score(_engine(loaded, prefill_backend="triton", decode_backend="triton", **kw))
    assert torch.isfinite(tri).all()
    assert float((tri - ref).abs().max()) < 2e-3

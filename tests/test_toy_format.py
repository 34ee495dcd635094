"""Adding a KV format is its table entry plus its numerics: the test-only ``int8_tok`` format
(tests/kvbench_toy_format.py, int8 elements with a per-token scale stored beside each token) reaches the
format table, config validation, the paged cache, capacity planning, the torch backend, ``kvbench formats``
and ``kvbench eval`` without any other change, and the Triton and FlashInfer backends refuse it by name."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbench.core.backends import assert_supported, supported_formats
from kvbench.core.formats import format_names, get_spec

HERE = Path(__file__).resolve().parent
KVBENCH = str(Path(sys.executable).parent / "kvbench")
DATA = HERE.parents[1] / "shared" / "data"
TOY = "int8_tok"


@pytest.fixture
def toy():
    """The plugin module, registered for one test and removed afterwards (other tests see the built-ins)."""
    spec = importlib.util.spec_from_file_location("kvbench_toy_format", HERE / "kvbench_toy_format.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # registers the format
    try:
        yield mod
    finally:
        mod.unregister()
    assert TOY not in format_names()


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(HERE), "KVBENCH_PLUGINS": "kvbench_toy_format"}


# --------------------------------------------------------------------------------- the table
def test_table_entry_and_refusals(toy):
    from kvbench.kernels.formats import FORMATS, get_format

    assert format_names()[-1] == TOY and TOY in FORMATS
    s = get_spec(TOY)
    assert (s.storage, s.token_scale, s.tensor_scale, s.block_size) == ("int8", True, False, 0)
    assert s.bytes_per_token(64) == 64 + 4 and s.scale_text == "fp32 per token"
    assert get_format(TOY).storage_dtype == torch.int8
    assert supported_formats("torch", "decode")[-1] == TOY
    assert TOY not in supported_formats("triton") and TOY not in supported_formats("flashinfer", "decode")
    with pytest.raises(ValueError, match=r"the triton backend does not support kv format int8_tok for prefill "
                                         r"\(supported: bf16, fp16, fp8_e4m3, fp8_e5m2, nvfp4\)"):
        assert_supported("triton", TOY, "prefill")
    with pytest.raises(ValueError, match=r"flashinfer backend .* int8_tok for decode \(supported: bf16, fp16, fp8_e4m3, fp8_e5m2\)"):
        assert_supported("flashinfer", TOY, "decode")
    assert_supported("torch", TOY, "decode")  # no error


def test_unregistered_format_is_refused_everywhere():
    from kvbench.harness.sweep.config import SweepConfigError, parse_config
    from kvbench.runtime.config import ConfigError, EngineConfig

    assert TOY not in format_names()
    with pytest.raises(ConfigError, match="kv_dtype='int8_tok' is not supported"):
        EngineConfig(kv_dtype=TOY)
    with pytest.raises(SweepConfigError, match="axes.kv.1..dtype"):
        parse_config({"axes": {"kv": ["bf16", TOY]}})


def test_numerics_are_required(toy):
    from kvbench.core.formats import FormatSpec, register_format, unregister_format
    from kvbench.kernels.formats import get_format

    register_format(FormatSpec("int8_bare", 8, "int8", max_value=127.0, quantized=True))
    try:
        with pytest.raises(ValueError, match="'int8_bare' is in the format table but has no numerics"):
            get_format("int8_bare")
    finally:
        unregister_format("int8_bare")


def test_roundtrip_within_half_a_step(toy):
    from kvbench.kernels.formats import get_format

    fmt = get_format(TOY)
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([0.1, 1.0, 30.0])[:, None]
    x[0, 0] = 0.0  # an all-zero vector gets scale 1 and stays zero
    q = fmt.quantize(x)
    assert q.data.dtype == torch.int8 and q.token_scale.shape == (5, 3) and q.block_scale is None
    step = x.abs().amax(-1) / 127
    assert torch.equal(q.data.abs().amax(-1)[1:], torch.full((4, 3), 127, dtype=torch.int8))
    err = (fmt.dequantize(q) - x).abs()
    assert (err <= step.unsqueeze(-1) / 2 + 1e-6).all() and err.max() > 0
    assert float(q.token_scale[0, 0]) == 1.0 and fmt.dequantize(q)[0, 0].abs().max() == 0


# ------------------------------------------------------------------------- cache and capacity
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_paged_cache_stores_token_scales(toy, layout):
    from kvbench.kernels.formats import get_format
    from kvbench.runtime.config import KVCacheSpec
    from kvbench.runtime.kv_cache import PagedKVCache, bytes_per_token, plan_capacity

    spec = KVCacheSpec(2, 3, 64, TOY, 4, layout=layout)
    cache = PagedKVCache(spec, 5)
    assert cache.k_token_scale[1].shape == (6, 4, 3) and cache.k_token_scale[1].dtype == torch.float32
    assert cache.k_block_scale[0] is None and cache.k_data[0].dtype == torch.int8
    assert bytes_per_token(spec) == 2 * 2 * 3 * (64 + 4)
    assert cache.total_bytes == 2 * 2 * 6 * 4 * 3 * (64 + 4)  # data + token scales, scratch page included
    plan = plan_capacity(spec, 10 * 4 * bytes_per_token(spec), 8)
    assert (plan.num_pages, plan.max_concurrency) == (10, 5)

    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(7, 3, 64, generator=g) * 3, torch.randn(7, 3, 64, generator=g) / 5
    slots = torch.tensor([0, 1, 2, 3, 9, 10, 17])
    cache.write(1, slots, k, v)
    kr, vr = cache.read_slots(1, slots)
    fmt = get_format(TOY)
    assert torch.equal(kr, fmt.roundtrip(k)) and torch.equal(vr, fmt.roundtrip(v))
    page, off = slots // 4, slots % 4
    assert torch.allclose(cache.v_token_scale[1][page, off], v.abs().amax(-1) / 127)


def test_torch_backend_decodes_through_the_token_scales(toy):
    """One decode step over a 9-token prefix equals float64 attention over the int8_tok round trip of
    every cached K/V, and differs from the bf16 cache's result."""
    from kvbench.kernels.formats import get_format
    from kvbench.runtime.attention.base import AttentionLayer, AttentionMetadata, BackendOptions, apply_rope, build_rope_cache
    from kvbench.runtime.attention.registry import create_backend
    from kvbench.runtime.config import KVCacheSpec
    from kvbench.runtime.kv_cache import PagedKVCache

    H, HK, D, P, PS = 4, 2, 32, 9, 4
    g = torch.Generator().manual_seed(2)
    pk, pv = torch.randn(P, HK, D, generator=g), torch.randn(P, HK, D, generator=g)
    q, k, v = torch.randn(1, H, D, generator=g), torch.randn(1, HK, D, generator=g), torch.randn(1, HK, D, generator=g)
    rope = build_rope_cache(D, 64, 10000.0)
    layer = AttentionLayer(0, H, HK, D, 1 / math.sqrt(D))

    def run(kv_dtype):
        cache = PagedKVCache(KVCacheSpec(1, HK, D, kv_dtype, PS), 4)
        cache.write(0, torch.arange(P), apply_rope(pk, torch.arange(P), rope), pv)
        meta = AttentionMetadata("decode", torch.tensor([P]), torch.tensor([P]), torch.tensor([[0, 1, 2]], dtype=torch.int32),
                                 torch.tensor([P + 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1, P + 1,
                                 PS, rope, [P + 1], [1])
        backend = create_backend("torch", "torch", BackendOptions(kv_dtype=kv_dtype))
        return backend.forward(q, k, v, layer, cache, meta)

    fmt = get_format(TOY)
    K = fmt.roundtrip(apply_rope(torch.cat((pk, k)), torch.arange(P + 1), rope)).double()
    V = fmt.roundtrip(torch.cat((pv, v))).double()
    qr = apply_rope(q, torch.tensor([P]), rope).double()
    ref = torch.cat([torch.softmax(K[:, h // 2] @ qr[0, h] * layer.softmax_scale, 0) @ V[:, h // 2] for h in range(H)])
    out = run(TOY)
    assert (out[0].double() - ref).abs().max() < 1e-5
    assert (run("bf16") - out).abs().max() > 1e-4  # the format changed the numbers


def test_runtime_registry_refuses_triton(toy):
    from kvbench.runtime.attention.base import UnsupportedBackend
    from kvbench.runtime.attention.registry import check_supported

    check_supported("torch", "torch", TOY)
    with pytest.raises(UnsupportedBackend, match="backend 'triton' does not support kv_dtype='int8_tok' for prefill"):
        check_supported("triton", "triton", TOY)


def test_sweep_config_and_unit_scales(toy, recwarn):
    from kvbench.harness.sweep.config import parse_config
    from kvbench.runtime.scales import unit_scales

    cfg = parse_config({"axes": {"kv": ["bf16", TOY]}})
    assert [k.dtype for k in cfg.kv] == ["bf16", TOY]
    unit_scales(TOY, 2)  # no tensor scale: unit scales are exact, no warning
    assert not [w for w in recwarn if "unit scales" in str(w.message)]
    # on the triton backend the sweep config is refused when it loads, naming the backend and what it runs
    from kvbench.harness.sweep.config import SweepConfigError

    with pytest.raises(SweepConfigError, match=rf"the triton backend does not run {TOY} for prefill \(it runs bf16, "):
        parse_config({"axes": {"kv": ["bf16", TOY], "backends": ["torch", "triton"]}})


# --------------------------------------------------------------------------------- the CLI
def test_cli_lists_and_refuses():
    fm = json.loads(subprocess.run([KVBENCH, "formats", "--json"], env=_env(), capture_output=True, text=True,
                                   check=True).stdout)
    row = {r["name"]: r for r in fm}[TOY]
    assert row["backends"] == {"torch": ["prefill", "decode"]} and row["token_scale_bytes"] == 4
    assert row["storage"] == "int8" and row["scale"] == "fp32 per token"
    for flags, needle in ((["--backend", "triton"], "the triton backend does not support kv format int8_tok"),
                          (["--decode-backend", "flashinfer"], "flashinfer backend does not")):
        r = subprocess.run([KVBENCH, "eval", "--suite", "gsm8k", "--limit", "1", "--kv-dtype", TOY, *flags],
                           env=_env(), capture_output=True, text=True)
        assert r.returncode == 2 and needle in " ".join(r.stderr.replace("│", " ").split()), r.stderr
    plain = subprocess.run([KVBENCH, "formats", "--json"], capture_output=True, text=True, check=True).stdout
    assert TOY not in plain  # nothing without the plugin
    bad = subprocess.run([KVBENCH, "formats"], env={**os.environ, "KVBENCH_PLUGINS": "no_such_plugin_mod"},
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "cannot import plugin 'no_such_plugin_mod'" in bad.stderr


@pytest.mark.slow
@pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists(), reason="shared GSM8K data not present")
def test_cli_eval_runs_the_toy_format(tmp_path):
    """`kvbench eval` on the default model (CPU, torch backend) with the toy format end to end."""
    out = tmp_path / "run"
    r = subprocess.run([KVBENCH, "eval", "--suite", "gsm8k", "--limit", "2", "--max-tokens", "4", "--kv-dtype", TOY,
                        "--data-dir", str(DATA), "--out", str(out), "--no-progress"],
                       env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    items = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    assert len(items) == 2 and all(i["error"] is None and i["output_tokens"] == 4 for i in items)
    cap = json.loads((out / "summary.json").read_text())["capacity"]
    # SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64; K and V, each 64 int8 + one fp32 token scale
    assert cap["kv_dtype"] == TOY and cap["bytes_per_token"] == 2 * 30 * 3 * (64 + 4)

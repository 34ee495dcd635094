"""The runtime's KV budget from free device memory: the activation reserve, and the prefix workspaces reserved
for quantized caches — the MLA prefill's for a quantized latent, the GQA extend's for a quantized KV cache
(torch.cuda faked; runs on CPU)."""

from types import SimpleNamespace

import torch

from kvbench.kernels.mla_prefill import WORKSPACE_BYTES
from kvbench.kernels.prefill import WORKSPACE_CAP_BYTES
from kvbench.runtime.models import engine_setup as S


def _budget(monkeypatch, kv_dtype, mla, layer_dtypes=None):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (40 * 2**30, 80 * 2**30))
    cfg = SimpleNamespace(kv_budget_gb=None, max_num_batched_tokens=2048, max_running=64, mem_fraction=0.9, kv_dtype=kv_dtype,
                          kv_layer_dtypes=layer_dtypes)
    m = SimpleNamespace(intermediate_size=1536, hidden_size=576, vocab_size=49152, is_mla=mla)
    return S.kv_budget_bytes(cfg, torch.device("cuda"), SimpleNamespace(config=m))


def test_mla_quantized_cache_reserves_the_prefix_workspace(monkeypatch):
    base = _budget(monkeypatch, "bf16", mla=False)
    act = 2048 * (3 * 1536 + 6 * 576) * 4 + 64 * 49152 * 4 * 3 + 512 * 2**20
    assert base == 40 * 2**30 * 0.9 - act
    assert _budget(monkeypatch, "fp8_e4m3", mla=True) == base - WORKSPACE_BYTES
    assert _budget(monkeypatch, "nvfp4", mla=True) == base - WORKSPACE_BYTES
    assert _budget(monkeypatch, "bf16", mla=True) == base  # a 16-bit latent is read as it is: no workspace


def test_quantized_gqa_cache_reserves_the_extend_workspace(monkeypatch):
    base = _budget(monkeypatch, "bf16", mla=False)
    for fmt in ("fp8_e4m3", "fp8_e5m2", "nvfp4"):
        assert _budget(monkeypatch, fmt, mla=False) == base - WORKSPACE_CAP_BYTES
    assert _budget(monkeypatch, "bf16", mla=False, layer_dtypes="0-3:nvfp4") == base - WORKSPACE_CAP_BYTES

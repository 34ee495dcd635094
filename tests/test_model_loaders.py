"""HF safetensors directories (Llama, Mistral, Qwen2, Qwen3; sharded; k/v scales) and synthetic shapes:
logits of our llama-family model equal transformers' on tiny random checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from kvbench.runtime.attention.base import AttentionMetadata, BackendOptions, build_rope_cache
from kvbench.runtime.attention.torch_backend import TorchBackend
from kvbench.runtime.config import KVCacheSpec
from kvbench.runtime.kv_cache import PagedKVCache
from kvbench.runtime.models.hf_loader import load_hf_dir
from kvbench.runtime.models.llama import LlamaForCausalLM
from kvbench.runtime.models.synthetic import parse_synthetic

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=128, rms_norm_eps=1e-6)


def _prefill(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    cfg = model.config
    T = len(ids)
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "bf16", 16)
    npages = -(-T // 16)
    cache = PagedKVCache(spec, npages)
    rope = build_rope_cache(cfg.rope_dim, 128, cfg.rope_theta, cfg.rope_scaling)
    meta = AttentionMetadata("prefill", torch.arange(T), torch.arange(T), torch.arange(npages, dtype=torch.int32)[None],
                             torch.tensor([T], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32), T, T, 16, rope, [T], [T])
    be = TorchBackend(BackendOptions())
    return model.logits(model(torch.tensor(ids), be, cache, meta))


def _save_tiny(tmp_path, arch: str, extra: dict, shards: bool = False):
    import transformers

    cls_cfg, cls_model = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[arch]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_cfg)(**TINY, **extra)
    hf = getattr(transformers, cls_model)(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="60KB" if shards else "10GB")
    return hf


@pytest.mark.parametrize(
    "arch,extra,shards",
    [
        ("llama", {"rope_theta": 5000.0, "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}, True),
        ("mistral", {"sliding_window": 5}, False),
        ("qwen2", {"tie_word_embeddings": True}, False),
        ("qwen3", {"head_dim": 32}, False),
    ],
)
def test_hf_dir_logits_match_transformers(tmp_path, arch, extra, shards):
    hf = _save_tiny(tmp_path, arch, extra, shards)
    if shards:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg, state, scales = load_hf_dir(tmp_path)
    assert cfg.arch == arch and not scales.any
    model = LlamaForCausalLM.from_state(cfg, state, "cpu", torch.float32)
    model.bind()
    ids = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = _prefill(model, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert torch.isfinite(ours).all()
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-5


def test_kv_scales_read_and_no_pickle(tmp_path):
    from safetensors.torch import load_file, save_file

    _save_tiny(tmp_path, "llama", {})
    f = tmp_path / "model.safetensors"
    st = load_file(str(f))
    st["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    st["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    st["model.layers.1.self_attn.k_scale"] = torch.tensor(0.125)
    save_file(st, str(f), metadata={"format": "pt"})
    _cfg, _state, scales = load_hf_dir(tmp_path)
    assert float(scales.k[0]) == 0.5 and float(scales.v[0]) == 0.25 and float(scales.k[1]) == 0.125
    assert scales.v[1] is None and not scales.complete
    # a directory with only pickle weights is refused with a clear message
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **TINY}))
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="pickle"):
        load_hf_dir(d)
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], **TINY}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_hf_dir(d)


def test_synthetic_presets_parse_and_run():
    cfg = parse_synthetic("synthetic:gpt-oss-20b,layers=3,hidden=128,heads=4,kv_heads=2,head_dim=32,vocab=64,intermediate_size=64")
    assert cfg.attention_sinks and cfg.sliding_windows == [128, None, 128] and cfg.num_layers == 3
    full = parse_synthetic("synthetic:llama-3-8b")
    assert (full.num_layers, full.num_kv_heads, full.head_dim, full.vocab_size) == (32, 8, 128, 128256)
    assert parse_synthetic("synthetic:qwen3-8b").qk_norm
    lite = parse_synthetic("synthetic:deepseek-v2-lite")
    assert lite.is_mla and lite.num_layers == 27
    with pytest.raises(ValueError, match="unknown synthetic model"):
        parse_synthetic("synthetic:nope")
    with pytest.raises(ValueError, match="bad synthetic option"):
        parse_synthetic("synthetic:llama-3-8b,colour=3")

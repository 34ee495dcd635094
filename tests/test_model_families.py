"""The model families users run, in the embedded engine, against transformers (float32) on tiny random
checkpoints that transformers writes in the test: Qwen 3 (q/k norm, GQA, explicit head_dim), Mistral (a
sliding window on every layer, whose pages below the window the scheduler frees), Gemma 3 (interleaved
local/global layers; tests/test_model_gemma3.py).
Greedy tokens must be identical and teacher-forced log-probs agree, on the torch and triton backends, from a
Hugging Face directory and from a GGUF file laid out as llama.cpp's converter lays it out."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import check_engine_parity, config_json, gguf_loaded, save_tiny, write_gguf  # noqa: E402

BACKENDS = ["torch", "triton"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    # head_dim 32 with hidden 64 and 4 heads: q is 128 wide, wider than the hidden state
    return d, save_tiny(d, "qwen3", {"head_dim": 32})


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen3_hf_dir_greedy_and_logprobs(qwen3, backend):
    d, hf = qwen3
    assert config_json(d)["architectures"] == ["Qwen3ForCausalLM"]
    check_engine_parity(hf, str(d), backend)


def test_qwen3_gguf(qwen3, tmp_path):
    _d, hf = qwen3
    loaded = gguf_loaded(write_gguf(hf, tmp_path / "qwen3.gguf", "qwen3"))
    c = loaded.config
    assert (c.arch, c.qk_norm, c.head_dim, c.num_kv_heads, c.qkv_bias) == ("qwen3", True, 32, 2, False)
    check_engine_parity(hf, loaded, "torch")


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    d = tmp_path_factory.mktemp("mistral")
    # window 6 with prompts of 9-23 tokens (page size 4): the window drops whole pages and parts of pages
    return d, save_tiny(d, "mistral", {"sliding_window": 6, "head_dim": 16})


@pytest.mark.parametrize("backend", BACKENDS)
def test_mistral_sliding_window_greedy_and_logprobs(mistral, backend):
    d, hf = mistral
    check_engine_parity(hf, str(d), backend)


def test_mistral_window_matters(mistral, tmp_path):
    """The same weights without the window give other tokens: the parity above is a test of the window."""
    import json
    import shutil

    d, hf = mistral
    full = tmp_path / "full"
    shutil.copytree(d, full)
    cfg = config_json(full)
    cfg["sliding_window"] = None
    (full / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AssertionError, match="greedy tokens differ"):
        check_engine_parity(hf, str(full), "torch")


def test_mistral_frees_pages_below_the_window(mistral):
    """Every layer slides: a sequence holds the window's pages plus one while it decodes (the scheduler frees
    the rest, their entries pointing at the scratch page), the window and a chunk while it prefills; the
    parity tests above run this way on both backends."""
    from kvbench.core import SamplingParams
    from tiny_models import engine, prompts

    d, _hf = mistral
    e = engine(str(d), "torch", max_num_batched_tokens=8)
    held = {"decode": 0, "prefill": 0}
    schedule = e.scheduler.schedule

    def watch():
        batch = schedule()
        for seq, q in zip(batch.seqs if batch else [], batch.q_lens if batch else []):
            live = len([p for p in seq.pages if p != e.cache.scratch_page])
            held[batch.phase] = max(held[batch.phase], live)
        return batch

    e.scheduler.schedule = watch
    try:
        assert e.scheduler.window == 6 and e.capacity.extra["windowed_pages"]
        outs = e.generate(prompts(256), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        assert all(len(o.token_ids) == 20 for o in outs)
        assert held["decode"] == -(-6 // 4) + 1 and held["prefill"] <= -(-(6 + 8 - 1) // 4) + 1, held
        assert e.cache.allocator.num_used == 0
    finally:
        e.shutdown()


def test_mistral_gguf_llama_arch_with_window(mistral, tmp_path):
    """llama.cpp names Mistral ``llama``; its window (when the file has one) is ``llama.attention.sliding_window``."""
    _d, hf = mistral
    loaded = gguf_loaded(write_gguf(hf, tmp_path / "mistral.gguf", "llama", name="Mistral tiny", window=6))
    assert loaded.config.sliding_windows == [6, 6]
    check_engine_parity(hf, loaded, "torch")


@pytest.mark.parametrize("cfg,words", [
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 128}, ["Qwen3MoeForCausalLM", "mixture-of-experts", "num_experts=128"]),
    ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 8}, ["MixtralForCausalLM", "mixture-of-experts"]),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "vision_config": {"model_type": "siglip_vision_model"},
      "text_config": {"model_type": "gemma3_text"}}, ["Gemma3ForConditionalGeneration", "multimodal", "vision_config"]),
])
def test_moe_and_multimodal_refused_at_load(tmp_path, cfg, words):
    """Refused from config.json alone, before any weight is read, naming the architecture and the way out."""
    import json

    from kvbench.runtime.models.loader import load_model

    (tmp_path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64, "num_hidden_layers": 2,
                                                      "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 256}))
    with pytest.raises(ValueError) as e:
        load_model(str(tmp_path))
    for w in [*words, "docs/external-engines.md"]:
        assert w in str(e.value)


@pytest.mark.parametrize("meta,word", [({"general.architecture": "qwen3moe", "qwen3moe.expert_count": 128}, "qwen3moe"),
                                       ({"general.architecture": "llama", "llama.expert_count": 8}, "'llama'")])
def test_moe_gguf_refused(meta, word):
    from kvbench.runtime.models.gguf_loader import gguf_config

    with pytest.raises(ValueError, match="mixture-of-experts") as e:
        gguf_config(meta)
    assert word in str(e.value) and "docs/external-engines.md" in str(e.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mistral_mixed_steps_with_windowed_pages(mistral, backend):
    """``mixed_prefill`` where every layer slides and the pages below the window go back: decode rows (their page
    lists pointing at the scratch page below the window) ride in the other prompts' chunks; the tokens equal
    separate steps and the log-probs agree (the prompts' chunks are cut differently: fp16 rounding of a chunk's
    own K/V only)."""
    from kvbench.core import SamplingParams
    from tiny_models import max_logprob_diff, mixed_vs_separate, prompts

    d, _hf = mistral
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)

    def scratched(e, batch):  # a decode row's most page entries below the window (the scratch page)
        rows = batch.seqs[:batch.decode_rows]
        return max(s.pages.count(e.cache.scratch_page) for s in rows) if rows else None

    def windowed(e):
        assert e.scheduler.window == 6

    res = mixed_vs_separate(str(d), backend, prompts(256, lengths=(23, 5, 17, 3)), params, scratched, windowed)
    assert not res[False][2] and res[True][2] and max(res[True][2]) > 0, res[True][2]  # decode rows past dropped pages
    assert res[True][0] == res[False][0]
    diff = max_logprob_diff(res[False][1], res[True][1])
    assert diff < 1e-3, diff


@pytest.mark.parametrize("hd", [32, 96])
def test_flashinfer_prefill_refused_at_head_sizes_it_does_not_compile(tmp_path, hd, monkeypatch):
    """flashinfer's paged prefill compiles for head_dim 64 / 128 / 256 only (its Hopper kernels fail a static
    assertion on others, found on the H200 with Qwen 3 at head_dim 32): the engine refuses it at build with the way
    out, before any kernel is built (here flashinfer is said to be available, as on a GPU machine that has it)."""
    from kvbench.runtime.attention.flashinfer_backend import FlashInferBackend
    from kvbench.runtime.config import ConfigError
    from tiny_models import engine

    monkeypatch.setattr(FlashInferBackend, "available", classmethod(lambda cls: (True, "")))
    save_tiny(tmp_path, "qwen3", {"head_dim": hd})
    with pytest.raises(ConfigError, match=f"head_dim 64, 128, 256.*head_dim {hd}.*--prefill-backend triton or torch"):
        engine(str(tmp_path), "flashinfer", decode_backend="torch")

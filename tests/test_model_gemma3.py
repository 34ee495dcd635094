"""Gemma 3 (text) in the embedded engine against transformers (float32): interleaved sliding-window and global
layers with a window smaller than the prompts, q/k norms, (1 + weight) norms, the four norms per layer,
embeddings scaled by sqrt(hidden), GeGLU, ``query_pre_attn_scalar``, local and global RoPE bases with linear
scaling on the global layers; from a Hugging Face directory (torch and triton backends) and from a GGUF file
in llama.cpp's layout (norms stored as 1 + w, the family's fixed layer pattern and local base)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import check_engine_parity, gguf_loaded, prefill_logits, prompts, save_tiny, write_gguf  # noqa: E402

SHAPE = dict(head_dim=256, num_attention_heads=2, num_key_value_heads=1, sliding_window=6, query_pre_attn_scalar=64)
ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}


def _distinct(hf) -> None:
    """Smaller tied embeddings and a larger final norm: the tokens a greedy run picks vary and are no near-ties."""
    hf.model.embed_tokens.weight.mul_(0.5)
    hf.model.norm.weight.add_(4.0)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3")
    extra = {**SHAPE, "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": ROPE}
    return d, save_tiny(d, "gemma3", extra, post=_distinct)


def test_gemma3_config(gemma3):
    from kvbench.runtime.models.hf_config import from_hf_config

    d, _hf = gemma3
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    c = from_hf_config(cfg)
    assert (c.arch, c.sliding_windows, c.head_dim, c.num_kv_heads, c.tie_word_embeddings) == ("gemma3", [6, None], 256, 1, True)
    assert [c.local_rope(i) for i in range(2)] == [True, False] and c.local_rope_theta == 100.0
    assert c.rope_theta == 50000.0 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.softmax_scale == 64**-0.5 and c.embed_scale == 8.0 and c.hidden_act == "gelu_tanh"
    # the older spelling of the same config (sliding_window_pattern, rope_local_base_freq, rope_scaling)
    old = {k: v for k, v in cfg.items() if k not in ("layer_types", "rope_parameters")}
    old.update(sliding_window_pattern=2, rope_theta=50000.0, rope_local_base_freq=100.0,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert from_hf_config(old) == c


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gemma3_hf_dir_greedy_and_logprobs(gemma3, backend):
    d, hf = gemma3
    check_engine_parity(hf, str(d), backend)


def test_gemma3_final_softcap(tmp_path):
    from kvbench.runtime.models.hf_loader import load_hf_dir
    from kvbench.runtime.models.loader import model_class

    hf = save_tiny(tmp_path, "gemma3", {**SHAPE, "head_dim": 32, "final_logit_softcapping": 2.0}, tokenizer=False,
                   post=_distinct)
    cfg, state, _ = load_hf_dir(tmp_path)
    model = model_class(cfg).from_state(cfg, state, "cpu", torch.float32)
    model.bind()
    ids = prompts(256)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = prefill_logits(model, ids)
    assert float(ref.abs().max()) > 1.5 and float(ours.abs().max()) < 2.0  # the cap bites
    assert float((ours - ref).abs().max()) < 1e-4


def test_gemma3_gguf_llama_cpp_layout(tmp_path):
    """Six layers: llama.cpp's fixed pattern makes the sixth global; local base 10000, global 1e6 (the file's)."""
    hf = save_tiny(tmp_path / "hf", "gemma3", {**SHAPE, "head_dim": 64, "num_hidden_layers": 6, "query_pre_attn_scalar": 64},
                   tokenizer=False, post=_distinct)
    loaded = gguf_loaded(write_gguf(hf, tmp_path / "gemma3.gguf", "gemma3", window=6))
    c = loaded.config
    assert c.sliding_windows == [6] * 5 + [None] and c.local_rope_theta == 10000.0 and c.rope_theta == 1e6
    assert float(loaded.model.model.norm.weight.sub(hf.model.norm.weight).abs().max().detach()) < 1e-6  # 1 + w undone
    check_engine_parity(hf, loaded, "torch")


def test_gemma3_sliding_and_global_layers_named_in_kv_maps(gemma3):
    """Per-layer KV formats name Gemma's layer kinds (``local`` / ``global``); capacity counts the sliding layers."""
    from kvbench.core import SamplingParams
    from tiny_models import engine

    d, _hf = gemma3
    e = engine(str(d), kv_dtype="fp16", kv_layer_dtypes="local:fp8_e4m3", kv_dtype_skip_layers="global")
    try:
        assert e.cache.spec.formats == ("fp8_e4m3", "bf16")
        x = e.capacity.extra
        assert x["layer_formats"] == {"fp16": 0, "fp8_e4m3": 1, "bf16": 1} and x["sliding_layers"] == 1
        assert x["max_concurrency_windowed"] >= e.capacity.max_concurrency
        # a plane slot would hold a global (bf16) and a sliding (fp8) layer: no layer groups, one table for all
        assert not x["windowed_pages"] and e.cache.spec.groups is None
        out = e.generate(prompts(256)[:1], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 3
    finally:
        e.shutdown()


def test_gemma3_layer_groups_keep_the_window_only(gemma3):
    """Layer groups over one pool: the sliding layer's pages below the window go back (its list points at the
    scratch page there) while the global layer keeps the whole context; tokens equal an engine with one table."""
    from kvbench.core import SamplingParams
    from tiny_models import engine

    d, _hf = gemma3
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = engine(str(d), extra={"layer_group_pages": False})
    try:
        assert plain.cache.spec.groups is None
        want = [o.token_ids for o in plain.generate(prompts(256), params)]
    finally:
        plain.shutdown()
    e = engine(str(d), max_num_batched_tokens=8)
    held = {"global": 0, "sliding": 0}
    schedule = e.scheduler.schedule

    def watch():
        batch = schedule()
        for seq in batch.seqs if batch is not None and batch.phase == "decode" else []:
            held["global"] = max(held["global"], len(seq.pages))
            held["sliding"] = max(held["sliding"], len([p for p in seq.group_pages[0] if p != e.cache.scratch_page]))
        return batch

    e.scheduler.schedule = watch
    try:
        g = e.cache.spec.groups
        assert g is not None and g.windows == (None, 6) and e.capacity.extra["layer_groups"] == 2
        assert e.cache.k_data[0] is e.cache.k_data[1]  # one plane slot for both groups' layers
        got = [o.token_ids for o in e.generate(prompts(256), params)]
        assert got == want
        assert held["sliding"] == -(-6 // 4) + 1 and held["global"] == -(-(23 + 16) // 4), held
        assert e.cache.allocator.num_used == 0
    finally:
        e.shutdown()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gemma3_mixed_steps_over_layer_groups(gemma3, backend):
    """``mixed_prefill`` with layer groups (the sliding layer's own page table, its pages below the window given
    back): the short prompt's decode rows ride in the long prompts' chunks, and their parts read each group's
    rows of the step; tokens equal separate steps and log-probs agree (the prompts' chunks are cut differently,
    which moves a chunk's own fp16 K/V rounding only)."""
    from kvbench.core import SamplingParams
    from tiny_models import max_logprob_diff, mixed_vs_separate

    d, _hf = gemma3
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)

    def groups(e):
        assert e.cache.spec.groups is not None and e.cache.spec.groups.windows == (None, 6)

    res = mixed_vs_separate(str(d), backend, prompts(256), params,
                            lambda e, batch: (batch.decode_rows, batch.num_tokens - batch.decode_rows), groups)
    (tok0, lp0, seen0), (tok1, lp1, seen1) = res[False], res[True]
    assert not any(dr for dr, _ in seen0) and any(dr >= 1 and n > 0 for dr, n in seen1), seen1
    assert tok1 == tok0
    diff = max_logprob_diff(lp0, lp1)
    assert diff < 1e-3, diff

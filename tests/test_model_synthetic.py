"""Synthetic GPT-OSS-style attention (sinks, alternating sliding window) through the engine: decode steps
over the paged cache agree with one prefill over the whole sequence."""

from __future__ import annotations

import torch

from kvbench.core.client import SamplingParams
from kvbench.runtime.attention.base import AttentionMetadata
from kvbench.runtime.config import EngineConfig
from kvbench.runtime.engine import Engine

NAME = "synthetic:gpt-oss-20b,layers=3,hidden=128,heads=4,kv_heads=2,head_dim=32,vocab=300,intermediate_size=128,window=6"


def test_gpt_oss_attention_decode_matches_prefill():
    e = Engine(EngineConfig(model=NAME, kv_dtype="fp16", kv_budget_gb=0.01, max_model_len=256))
    try:
        layers = e.runner.model.attention_layers
        assert [l.sliding_window for l in layers] == [6, None, 6] and all(l.sinks is not None for l in layers)
        prompt = list(range(40, 52))
        out = e.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
        assert len(out.token_ids) == 20  # the byte tokenizer has no EOS
        s = e.score(prompt, out.token_ids, full_distribution=True)
        assert s.is_greedy
        # reference: one prefill of the whole sequence (new K/V in compute precision, no cache reads)
        full = prompt + out.token_ids
        T = len(full)
        cache = e.cache
        pages = cache.allocator.allocate(-(-T // cache.page_size))
        try:
            slots = torch.tensor([pages[i // cache.page_size] * cache.page_size + i % cache.page_size for i in range(T)])
            meta = AttentionMetadata("prefill", torch.arange(T), slots, torch.tensor([pages], dtype=torch.int32),
                                     torch.tensor([T], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32),
                                     T, T, cache.page_size, e.runner.rope, [T], [T])
            e.runner.backend.plan(meta, cache)
            with torch.inference_mode():
                logits = e.runner.model.logits(e.runner.model(torch.tensor(full), e.runner.backend, cache, meta))
        finally:
            cache.allocator.free(pages)
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        kl = (ref.exp() * (ref - s.full_logprobs)).sum(-1)
        assert float(kl.max()) < 1e-4, kl
        # and sinks matter: zeroing them changes the distribution
        for l in layers:
            l.sinks = torch.full_like(l.sinks, -1e9)
        s2 = e.score(prompt, out.token_ids, full_distribution=True)
        assert float((s2.full_logprobs - s.full_logprobs).abs().max()) > 1e-3
    finally:
        e.shutdown()

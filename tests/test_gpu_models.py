"""GPU tests of the embedded engine on tiny checkpoints of real model families (written by transformers,
``tests/tiny_models.py``), loaded on a CUDA device in bfloat16.

Gemma 3 with layer groups under CUDA graphs (``test_gemma3_layer_groups_cuda_graphs_match_eager``): a tiny
Gemma 3 with the real model's head dim (256), a sliding window (6) far below the prompts' lengths and both
sliding and global layers, so the engine keeps one page list per layer group and the sliding groups' pages
below the window go back to the pool (``KVCacheSpec.groups``, docs/design.md §5).  On the triton backend, in
bf16, fp8_e4m3 and nvfp4 caches, decode replayed as CUDA graphs (``runtime/graphs.py`` stages every group's
page table and slots) must give what eager decode gives: teacher-forced scores through decode steps
(``score(mode="decode")``, compared as the largest per-token KL divergence of the full distributions) and the
greedy tokens of a batch of three that shrinks to two and one (graph buckets 4, 2, 1 with padded rows).

Each family's checks are their own test functions with their own fixtures; add new ones the same way.  Run
with ``python -m pytest -m gpu tests/test_gpu_models.py`` on a CUDA device; skipped elsewhere (tests/conftest.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_checks import kl_max  # noqa: E402
from tiny_models import save_tiny  # noqa: E402

from kvbench.core.client import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

# two bf16 runs of the same model whose attention differs only in rounding stay far below this; a wrong page
# (a stale table entry, another group's table) moves the distributions by orders of magnitude more
KL_MAX = 2e-3


@pytest.fixture(autouse=True)
def _quiet(quiet_gpu):
    yield


# --------------------------------------------------------------------------- Gemma 3: layer groups, CUDA graphs
GEMMA3_WINDOW = 6
GEMMA3 = dict(head_dim=256, num_attention_heads=2, num_key_value_heads=1, sliding_window=GEMMA3_WINDOW,
              query_pre_attn_scalar=256, num_hidden_layers=4,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
GEMMA3_CTX = [(i * 13 + 5) % 256 for i in range(150)]
GEMMA3_CONT = [(i * 7 + 3) % 256 for i in range(40)]
GEMMA3_PROMPTS = [GEMMA3_CTX[:37], GEMMA3_CTX[:90], GEMMA3_CTX]


@pytest.fixture(scope="module")
def gemma3_loaded(tmp_path_factory):
    from kvbench.runtime.models.loader import load_model

    d = tmp_path_factory.mktemp("gemma3_gpu")

    def distinct(hf):  # smaller tied embeddings, a larger final norm: greedy choices are no near-ties
        hf.model.embed_tokens.weight.mul_(0.5)
        hf.model.norm.weight.add_(4.0)

    save_tiny(d, "gemma3", GEMMA3, post=distinct)
    return load_model(str(d), device="cuda", dtype=torch.bfloat16)


def _gemma3_engine(loaded, kv: str, eager: bool):
    from kvbench.runtime.config import EngineConfig
    from kvbench.runtime.engine import Engine

    return Engine(EngineConfig(kv_dtype=kv, kv_scales="unit", prefill_backend="triton", decode_backend="triton",
                               device="cuda", dtype="bfloat16", enforce_eager=eager, kv_budget_gb=0.05,
                               max_model_len=256, max_running=8),
                  loaded=loaded)


def _watch_sliding_drops(e) -> dict:
    """Count the decode steps in which a sliding group's list held scratch entries (pages given back)."""
    seen = {"decode_steps": 0, "with_dropped_pages": 0}
    schedule = e.scheduler.schedule

    def watch():
        batch = schedule()
        if batch is not None and batch.phase == "decode":
            seen["decode_steps"] += 1
            seen["with_dropped_pages"] += any(d > 0 for s in batch.seqs for d in s.group_dead)
        return batch

    e.scheduler.schedule = watch
    return seen


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3", "nvfp4"])
def test_gemma3_layer_groups_cuda_graphs_match_eager(gemma3_loaded, kv):
    graphs = _gemma3_engine(gemma3_loaded, kv, eager=False)
    eager = _gemma3_engine(gemma3_loaded, kv, eager=True)
    try:
        for e in (graphs, eager):  # the groups are in use: sliding layers on their own page lists
            groups = e.cache.spec.groups
            assert groups is not None and GEMMA3_WINDOW in groups.windows and None in groups.windows, groups
            assert e.capacity.extra["layer_groups"] == groups.num_groups > 1
        seen = _watch_sliding_drops(graphs)
        score = dict(full_distribution=True, mode="decode")
        g = graphs.score(GEMMA3_CTX, GEMMA3_CONT, **score)
        ref = eager.score(GEMMA3_CTX, GEMMA3_CONT, **score)
        dg = graphs.runner.graphs
        assert dg is not None and dg.graphs, "no decode graph was captured (or capture failed: eager fallback)"
        assert dg.num_groups == graphs.cache.spec.groups.num_groups
        assert eager.runner.graphs is None
        # the continuation's decode steps ran past the window: sliding pages went back while graphs replayed
        assert seen["decode_steps"] >= len(GEMMA3_CONT) - 1 and seen["with_dropped_pages"] > 0, seen
        assert torch.isfinite(g.full_logprobs).all()
        kl = kl_max(ref.full_logprobs, g.full_logprobs)
        agree = sum(a == b for a, b in zip(ref.full_logprobs.argmax(-1).tolist(), g.full_logprobs.argmax(-1).tolist()))
        assert kl < KL_MAX and agree >= 0.9 * len(GEMMA3_CONT), (kv, kl, agree)
        # a batch of three (a padded bucket of four) that shrinks to two and one as requests end: the same
        # greedy tokens while they agree
        p = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=1) for m in (16, 9, 5)]
        og, oe = graphs.generate(GEMMA3_PROMPTS, p), eager.generate(GEMMA3_PROMPTS, p)
        assert graphs.runner.graphs is dg, "graphed decode fell back to eager"
        assert {4, 2, 1} <= set(dg.graphs), sorted(dg.graphs)
        assert all(dg.copy_in_graph.values()), dg.copy_in_graph
        assert [len(o.token_ids) for o in og] == [16, 9, 5]
        for a, b in zip(og, oe):
            same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
            assert same >= 4, (kv, a.token_ids, b.token_ids)
            d = (torch.tensor(a.logprobs[:same]) - torch.tensor(b.logprobs[:same])).abs().max()
            assert float(d) < 0.05, (kv, float(d))
    finally:
        graphs.shutdown()
        eager.shutdown()

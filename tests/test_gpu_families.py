"""GPU: the model families beyond Llama (Qwen 3, Mistral, Gemma 3) in the engine on CUDA against transformers
(float32, on the CPU) on tiny random checkpoints that transformers writes in the test: greedy tokens
identical and teacher-forced log-probs in agreement, on the torch and Triton backends compiled for the GPU
(head_dim 256 for Gemma 3, windows smaller than the prompts), eager and with CUDA-graph decode.  Run with
``pytest -m gpu`` on a CUDA device; skipped elsewhere (tests/conftest.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_checks import kl_max, need_flashinfer  # noqa: E402
from tiny_models import check_engine_parity, save_tiny  # noqa: E402

pytestmark = pytest.mark.gpu

GEMMA_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
              "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}


def _gemma_post(hf) -> None:
    hf.model.embed_tokens.weight.mul_(0.5)
    hf.model.norm.weight.add_(4.0)


FAMILIES = {
    "qwen3": ({"head_dim": 32}, None),
    "mistral": ({"sliding_window": 6, "head_dim": 32}, None),
    "gemma3": ({"head_dim": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": 6,
                "query_pre_attn_scalar": 64, "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": GEMMA_ROPE}, _gemma_post),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made = {}

    def get(arch, **over):
        key = (arch, tuple(sorted(over.items())))
        if key not in made:
            d = tmp_path_factory.mktemp(arch)
            extra, post = FAMILIES[arch]
            made[key] = (d, save_tiny(d, arch, {**extra, **over}, post=post))
        return made[key]

    return get


@pytest.fixture(autouse=True)
def _free():
    yield
    torch.cuda.empty_cache()


@pytest.mark.parametrize("arch", sorted(FAMILIES))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_family_parity_on_cuda(tiny, arch, backend):
    """float32 compute on the GPU: the same greedy tokens as transformers, log-probs within the CPU tests' bound."""
    d, hf = tiny(arch)
    got = check_engine_parity(hf, str(d), backend, device="cuda", dtype="float32", enforce_eager=True)
    print(arch, backend, got)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3", "nvfp4"])
def test_family_graph_decode_matches_eager(tiny, arch, kv):
    """CUDA-graph decode against eager decode on the same KV format (Gemma 3's layer groups staged too): greedy
    tokens of three prompts over 30 steps, past the window of the sliding models, equal; a batch that
    shrinks as requests end."""
    from kvbench.core import SamplingParams
    from tiny_models import engine, prompts

    d, _hf = tiny(arch)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=1) for m in (30, 12, 5)]
    outs = {}
    for eager in (True, False):
        e = engine(str(d), "triton", device="cuda", dtype="float32", enforce_eager=eager, kv_dtype=kv, kv_scales="unit",
                   max_running=8, max_model_len=128)
        try:
            outs[eager] = e.generate(prompts(256), params)
            if not eager:
                captured = e.runner.graphs is not None and bool(e.runner.graphs.graphs)
                print(arch, kv, "graphs captured:", captured, "groups:", e.cache.spec.groups is not None)
                assert captured, "no decode graph was captured"
                assert (e.cache.spec.groups is not None) == (arch == "gemma3")
        finally:
            e.shutdown()
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids, (arch, kv, a.token_ids, b.token_ids)
        diff = float((torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max())
        assert diff < 1e-3, (arch, kv, diff)


def test_nvfp4_below_head_dim_32_refused_on_the_gpu(tmp_path):
    """The Triton kernels split an nvfp4 head into halves that feed tensor-core dots of 16: a model of head_dim 16
    is refused when the engine is built, with the way out, instead of a compile error in its first step."""
    from kvbench.runtime.config import ConfigError
    from tiny_models import engine

    save_tiny(tmp_path, "mistral", {"sliding_window": 6, "head_dim": 16})
    with pytest.raises(ConfigError, match="head_dim >= 32.*head_dim 16.*torch backend"):
        engine(str(tmp_path), "triton", device="cuda", kv_dtype="nvfp4", kv_scales="unit")
    e = engine(str(tmp_path), "torch", device="cuda", kv_dtype="nvfp4", kv_scales="unit")
    e.shutdown()


@pytest.mark.parametrize("arch", sorted(FAMILIES))
@pytest.mark.parametrize("kv,pre", [("bf16", "flashinfer"), ("fp8_e4m3", "triton")])
def test_family_flashinfer_matches_torch(tiny, arch, kv, pre):
    """flashinfer claims these models (per-layer windows as ``window_left``, the families' softmax scales; with
    Gemma 3 the engine keeps one page list, no layer groups): bf16 compute, decode (and for a bf16 cache also
    prefill) on flashinfer against the torch backend on the same KV format, teacher-forced through decode steps."""
    from tiny_models import engine, prompts

    need_flashinfer()
    # flashinfer's prefill compiles for head_dim 64 / 128 / 256 only (the engine refuses others: the CPU test
    # test_model_families.py::test_flashinfer_prefill_refused_at_head_sizes_it_does_not_compile and the next test)
    d, _hf = tiny(arch) if FAMILIES[arch][0]["head_dim"] in (64, 128, 256) else tiny(arch, head_dim=64)
    ctx, cont = prompts(256, (40, 30), seed=5)
    scores = {}
    for name, (p, dec) in {"torch": ("torch", "torch"), "flashinfer": (pre, "flashinfer")}.items():
        e = engine(str(d), p, decode_backend=dec, device="cuda", dtype="bfloat16", enforce_eager=True, kv_dtype=kv,
                   kv_scales="unit")
        try:
            if name == "flashinfer":  # flashinfer reads one page table (the torch engine keeps Gemma 3's groups)
                assert e.cache.spec.groups is None
            scores[name] = e.score(ctx, cont, full_distribution=True, mode="decode").full_logprobs.double().cpu()
        finally:
            e.shutdown()
    assert torch.isfinite(scores["flashinfer"]).all()
    kl = kl_max(scores["torch"], scores["flashinfer"])
    print(arch, kv, pre, "flashinfer vs torch max KL", kl)
    assert kl < 2e-3, (arch, kv, kl)


def test_family_flashinfer_prefill_refused_at_head_dim_32(tiny):
    """On a machine with flashinfer: Qwen 3 at head_dim 32 is refused for flashinfer's prefill at engine build (its
    Hopper prefill fails a static assertion when it compiles), and runs with flashinfer decoding after a Triton
    prefill."""
    from kvbench.runtime.config import ConfigError
    from tiny_models import engine, prompts

    need_flashinfer()
    d, _hf = tiny("qwen3")
    with pytest.raises(ConfigError, match="head_dim 64, 128, 256.*head_dim 32"):
        engine(str(d), "flashinfer", device="cuda", dtype="bfloat16", enforce_eager=True, kv_dtype="bf16")
    e = engine(str(d), "triton", decode_backend="flashinfer", device="cuda", dtype="bfloat16", enforce_eager=True,
               kv_dtype="bf16")
    try:
        ctx, cont = prompts(256, (20, 10), seed=6)
        assert torch.isfinite(e.score(ctx, cont, full_distribution=True, mode="decode").full_logprobs).all()
    finally:
        e.shutdown()

"""The fused decoder-layer kernels (kernels/fused_ops.py) on Triton's CPU interpreter against the torch code
they replace and against float64: RMSNorm with and without the residual add (2-D rows, 3-D per-head rows of
a strided view, fp32 and bf16 weights), SiLU · up; outputs poisoned first.  The model's layer loop with
the residual carried into the next norm gives the same hidden states as the plain pre-norm loop."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kvbench.kernels.fused_ops import rms_norm, rms_norm_torch, silu_mul, silu_mul_torch


def _f64_norm(s, w, eps):
    s = s.double()
    return w.double() * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("n", [64, 100])
def test_rms_norm_with_and_without_residual(dtype, wdtype, n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(7, n, generator=g) * 3).to(dtype)
    r = (torch.randn(7, n, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(wdtype)
    out = rms_norm(x, w, 1e-5, triton_kernel=True)
    ref = rms_norm_torch(x, w, 1e-5)
    assert out.dtype == ref.dtype == torch.result_type(w, x)
    assert not out.isnan().any()
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: a last-place flip now and then
    assert (out.double() - ref.double()).norm() / ref.double().norm() <= tol
    assert (out.double() - _f64_norm(x, w, 1e-5)).norm() / ref.double().norm() <= max(tol, 1e-6)
    out2, s = rms_norm(x, w, 1e-5, residual=r, triton_kernel=True)
    ref2, s_ref = rms_norm_torch(x, w, 1e-5, residual=r)
    assert torch.equal(s, s_ref)  # the residual sum is rounded exactly as torch's add
    assert (out2.double() - ref2.double()).norm() / ref2.double().norm() <= tol


def test_rms_norm_per_head_rows_of_a_strided_view():
    # q of a fused qkv projection: [T, H, D] rows inside a wider row (the Qwen3 q/k norm)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 3 * 4 * 16, generator=g)
    q = qkv[:, : 4 * 16].reshape(5, 4, 16)
    assert not q.is_contiguous()
    w = 1 + 0.1 * torch.randn(16, generator=g)
    out = rms_norm(q, w, 1e-6, triton_kernel=True)
    assert torch.allclose(out, rms_norm_torch(q, w, 1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(1)
    gu = (torch.randn(6, 2 * 300, generator=g) * 4).to(dtype)
    out = silu_mul(gu, triton_kernel=True)
    ref = silu_mul_torch(gu)
    assert out.shape == (6, 300) and out.dtype == dtype and not out.isnan().any()
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert (out.double() - ref.double()).norm() / ref.double().norm() <= tol
    a, b = gu.double().chunk(2, dim=-1)
    assert (out.double() - a * torch.sigmoid(a) * b).norm() / ref.double().norm() <= max(tol, 1e-6)


def test_fallbacks_and_default_dispatch():
    # CPU tensors take the torch code unless the kernel is asked for; odd shapes always do
    x = torch.randn(2, 3, 4, 8)
    w = torch.ones(8)
    assert torch.equal(rms_norm(x, w, 1e-5), rms_norm_torch(x, w, 1e-5))
    gu = torch.randn(3, 9)
    with pytest.raises(RuntimeError):  # an odd width has no gate/up halves: torch's own error
        silu_mul(gu, triton_kernel=True)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_layer_loop_with_the_carried_residual_matches_the_plain_loop(qk_norm):
    # the model's forward (residual adds inside the next norm) against the textbook pre-norm loop on the same
    # weights — x = x + attn(norm1(x)); x = x + mlp(norm2(x)); norm(x) — with a stand-in attention backend
    from kvbench.runtime.models.config import ModelConfig
    from kvbench.runtime.models.llama import LlamaForCausalLM

    class EchoBackend:  # attention stand-in: the rotated-free q rows, so every layer's output depends on x
        def forward(self, q, k, v, spec, cache, meta):
            return q.reshape(q.shape[0], -1) + k.repeat_interleave(spec.num_heads // spec.num_kv_heads, 1).reshape(
                q.shape[0], -1) * 0.5

    cfg = ModelConfig(arch="qwen3" if qk_norm else "llama", hidden_size=64, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=96, vocab_size=50, qk_norm=qk_norm)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    m.bind()
    ids = torch.tensor([3, 7, 11, 2, 49])
    be = EchoBackend()
    got = m.forward(ids, be, None, None)
    with torch.inference_mode():
        x = m.model.embed_tokens(ids)
        for layer in m.model.layers:
            n1 = layer.input_layernorm
            x = x + layer.self_attn(rms_norm_torch(x, n1.weight, n1.eps), be, None, None)
            n2 = layer.post_attention_layernorm
            x = x + layer.mlp(rms_norm_torch(x, n2.weight, n2.eps))
        want = rms_norm_torch(x, m.model.norm.weight, m.model.norm.eps)
    assert torch.equal(got, want)

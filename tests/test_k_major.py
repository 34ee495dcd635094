"""K-major weights (``llama.k_major``, what ``bind`` does on a CUDA GPU): the same values as views of a
contiguous [K, N] tensor, linears fused K-major share that one tensor (memory not doubled), and a model whose
weights are all re-laid K-major gives exactly the hidden states and logits of the row-major one."""

import torch
import torch.nn as nn

from kvbench.runtime.models.llama import _fuse_linears, k_major


def test_k_major_is_a_view_of_a_row_major_transpose_with_the_same_values():
    w = torch.randn(6, 5)
    v = k_major(w)
    assert torch.equal(v, w) and v.shape == (6, 5)
    assert v.stride() == (1, 6) and v.t().is_contiguous()
    assert k_major(v).data_ptr() == v.data_ptr()  # idempotent: no second copy
    x = torch.randn(3, 5)
    torch.testing.assert_close(nn.functional.linear(x, v), nn.functional.linear(x, w), rtol=0, atol=1e-6)


def test_fused_k_major_linears_are_views_of_one_tensor():
    torch.manual_seed(0)
    lins = [nn.Linear(8, n, bias=True) for n in (12, 4, 4)]
    before = [(l.weight.detach().clone(), l.bias.detach().clone()) for l in lins]
    w, b = _fuse_linears(*lins, kmajor=True)
    assert w.shape == (20, 8) and w.t().is_contiguous()
    o = 0
    for l, (w0, b0) in zip(lins, before):
        assert torch.equal(l.weight, w0) and torch.equal(l.bias, b0)
        assert l.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
        assert torch.equal(w[o : o + l.out_features], w0)
        o += l.out_features
    x = torch.randn(5, 8)
    want = torch.cat([x @ w0.t() + b0 for w0, b0 in before], dim=-1)
    torch.testing.assert_close(nn.functional.linear(x, w, b), want, rtol=1e-6, atol=1e-6)


def test_a_k_major_model_computes_what_the_row_major_one_does():
    from kvbench.runtime.models.config import ModelConfig
    from kvbench.runtime.models.llama import LlamaForCausalLM

    class EchoBackend:
        def forward(self, q, k, v, spec, cache, meta):
            return q.reshape(q.shape[0], -1) + v.repeat_interleave(spec.num_heads // spec.num_kv_heads, 1).reshape(
                q.shape[0], -1) * 0.5

    cfg = ModelConfig(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=96, vocab_size=50, tie_word_embeddings=False)
    torch.manual_seed(1)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    m.bind()  # on the CPU: row-major
    ids = torch.tensor([3, 7, 11, 2, 49])
    be = EchoBackend()
    want_h = m.forward(ids, be, None, None)
    want_l = m.logits(want_h)
    m.bind(kmajor=True)  # what bind does on a GPU
    for layer in m.model.layers:
        for lin in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            assert lin.weight.stride(0) == 1  # K-major: a column slice of a [K, N] tensor
    assert not m.lm_head.weight.is_contiguous() and m.lm_head.weight.t().is_contiguous()
    got_h = m.forward(ids, be, None, None)
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.logits(got_h), want_l, rtol=1e-5, atol=1e-5)

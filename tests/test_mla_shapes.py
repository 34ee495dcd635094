"""Synthetic MLA attention configs: shapes, weights, and their use with the absorbed kernels' helpers."""

import math

import pytest
import torch

from kvbench.kernels.mla import absorb_query, split_kv_b, unabsorb_output
from kvbench.runtime.models.mla_shapes import MLA_SHAPES, get_mla_shape, make_mla_weights, mla_layer_param_shapes


def test_published_shapes():
    v3 = get_mla_shape("deepseek-v3")
    assert (v3.num_heads, v3.kv_lora_rank, v3.qk_rope_head_dim, v3.qk_nope_head_dim, v3.v_head_dim) == (128, 512, 64, 128, 128)
    assert v3.latent_dim == 576 and v3.q_lora_rank == 1536
    lite = get_mla_shape("deepseek-v2-lite")
    assert lite.q_lora_rank is None and lite.num_heads == 16 and lite.hidden_size == 2048
    # YaRN mscale² on 1/sqrt(192): 0.1·ln(40)+1 for V3.
    m = 0.1 * math.log(40) + 1
    assert v3.softmax_scale == pytest.approx(192 ** -0.5 * m * m)
    with pytest.raises(ValueError, match="unknown MLA shape"):
        get_mla_shape("deepseek-v9")


def test_random_weights_shapes_and_determinism():
    small = MLA_SHAPES["deepseek-v2-lite"].with_layers(2)
    w = make_mla_weights(small, seed=3)
    assert len(w) == 2 * len(mla_layer_param_shapes(small))
    for name, shp in mla_layer_param_shapes(small).items():
        assert tuple(w[f"model.layers.1.self_attn.{name}"].shape) == shp
    assert "model.layers.0.self_attn.q_proj.weight" in w and "model.layers.0.self_attn.q_a_proj.weight" not in w
    w2 = make_mla_weights(small, seed=3)
    assert all(torch.equal(w[k], w2[k]) for k in w)
    assert not torch.equal(w["model.layers.0.self_attn.kv_b_proj.weight"], make_mla_weights(small, seed=4)["model.layers.0.self_attn.kv_b_proj.weight"])
    with pytest.raises(ValueError):
        make_mla_weights(small, num_layers=0)


def test_absorption_identity_on_v2_lite_weights():
    """q_lat·c == q_nope·(W_UK c) and W_UV·(Σ p c) == Σ p (W_UV c) with the shape's real kv_b_proj."""
    s = get_mla_shape("deepseek-v2-lite")
    w = make_mla_weights(s, num_layers=1, dtype=torch.float64)["model.layers.0.self_attn.kv_b_proj.weight"]
    w_uk, w_uv = split_kv_b(w, s.num_heads, s.qk_nope_head_dim, s.v_head_dim)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, s.num_heads, s.qk_nope_head_dim, generator=gen, dtype=torch.float64)
    c = torch.randn(5, s.kv_lora_rank, generator=gen, dtype=torch.float64)
    k_nope = torch.einsum("hnr,sr->hsn", w_uk, c)
    assert torch.allclose(torch.einsum("thr,sr->ths", absorb_query(q, w_uk), c), torch.einsum("thn,hsn->ths", q, k_nope))
    p = torch.softmax(torch.randn(2, s.num_heads, 5, generator=gen, dtype=torch.float64), -1)
    o_lat = torch.einsum("ths,sr->thr", p, c)
    v = torch.einsum("hvr,sr->hsv", w_uv, c)
    assert torch.allclose(unabsorb_output(o_lat, w_uv), torch.einsum("ths,hsv->thv", p, v))

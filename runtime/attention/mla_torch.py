"""MLA on the torch reference backend: RoPE, append the latent through ``PagedKVCache.write`` (the
format's torch quantizer), gather and dequantize each sequence's latent pages, expand them with
``kv_b_proj`` (``W_UK``, ``W_UV``) and run masked softmax attention in float32.  Uses the padded slot
table that ``TorchBackend.plan`` builds (``meta.extra["torch"]``)."""

from __future__ import annotations

import torch

from kvbench.runtime.attention.base import AttentionMetadata, apply_rope
from kvbench.runtime.attention.mla_base import MLAAttentionLayer, absorb

__all__ = ["torch_forward_mla", "rope_latent"]


def rope_latent(q_pe: torch.Tensor, k_pe: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE'd ``q_pe [T, H, rope]`` and ``k_pe [T, rope]`` (float32 math, inputs' dtypes)."""
    return apply_rope(q_pe, meta.positions, meta.rope), apply_rope(k_pe[:, None], meta.positions, meta.rope)[:, 0]


def torch_forward_mla(backend, q_nope, q_pe, c_kv, k_pe, layer: MLAAttentionLayer, cache, meta: AttentionMetadata) -> torch.Tensor:
    from kvbench.runtime.attention.torch_backend import quantize_query_fp8

    st = meta.extra.get("torch")
    if st is None:
        backend.plan(meta, cache)
        st = meta.extra["torch"]
    T, H = q_nope.shape[:2]
    r, vd = layer.kv_lora_rank, layer.v_head_dim
    qp, kp = rope_latent(q_pe, k_pe, meta)
    new_lat = torch.cat((c_kv, kp), dim=-1)  # [T, rank + rope]
    cache.write(layer.layer_idx, meta.slot_mapping, new_lat[:, None])

    w_uk, w_uv = layer.w_uk.float(), layer.w_uv.float()
    slots, rows = st["slots"], st["rows"]
    B, S = slots.shape
    Q = rows.shape[1]
    lat, _ = cache.read_slots(layer.layer_idx, slots.reshape(-1), torch.float32)
    lat = lat.view(B, S, r + layer.qk_rope_head_dim)
    if meta.phase == "prefill":  # the new tokens' own latent in compute precision
        bi, qi = st["valid_idx"]
        lat = lat.clone()
        lat[bi, st["qpos"][bi, qi]] = new_lat.float()[rows[bi, qi]]
    # keys no query sees (padding, the scratch page) are zeroed, so stale bytes never reach the output
    lat = torch.where(st["base_mask"].any(1)[..., None], lat, torch.zeros((), device=lat.device))
    c, kpe = lat[..., :r], lat[..., r:]

    qp_b = qp.float()[rows]  # [B, Q, H, rope]
    if backend.opts.quantize_query:  # absorbed query through fp8 (the form the MLA kernels consume)
        q_abs = quantize_query_fp8(torch.cat((absorb(q_nope.float(), w_uk), qp.float()), dim=-1), layer.q_scale)
        q_abs = q_abs[rows]
        scores = torch.einsum("bqhr,bsr->bhqs", q_abs[..., :r], c) + torch.einsum("bqhp,bsp->bhqs", q_abs[..., r:], kpe)
    else:
        k_nope = torch.einsum("bsr,hnr->bhsn", c, w_uk)
        scores = torch.einsum("bqhn,bhsn->bhqs", q_nope.float()[rows], k_nope) + torch.einsum("bqhp,bsp->bhqs", qp_b, kpe)
    scores = scores * layer.softmax_scale
    mask = st["base_mask"][:, None]  # [B, 1, Q, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    safe = torch.where(mask.any(-1, keepdim=True), scores, torch.zeros_like(scores))  # padded rows: no NaN
    probs = torch.softmax(safe, dim=-1)
    v = torch.einsum("bsr,hvr->bhsv", c, w_uv)
    out = torch.einsum("bhqs,bhsv->bqhv", probs, v).reshape(B, Q, H * vd)
    res = torch.zeros(T, H * vd, dtype=torch.float32, device=q_nope.device)
    if meta.phase == "decode":  # one row per sequence, in order (rows past B are padding)
        res[:B] = out[:, 0]
    else:
        bi, qi = st["valid_idx"]
        res[rows[bi, qi]] = out[bi, qi]
    return res.to(q_nope.dtype)

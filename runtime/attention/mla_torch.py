"""MLA on the torch reference backend: RoPE, append the latent through ``PagedKVCache.write`` (the
format's torch quantizer), read and dequantize the latent positions the step's queries can see (one
gather, ``TorchPlan.reads``), then per sequence expand the latent with ``kv_b_proj`` (``W_UK``, ``W_UV``)
and attend in float32 query chunks (``torch_backend.attend_chunked``): no padding to the batch's longest
sequence and no score tile larger than one chunk's ``[H, C, S]``.

With ``quantize_query`` (in the phases it names; per sequence, ``base.query_fp8``) the absorbed query
``[W_UKᵀ q_nope | rope(q_pe)]`` is rounded through fp8 and attends to the latent itself (one shared "kv head"), the output ``W_UV · (P c)``.  Round-trip sequences
(``base.py``) and decode read every latent, their own included, back from the pages."""

from __future__ import annotations

import torch

from kvbench.runtime.attention.base import AttentionMetadata, apply_rope, query_fp8
from kvbench.runtime.attention.mla_base import MLAAttentionLayer, absorb

__all__ = ["torch_forward_mla", "rope_latent"]


def rope_latent(q_pe: torch.Tensor, k_pe: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE'd ``q_pe [T, H, rope]`` and ``k_pe [T, rope]`` (float32 math, inputs' dtypes)."""
    return apply_rope(q_pe, meta.positions, meta.rope), apply_rope(k_pe[:, None], meta.positions, meta.rope)[:, 0]


def torch_forward_mla(backend, q_nope, q_pe, c_kv, k_pe, layer: MLAAttentionLayer, cache, meta: AttentionMetadata) -> torch.Tensor:
    from kvbench.runtime.attention.torch_ops import attend_chunked, quantize_query_fp8, seq_kv

    st = backend.step_plan(meta, cache)
    T, H = q_nope.shape[:2]
    r, vd = layer.kv_lora_rank, layer.v_head_dim
    qp, kp = rope_latent(q_pe, k_pe, meta)
    new_lat = torch.cat((c_kv, kp), dim=-1)  # [T, rank + rope]
    cache.write(layer.layer_idx, meta.slot_mapping, new_lat[:, None])

    w_uk, w_uv = layer.w_uk.float(), layer.w_uv.float()
    slots, offs, los, ns = st.reads(None)
    lat_c, _ = cache.read_slots(layer.layer_idx, slots, torch.float32)  # [N, 1, rank + rope]
    which = query_fp8(backend.opts, meta)
    fp8 = [which] * st.B if isinstance(which, bool) else list(which)  # per sequence
    q8 = q_all = None
    if any(fp8):  # absorbed query through fp8 (the form the MLA kernels consume)
        q8 = quantize_query_fp8(torch.cat((absorb(q_nope.float(), w_uk), qp.float()), dim=-1), layer.q_scale)
    if not all(fp8):
        q_all = torch.cat((q_nope.float(), qp.float()), dim=-1)  # [T, H, nope + rope]
    res = torch.zeros(T, H * vd, dtype=torch.float32, device=q_nope.device)  # padding rows stay zero
    for b in range(st.B):
        r0, r1 = st.cu[b], st.cu[b + 1]
        if r1 == r0:
            continue
        lat = seq_kv(st, b, lat_c, offs, ns, new_lat[:, None])  # [S, 1, rank + rope]
        c, kpe = lat[:, 0, :r], lat[:, 0, r:]
        pre = st.seq_lens[b] - st.q_lens[b]
        if fp8[b]:
            o_lat = attend_chunked(q8[r0:r1], lat, c[:, None], pre, los[b], layer.softmax_scale, chunk=backend.query_chunk)
            out = torch.einsum("qhr,hvr->qhv", o_lat, w_uv)
        else:
            k_nope = torch.einsum("sr,hnr->shn", c, w_uk)  # [S, H, nope]
            keys = torch.cat((k_nope, kpe[:, None].expand(-1, H, -1)), dim=-1)
            vals = torch.einsum("sr,hvr->shv", c, w_uv)  # [S, H, v]
            out = attend_chunked(q_all[r0:r1], keys, vals, pre, los[b], layer.softmax_scale, chunk=backend.query_chunk)
        res[r0:r1] = out.reshape(r1 - r0, H * vd)
    return res.to(q_nope.dtype)

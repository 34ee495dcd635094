"""MLA on the Triton backend: fused (or unfused) RoPE + quantize + append of ``[c_kv | k_pe]`` into the
latent pages (``kernels/mla_append.py``), then the absorbed kernels: ``mla_decode`` (split-K over pages)
or ``mla_prefill`` (new tokens over the quantized prefix plus their own latent in compute precision;
round-trip sequences pass their latent as stored instead, read back after the append).

No host syncs (the decode split count follows ``meta.max_seqlen_k``), so decode can be captured in a
CUDA graph.  With ``quantize_query`` (in the phases it names, ``base.query_fp8``) the append kernel emits
the fp8 absorbed query that both kernels take (``q_scale`` per layer); a prefill step that mixes quantized
round-trip rows with plain rows rounds the quantized rows' absorbed query through e4m3 in torch and runs
the kernels on compute-dtype queries (``q_scale=None``)."""

from __future__ import annotations

import torch

from kvbench.runtime.attention.base import AttentionMetadata, query_fp8, query_fp8_rows
from kvbench.runtime.attention.mla_base import MLAAttentionLayer, absorb, unabsorb

__all__ = ["triton_forward_mla", "latent_cache_view"]


def latent_cache_view(cache, layer_idx: int, rank: int):
    """``kernels.mla.LatentCache`` over one layer's latent plane of the paged pool (no copy)."""
    from kvbench.kernels import LatentCache, LatentLayout

    spec = cache.spec
    if not spec.mla:
        raise ValueError("an MLA layer needs a latent cache (KVCacheSpec(mla=True))")
    lay = LatentLayout(rank, spec.head_dim - rank, spec.kv_dtype)
    return LatentCache(lay, cache.k_data[layer_idx], cache.k_block_scale[layer_idx], cache.k_scale[layer_idx])


def triton_forward_mla(backend, q_nope, q_pe, c_kv, k_pe, layer: MLAAttentionLayer, cache, meta: AttentionMetadata) -> torch.Tensor:
    from kvbench.kernels import mla_append_unfused
    from kvbench.kernels.mla_append import mla_append

    T, H = q_nope.shape[:2]
    r = layer.kv_lora_rank
    lc = latent_cache_view(cache, layer.layer_idx, r)
    c_kv = c_kv.contiguous()
    k_pe = k_pe.contiguous()
    q_lat = absorb(q_nope, layer.w_uk)
    which = query_fp8(backend.opts, meta)
    q_scale = backend._q_scale(layer.q_scale, q_nope.device) if which is True else None
    append = mla_append if backend.opts.fused_append else mla_append_unfused
    q_rot, k_rot, q8 = append(
        c_kv, k_pe, q_pe, meta.positions, backend._cos_sin_cache(meta.rope), meta.slot_mapping, lc,
        rope_style=meta.rope.style, q_lat=q_lat.contiguous() if q_scale is not None else None, q_scale=q_scale,
    )
    if q8 is not None:
        ql, qp = q8[..., :r], q8[..., r:]
    else:
        ql, qp = q_lat.contiguous(), q_rot
        if which is not False:  # mixed step: the quantized rows' absorbed query rounded in torch
            from kvbench.runtime.attention.torch_backend import quantize_query_fp8

            rows = query_fp8_rows(which, meta, T)[:, None, None]
            qa = torch.cat((ql, qp.to(ql.dtype)), dim=-1)
            qa = torch.where(rows, quantize_query_fp8(qa, layer.q_scale), qa)
            ql, qp = qa[..., :r].contiguous(), qa[..., r:].to(qp.dtype).contiguous()
    if meta.phase == "decode":
        from kvbench.kernels import MLADecodeOptions
        from kvbench.kernels.mla_decode import mla_decode

        B = meta.num_seqs
        o_lat = mla_decode(ql[:B], qp[:B], lc, meta.page_table, meta.seq_lens, layer.softmax_scale, q_scale=q_scale,
                           opts=MLADecodeOptions(max_seq_len=max(int(meta.max_seqlen_k), 1)))
        if T != B:
            full = torch.zeros(T, H, r, dtype=o_lat.dtype, device=o_lat.device)
            full[:B] = o_lat
            o_lat = full
    else:
        from kvbench.kernels import MLAPrefillOptions
        from kvbench.kernels.mla_prefill import mla_prefill

        if meta.has_roundtrip:  # decode semantics: these rows see their latent as stored
            from kvbench.runtime.attention.base import stored_new_kv

            lat = torch.cat((c_kv, k_rot.to(c_kv.dtype)), dim=-1)[:, None]
            lat, _ = stored_new_kv(cache, layer.layer_idx, meta, lat, lat)
            c_kv, k_rot = lat[:, 0, :r].contiguous(), lat[:, 0, r:].to(k_rot.dtype).contiguous()
        o_lat = mla_prefill(ql, qp, c_kv, k_rot, lc, meta.page_table, meta.seq_lens, meta.cu_seqlens_q,
                            layer.softmax_scale, q_scale=q_scale,
                            opts=MLAPrefillOptions(max_q_len=max(int(meta.max_seqlen_q), 1)))
    out = unabsorb(o_lat.to(q_nope.dtype), layer.w_uv)
    return out.reshape(T, H * layer.v_head_dim)

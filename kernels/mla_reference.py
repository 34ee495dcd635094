"""Float64 references for the MLA kernels, in the textbook (non-absorbed) form.

Keys and values are expanded per head from the latent with the up-projections
(``k_nope[h] = W_UK[h] c``, ``v[h] = W_UV[h] c``) and attention runs on
``[q_nope | q_pe] · [k_nope | k_pe]`` with output ``Σ p · v`` — so the absorbed kernels are checked
against an independent computation, not against a rearrangement of themselves.  Cached latents are read
through ``kernels/formats.py`` (the numerics spec).
"""

from __future__ import annotations

import torch

from kvbench.kernels.formats import E4M3_MAX, QuantizedKV, get_format
from kvbench.kernels.mla import LatentCache

__all__ = [
    "ref_rope",
    "ref_append_rows",
    "ref_attention",
    "ref_decode",
    "ref_decode_latent",
    "ref_prefill",
    "quantize_absorbed_query",
    "sequence_slots",
]


def ref_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rope_style: str = "neox") -> torch.Tensor:
    """RoPE in float64; ``x [T, (H,) rope]``, ``positions [T]``, cache ``[P, rope]`` = (cos | sin)."""
    half = x.shape[-1] // 2
    cs = cos_sin_cache.double()[positions.long()]
    cos, sin = cs[:, :half], cs[:, half:]
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    xd = x.double()
    if rope_style == "neox":
        x1, x2 = xd[..., :half], xd[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if rope_style != "interleaved":
        raise ValueError(f"unknown rope_style {rope_style!r}")
    x1, x2 = xd[..., 0::2], xd[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def ref_append_rows(c_kv, k_pe, positions, cos_sin_cache, kv_dtype: str, k_scale, rope_style: str = "neox") -> tuple[torch.Tensor, QuantizedKV]:
    """Expected cache rows: float64 RoPE, then the spec's quantizer on the float32 row ``[c_kv | k_pe]``.

    Returns ``(rows_float64 [T, rank + rope], QuantizedKV)``."""
    rows = torch.cat((c_kv.double(), ref_rope(k_pe, positions, cos_sin_cache, rope_style)), dim=-1)
    return rows, get_format(kv_dtype).quantize(rows.float(), k_scale)


def ref_attention(q_nope, q_pe, c, k_pe, w_uk, w_uv, sm_scale: float, q_pos=None, k_pos=None) -> torch.Tensor:
    """One sequence, non-absorbed, float64.

    ``q_nope [T, H, nope]``, ``q_pe [T, H, rope]``, latent ``c [S, rank]``, ``k_pe [S, rope]``,
    ``W_UK [H, nope, rank]``, ``W_UV [H, v, rank]``.  Key ``j`` is visible to query ``i`` when
    ``k_pos[j] <= q_pos[i]`` (both ``None``: every key visible).  Returns ``[T, H, v]``."""
    c, k_pe = c.double(), k_pe.double()
    k_nope = torch.einsum("hnr,sr->hsn", w_uk.double(), c)  # [H, S, nope]
    v = torch.einsum("hvr,sr->hsv", w_uv.double(), c)  # [H, S, v]
    s = torch.einsum("thn,hsn->hts", q_nope.double(), k_nope) + torch.einsum("thp,sp->hts", q_pe.double(), k_pe)
    s = s * sm_scale
    if q_pos is not None:
        vis = k_pos.long()[None, :] <= q_pos.long()[:, None]  # [T, S]
        s = s.masked_fill(~vis[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hts,hsv->thv", p, v)


def sequence_slots(page_table_row: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(length, device=page_table_row.device)
    return page_table_row.long()[pos // page_size] * page_size + pos % page_size


def ref_decode(q_nope, q_pe, cache: LatentCache, page_table, seq_lens, w_uk, w_uv, sm_scale: float) -> torch.Tensor:
    """Decode: one query per sequence over every cached token.  Returns float64 ``[B, H, v]``."""
    outs = []
    for b in range(q_nope.shape[0]):
        n = int(seq_lens[b])
        c, kpe = cache.dequantize_slots(sequence_slots(page_table[b], n, cache.page_size), torch.float64)
        outs.append(ref_attention(q_nope[b : b + 1], q_pe[b : b + 1], c, kpe, w_uk, w_uv, sm_scale)[0])
    return torch.stack(outs)


def ref_decode_latent(q_lat, q_pe, cache: LatentCache, page_table, seq_lens, sm_scale: float) -> torch.Tensor:
    """Decode in latent space (the absorbed form; the non-absorbed one with identity up-projections), for
    queries that exist only absorbed, e.g. rounded to e4m3: ``softmax(q_lat·c + q_pe·k_pe) · c`` in float64,
    without expanding the latent per head (which at 128 heads and 32k tokens would take ~17 GB).
    Returns float64 ``[B, H, rank]``."""
    outs = []
    for b in range(q_lat.shape[0]):
        c, kpe = cache.dequantize_slots(sequence_slots(page_table[b], int(seq_lens[b]), cache.page_size), torch.float64)
        c, kpe = c.to(q_lat.device), kpe.to(q_lat.device)
        s = (q_lat[b].double() @ c.T + q_pe[b].double() @ kpe.T) * sm_scale
        outs.append(torch.softmax(s, -1) @ c)
    return torch.stack(outs)


def quantize_absorbed_query(q_lat: torch.Tensor, q_pe: torch.Tensor):
    """The absorbed query ``[q_lat | q_pe]`` rounded to e4m3 with one float32 dequant multiplier (amax / 448),
    the form ``quantize_query`` feeds the kernels: returns ``(q_lat8, q_pe8, q_scale [1])``."""
    e4m3 = get_format("fp8_e4m3")  # the cache's e4m3 rounding (formats.py), with this one scale
    s = (torch.cat((q_lat, q_pe), -1).float().abs().amax() / E4M3_MAX).clamp(min=1e-12)
    return e4m3.quantize(q_lat, s).data, e4m3.quantize(q_pe, s).data, s.reshape(1).float()


def ref_prefill(q_nope, q_pe, c_new, kpe_new, cache: LatentCache, page_table, seq_lens, cu_seqlens_q, w_uk, w_uv,
                sm_scale: float) -> torch.Tensor:
    """Prefill/extend: the cached prefix from the pages, the new tokens' own latent in compute precision,
    causal.  Returns float64 ``[T, H, v]``."""
    dev = q_nope.device
    out = torch.empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1], dtype=torch.float64, device=dev)
    for b in range(page_table.shape[0]):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n_new = q1 - q0
        if n_new == 0:
            continue
        prefix = int(seq_lens[b]) - n_new
        cp, kp = cache.dequantize_slots(sequence_slots(page_table[b], prefix, cache.page_size), torch.float64)
        c = torch.cat((cp.to(dev), c_new[q0:q1].double()))
        k = torch.cat((kp.to(dev), kpe_new[q0:q1].double()))
        pos = torch.arange(prefix + n_new, device=dev)
        out[q0:q1] = ref_attention(q_nope[q0:q1], q_pe[q0:q1], c, k, w_uk, w_uv, sm_scale, pos[prefix:], pos)
    return out

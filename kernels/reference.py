"""Reference implementations (torch, no Triton) for every attention kernel of ``kvbench.kernels``.

* RoPE is defined in float32 with a fixed order of operations (``x·cos − x'·sin`` as two rounded
  products and one rounded sum, no fused multiply-add), because the append kernels must reproduce the
  cache contents bit for bit: ``cache = formats.quantize(rope(k).to(k.dtype))``.
* Attention references compute in float64 on the dequantized cache (dequantization itself in float64,
  so the scales are applied exactly).

Conventions shared with the kernels and the backends:

* ``cos_sin_cache`` is ``[max_position, rotary_dim]`` float32: cos in the first half, sin in the second.
* ``rope_style``: ``"neox"`` rotates the pairs ``(i, i + rotary_dim/2)``, ``"interleaved"`` the pairs
  ``(2i, 2i+1)``; dimensions ``>= rotary_dim`` pass through.
* ``sliding_window = W`` (``None`` or 0 = off): a query at position ``p`` sees keys at positions
  ``p − W < j <= p`` (the ``W`` most recent tokens including itself).
* ``sinks``: one learned logit per query head (natural-log units, not multiplied by ``sm_scale``)
  that joins the softmax denominator only.
* ``q_scale``: when the query was quantized to fp8, the kernels get the fp8 query and its fp32 scale;
  the references take the dequantized query.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvbench.kernels.config import AttentionParams, PagedKV
from kvbench.kernels.formats import NVFP4_BLOCK, dequantize_e2m1, get_format, unpack_nibbles

__all__ = [
    "ROPE_STYLES",
    "build_cos_sin_cache",
    "rope_reference",
    "append_reference",
    "store_reference",
    "dequantize_f64",
    "gather_kv_f64",
    "attention_f64",
    "decode_reference",
    "prefill_reference",
    "slots_from_page_table",
]

ROPE_STYLES = ("neox", "interleaved")


def build_cos_sin_cache(
    max_position: int,
    rotary_dim: int,
    base: float = 10000.0,
    device=None,
    inv_freq: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[max_position, rotary_dim]`` float32 table: cos in the first half, sin in the second."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    if inv_freq is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    t = torch.arange(max_position, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq.to(torch.float64).cpu())
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.float32).to(device)


def _check_style(style: str) -> None:
    if style not in ROPE_STYLES:
        raise ValueError(f"rope_style {style!r} is not supported; choose one of: {', '.join(ROPE_STYLES)}")


def rope_reference(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int, style: str = "neox"
) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` at ``positions`` ``[T]``; float32 arithmetic, result in ``x.dtype``."""
    _check_style(style)
    half = rotary_dim // 2
    cs = cos_sin_cache.to(x.device)[positions.long()]  # [T, rot]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    xf = x.float()
    out = xf.clone()
    if style == "neox":
        x1, x2 = xf[..., :half], xf[..., half:rotary_dim]
    else:
        x1, x2 = xf[..., 0:rotary_dim:2], xf[..., 1:rotary_dim:2]
    a = x1 * cos
    b = x2 * sin
    o1 = a - b
    c = x2 * cos
    d = x1 * sin
    o2 = c + d
    if style == "neox":
        out[..., :half] = o1
        out[..., half:rotary_dim] = o2
    else:
        out[..., 0:rotary_dim:2] = o1
        out[..., 1:rotary_dim:2] = o2
    return out.to(x.dtype)


def append_reference(
    q, k, v, positions, slot_mapping, cos_sin_cache, kv: PagedKV, *,
    rotary_dim: Optional[int] = None, rope_style: str = "neox", q_scale=None,
):
    """What the append kernels must produce. Returns ``(q_rot, k_rot, q_fp8, k_cache, v_cache,
    k_block_scale, v_block_scale)``; the caches are updated copies (the inputs are not touched)."""
    get_format(kv.kv_format)  # an unknown format raises before any work
    rot = rotary_dim or q.shape[-1]
    q_rot = rope_reference(q, positions, cos_sin_cache, rot, rope_style)
    k_rot = rope_reference(k, positions, cos_sin_cache, rot, rope_style)
    q_fp8 = None
    if q_scale is not None:
        q_fp8 = get_format("fp8_e4m3").quantize(q_rot, q_scale.reshape(())).data
    kc, kbs = store_reference(kv.kv_format, kv.k_cache, kv.k_block_scale, k_rot, slot_mapping, kv.k_scale)
    vc, vbs = store_reference(kv.kv_format, kv.v_cache, kv.v_block_scale, v, slot_mapping, kv.v_scale)
    return q_rot, k_rot, q_fp8, kc, vc, kbs, vbs


def store_reference(kv_format: str, cache, block_scale, x, slot_mapping, scale):
    """Copies of ``cache`` (and ``block_scale``) with ``formats.quantize(x)`` stored at the slots ≥ 0."""
    fmt = get_format(kv_format)
    c = cache.clone()
    bs = block_scale.clone() if block_scale is not None else None
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    qkv = fmt.quantize(x[keep], scale)
    page, off = slots // c.shape[1], slots % c.shape[1]  # (page, offset) indexing: any page layout
    c[page, off] = qkv.data
    if bs is not None:
        bs[page, off] = qkv.block_scale
    return c, bs


# ------------------------------------------------------------------------------------ attention
def dequantize_f64(kv_format: str, data: torch.Tensor, scale, block_scale=None) -> torch.Tensor:
    """Stored cache values ``[..., H_kv, Dp]`` → float64 ``[..., H_kv, D]`` (``scale`` per kv head)."""
    fmt = get_format(kv_format)
    s = torch.as_tensor(scale, dtype=torch.float64, device=data.device)
    if fmt.name in ("bf16", "fp16"):
        return data.to(torch.float64)
    if fmt.name == "nvfp4":
        codes = unpack_nibbles(data)
        d = codes.shape[-1]
        vals = dequantize_e2m1(codes, torch.float64).reshape(*codes.shape[:-1], d // NVFP4_BLOCK, NVFP4_BLOCK)
        vals = vals * block_scale.to(torch.float64).unsqueeze(-1) * s[..., None, None]
        return vals.reshape(*codes.shape[:-1], d)
    return data.to(torch.float64) * s[..., None]


def slots_from_page_table(page_table_row: torch.Tensor, start: int, end: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(start, end, device=page_table_row.device)
    return page_table_row[pos // page_size].long() * page_size + pos % page_size


def gather_kv_f64(kv_format, cache, scale, block_scale, page_table_row, start, end):
    """Dequantized float64 ``[end − start, H_kv, D]`` of one sequence's cached positions."""
    page_size = cache.shape[1]
    slots = slots_from_page_table(page_table_row, start, end, page_size)
    page, off = slots // page_size, slots % page_size  # (page, offset) indexing: any page layout
    data = cache[page, off]
    bs = block_scale[page, off] if block_scale is not None else None
    return dequantize_f64(kv_format, data, scale, bs)


def attention_f64(q, k, v, q_pos, k_pos, sm_scale, sliding_window=None, sinks=None) -> torch.Tensor:
    """float64 attention. ``q`` ``[M, H_q, D]``, ``k``/``v`` ``[N, H_kv, D]``, positions ``[M]``/``[N]``;
    causal by position; GQA by repeating kv heads. Returns ``[M, H_q, D]`` float64."""
    hq, hk = q.shape[1], k.shape[1]
    g = hq // hk
    qd, kd, vd = q.double(), k.double(), v.double()
    kd = kd.repeat_interleave(g, dim=1)
    vd = vd.repeat_interleave(g, dim=1)
    logits = torch.einsum("mhd,nhd->hmn", qd, kd) * sm_scale
    diff = q_pos[:, None].long() - k_pos[None, :].long()
    visible = diff >= 0
    if sliding_window:
        visible &= diff < sliding_window
    logits = logits.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        sink_col = sinks.double().to(q.device)[:, None, None].expand(hq, q.shape[0], 1)
        logits = torch.cat((logits, sink_col), dim=-1)
    p = torch.softmax(logits, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("hmn,nhd->mhd", p, vd)


def _q_f64(q, q_scale):
    return q.double() * (float(q_scale.reshape(())) if q_scale is not None else 1.0)


_NO_ATTN = AttentionParams()


def _gather(kv: PagedKV, page_table_row, start: int, end: int):
    """Dequantized float64 K and V of one sequence's cached positions ``[start, end)``."""
    k = gather_kv_f64(kv.kv_format, kv.k_cache, kv.k_scale, kv.k_block_scale, page_table_row, start, end)
    v = gather_kv_f64(kv.kv_format, kv.v_cache, kv.v_scale, kv.v_block_scale, page_table_row, start, end)
    return k, v


def decode_reference(q, kv: PagedKV, page_table, seq_lens, attn: AttentionParams = _NO_ATTN) -> torch.Tensor:
    """``q`` ``[B, H_q, D]`` (one new token per sequence, at position ``seq_len − 1``) → float64."""
    d = q.shape[-1]
    sm_scale = attn.sm_scale if attn.sm_scale is not None else d**-0.5
    qf = _q_f64(q, attn.q_scale)
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        k, v = _gather(kv, page_table[b], 0, n)
        pos = torch.arange(n, device=q.device)
        out[b] = attention_f64(qf[b : b + 1], k, v, pos[-1:], pos, sm_scale, attn.sliding_window, attn.sinks)[0]
    return out


def prefill_reference(
    q, k_new, v_new, cu_seqlens_q: Sequence[int] | torch.Tensor, kv: PagedKV, page_table, seq_lens,
    attn: AttentionParams = _NO_ATTN,
) -> torch.Tensor:
    """Packed new tokens ``q`` ``[T, H_q, D]``, ``k_new``/``v_new`` ``[T, H_kv, D]`` (compute precision);
    sequence ``b`` has new tokens ``cu[b]:cu[b+1]`` at positions ``seq_len − q_len ..``; its prefix
    ``[0, seq_len − q_len)`` comes from the pages. Returns float64 ``[T, H_q, D]``."""
    d = q.shape[-1]
    sm_scale = attn.sm_scale if attn.sm_scale is not None else d**-0.5
    cu = [int(x) for x in cu_seqlens_q]
    qf = _q_f64(q, attn.q_scale)
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        n = int(seq_lens[b])
        prefix = n - (e - s)
        kp, vp = _gather(kv, page_table[b], 0, prefix)
        k = torch.cat((kp, k_new[s:e].double()))
        v = torch.cat((vp, v_new[s:e].double()))
        kpos = torch.arange(n, device=q.device)
        out[s:e] = attention_f64(qf[s:e], k, v, kpos[prefix:], kpos, sm_scale, attn.sliding_window, attn.sinks)
    return out

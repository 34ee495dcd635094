"""Fused MLA RoPE + quantize + append (Triton), and the unfused torch path kept for comparison.

One program per new token: RoPE on its ``q_pe`` (all heads) and ``k_pe``, quantize ``[c_kv | k_pe]`` to
the cache format (fp8 with the per-layer ``k_scale``; nvfp4 with e4m3 block scales per 16 elements) and
write the row to ``slot_mapping[t]`` (−1 = skip).  Optionally it also emits an fp8 (e4m3) query
``[q_lat | rope(q_pe)] / q_scale`` for kernels that take fp8 queries.  Quantization follows
``kernels/formats.py`` operation by operation (correctly rounded divisions), so on a GPU the stored
bytes match it exactly; RoPE is computed in float32 before quantization.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvbench.kernels.mla import FMT_NVFP4, LatentCache
from kvbench.kernels._triton_utils import e2m1_code
from kvbench.kernels.mla_common import check_cache

ROPE_STYLES = ("neox", "interleaved")


@triton.jit
def _rope_at(X, CS, p, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """RoPE'd float32 values at element indices ``p`` of the vector at ``X`` (cos/sin row at ``CS``)."""
    if IS_NEOX:
        f = p % HALF
        partner = tl.where(p < HALF, p + HALF, p - HALF)
        sgn = tl.where(p < HALF, -1.0, 1.0)
    else:
        f = p // 2
        partner = p ^ 1
        sgn = tl.where((p % 2) == 0, -1.0, 1.0)
    x = tl.load(X + p).to(tl.float32)
    xp = tl.load(X + partner).to(tl.float32)
    c = tl.load(CS + f)
    s = tl.load(CS + HALF + f)
    return x * c + sgn * xp * s


@triton.jit
def _store_nvfp4(KV, BS, slot, xe, xo, g, blk, j, byte0, blk0, PD: tl.constexpr, NB: tl.constexpr):
    """Quantize blocks of 16 given as even / odd halves ``[NBLK, 8]`` and store bytes + block scales."""
    amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
    s = tl.math.div_rn(tl.math.div_rn(amax, 6.0), g)
    s = tl.minimum(tl.maximum(s, 0.015625), 448.0)
    s8 = s.to(tl.float8e4nv)
    den = s8.to(tl.float32) * g
    ce = e2m1_code(tl.math.div_rn(xe, den[:, None]))
    co = e2m1_code(tl.math.div_rn(xo, den[:, None]))
    tl.store(KV + slot * PD + byte0 + blk[:, None] * 8 + j[None, :], (ce | (co << 4)).to(tl.uint8))
    tl.store(BS + slot * NB + blk0 + blk, s8)


@triton.jit
def _mla_append_kernel(
    C, KPE, KOUT, QPE, QOUT, POS, CS, SLOT, KV, BS, KSCALE, QLAT, Q8, QSCALE,
    stride_c, stride_kpe, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, stride_8t, stride_8h,
    H,
    RANK: tl.constexpr, ROPE: tl.constexpr, HB: tl.constexpr, FMT: tl.constexpr, IS_NEOX: tl.constexpr,
    EMIT_Q8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = ROPE // 2
    pos = tl.load(POS + t).to(tl.int64)
    cs = CS + pos * ROPE
    dp = tl.arange(0, ROPE)
    # --- q_pe: RoPE for every head (and the optional fp8 query).
    for h0 in range(0, H, HB):
        h = h0 + tl.arange(0, HB)
        hm = h < H
        hh = tl.where(hm, h, 0).to(tl.int64)
        qo = _rope_at(QPE + t * stride_qt + hh[:, None] * stride_qh, cs, dp[None, :], HALF, IS_NEOX)
        tl.store(QOUT + t * stride_ot + h[:, None] * stride_oh + dp[None, :], qo.to(QOUT.dtype.element_ty), mask=hm[:, None])
        if EMIT_Q8:
            qs = tl.load(QSCALE)
            q8 = tl.minimum(tl.maximum(tl.math.div_rn(qo, qs), -FP8_MAX), FP8_MAX)
            base8 = Q8 + t * stride_8t + h[:, None] * stride_8h
            tl.store(base8 + RANK + dp[None, :], q8.to(Q8.dtype.element_ty), mask=hm[:, None])
            dr = tl.arange(0, RANK)
            ql = tl.load(QLAT + t * stride_lt + h[:, None] * stride_lh + dr[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
            ql8 = tl.minimum(tl.maximum(tl.math.div_rn(ql, qs), -FP8_MAX), FP8_MAX)
            tl.store(base8 + dr[None, :], ql8.to(Q8.dtype.element_ty), mask=hm[:, None])
    # --- k_pe after RoPE, in the compute dtype (prefill attends to the new tokens' own keys).
    kx = KPE + t * stride_kpe
    tl.store(KOUT + t * ROPE + dp, _rope_at(kx, cs, dp, HALF, IS_NEOX).to(KOUT.dtype.element_ty))
    # --- latent row: quantize and write to its slot.
    slot = tl.load(SLOT + t).to(tl.int64)
    if slot >= 0:
        cx = C + t * stride_c
        if FMT == 2:
            PD: tl.constexpr = (RANK + ROPE) // 2
            NB: tl.constexpr = (RANK + ROPE) // 16
            g = tl.load(KSCALE)
            j = tl.arange(0, 8)
            blk = tl.arange(0, RANK // 16)
            e = blk[:, None] * 16 + 2 * j[None, :]
            ce = tl.load(cx + e).to(tl.float32)
            co = tl.load(cx + e + 1).to(tl.float32)
            _store_nvfp4(KV, BS, slot, ce, co, g, blk, j, 0, 0, PD, NB)
            rblk = tl.arange(0, ROPE // 16)
            re = rblk[:, None] * 16 + 2 * j[None, :]
            ke = _rope_at(kx, cs, re, HALF, IS_NEOX)
            ko = _rope_at(kx, cs, re + 1, HALF, IS_NEOX)
            _store_nvfp4(KV, BS, slot, ke, ko, g, rblk, j, RANK // 2, RANK // 16, PD, NB)
        else:
            D: tl.constexpr = RANK + ROPE
            dr = tl.arange(0, RANK)
            c = tl.load(cx + dr).to(tl.float32)
            k = _rope_at(kx, cs, dp, HALF, IS_NEOX)
            if FMT == 1:
                ks = tl.load(KSCALE)
                c = tl.minimum(tl.maximum(tl.math.div_rn(c, ks), -FP8_MAX), FP8_MAX)
                k = tl.minimum(tl.maximum(tl.math.div_rn(k, ks), -FP8_MAX), FP8_MAX)
            tl.store(KV + slot * D + dr, c.to(KV.dtype.element_ty))
            tl.store(KV + slot * D + RANK + dp, k.to(KV.dtype.element_ty))


def _check_inputs(c_kv, k_pe, q_pe, positions, cos_sin_cache, slot_mapping, cache: LatentCache, rope_style):
    lay = cache.layout
    if rope_style not in ROPE_STYLES:
        raise ValueError(f"rope_style must be one of {ROPE_STYLES}, got {rope_style!r}")
    if c_kv.dim() != 2 or c_kv.shape[1] != lay.kv_lora_rank:
        raise ValueError(f"c_kv must be [T, {lay.kv_lora_rank}], got {tuple(c_kv.shape)}")
    t = c_kv.shape[0]
    if tuple(k_pe.shape) != (t, lay.rope_dim):
        raise ValueError(f"k_pe must be [T={t}, {lay.rope_dim}], got {tuple(k_pe.shape)}")
    if q_pe.dim() != 3 or q_pe.shape[0] != t or q_pe.shape[2] != lay.rope_dim:
        raise ValueError(f"q_pe must be [T={t}, H, {lay.rope_dim}], got {tuple(q_pe.shape)}")
    if tuple(positions.shape) != (t,) or tuple(slot_mapping.shape) != (t,):
        raise ValueError("positions and slot_mapping must be [T]")
    if positions.is_floating_point() or slot_mapping.is_floating_point():
        raise ValueError("positions and slot_mapping must be integer tensors")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != lay.rope_dim:
        raise ValueError(f"cos_sin_cache must be [max_positions, {lay.rope_dim}]")
    dev = cache.data.device
    for name, x in (("c_kv", c_kv), ("k_pe", k_pe), ("q_pe", q_pe), ("positions", positions),
                    ("cos_sin_cache", cos_sin_cache), ("slot_mapping", slot_mapping)):
        if x.device != dev:
            raise ValueError(f"{name} is on {x.device}, the cache on {dev}")
    if c_kv.stride(1) != 1 or k_pe.stride(1) != 1 or q_pe.stride(2) != 1:
        raise ValueError("c_kv, k_pe and q_pe must be contiguous in their last dimension")


def _q8_out(q_lat, q_pe, q_scale, lay):
    import torch

    if q_lat is None:
        return None
    t, h = q_pe.shape[:2]
    if tuple(q_lat.shape) != (t, h, lay.kv_lora_rank) or q_lat.stride(2) != 1:
        raise ValueError(f"q_lat must be [T, H, {lay.kv_lora_rank}] contiguous in its last dim")
    if q_scale is None or q_scale.dtype != torch.float32:
        raise ValueError("emitting an fp8 query needs q_scale, an fp32 tensor [1]")
    return torch.empty(t, h, lay.head_dim, dtype=torch.float8_e4m3fn, device=q_pe.device)


def mla_append(c_kv, k_pe, q_pe, positions, cos_sin_cache, slot_mapping, cache: LatentCache, *,
               rope_style: str = "neox", q_lat=None, q_scale=None, heads_per_block: int = 16):
    """Fused append.  Returns ``(q_pe_rotated, k_pe_rotated, q_fp8)`` (the first two in the inputs'
    dtypes, for attention over the new tokens' own keys); ``q_fp8`` is ``[T, H, rank + rope]`` e4m3
    (``[q_lat | rope(q_pe)] / q_scale``) when ``q_lat`` is given, else ``None``.  Inputs are not mutated."""
    import torch

    fmt = check_cache(cache)
    _check_inputs(c_kv, k_pe, q_pe, positions, cos_sin_cache, slot_mapping, cache, rope_style)
    lay = cache.layout
    t, h = q_pe.shape[:2]
    q_out = torch.empty_like(q_pe, memory_format=torch.contiguous_format)
    k_out = torch.empty(t, lay.rope_dim, dtype=k_pe.dtype, device=k_pe.device)
    q8 = _q8_out(q_lat, q_pe, q_scale, lay)
    if t == 0:
        return q_out, k_out, q8
    hb = min(triton.next_power_of_2(h), heads_per_block)
    bs = cache.block_scale if fmt == FMT_NVFP4 else cache.data
    ql = q_lat if q8 is not None else q_pe
    q8a = q8 if q8 is not None else q_out
    qs = q_scale if q8 is not None else cache.k_scale
    fp8_max = 57344.0 if cache.data.dtype == torch.float8_e5m2 else 448.0
    _mla_append_kernel[(t,)](
        c_kv, k_pe, k_out, q_pe, q_out, positions, cos_sin_cache.float().contiguous(), slot_mapping,
        cache.data, bs, cache.k_scale, ql, q8a, qs,
        c_kv.stride(0), k_pe.stride(0), q_pe.stride(0), q_pe.stride(1), q_out.stride(0), q_out.stride(1),
        ql.stride(0), ql.stride(1), q8a.stride(0), q8a.stride(1),
        h, RANK=lay.kv_lora_rank, ROPE=lay.rope_dim, HB=hb, FMT=fmt, IS_NEOX=rope_style == "neox",
        EMIT_Q8=q8 is not None, FP8_MAX=fp8_max,
    )
    return q_out, k_out, q8


def rope_torch(x, positions, cos_sin_cache, rope_style: str = "neox"):
    """RoPE in float32 (torch ops), ``x [..., T, (H,) rope]`` with ``positions [T]``; returns float32."""
    import torch

    half = x.shape[-1] // 2
    cs = cos_sin_cache.float()[positions.long()]
    cos, sin = cs[:, :half], cs[:, half:]
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    xf = x.float()
    if rope_style == "neox":
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def mla_append_unfused(c_kv, k_pe, q_pe, positions, cos_sin_cache, slot_mapping, cache: LatentCache, *,
                       rope_style: str = "neox", q_lat=None, q_scale=None):
    """The same contract as ``mla_append`` in separate torch steps: RoPE, ``formats.quantize``, store."""
    import torch

    from kvbench.kernels.formats import get_format

    check_cache(cache)
    _check_inputs(c_kv, k_pe, q_pe, positions, cos_sin_cache, slot_mapping, cache, rope_style)
    lay = cache.layout
    q_rot = rope_torch(q_pe, positions, cos_sin_cache, rope_style)
    k_rot = rope_torch(k_pe, positions, cos_sin_cache, rope_style)
    q8 = _q8_out(q_lat, q_pe, q_scale, lay)
    if q8 is not None:
        q8.copy_(get_format("fp8_e4m3").quantize(torch.cat((q_lat.float(), q_rot), dim=-1), q_scale[0]).data)
    fmt = get_format(lay.kv_dtype)
    qkv = fmt.quantize(torch.cat((c_kv.float(), k_rot), dim=-1), cache.k_scale[0])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    cache.data.view(-1, lay.packed_dim)[slots] = qkv.data[keep]
    if qkv.block_scale is not None:
        cache.block_scale.view(-1, lay.head_dim // 16)[slots] = qkv.block_scale[keep]
    return q_rot.to(q_pe.dtype), k_rot.to(k_pe.dtype), q8

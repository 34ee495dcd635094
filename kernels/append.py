"""RoPE + quantize + append of new tokens into the paged KV cache (Triton).

``fused_rope_quant_append`` does everything in one launch: RoPE on q and k (neox or interleaved,
partial rotary dim), k and v quantized to the cache format (bf16/fp16 copy, fp8 e4m3/e5m2 with per-head
fp32 scales, nvfp4 with e4m3 block scales) and stored at their slots (slot −1 = skip), and optionally an
fp8 copy of the rotated q.  ``unfused_rope_quant_append`` is the same work in two launches (``rope``, then
``quantize_store``), kept for comparison.  Both must reproduce ``reference.append_reference`` exactly:
the float32 RoPE runs without FMA contraction and divisions are correctly rounded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kvbench.kernels._triton_utils import (
    FMT_FP8,
    FMT_NVFP4,
    FMT_PLAIN,
    NO_FMA,
    check_cache,
    e2m1_code,
    format_code,
    next_pow2,
)
from kvbench.kernels.formats import get_format
from kvbench.kernels.reference import ROPE_STYLES

__all__ = ["AppendOutput", "fused_rope_quant_append", "unfused_rope_quant_append", "rope", "quantize_store"]


@dataclass
class AppendOutput:
    q: torch.Tensor  # rotated q, compute dtype [T, H_q, D]
    k: torch.Tensor  # rotated k, compute dtype [T, H_kv, D] (prefill attends to it in compute precision)
    q_fp8: Optional[torch.Tensor] = None  # float8_e4m3fn [T, H_q, D] when q_scale was given


@triton.jit
def _rope_load(row, cs_row, d, dmask, ROT: tl.constexpr, NEOX: tl.constexpr, DO_ROPE: tl.constexpr):
    x = tl.load(row + d, mask=dmask, other=0.0).to(tl.float32)
    if DO_ROPE:
        HALF: tl.constexpr = ROT // 2
        in_rot = dmask & (d < ROT)
        if NEOX:
            first = d < HALF
            partner = tl.where(first, d + HALF, d - HALF)
            fi = tl.where(first, d, d - HALF)
        else:
            first = (d % 2) == 0
            partner = tl.where(first, d + 1, d - 1)
            fi = d // 2
        xp = tl.load(row + partner, mask=in_rot, other=0.0).to(tl.float32)
        c = tl.load(cs_row + fi, mask=in_rot, other=1.0)
        s = tl.load(cs_row + HALF + fi, mask=in_rot, other=0.0)
        xc = x * c
        xs = xp * s
        x = tl.where(in_rot, tl.where(first, xc - xs, xc + xs), x)
    return x


@triton.jit
def _quant_store_plain_fp8(dst, x, d, dmask, scale, FMT: tl.constexpr, QMAX: tl.constexpr):
    if FMT == 1:
        y = tl.math.div_rn(x, scale)
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        tl.store(dst + d, y.to(dst.dtype.element_ty), mask=dmask)
    else:
        tl.store(dst + d, x.to(dst.dtype.element_ty), mask=dmask)


@triton.jit
def _append_kernel(
    Q, K, V, POS, SLOTS, CS, Q_OUT, K_OUT, Q8, Q_SCALE,
    KC, VC, KBS, VBS, K_SCALE, V_SCALE,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sqo_t, sqo_h, sko_t, sko_h, sq8_t, sq8_h,
    skc_slot, skc_h, svc_slot, svc_h, skb_slot, skb_h, svb_slot, svb_h, s_cs,
    H_Q, D: tl.constexpr, D_PAD: tl.constexpr, NB_PAD: tl.constexpr,
    ROT: tl.constexpr, NEOX: tl.constexpr, FMT: tl.constexpr, QMAX: tl.constexpr,
    DO_ROPE: tl.constexpr, DO_STORE: tl.constexpr, WRITE_K_OUT: tl.constexpr, Q_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cs_row = CS
    if DO_ROPE:
        pos = tl.load(POS + t).to(tl.int64)
        cs_row = CS + pos * s_cs
    d = tl.arange(0, D_PAD)
    dmask = d < D
    if h < H_Q:
        x = _rope_load(Q + t * sq_t + h * sq_h, cs_row, d, dmask, ROT, NEOX, DO_ROPE)
        xq = x.to(Q_OUT.dtype.element_ty)
        tl.store(Q_OUT + t * sqo_t + h * sqo_h + d, xq, mask=dmask)
        if Q_FP8:
            qs = tl.load(Q_SCALE)
            y = tl.math.div_rn(xq.to(tl.float32), qs)
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
            tl.store(Q8 + t * sq8_t + h * sq8_h + d, y.to(tl.float8e4nv), mask=dmask)
    else:
        hk = (h - H_Q).to(tl.int64)
        slot = tl.load(SLOTS + t).to(tl.int64)
        k_row = K + t * sk_t + hk * sk_h
        v_row = V + t * sv_t + hk * sv_h
        if FMT == 2:
            nb = tl.arange(0, NB_PAD)
            p = tl.arange(0, 8)
            de = nb[:, None] * 16 + p[None, :] * 2
            pm = de < D
            ke = _rope_load(k_row, cs_row, de, pm, ROT, NEOX, DO_ROPE).to(K_OUT.dtype.element_ty)
            ko = _rope_load(k_row, cs_row, de + 1, pm, ROT, NEOX, DO_ROPE).to(K_OUT.dtype.element_ty)
            if WRITE_K_OUT:
                tl.store(K_OUT + t * sko_t + hk * sko_h + de, ke, mask=pm)
                tl.store(K_OUT + t * sko_t + hk * sko_h + de + 1, ko, mask=pm)
            if DO_STORE:
                if slot >= 0:
                    ks = tl.load(K_SCALE + hk)
                    vs = tl.load(V_SCALE + hk)
                    ve = tl.load(v_row + de, mask=pm, other=0.0).to(tl.float32)
                    vo = tl.load(v_row + de + 1, mask=pm, other=0.0).to(tl.float32)
                    bm = nb < D // 16
                    _nvfp4_store(KC + slot * skc_slot + hk * skc_h, KBS + slot * skb_slot + hk * skb_h,
                                 ke.to(tl.float32), ko.to(tl.float32), nb, pm, bm, ks)
                    _nvfp4_store(VC + slot * svc_slot + hk * svc_h, VBS + slot * svb_slot + hk * svb_h,
                                 ve, vo, nb, pm, bm, vs)
        else:
            kx = _rope_load(k_row, cs_row, d, dmask, ROT, NEOX, DO_ROPE).to(K_OUT.dtype.element_ty)
            if WRITE_K_OUT:
                tl.store(K_OUT + t * sko_t + hk * sko_h + d, kx, mask=dmask)
            if DO_STORE:
                if slot >= 0:
                    ks = 1.0
                    vs = 1.0
                    if FMT == 1:
                        ks = tl.load(K_SCALE + hk)
                        vs = tl.load(V_SCALE + hk)
                    vx = tl.load(v_row + d, mask=dmask, other=0.0)
                    _quant_store_plain_fp8(KC + slot * skc_slot + hk * skc_h, kx.to(tl.float32), d, dmask, ks, FMT, QMAX)
                    _quant_store_plain_fp8(VC + slot * svc_slot + hk * svc_h, vx.to(tl.float32), d, dmask, vs, FMT, QMAX)


@triton.jit
def _nvfp4_store(dst, bs_dst, xe, xo, nb, pm, bm, scale):
    xe = tl.where(pm, xe, 0.0)
    xo = tl.where(pm, xo, 0.0)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
    s = tl.math.div_rn(tl.math.div_rn(amax, 6.0), scale)
    s = tl.minimum(tl.maximum(s, 0.015625), 448.0)
    s8 = s.to(tl.float8e4nv)
    denom = (s8.to(tl.float32) * scale)[:, None]
    ce = e2m1_code(tl.math.div_rn(xe, denom))
    co = e2m1_code(tl.math.div_rn(xo, denom))
    byte = (ce | (co << 4)).to(tl.uint8)
    p = tl.arange(0, 8)
    tl.store(dst + nb[:, None] * 8 + p[None, :], byte, mask=pm)
    tl.store(bs_dst + nb, s8, mask=bm)

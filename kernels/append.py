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
    NO_FMA,
    cast_fp8,
    cast_rne,
    check_kv,
    e2m1_code,
    e2m1_code_by_thresholds,
    format_code,
    interpreting,
    next_pow2,
    pdl,
    pdl_enter,
    pdl_launch,
)
from kvbench.kernels.config import PagedKV
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
def _quant_store_plain_fp8(dst, x, d, dmask, scale, FMT: tl.constexpr, QMAX: tl.constexpr,
                           E5M2: tl.constexpr, EXACT: tl.constexpr):
    if FMT == 1:
        y = tl.math.div_rn(x, scale)
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        tl.store(dst + d, cast_fp8(y, dst.dtype.element_ty, E5M2, EXACT), mask=dmask)
    else:
        tl.store(dst + d, cast_rne(x, dst.dtype.element_ty, EXACT), mask=dmask)


@triton.jit
def _nvfp4_store(dst, bs_dst, xe, xo, blk, p, pm, bm, scale, EXACT: tl.constexpr, PACKED: tl.constexpr = False,
                 BITCODE: tl.constexpr = True):
    """xe / xo: [HB, NB, 8] float32 even / odd elements of each 16-element block of HB head vectors;
    ``dst`` / ``bs_dst`` [HB, 1, 1] row pointers; ``scale`` [HB, 1, 1].  ``PACKED`` (head dim a multiple of 64,
    so every row and every group of 4 block scales starts 4-byte aligned): the codes and the scales are
    stored as 32-bit words of 4 bytes each instead of byte by byte."""
    xe = tl.where(pm, xe, 0.0)
    xo = tl.where(pm, xo, 0.0)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=2), tl.max(tl.abs(xo), axis=2))  # [HB, NB]
    sc = tl.reshape(scale, (scale.shape[0], 1))
    s = tl.math.div_rn(tl.math.div_rn(amax, 6.0), sc)
    s = tl.minimum(tl.maximum(s, 0.015625), 448.0)
    s8 = cast_fp8(s, tl.float8e4nv, False, EXACT)
    denom = (s8.to(tl.float32) * sc)[:, :, None]
    if BITCODE:
        ce = e2m1_code(tl.math.div_rn(xe, denom))
        co = e2m1_code(tl.math.div_rn(xo, denom))
    else:
        ce = e2m1_code_by_thresholds(tl.math.div_rn(xe, denom))
        co = e2m1_code_by_thresholds(tl.math.div_rn(xo, denom))
    HB: tl.constexpr = xe.shape[0]
    NB: tl.constexpr = xe.shape[1]
    bs_row = tl.reshape(bs_dst, (HB, 1))
    if PACKED:
        codes = tl.reshape(ce | (co << 4), (HB, NB, 2, 4))
        words = tl.sum(codes << (tl.arange(0, 4) * 8)[None, None, None, :], axis=3)  # disjoint bytes: sum == or
        wm = tl.max(tl.reshape(pm.to(tl.int32), (HB, NB, 2, 4)), axis=3) > 0
        wptr = (dst + blk * 8).to(tl.pointer_type(tl.int32)) + tl.arange(0, 2)[None, None, :]
        tl.store(wptr, words, mask=wm)
        sb = tl.reshape(s8.to(tl.uint8, bitcast=True).to(tl.int32), (HB, NB // 4, 4))
        sw = tl.sum(sb << (tl.arange(0, 4) * 8)[None, None, :], axis=2)
        swm = tl.max(tl.reshape(bm.to(tl.int32), (HB, NB // 4, 4)), axis=2) > 0
        tl.store(bs_row.to(tl.pointer_type(tl.int32)) + tl.arange(0, NB // 4)[None, :], sw, mask=swm)
    else:
        byte = (ce | (co << 4)).to(tl.uint8)
        tl.store(dst + blk * 8 + p, byte, mask=pm)
        tl.store(bs_row + tl.reshape(blk, (1, NB)), s8, mask=bm)


@triton.jit
def _append_kernel(
    Q, K, V, POS, SLOTS, CS, Q_OUT, K_OUT, Q8, Q_SCALE,
    KC, VC, KBS, VBS, K_SCALE, V_SCALE,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sqo_t, sqo_h, sko_t, sko_h, sq8_t, sq8_h,
    page_size, s_page, s_tok, skc_h, svc_h, sb_page, sb_tok, skb_h, svb_h, s_cs,
    H_Q, H_KV, D: tl.constexpr, D_PAD: tl.constexpr, NB_PAD: tl.constexpr, HB: tl.constexpr,
    ROT: tl.constexpr, NEOX: tl.constexpr, FMT: tl.constexpr, QMAX: tl.constexpr,
    DO_ROPE: tl.constexpr, DO_STORE: tl.constexpr, WRITE_K_OUT: tl.constexpr, Q_FP8: tl.constexpr,
    E5M2: tl.constexpr, EXACT: tl.constexpr, KV_FIRST: tl.constexpr = False, PACKED: tl.constexpr = False,
    HOIST: tl.constexpr = True, BITCODE: tl.constexpr = True, PDL: tl.constexpr = False,
):
    """One program: token ``t``, a block of ``HB`` query heads or of ``HB`` kv heads.  ``KV_FIRST``: the kv
    blocks (the longer programs: RoPE, quantization, two stores) take the first block indices, so they are
    scheduled before the query blocks instead of forming the grid's tail.  ``PDL``: a programmatic dependent
    launch (``_triton_utils.pdl_enter``)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    nqb = tl.cdiv(H_Q, HB)
    if KV_FIRST:
        nkb = tl.cdiv(H_KV, HB)
        hb = tl.where(hb < nkb, hb + nqb, hb - nkb)
    cs_row = CS
    if DO_ROPE:
        pos = tl.load(POS + t).to(tl.int64)
        cs_row = CS + pos * s_cs
    hh = tl.arange(0, HB)
    if hb < nqb:
        h = (hb * HB + hh).to(tl.int64)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        dmask = (d < D) & (h < H_Q)
        x = _rope_load(Q + t * sq_t + h * sq_h, cs_row, d, dmask, ROT, NEOX, DO_ROPE)
        xq = cast_rne(x, Q_OUT.dtype.element_ty, EXACT)
        tl.store(Q_OUT + t * sqo_t + h * sqo_h + d, xq, mask=dmask)
        if Q_FP8:
            qs = tl.load(Q_SCALE)
            y = tl.math.div_rn(xq.to(tl.float32), qs)
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
            tl.store(Q8 + t * sq8_t + h * sq8_h + d, cast_fp8(y, tl.float8e4nv, False, EXACT), mask=dmask)
    else:
        _kv_block(t, hb - nqb, cs_row, K, V, SLOTS, K_OUT, KC, VC, KBS, VBS, K_SCALE, V_SCALE,
                  sk_t, sk_h, sv_t, sv_h, sko_t, sko_h, page_size, s_page, s_tok, skc_h, svc_h, sb_page, sb_tok,
                  skb_h, svb_h, H_KV, D, D_PAD, NB_PAD, HB, ROT, NEOX, FMT, QMAX, DO_ROPE, DO_STORE,
                  WRITE_K_OUT, E5M2, EXACT, PACKED, HOIST, BITCODE)


@triton.jit
def _v_and_scales(V, t, sv_t, sv_h, hk2, d, dmask, K_SCALE, V_SCALE, hk, H_KV, FMT: tl.constexpr):
    """The per-head k / v scales (1 for the 16-bit formats) and the v rows of a kv block."""
    if FMT >= 1:
        ks = tl.load(K_SCALE + hk, mask=hk < H_KV, other=1.0)
        vs = tl.load(V_SCALE + hk, mask=hk < H_KV, other=1.0)
    else:
        ks = 1.0
        vs = 1.0
    vx = tl.load(V + t * sv_t + hk2 * sv_h + d, mask=dmask, other=0.0)
    return ks, vs, vx


@triton.jit
def _kv_block(t, kvb, cs_row, K, V, SLOTS, K_OUT, KC, VC, KBS, VBS, K_SCALE, V_SCALE,
              sk_t, sk_h, sv_t, sv_h, sko_t, sko_h, page_size, s_page, s_tok, skc_h, svc_h, sb_page, sb_tok,
              skb_h, svb_h, H_KV, D: tl.constexpr, D_PAD: tl.constexpr, NB_PAD: tl.constexpr, HB: tl.constexpr,
              ROT: tl.constexpr, NEOX: tl.constexpr, FMT: tl.constexpr, QMAX: tl.constexpr, DO_ROPE: tl.constexpr,
              DO_STORE: tl.constexpr, WRITE_K_OUT: tl.constexpr, E5M2: tl.constexpr, EXACT: tl.constexpr,
              PACKED: tl.constexpr, HOIST: tl.constexpr, BITCODE: tl.constexpr):
    """A block of ``HB`` kv heads of token ``t``: RoPE on k, k and v quantized and stored at the token's slot.
    ``HOIST`` (the default): v and the scales are loaded before the RoPE instead of after the slot's test, so
    their latency overlaps the RoPE's loads instead of following them (a token's programs wait on one chain of
    loads fewer; ``python docs/scripts/speed_probes.py append-variants``)."""
    hh = tl.arange(0, HB)
    slot = tl.load(SLOTS + t).to(tl.int64)
    # the slot's element offset in the data and block-scale planes (any page layout)
    row = (slot // page_size) * s_page + (slot % page_size) * s_tok
    brow = (slot // page_size) * sb_page + (slot % page_size) * sb_tok
    hk2 = (kvb * HB + hh).to(tl.int64)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    dmask = (d < D) & (hk2 < H_KV)
    hk = tl.reshape(hk2, (HB, 1, 1)) if FMT == 2 else hk2
    if HOIST and DO_STORE:
        ks, vs, vx = _v_and_scales(V, t, sv_t, sv_h, hk2, d, dmask, K_SCALE, V_SCALE, hk, H_KV, FMT)
    # RoPE on contiguous rows (nvfp4: then split into the even / odd elements of each 16-block)
    kx = cast_rne(_rope_load(K + t * sk_t + hk2 * sk_h, cs_row, d, dmask, ROT, NEOX, DO_ROPE),
                  K_OUT.dtype.element_ty, EXACT)
    if WRITE_K_OUT:
        tl.store(K_OUT + t * sko_t + hk2 * sko_h + d, kx, mask=dmask)
    if DO_STORE:
        if slot >= 0:
            if not HOIST:
                ks, vs, vx = _v_and_scales(V, t, sv_t, sv_h, hk2, d, dmask, K_SCALE, V_SCALE, hk, H_KV, FMT)
            if FMT == 2:
                blk = tl.arange(0, NB_PAD)[None, :, None]
                p = tl.arange(0, 8)[None, None, :]
                pm = ((blk * 16 + p * 2) < D) & (hk < H_KV)
                bm = (tl.reshape(blk, (1, NB_PAD)) < D // 16) & (hk2 < H_KV)
                ke, ko = tl.split(tl.reshape(kx.to(tl.float32), (HB, NB_PAD, 8, 2)))
                ve, vo = tl.split(tl.reshape(vx.to(tl.float32), (HB, NB_PAD, 8, 2)))
                _nvfp4_store(KC + row + hk * skc_h, KBS + brow + hk * skb_h,
                             ke, ko, blk, p, pm, bm, ks, EXACT, PACKED, BITCODE)
                _nvfp4_store(VC + row + hk * svc_h, VBS + brow + hk * svb_h,
                             ve, vo, blk, p, pm, bm, vs, EXACT, PACKED, BITCODE)
            else:
                _quant_store_plain_fp8(KC + row + hk * skc_h, kx.to(tl.float32), d, dmask, ks, FMT,
                                       QMAX, E5M2, EXACT)
                _quant_store_plain_fp8(VC + row + hk * svc_h, vx.to(tl.float32), d, dmask, vs, FMT,
                                       QMAX, E5M2, EXACT)


# ------------------------------------------------------------------------------------ wrappers
def _check_tokens(q, k, v, positions, slot_mapping):
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must be [T, H_kv, D] of one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q is not None and (q.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]):
        raise ValueError(f"q must be [T, H_q, D] matching k {tuple(k.shape)}, got {tuple(q.shape)}")
    t = k.shape[0]
    for name, x in (("positions", positions), ("slot_mapping", slot_mapping)):
        if x is not None and (x.dim() != 1 or x.shape[0] != t or x.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"{name} must be int32/int64 [T={t}], got {x.dtype} {tuple(x.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is not None and x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")


def _rope_args(cos_sin_cache, rotary_dim, head_dim, style):
    if style not in ROPE_STYLES:
        raise ValueError(f"rope_style {style!r} is not supported; choose one of: {', '.join(ROPE_STYLES)}")
    rot = rotary_dim or head_dim
    if rot % 2 or rot > head_dim:
        raise ValueError(f"rotary_dim must be even and <= head_dim ({head_dim}), got {rot}")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rot:
        raise ValueError(f"cos_sin_cache must be float32 [max_pos, {rot}], got {cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}")
    return rot, cos_sin_cache.contiguous()


# overrides for tuning probes ("hb", "num_warps", "kv_first", "packed", "hoist", "bitcode"); empty in use
_TUNE: dict = {}


def launch_shape(t: int, num_kv_heads: int, head_dim: int, nvfp4_store: bool) -> tuple[int, int]:
    """(heads per program, warps) for ``t`` tokens.  Few tokens: small programs, many of them, so the
    launch is spread over more SMs; from 256 tokens whole 8-head blocks (nvfp4's quantizing blocks 4 heads
    on 2 warps).  In elements per program (the table was measured at head dim 128): 256 below 64 tokens,
    512 below 256, then 1024 (nvfp4 stores 512).  From ``python docs/scripts/speed_probes.py append-shapes`` (the
    fused append over heads 1-8 × warps 1-8 × kv blocks first or last; H100, 2026-11-24, 32/8 heads, D 128,
    graph replays): this table is within 0.1 µs of the best of those 32 for bf16, fp8_e4m3 and nvfp4 at 1, 16,
    128 and 512 tokens (in a second run fp8 at 512 timed 0.3 µs over its best, which was this same shape).  The
    unfused pair and the plain store (the benchmarks' comparators) take the same table."""
    if t < 64:
        elems, warps = 256, 4
    elif t < 256:
        elems, warps = 512, 4
    elif nvfp4_store:
        elems, warps = 512, 2
    else:
        elems, warps = 1024, 4
    return max(1, min(next_pow2(num_kv_heads), elems // max(head_dim, 1))), warps


def packed_stores(t: int, head_dim: int) -> bool:
    """nvfp4 codes and block scales stored as 32-bit words (head dims that are multiples of 64) from 256 tokens:
    ``python docs/scripts/speed_probes.py packed-stores`` on an H100 (2026-11-24 22:31 UTC; fused append 32/8 heads,
    D 128, graph replays, best of 16 launch shapes each): 512 tokens 6.51 → 5.97 µs; at 1 / 16 / 128 tokens byte
    stores stay ahead (2.18 / 2.34 / 3.28 against 2.28 / 2.47 / 3.33 µs)."""
    return t >= 256 and head_dim % 64 == 0


def _launch(t, q, k, v, positions, slots, cs, q_out, k_out, q8, q_scale, kc, vc, *, rot, neox, fmt_name,
            do_rope, do_store, write_k_out, num_q_heads):
    fmt = get_format(fmt_name)
    d = k.shape[-1]
    hb, warps = launch_shape(t, k.shape[1], d, fmt.name == "nvfp4" and do_store)
    hb = _TUNE.get("hb", hb)  # heads per program
    grid = (t, triton.cdiv(num_q_heads, hb) + triton.cdiv(k.shape[1], hb))
    dummy = k
    qq = q if q is not None else dummy
    qo = q_out if q_out is not None else dummy
    ko = k_out if k_out is not None else dummy
    q8t = q8 if q8 is not None else dummy
    on = pdl()
    _append_kernel[grid](
        qq, k, v, positions if positions is not None else slots, slots if slots is not None else positions,
        cs if cs is not None else k, qo, ko, q8t, q_scale if q_scale is not None else k,
        kc.data if kc else dummy, vc.data if vc else dummy, kc.bs_ptr if kc else dummy, vc.bs_ptr if vc else dummy,
        kc.scale if kc else dummy, vc.scale if vc else dummy,
        qq.stride(0), qq.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), q8t.stride(0), q8t.stride(1),
        kc.page_size if kc else 1, kc.page_stride if kc else 0, kc.tok_stride if kc else 0,
        kc.head_stride if kc else 0, vc.head_stride if vc else 0,
        kc.bs_page_stride if kc else 0, kc.bs_tok_stride if kc else 0,
        kc.bs_head_stride if kc else 0, vc.bs_head_stride if vc else 0,
        cs.stride(0) if cs is not None else 0,
        num_q_heads, k.shape[1], D=d, D_PAD=next_pow2(max(d, 16)), NB_PAD=next_pow2(max(d, 16)) // 16, HB=hb,
        ROT=rot, NEOX=neox, FMT=format_code(fmt_name), QMAX=float(fmt.max_value or 0.0),
        DO_ROPE=do_rope, DO_STORE=do_store, WRITE_K_OUT=write_k_out, Q_FP8=q8 is not None,
        E5M2=fmt.name == "fp8_e5m2", EXACT=interpreting(), KV_FIRST=_TUNE.get("kv_first", True),
        PACKED=_TUNE.get("packed", packed_stores(t, d)) and fmt.name == "nvfp4" and d % 64 == 0,
        HOIST=_TUNE.get("hoist", True), BITCODE=_TUNE.get("bitcode", True), PDL=on,
        num_warps=_TUNE.get("num_warps", warps), **NO_FMA, **pdl_launch(on),
    )


def _prepare(q, k, v, positions, slot_mapping, cos_sin_cache, kv: PagedKV, rotary_dim, rope_style, q_scale):
    _check_tokens(q, k, v, positions, slot_mapping)
    d = k.shape[-1]
    rot, cs = _rope_args(cos_sin_cache, rotary_dim, d, rope_style)
    kc, vc = check_kv(kv, d)
    if kc.num_kv_heads != k.shape[1]:
        raise ValueError(f"cache has {kc.num_kv_heads} kv heads, k has {k.shape[1]}")
    if q_scale is not None and (q_scale.dtype != torch.float32 or q_scale.numel() != 1):
        raise ValueError("q_scale must be a one-element fp32 tensor")
    return rot, cs, kc, vc


def fused_rope_quant_append(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor, kv: PagedKV, *, rotary_dim: Optional[int] = None, rope_style: str = "neox",
    q_scale: Optional[torch.Tensor] = None, q_out: Optional[torch.Tensor] = None, k_out: Optional[torch.Tensor] = None,
) -> AppendOutput:
    """One launch: RoPE(q, k) → q_out, k_out; quantize(k_rot), quantize(v) → the slots of ``kv``'s pages; fp8 q
    if ``q_scale`` is given.  ``q``/``k``/``v`` are not modified."""
    rot, cs, kc, vc = _prepare(q, k, v, positions, slot_mapping, cos_sin_cache, kv, rotary_dim, rope_style, q_scale)
    q_out = torch.empty_like(q) if q_out is None else q_out
    k_out = torch.empty_like(k) if k_out is None else k_out
    q8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device) if q_scale is not None else None
    t, hq, hk = k.shape[0], q.shape[1], k.shape[1]
    if t:
        _launch(t, q, k, v, positions, slot_mapping, cs, q_out, k_out, q8, q_scale, kc, vc,
                rot=rot, neox=rope_style == "neox", fmt_name=kv.kv_format, do_rope=True, do_store=True,
                write_k_out=True, num_q_heads=hq)
    return AppendOutput(q_out, k_out, q8)


def rope(q, k, positions, cos_sin_cache, rotary_dim=None, rope_style="neox", q_scale=None):
    """The RoPE stage alone (Triton): returns ``AppendOutput`` with rotated q, k (and fp8 q)."""
    _check_tokens(q, k, k, positions, None)
    rot, cs = _rope_args(cos_sin_cache, rotary_dim, k.shape[-1], rope_style)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    q8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device) if q_scale is not None else None
    t, hq, hk = k.shape[0], q.shape[1], k.shape[1]
    if t:
        _launch(t, q, k, k, positions, None, cs, q_out, k_out, q8, q_scale, None, None,
                rot=rot, neox=rope_style == "neox", fmt_name="bf16", do_rope=True, do_store=False,
                write_k_out=True, num_q_heads=hq)
    return AppendOutput(q_out, k_out, q8)


def quantize_store(k, v, slot_mapping, kv: PagedKV) -> None:
    """The quantize + store stage alone (Triton): ``k``/``v`` ``[T, H_kv, D]`` → the slots of ``kv``'s pages."""
    _check_tokens(None, k, v, None, slot_mapping)
    d = k.shape[-1]
    kc, vc = check_kv(kv, d)
    if k.shape[0]:
        _launch(k.shape[0], None, k, v, None, slot_mapping, None, None, None, None, None, kc, vc,
                rot=2, neox=True, fmt_name=kv.kv_format, do_rope=False, do_store=True, write_k_out=False,
                num_q_heads=0)


def unfused_rope_quant_append(q, k, v, positions, slot_mapping, cos_sin_cache, kv: PagedKV, *, rotary_dim=None,
                              rope_style="neox", q_scale=None) -> AppendOutput:
    """Two launches: ``rope`` then ``quantize_store``; same results as the fused kernel."""
    _prepare(q, k, v, positions, slot_mapping, cos_sin_cache, kv, rotary_dim, rope_style, q_scale)
    out = rope(q, k, positions, cos_sin_cache, rotary_dim, rope_style, q_scale)
    quantize_store(out.k, v, slot_mapping, kv)
    return out

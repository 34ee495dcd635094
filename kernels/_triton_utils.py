"""Shared pieces of the Triton kernels: format codes, argument checks, and in-register quantize /
dequantize helpers.  Imported only by the kernel modules (torch and triton load here)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kvbench.kernels.formats import get_format

# Format codes passed to kernels as constexpr: one table, derived from the format specs (format_codes.py).
from kvbench.kernels.format_codes import FMT_FP8, FMT_NVFP4, FMT_PLAIN, format_code  # noqa: E402,F401

# Launch option that keeps ``a*b + c`` as two rounded operations (no FMA contraction), so the
# float32 RoPE matches the torch reference bit for bit.
NO_FMA = {"enable_fp_fusion": False}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def gdc_available() -> bool:
    """Whether kernels may use grid dependency control (``tl.extra.cuda.gdc_*``, programmatic dependent
    launch): this Triton has it and the code is compiled, not interpreted."""
    return not interpreting() and hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")


# Programmatic dependent launch of the decode step's own kernels (RMSNorm, SiLU·up, the fused append, the paged
# decode and its reduce, the few-row GEMM), on while the engine's linear layers are ``gemm_library = "triton"``
# (``runtime/gemm_library.py`` sets it before each step): each such kernel may start while the kernel before it
# in the stream finishes, and waits for it (``pdl_enter``) before it touches memory.
_PDL = [False]


def set_pdl(on: bool) -> None:
    _PDL[0] = bool(on)


def pdl() -> bool:
    """Whether launches now are programmatic dependents (``set_pdl`` and ``gdc_available``)."""
    return _PDL[0] and gdc_available()


def pdl_launch(on: bool) -> dict:
    """The launch option of a programmatic dependent launch, when ``on``."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first statement: with ``PDL``, let the next kernel launch (it waits in turn), then wait until
    the kernel before this one is done and its writes are visible.  Nothing before it touches memory."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


def dot_code(dtype: torch.dtype) -> int:
    """Dot-operand code for a compute dtype (0 bf16, 1 fp16, 2 fp32, 3 bf16 emulated in fp32 on the
    CPU interpreter, whose bf16 ``tl.dot`` gives wrong results)."""
    code = {torch.bfloat16: 0, torch.float16: 1, torch.float8_e4m3fn: 0}.get(dtype, 2)
    return 3 if code == 0 and interpreting() else code


def cache_dot_code(kv_format: str, q_dtype: torch.dtype) -> int:
    """Dot dtype for tiles read from the cache: float32 when the compute dtype is float32; otherwise the
    cache's own half type (bf16 / fp16), and float16 for fp8 and nvfp4, whose values convert to it
    exactly and cheaply (one conversion per pair for e4m3, a shift for e5m2)."""
    if q_dtype == torch.float32:
        return 2
    name = get_format(kv_format).name
    return dot_code(torch.bfloat16) if name == "bf16" else 1


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@dataclass
class CacheArgs:
    """One K or V cache plane, validated: data ``[P+1, page, H_kv, Dp]`` and its optional block scale.

    The plane may be laid out token-major within a page (NHD, ``[P+1, page, H_kv, Dp]`` contiguous) or
    head-major (HND: contiguous ``[P+1, H_kv, page, Dp]`` seen through ``permute(0, 2, 1, 3)``); kernels
    address an element as ``page · page_stride + offset · tok_stride + head · head_stride + d``."""

    data: torch.Tensor
    block_scale: Optional[torch.Tensor]
    scale: torch.Tensor
    page_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def page_stride(self) -> int:
        return self.data.stride(0)

    @property
    def tok_stride(self) -> int:
        return self.data.stride(1)

    @property
    def head_stride(self) -> int:
        return self.data.stride(2)

    @property
    def bs_page_stride(self) -> int:
        return self.block_scale.stride(0) if self.block_scale is not None else 0

    @property
    def bs_tok_stride(self) -> int:
        return self.block_scale.stride(1) if self.block_scale is not None else 0

    @property
    def bs_head_stride(self) -> int:
        return self.block_scale.stride(2) if self.block_scale is not None else 0

    @property
    def bs_ptr(self):
        return self.block_scale if self.block_scale is not None else self.data


def same_layout(kc: CacheArgs, vc: CacheArgs) -> None:
    """The kernels address K and V pages with one set of page / token strides."""
    if (kc.page_stride, kc.tok_stride) != (vc.page_stride, vc.tok_stride) or (
            kc.bs_page_stride, kc.bs_tok_stride) != (vc.bs_page_stride, vc.bs_tok_stride):
        raise ValueError("k and v caches must have the same layout (page and token strides)")


def _layout_ok(t: torch.Tensor) -> bool:
    """NHD contiguous, or HND contiguous seen as [P+1, page, H_kv, Dp]."""
    if t.is_contiguous():
        return True
    return t.permute(0, 2, 1, 3).is_contiguous()


def check_cache(name: str, kv_format: str, data, block_scale, scale, head_dim: int) -> CacheArgs:
    fmt = get_format(kv_format)
    if data.dim() != 4:
        raise ValueError(f"{name} cache must be [num_pages+1, page_size, H_kv, Dp], got shape {tuple(data.shape)}")
    if data.dtype != fmt.storage_dtype:
        raise ValueError(f"{name} cache dtype {data.dtype} does not match format {fmt.name} ({fmt.storage_dtype})")
    if not _layout_ok(data):
        raise ValueError(f"{name} cache must be contiguous as [P+1, page, H_kv, Dp] (NHD) or as [P+1, H_kv, page, Dp] "
                         f"(HND, passed as its permute(0, 2, 1, 3)); got strides {tuple(data.stride())}")
    dp = fmt.packed_dim(head_dim)
    if data.shape[-1] != dp:
        raise ValueError(f"{name} cache last dim {data.shape[-1]} != {dp} for head_dim {head_dim} in {fmt.name}")
    page_size, hk = data.shape[1], data.shape[2]
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if fmt.has_block_scales:
        if block_scale is None:
            raise ValueError(f"{fmt.name} needs a {name} block_scale tensor")
        want = (*data.shape[:3], head_dim // fmt.block_size)
        if tuple(block_scale.shape) != want or block_scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name} block_scale must be float8_e4m3fn {want}, got {block_scale.dtype} {tuple(block_scale.shape)}")
        if not _layout_ok(block_scale) or block_scale.is_contiguous() != data.is_contiguous():
            raise ValueError(f"{name} block_scale must be laid out like its cache (NHD or HND)")
    if fmt.is_quantized:
        if scale is None:
            raise ValueError(f"{fmt.name} needs a {name} scale tensor (fp32 [H_kv])")
    if scale is None:
        scale = torch.ones(hk, dtype=torch.float32, device=data.device)
    if scale.dtype != torch.float32 or scale.numel() != hk or scale.device != data.device:
        raise ValueError(f"{name} scale must be fp32 with {hk} elements on {data.device}, got {scale.dtype} {tuple(scale.shape)} on {scale.device}")
    return CacheArgs(data, block_scale if fmt.has_block_scales else None, scale.contiguous(), page_size, hk, head_dim)


def check_kv(kv, head_dim: int) -> tuple[CacheArgs, CacheArgs]:
    """A ``config.PagedKV``'s K and V planes validated (``check_cache``), with one page / token layout."""
    kc = check_cache("k", kv.kv_format, kv.k_cache, kv.k_block_scale, kv.k_scale, head_dim)
    vc = check_cache("v", kv.kv_format, kv.v_cache, kv.v_block_scale, kv.v_scale, head_dim)
    same_layout(kc, vc)
    return kc, vc


# ------------------------------------------------------------------------------- jit helpers
def check_query(q: torch.Tensor, q_scale, sinks, num_heads: int) -> bool:
    """Validate the fp8-q / q_scale pairing and the sinks' length; returns whether q is fp8."""
    is_fp8_q = q.dtype == torch.float8_e4m3fn
    if is_fp8_q != (q_scale is not None):
        raise ValueError("an fp8 q needs q_scale, and q_scale needs an fp8 q")
    if sinks is not None and sinks.numel() != num_heads:
        raise ValueError(f"sinks must have H_q={num_heads} elements, got {sinks.numel()}")
    return is_fp8_q


@triton.jit
def e2m1_to_f16(code):
    """e2m1 codes (int32, 0..15, bit 3 = sign) → float16: the 3 magnitude bits placed at bits 9..11 of an
    fp16 give the e2m1 value times 2^-14 for all eight codes (subnormals included); the multiplication by
    2^14 is exact."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True) * 16384.0


@triton.jit
def e2m1_code(y):
    """float32 values (already divided by their scale) → e2m1 codes (int32 0..15, bit 3 the sign); ties to the
    even code, saturating at 6, NaN → 0: ``formats.quantize_e2m1``'s rounding, from the float's bits.  From 1
    up, rounding the bits half to even at the first mantissa bit gives ``(exponent << 1 | mantissa bit)``, which
    is the code plus 252 (1.0 → 2, 1.5 → 3, ..., 6.0 → 7; 8 and up saturate to 7); below 1 the code is ``2|y|``
    rounded half to even (0, 0.5, 1.0: the e2m1 subnormals), the integer part of ``2|y| + 2²³``'s bits.  About
    half the instructions of the seven threshold comparisons (``e2m1_code_by_thresholds``), with the same codes
    for every float32 (tests/test_e2m1_code.py)."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    norm = tl.minimum(((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252, 7)
    sub = tl.fma(a, 2.0, 8388608.0).to(tl.int32, bitcast=True) & 3
    code = tl.where(a >= 1.0, norm, tl.where(a < 1.0, sub, 0))
    return code | ((y < 0).to(tl.int32) << 3)


@triton.jit
def e2m1_code_by_thresholds(y):
    """``e2m1_code`` by seven comparisons with the rounding thresholds (ties to the even code, saturating);
    the same thresholds as ``formats.quantize_e2m1``."""
    a = tl.abs(y)
    code = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return code | ((y < 0).to(tl.int32) << 3)


@triton.jit
def to_dot(x, DOT: tl.constexpr):
    if DOT == 0:
        return x.to(tl.bfloat16)
    elif DOT == 1:
        return x.to(tl.float16)
    elif DOT == 3:
        # bf16-rounded operands in a float32 dot: the CPU interpreter's bf16 tl.dot is wrong (triton 3.9)
        return x.to(tl.bfloat16).to(tl.float32)
    elif DOT == 4:  # as stored (fp8 operands of an fp8 dot)
        return x
    else:
        return x.to(tl.float32)


@triton.jit
def load_plain_tile(C, row, hk, s_h, d, dmask, tmask, DOT: tl.constexpr):
    """``row``: each token's element offset (page · page_stride + offset · tok_stride)."""
    x = tl.load(C + row[:, None] + hk * s_h + d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)
    return to_dot(x, DOT)


@triton.jit
def page_rows(pt_row, offs, tmask, PAGE: tl.constexpr, s_page, s_tok, sb_page, sb_tok, FMT: tl.constexpr):
    """Element offsets of the tokens ``offs`` of one sequence (page-table row ``pt_row``) in the data plane
    and, for nvfp4, in the block-scale plane: page · page_stride + offset · tok_stride."""
    page = tl.load(pt_row + offs // PAGE, mask=tmask, other=0).to(tl.int64)
    o = offs % PAGE
    row = page * s_page + o * s_tok
    if FMT == 2:
        brow = page * sb_page + o * sb_tok
    else:
        brow = row
    return row, brow


@triton.jit
def load_raw_tile(C, BS, row, brow, hk, s_h, sb_h, i, imask, tmask, NB: tl.constexpr,
                  ND: tl.constexpr, FMT: tl.constexpr):
    """Stored values of a [BLOCK_N, Dp] tile (and its [BLOCK_N, NB] block scales for nvfp4, where
    ``ND`` = D/16 scales per row are padded to the power of two ``NB``); no conversion yet, so the
    load can be issued a tile ahead.  ``row`` / ``brow``: each token's element offset in the data /
    block-scale plane (page · page_stride + offset · tok_stride)."""
    m = tmask[:, None] & imask[None, :]
    if FMT == 2:
        x = tl.load(C + row[:, None] + hk * s_h + i[None, :], mask=m, other=0)
        b = tl.arange(0, NB)
        bs = tl.load(BS + brow[:, None] + hk * sb_h + b[None, :], mask=tmask[:, None] & (b[None, :] < ND),
                     other=0.0)
    else:
        x = tl.load(C + row[:, None] + hk * s_h + i[None, :], mask=m, other=0.0)
        bs = x
    return x, bs


# The byte-permute unpacking below is PTX (GPU only); the interpreter takes the arithmetic path.
ASM_UNPACK = tl.constexpr(not interpreting())

# An e2m1 code [s e1 e0 m] placed in a byte as [s 0 0 e1 e0 m 0 0] is an e4m3 byte of exactly 2^-6 times
# its value (e > 0: 2^(e-7)·(1 + m/2); e = 0: the subnormal 2^-6·m/2; never a NaN pattern), and one
# ``cvt.rn.f16x2.e4m3x2`` turns two such bytes into float16.  For the 8 codes of a 32-bit word, the low
# nibbles of its four bytes take two shifts, two masks and an or; the high nibbles (sign already at bit 7)
# a shift, two masks and an or; then four conversions and four multiplies by the block scale, which the
# callers pass times 2^6 (``E2M1_SCALE``; exact: at most 448 · 64 in float16) — about 2 instructions per
# code, where a byte-permute lookup plus a separate sign permute took 3.
E2M1_SCALE = tl.constexpr(64.0)

def _e2m1_asm(regroup: bool, outs: dict) -> str:
    """PTX for 8 e2m1 codes in the 32-bit ``$4`` → four f16x2 results.  Blocks A..D decode the code pairs
    (nibbles 0,2), (4,6), (1,3), (5,7) of the word; ``outs`` maps each block to (output, scale operand).
    ``regroup`` first permutes the bytes of ``$4`` as [b0, b2, b1, b3] (two 16-bit units → element k of
    both units in one pair)."""
    half = {"A": "a0", "B": "a1", "C": "b0", "D": "b1"}  # the 16-bit halves of the low / high nibble bytes
    lines = [".reg .b32 w, lo, hi, t, zero;", ".reg .b16 a0, a1, b0, b1;", "mov.b32 zero, 0;",
             "prmt.b32 w, $4, zero, 0x3120;" if regroup else "mov.b32 w, $4;",
             "shl.b32 lo, w, 2;", "and.b32 lo, lo, 0x1C1C1C1C;", "shl.b32 t, w, 4;", "and.b32 t, t, 0x80808080;",
             "or.b32 lo, lo, t;", "shr.b32 hi, w, 2;", "and.b32 hi, hi, 0x1C1C1C1C;", "and.b32 t, w, 0x80808080;",
             "or.b32 hi, hi, t;", "mov.b32 {a0, a1}, lo;", "mov.b32 {b0, b1}, hi;"]
    for name, (out, sc) in outs.items():
        lines += [f"cvt.rn.f16x2.e4m3x2 {out}, {half[name]};", f"mul.rn.f16x2 {out}, {out}, {sc};"]
    return "{\n" + "\n".join(lines) + "\n}"


# bytes: $0/$1 = low nibbles of bytes (0,1)/(2,3), $2/$3 = high nibbles; scales $5 (bytes 0,1), $6 (2,3)
_E2M1_BYTES_ASM = tl.constexpr(_e2m1_asm(False, {"A": ("$0", "$5"), "B": ("$1", "$6"), "C": ("$2", "$5"),
                                                 "D": ("$3", "$6")}))


@triton.jit
def e2m1_pairs_scaled(byte, s):
    """uint8 bytes (two e2m1 codes each) and float16 scales of the same shape → (low-nibble values,
    high-nibble values) · scale in float16, exactly (products of 2 and 4 significant bits).  Element-wise
    (each output depends on its own byte and scale only), four bytes per PTX instance.  Marked impure so
    the compiler unpacks where the bytes are loaded instead of moving it after a shared-memory round trip
    in the dot-operand layout, where 8-bit data is gathered byte by byte (measured faster on an H200)."""
    if ASM_UNPACK:
        lo, hi = tl.inline_asm_elementwise(
            _E2M1_BYTES_ASM, "=r,=r,=r,=r,r,r,r", [byte, s], dtype=(tl.float16, tl.float16), is_pure=False, pack=4)
    else:
        b = byte.to(tl.int32)
        lo = e2m1_to_f16(b & 15) * s
        hi = e2m1_to_f16(b >> 4) * s
    return lo, hi


# nvfp4 read as 16-bit units (4 codes, elements 4j..4j+3): a first ``prmt`` regroups the two units of a
# register as [u0.b0, u1.b0, u0.b1, u1.b1], after which the unpacking above applies unchanged and gives
# element k of both units per output register; every output is scaled by the two units' block scales.
_E2M1_UNITS_ASM = tl.constexpr(_e2m1_asm(True, {"A": ("$0", "$5"), "C": ("$1", "$5"), "B": ("$2", "$5"),
                                                 "D": ("$3", "$5")}))


@triton.jit
def nvfp4_units_split(x, bs, NB: tl.constexpr):
    """nvfp4 tile read as int16 units ``[N, NB*4]`` (4 codes each) and its e4m3 block scales ``[N, NB]`` →
    four float16 tiles: elements 4j, 4j+1, 4j+2, 4j+3 of every row, times their block scale (exact).
    Like ``fp8_pairs_split``, 16-bit units keep the tiles on the 16-bit operand path of the dots."""
    s = bs.to(tl.float16)
    if ASM_UNPACK:
        s = s * E2M1_SCALE
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (s.shape[0], NB, 4)), (s.shape[0], NB * 4))
    if ASM_UNPACK:
        t0, t1, t2, t3 = tl.inline_asm_elementwise(
            _E2M1_UNITS_ASM, "=r,=r,=r,=r,r,r", [x, s], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=2)
    else:
        u = x.to(tl.int32) & 0xFFFF
        t0 = e2m1_to_f16(u & 15) * s
        t1 = e2m1_to_f16((u >> 4) & 15) * s
        t2 = e2m1_to_f16((u >> 8) & 15) * s
        t3 = e2m1_to_f16((u >> 12) & 15) * s
    return t0, t1, t2, t3


# Two 16-bit units [e0 o0 e1 o1] (bytes): one permute makes the halves (e0 e1) and (o0 o1), one conversion
# each.  Two permutes, one per half, were measured on an H100 (2026-11-21 23:38 UTC, .scratch/pairs_ab.sh,
# three alternating runs, graph replays): MLA decode fp8 at 16 heads, 64 x 8192, 131.2-131.7 -> 130.7-131.2 us,
# 64 x 32768 450.6-451.7 -> 447.9-449.4 us; the GQA fp8 decode 361.9-362.4 -> 361.1-361.6 us.
_FP8_PAIRS_ASM = tl.constexpr("""
{
.reg .b32 eo;
.reg .b16 e, o;
prmt.b32 eo, $2, 0, 0x3120;
mov.b32 {e, o}, eo;
cvt.rn.f16x2.FMT $0, e;
cvt.rn.f16x2.FMT $1, o;
}
""")
_E4M3_PAIRS_ASM = tl.constexpr(_FP8_PAIRS_ASM.value.replace("FMT", "e4m3x2"))
_E5M2_PAIRS_ASM = tl.constexpr(_FP8_PAIRS_ASM.value.replace("FMT", "e5m2x2"))


@triton.jit
def fp8_pairs_split(x, E5M2: tl.constexpr):
    """int16 units holding two fp8 values (element 2j in the low byte, 2j+1 in the high byte) →
    (even elements, odd elements) in float16, exactly.  Reading fp8 tiles as 16-bit units keeps them on the
    16-bit shared-memory path of the dot operands (``ldmatrix``, transposed for V) — 8-bit data in the
    layout of a non-transposed right-hand operand can only be gathered byte by byte."""
    if ASM_UNPACK:
        if E5M2:
            ev, od = tl.inline_asm_elementwise(_E5M2_PAIRS_ASM, "=r,=r,r", [x], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=2)
        else:
            ev, od = tl.inline_asm_elementwise(_E4M3_PAIRS_ASM, "=r,=r,r", [x], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=2)
    else:
        u = x.to(tl.int32)
        lo = (u & 255).to(tl.uint8)
        hi = ((u >> 8) & 255).to(tl.uint8)
        if E5M2:
            ev = lo.to(tl.float8e5, bitcast=True).to(tl.float16)
            od = hi.to(tl.float8e5, bitcast=True).to(tl.float16)
        else:
            ev = lo.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            od = hi.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return ev, od


@triton.jit
def dequant_tile(x, bs, NB: tl.constexpr, FMT: tl.constexpr, DOT: tl.constexpr):
    """A raw tile → dot operands.  nvfp4 gives the (even, odd) element tiles with block scales applied,
    exactly in float16: an e2m1 value (2 significant bits) times an e4m3 block scale (4 bits, at least
    2^-6 by construction) lies in [2^-7, 2688].  Other formats give (tile, tile)."""
    if FMT == 2:
        s = bs.to(tl.float16)
        if ASM_UNPACK:
            s = s * E2M1_SCALE
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (s.shape[0], NB, 8)), (s.shape[0], NB * 8))
        lo, hi = e2m1_pairs_scaled(x, s)
        lo = to_dot(lo, DOT)
        hi = to_dot(hi, DOT)
    else:
        lo = to_dot(x, DOT)
        hi = lo
    return lo, hi


@triton.jit
def load_nvfp4_tile(C, BS, row, brow, hk, s_h, sb_h, i, imask, tmask, NB: tl.constexpr,
                    ND: tl.constexpr, DOT: tl.constexpr):
    """[BLOCK_N, D/2] bytes → (even, odd) element tiles in the dot dtype, block scales applied."""
    x, bs = load_raw_tile(C, BS, row, brow, hk, s_h, sb_h, i, imask, tmask, NB, ND, 2)
    return dequant_tile(x, bs, NB, 2, DOT)


@triton.jit
def fp8_grid_rne(y, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round float32 ``y`` to the nearest value of an fp8 grid (``MANT`` mantissa bits, smallest normal
    exponent ``MIN_EXP``), ties to even, in float32 arithmetic.  Used only on the CPU interpreter, whose
    float32→fp8 cast mis-rounds; after it the cast is exact.  ``y`` must already be clamped to the range."""
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, MIN_EXP)
    ulp = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - (e - MANT)) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to an integer, ties to even
    r = ((tl.abs(y) * inv) + magic) - magic
    r = r * ulp
    return tl.where(bits < 0, -r, r)  # keeps the sign of -0.0 too


@triton.jit
def cast_fp8(y, dst_ty: tl.constexpr, E5M2: tl.constexpr, EXACT: tl.constexpr):
    """float32 (clamped) → fp8 with round-to-nearest-even; ``EXACT`` rounds in float32 first (CPU
    interpreter), otherwise the hardware cast (RNE on the GPU) does it."""
    if EXACT:
        if E5M2:
            y = fp8_grid_rne(y, 2, -14)
        else:
            y = fp8_grid_rne(y, 3, -6)
    return y.to(dst_ty)


@triton.jit
def cast_rne(x, dst_ty: tl.constexpr, EXACT: tl.constexpr):
    """float32 → bf16/fp16/fp32 with round-to-nearest-even.  ``EXACT`` (CPU interpreter, whose
    float32→bf16 cast truncates) rounds the bf16 bit pattern with integer arithmetic first."""
    if EXACT:
        if dst_ty == tl.bfloat16:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dst_ty)

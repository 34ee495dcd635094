"""The kernels compile for a Hopper GPU (sm_90) with the installed Triton, without a GPU: this catches
what the CPU interpreter accepts but the compiler rejects (type mismatches across branches, shapes).
Numbers are checked by the other tests (interpreter) and by ``python -m kvbench.tools.kernel_check`` (GPU).

The compilation runs in a subprocess with ``TRITON_INTERPRET=0``: the other kernel tests put this
process's kernels into interpreter mode."""

import os
import re
import subprocess
import sys

import pytest


def _compile(fn, consts, ptrs, floats=(), aligned=(), **opts):
    """``aligned``: arguments known to be multiples of 16 (pointers, strides), as the launcher specializes
    them on a GPU; without it, no tile load can be asynchronous."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts or None)


def compile_decode():
    from kvbench.kernels.decode import _decode_reduce_kernel, _decode_split_kernel

    base = dict(Q="*bf16", KBS="*fp8e4nv", VBS="*fp8e4nv", K_SCALE="*fp32", Q_SCALE="*fp32", PT="*i32",
                SEQ_LENS="*i32", ACC="*fp32", ML="*fp32", OUT="*bf16", V_SCALE="*fp32", SINKS="*fp32")
    # (cache pointer type, head-dim tile, constexprs): nvfp4 as bytes (even/odd halves, hand prefetch), nvfp4
    # as 16-bit units (quarters), fp8 as 16-bit pairs, fp8 e5m2 bytes with fp32 compute, bf16; the last two
    # with one split (the output written by the split kernel, with sinks)
    variants = [
        ("*u8", 64, dict(FMT=2, DOT=1, PREFETCH=True, SPLIT8=False, E5M2=False, NV4=False)),
        ("*i16", 32, dict(FMT=2, DOT=1, PREFETCH=False, SPLIT8=False, E5M2=False, NV4=True)),
        ("*i16", 64, dict(FMT=1, DOT=1, PREFETCH=False, SPLIT8=True, E5M2=False, NV4=False)),
        ("*fp8e5", 128, dict(FMT=1, DOT=2, PREFETCH=False, SPLIT8=False, E5M2=True, NV4=False)),
        ("*bf16", 128, dict(FMT=0, DOT=0, PREFETCH=False, SPLIT8=False, E5M2=False, NV4=False)),
        ("*i16", 64, dict(FMT=1, DOT=1, PREFETCH=False, SPLIT8=True, E5M2=False, NV4=False, DIRECT=True, HAS_SINKS=True)),
        ("*bf16", 128, dict(FMT=0, DOT=0, PREFETCH=False, SPLIT8=False, E5M2=False, NV4=False, DIRECT=True)),
    ]
    for cache_ty, dp, extra in variants:
        c = dict(G=4, G_PAD=16, D=128, DP_PAD=dp, NB=8, PAGE=16, BLOCK_N=64, HAS_Q_SCALE=False, **extra)
        _compile(_decode_split_kernel, c, dict(base, KC=cache_ty, VC=cache_ty), ("sm_scale_log2",), num_warps=4)
    c = dict(G=4, D=128, D_PAD=128, S_PAD=4, FMT=2, HAS_SINKS=True)  # the split count a run-time argument
    _compile(_decode_reduce_kernel, c, dict(ACC="*fp32", ML="*fp32", OUT="*bf16", V_SCALE="*fp32", SINKS="*fp32"))


def compile_decode_nv4():
    """The explicit-layout nvfp4 decode (Gluon) at its launch defaults and with the other options; at the
    defaults its registers fit the 128-register cap that lets four programs share an SM."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kvbench.kernels import decode_nv4 as nv4

    fn = nv4._decode_nv4_kernel
    ptrs = dict(Q="*bf16", KC="*i32", VC="*i32", KBS="*u8", VBS="*u8", K_SCALE="*fp32", PT="*i32", SEQ_LENS="*i32",
                ACC="*fp32", ML="*fp32", OUT="*bf16", V_SCALE="*fp32", SINKS="*fp32")
    aligned = [i for i, n in enumerate(fn.arg_names) if n in ptrs or n in ("s_page", "skc_h", "svc_h")]
    # the defaults (byte-permute unpacking, tiles copied ahead into shared memory), the kernel before them (direct
    # loads into registers, e4m3 conversions), and the register prefetch with the other options
    defaults = dict(PREFETCH=nv4.PREFETCH, UNPACK=nv4.UNPACK, STAGES=nv4.STAGES, VSWZ=nv4.VSWZ, CPL=nv4.CPL,
                    HALVES=nv4.HALVES, s_tok=16, sb_tok=2)
    for consts, opts in ((dict(G=4, NH=8, PAGE=16, DIRECT=False, HAS_SINKS=False, **defaults), dict(maxnreg=nv4.MAXNREG)),
                         (dict(G=4, NH=8, PAGE=16, DIRECT=False, HAS_SINKS=False, PREFETCH=False, UNPACK=0, STAGES=0,
                               VSWZ=False, CPL=0, HALVES=False, s_tok=16, sb_tok=8), dict(maxnreg=nv4.MAXNREG)),
                         (dict(G=16, NH=16, PAGE=32, DIRECT=True, HAS_SINKS=True, PREFETCH=True, UNPACK=0, STAGES=0,
                               VSWZ=False, CPL=0, HALVES=False, s_tok=128,
                               sb_tok=64), {})):
        scales = dict(KBS="*i32", VBS="*i32") if consts["STAGES"] else {}  # the launcher copies them as words
        sig = {n: "constexpr" if n in consts else {**ptrs, **scales}.get(n, "fp32" if n == "sm_scale_log2" else "i32")
               for n in fn.arg_names}
        src = GluonASTSource(fn, sig, constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, **opts))
        assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16", k.asm["ptx"])) == 4 * consts["NH"], "mma count per tile"
        if opts:
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
                res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
            regs = int(re.search(r"REG:(\d+)", res).group(1))
            assert regs <= nv4.MAXNREG, res
            copies = len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*, 0x10,", k.asm["ptx"]))
            if consts["STAGES"]:  # K and V rows as 16-byte copies, the first tiles and one per iteration
                assert copies >= 16 and k.metadata.shared >= consts["STAGES"] * 18 * 1024, (copies, k.metadata.shared)
                assert int(re.search(r"STACK:(\d+)", res).group(1)) == 0, res  # no spills under the cap
            else:
                assert copies == 0


def compile_prefill():
    from kvbench.kernels.prefill import _prefill_kernel

    ptrs = dict(Q="*fp8e4nv", KN="*bf16", VN="*bf16", KC="*fp8e4nv", VC="*fp8e4nv", KBS="*fp8e4nv", VBS="*fp8e4nv",
                K_SCALE="*fp32", V_SCALE="*fp32", Q_SCALE="*fp32", SINKS="*fp32", PT="*i32", SEQ_LENS="*i32",
                CU_Q="*i32", OUT="*bf16")
    # over an e4m3 prefix: an fp8 q's scores as fp8 dots (FP8_QK), a bf16 q split into two e4m3 terms
    # (Q_SPLIT: two fp8 dots per prefix tile), or over converted tiles; then an nvfp4 prefix
    for fmt, qty, fp8_qk, q_split, full in ((1, "*fp8e4nv", True, False, True), (1, "*fp8e4nv", False, False, False),
                                            (1, "*bf16", True, True, True), (2, "*fp8e4nv", False, False, True)):
        c = dict(G=4, D=128, DP_PAD=64 if fmt == 2 else 128, NB=8, PAGE=16, BLOCK_M=64, BLOCK_N=64, FMT=fmt, DOT=0,
                 DOT_P=1, HAS_Q_SCALE=not q_split, HAS_SINKS=True, HEAVY_FIRST=True, FULL_D=True, FP8_QK=fp8_qk,
                 BLOCK_NP=128, PREFIX_FULL=full, TMA=False, Q_SPLIT=q_split, NO_PREFIX=False)
        kc = "*u8" if fmt == 2 else "*fp8e4nv"
        k = _compile(_prefill_kernel, c, dict(ptrs, Q=qty, KC=kc, VC=kc), ("sm_scale_log2",), num_warps=4)
        _check_prefix_dots(k.asm["ttgir"], fp8_qk, q_split, full)
        assert "async_tma_copy" not in k.asm["ttgir"]
    # q and the new tokens through tensor descriptors (TMA bulk copies), with a bf16 q (converted K tiles, or
    # split) or an fp8 q over an e4m3 prefix
    for qty, fp8_qk, q_split in (("bf16", False, False), ("fp8e4nv", True, False), ("bf16", True, True)):
        c = dict(G=4, D=128, DP_PAD=128, NB=8, PAGE=16, BLOCK_M=128, BLOCK_N=128, FMT=1, DOT=0, DOT_P=1,
                 HAS_Q_SCALE=qty != "bf16", HAS_SINKS=False, HEAVY_FIRST=True, FULL_D=True, FP8_QK=fp8_qk, BLOCK_NP=128,
                 PREFIX_FULL=True, TMA=True, Q_SPLIT=q_split, NO_PREFIX=False)
        desc = dict(Q=f"tensordesc<{qty}[128,128]>", KN="tensordesc<bf16[128,128]>", VN="tensordesc<bf16[128,128]>")
        k = _compile(_prefill_kernel, c, dict(ptrs, **desc), ("sm_scale_log2",), num_warps=8, num_stages=3)
        tma = [ln for ln in k.asm["ttgir"].splitlines() if "async_tma_copy_global_to_local" in ln]
        assert len(tma) >= 3, f"TMA copies: {len(tma)}"
        _check_prefix_dots(k.asm["ttgir"], fp8_qk, q_split, True)
    # prompts only over an nvfp4 cache (NO_PREFIX): the plain path through descriptors, and no cache read at all
    # (the nvfp4 bytes' pointer is never loaded: no phase 1 in the code)
    c = dict(G=4, D=128, DP_PAD=128, NB=8, PAGE=16, BLOCK_M=128, BLOCK_N=128, FMT=0, DOT=0, DOT_P=0, HAS_Q_SCALE=False,
             HAS_SINKS=False, HEAVY_FIRST=True, FULL_D=True, FP8_QK=False, BLOCK_NP=128, PREFIX_FULL=True, TMA=True,
             Q_SPLIT=False, NO_PREFIX=True)
    desc = dict(Q="tensordesc<bf16[128,128]>", KN="tensordesc<bf16[128,128]>", VN="tensordesc<bf16[128,128]>")
    k = _compile(_prefill_kernel, c, dict(ptrs, KC="*u8", VC="*u8", **desc), ("sm_scale_log2",), num_warps=8,
                 num_stages=3)
    ttgir = k.asm["ttgir"]
    assert len([ln for ln in ttgir.splitlines() if "async_tma_copy_global_to_local" in ln]) >= 3
    loads = [ln for ln in ttgir.splitlines() if "tt.load" in ln]
    assert loads and not [ln for ln in loads if "i8>" in ln], "a prompts-only prefill read the nvfp4 cache"


def _check_prefix_dots(ttgir, fp8_qk, q_split, full):
    """fp8 tensor-core dots per prefix loop: one for an fp8 q, two for a split bf16 q, none otherwise."""
    loops = 2 if full else 1  # the unmasked whole tiles and the masked rest
    fp8_dots = [ln for ln in ttgir.splitlines() if "warp_group_dot " in ln and "f8E4M3FN" in ln]
    assert len(fp8_dots) == (2 * loops if q_split else loops if fp8_qk else 0), f"fp8 dots: {len(fp8_dots)}"
    to_f16 = [ln for ln in ttgir.splitlines() if "tt.fp_to_fp" in ln and "f8E4M3FN" in ln.split("->")[0]
              and "xf16" in ln.split("->")[-1]]
    # V tiles only where the scores run on the stored K; K and V tiles otherwise
    assert len(to_f16) == loops if fp8_qk else len(to_f16) >= 2 * loops, f"fp8 -> f16 conversions: {len(to_f16)}"


def compile_append():
    from kvbench.kernels.append import _append_kernel

    ptrs = dict(Q="*bf16", K="*bf16", V="*bf16", POS="*i64", SLOTS="*i64", CS="*fp32", Q_OUT="*bf16", K_OUT="*bf16",
                Q8="*fp8e4nv", Q_SCALE="*fp32", KC="*u8", VC="*u8", KBS="*fp8e4nv", VBS="*fp8e4nv",
                K_SCALE="*fp32", V_SCALE="*fp32")
    c = dict(D=128, D_PAD=128, NB_PAD=8, HB=8, ROT=64, NEOX=False, FMT=2, QMAX=6.0, DO_ROPE=True, DO_STORE=True,
             WRITE_K_OUT=True, Q_FP8=True, E5M2=False, EXACT=False, KV_FIRST=True, PACKED=False, HOIST=True,
             BITCODE=True)
    _compile(_append_kernel, c, ptrs, num_warps=4, enable_fp_fusion=False)
    _pdl_ptx(_compile(_append_kernel, dict(c, PDL=True), ptrs, num_warps=4, enable_fp_fusion=False, launch_pdl=True))


def _pdl_ptx(k) -> None:
    """A programmatic dependent launch's kernel lets the next launch go, then waits, before its first load."""
    ptx = k.asm["ptx"]
    go, wait, load = (ptx.find(s) for s in ("griddepcontrol.launch_dependents", "griddepcontrol.wait", "ld.global"))
    assert 0 <= go < wait and (load < 0 or wait < load), (go, wait, load)


def compile_pdl_small_kernels():
    """The decode step's small kernels and the paged decode as programmatic dependent launches
    (``_triton_utils.pdl_enter``)."""
    from kvbench.kernels.decode import _decode_reduce_kernel, _decode_split_kernel
    from kvbench.kernels.fused_ops import _rms_norm_kernel, _silu_mul_kernel

    opts = dict(num_warps=4, launch_pdl=True)
    _pdl_ptx(_compile(_rms_norm_kernel, dict(BLOCK=4096, HAS_RES=True, EXACT=False, PDL=True),
                      dict(X="*bf16", R="*bf16", W="*bf16", OUT="*bf16", RES_OUT="*bf16"), ("eps",), **opts))
    _pdl_ptx(_compile(_silu_mul_kernel, dict(BLOCK=1024, EXACT=False, PDL=True), dict(GU="*bf16", OUT="*bf16"), **opts))
    base = dict(Q="*bf16", KBS="*fp8e4nv", VBS="*fp8e4nv", K_SCALE="*fp32", Q_SCALE="*fp32", PT="*i32", SEQ_LENS="*i32",
                ACC="*fp32", ML="*fp32", OUT="*bf16", V_SCALE="*fp32", SINKS="*fp32", KC="*i16", VC="*i16")
    c = dict(G=4, G_PAD=16, D=128, DP_PAD=64, NB=8, PAGE=16, BLOCK_N=64, HAS_Q_SCALE=False, FMT=1, DOT=1,
             PREFETCH=False, SPLIT8=True, E5M2=False, NV4=False, PDL=True)
    _pdl_ptx(_compile(_decode_split_kernel, c, base, ("sm_scale_log2",), **opts))
    c = dict(G=4, D=128, D_PAD=128, S_PAD=4, FMT=1, HAS_SINKS=False, PDL=True)
    _pdl_ptx(_compile(_decode_reduce_kernel, c, dict(ACC="*fp32", ML="*fp32", OUT="*bf16", V_SCALE="*fp32", SINKS="*fp32"),
                      **opts))


def compile_mla_decode():
    import triton.language as tl

    from kvbench.kernels.mla_decode import _mla_decode_split

    ptrs = dict(QL="*bf16", QP="*bf16", BS="*fp8e4nv", KSCALE="*fp32", QSCALE="*fp32", PT="*i32", SL="*i32", MO="*fp32",
                ML="*fp32")
    # (latent pointer type, constexprs, launch): bf16 tiles; fp8 / nvfp4 as 16-bit units (fp16 dots); fp8
    # bytes; fp8 units in four column chunks and tiles within one page; the exact query split over e4m3 bytes
    # and e4m3 queries' fp8 scores, both at the many-heads default (64-head tiles, 8 warps)
    few, many = dict(BLOCK_H=16, BLOCK_N=32, num_warps=4), dict(BLOCK_H=64, BLOCK_N=64, num_warps=8)
    variants = [("*bf16", dict(FMT=0, DT=tl.bfloat16, UNITS=0, E5M2=False), few),
                ("*i16", dict(FMT=1, DT=tl.float16, UNITS=1, E5M2=False), few),
                ("*i16", dict(FMT=1, DT=tl.float16, UNITS=1, E5M2=True), few),
                ("*i16", dict(FMT=1, DT=tl.float16, UNITS=1, E5M2=False, CHUNKS=4, PAGE_TILES=True), few),
                ("*bf16", dict(FMT=0, DT=tl.bfloat16, UNITS=0, E5M2=False, PAGE_TILES=True), few),
                ("*i16", dict(FMT=2, DT=tl.float16, UNITS=2, E5M2=False), few),
                ("*fp8e4nv", dict(FMT=1, DT=tl.bfloat16, UNITS=0, E5M2=False), few),
                ("*fp8e4nv", dict(FMT=1, DT=tl.float16, UNITS=0, E5M2=False, Q_SPLIT=True), many),
                ("*fp8e4nv", dict(FMT=1, DT=tl.float16, UNITS=0, E5M2=False, Q_FP8=True, FP8_SCORES=True), many)]
    for kv_ty, extra, launch in variants:
        launch = dict(launch)
        nw = launch.pop("num_warps")
        c = dict(PAGE=64, RANK=512, ROPE=64, Q_FP8=False, Q_SPLIT=False, EXACT_CAST=False, CHUNKS=1, PAGE_TILES=False,
                 FP8_SCORES=False, **launch)
        c.update(extra)
        q_ty = "*fp8e4nv" if c["FP8_SCORES"] else "*bf16"  # e4m3 queries (quantize_query) for the fp8 scores
        k = _compile(_mla_decode_split, c, dict(ptrs, KV=kv_ty, QL=q_ty, QP=q_ty), ("sm_scale_log2",), num_warps=nw)
        if c["Q_SPLIT"] or c["FP8_SCORES"]:  # the scores on the stored latent: fp8 wgmma, and only P·c converted
            assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", k.asm["ptx"]), "no fp8 wgmma"
    # The defaults' pipeline depth: the tile loads follow a page-table load, and below five stages Triton gives
    # them one shared-memory buffer, so each tile's load latency is exposed (docs/mla.md).  fp8 at 16 heads
    # and the stored-e4m3 paths at many heads must get two buffers, and the 16-head kernel must still fit two
    # programs per SM (228 KB of shared memory, 1 KB reserved per program).
    from kvbench.kernels.mla_decode import _STORED_FP8_STAGES, _defaults

    aligned = [n for n in _mla_decode_split.arg_names
               if n in ptrs or n in ("KV", "QL", "QP") or (n.startswith("stride") and n != "stride_bs")]
    _, bh, bn, nw, ns, _, ch = _defaults(1, 16)
    c = dict(PAGE=64, RANK=512, ROPE=64, Q_FP8=False, Q_SPLIT=False, EXACT_CAST=False, CHUNKS=ch, PAGE_TILES=True,
             FP8_SCORES=False, BLOCK_H=bh, BLOCK_N=bn, FMT=1, DT=tl.float16, UNITS=1, E5M2=False)
    k = _compile(_mla_decode_split, c, dict(ptrs, KV="*i16"), ("sm_scale_log2",), aligned, num_warps=nw, num_stages=ns)
    assert re.search(rf"memdesc<2x{bn}x{512 // (2 * ch)}xi16", k.asm["ttgir"]), "fp8 16-head tiles not double-buffered"
    assert k.metadata.shared <= 113 * 1024, k.metadata.shared
    # each 32-bit pair of fp8 units: one byte permute regroups it into (even, odd) halves for two conversions
    cvt, prmt = (len(re.findall(p, k.asm["ptx"])) for p in (r"cvt\.rn\.f16x2\.e4m3x2", r"prmt\.b32"))
    assert cvt > 0 and prmt * 2 == cvt, (cvt, prmt)
    _, bh, bn, nw, _, _, _ = _defaults(1, 128)
    c.update(BLOCK_H=bh, BLOCK_N=bn, CHUNKS=1, UNITS=0, Q_SPLIT=True)
    k = _compile(_mla_decode_split, c, dict(ptrs, KV="*fp8e4nv"), ("sm_scale_log2",), aligned, num_warps=nw,
                 num_stages=_STORED_FP8_STAGES)
    assert re.search(rf"memdesc<2x{bn}x512xf8E4M3FN", k.asm["ttgir"]), "stored e4m3 tiles not double-buffered"


def compile_mla_decode_wg():
    """The Hopper MLA decode (Gluon, warpgroup MMAs from shared memory) for a bf16 latent and for fp8_pv: the MMA
    shapes (scores 64 heads x 32 tokens per warpgroup over the full depth, P·c 64 x 256 per warpgroup), the TMA
    tile copies, no register spills, no MMA serialized by ptxas, and shared memory within the 227 KB an sm_90
    program may have."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    from kvbench.kernels import mla_decode_wg as wg

    fn = wg._mla_decode_wg
    # (mode, page): bf16, fp8_pv, an e4m3 latent with e4m3 queries / with bf16 queries split into two e4m3 terms
    # (scores on the stored tile, P·c in bf16 on its conversion); pages of 64 (one copy per tile) and of 16 (four)
    # and ("split_e5m2") an e5m2 latent with the split bf16 query, its scores e4m3 x e5m2 MMAs
    for mode, page in (("bf16", 64), ("fp8_pv", 64), ("bf16", 16), ("e4m3", 64), ("split", 16), ("split_e5m2", 64)):
        fp8, cvt = mode == "fp8_pv", mode in ("e4m3", "split", "split_e5m2")
        ty, bits = ("bf16", 16) if mode == "bf16" else ("fp8e5", 8) if mode == "split_e5m2" else ("fp8e4nv", 8)
        c_lay, pe_lay = (repr(x) for x in wg._tile_layouts(bits))
        rows = min(page, 64)
        qty = "bf16" if mode == "bf16" else "fp8e4nv"
        ptrs = dict(C_DESC=f"tensordesc<{ty}[{rows},512],{c_lay}>", PE_DESC=f"tensordesc<{ty}[{rows},64],{pe_lay}>",
                    QL=f"*{qty}", QP=f"*{qty}", QL2=f"*{qty}", QP2=f"*{qty}", QINV="*fp32", KSCALE="*fp32",
                    QSCALE="*fp32", PT="*i32", SL="*i32", MO="*fp32", ML="*fp32")
        consts = dict(PAGE=page, RANK=512, ROPE=64, STAGES=wg.STAGES[mode[:5] if cvt else fp8], FP8=fp8, PARTS=0,
                      CVT=cvt, SPLIT=mode.startswith("split"))
        sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "sm_scale_log2" else "i32")
               for n in fn.arg_names}
        aligned = [i for i, n in enumerate(fn.arg_names) if n in ptrs and "DESC" not in n]
        src = GluonASTSource(fn, sig, constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
        ptx = k.asm["ptx"]
        sdt, ks = ("bf16.bf16", 16) if mode == "bf16" else ("e4m3.e5m2", 32) if mode == "split_e5m2" else ("e4m3.e4m3", 32)
        pdt, kp = ("e4m3.e4m3", 32) if fp8 else ("f16.f16", 16) if cvt else ("bf16.bf16", 16)
        terms = 2 if mode.startswith("split") else 1
        # scores: terms x (512 + 64) / depth per tile, issued at two places (tile 0, the loop; three with the
        # converted tile: tile 1 before the loop); P·c at two (loop, last tile)
        sites = 3 if cvt else 2
        assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n32k{ks}\.f32\.{sdt}", ptx)) == sites * terms * 576 // ks
        assert len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n256k{kp}\.f32\.{pdt}", ptx)) == 2 * 64 // kp
        assert "cp.async.bulk.tensor" in ptx
        assert k.metadata.shared <= 232448, (mode, k.metadata.shared)
        with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
            f.write(ptx)
            f.flush()
            log = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                                 text=True, check=True).stderr
        assert "0 bytes spill stores" in log and "C751" not in log, (mode, log)  # C7514/C7515: MMAs serialized


def compile_mla_prefill():
    import triton.language as tl

    from kvbench.kernels.mla_prefill import _dequant_prefix, _mla_prefill_kernel

    # the prefix workspace fill: fp8 and nvfp4 pages into bf16 rows
    for kv_ty, fmt in (("*fp8e4nv", 1), ("*u8", 2)):
        _compile(_dequant_prefix, dict(PAGE=64, RANK=512, ROPE=64, FMT=fmt, DT=tl.bfloat16, SUB=64),
                 dict(KV=kv_ty, BS="*fp8e4nv", PT="*i32", SL="*i32", CU="*i32", WS="*bf16"), num_warps=4)

    ptrs = dict(CN="*bf16", KN="*bf16", BS="*fp8e4nv", KSCALE="*fp32", QSCALE="*fp32", PT="*i32", SL="*i32", CU="*i32",
                OUT="*bf16", MO="*fp32", ML="*fp32")
    # the defaults' shape (4 tokens x 16 heads, 64-token tiles, 8 warps): converted bf16 / e4m3 / nvfp4 tiles, and
    # e4m3 queries over an e4m3 prefix as fp8 wgmma scores; the prefix split (partial outputs) over the 16-bit
    # workspace and over an e4m3 prefix with fp8 scores
    variants = [("*bf16", "*bf16", dict(FMT=0)), ("*fp8e4nv", "*bf16", dict(FMT=1)), ("*u8", "*bf16", dict(FMT=2)),
                ("*fp8e4nv", "*fp8e4nv", dict(FMT=1, FP8_SCORES=True, Q_FP8=True)), ("*bf16", "*bf16", dict(FMT=0, SPLIT=True)),
                ("*fp8e4nv", "*fp8e4nv", dict(FMT=1, FP8_SCORES=True, Q_FP8=True, SPLIT=True))]
    for kv_ty, q_ty, extra in variants:
        c = dict(PAGE=64, RANK=512, ROPE=64, TB=4, HB=16, BLOCK_N=64, DT=tl.bfloat16, Q_FP8=False, FP8_SCORES=False,
                 SPLIT=False)
        c.update(extra)
        k = _compile(_mla_prefill_kernel, c, dict(ptrs, KV=kv_ty, QL=q_ty, QP=q_ty, QLH="*bf16", QPH="*bf16"), ("sm_scale_log2",),
                     num_warps=8)
        if c["FP8_SCORES"]:
            assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", k.asm["ptx"]), "no fp8 wgmma"


def compile_skinny_gemm():
    """The few-row GEMM: pointer loads with split K; tensor descriptors with a programmatic dependent launch that
    prefetches weight lines into L2 (``griddepcontrol`` and ``prefetch.global.L2`` in the PTX)."""
    from kvbench.kernels.skinny_gemm import _skinny_kernel

    ptrs = dict(X="*bf16", W="*bf16", WP="*bf16", B="*bf16", OUT="*bf16", PART="*fp32", LOCK="*i32")
    base = dict(BM=64, BK=128, HAS_B=True, F32_DOT=False, EXACT=False)
    _compile(_skinny_kernel, dict(base, BN=64, SPLIT=2, TMA=False, PDL=False, PREFETCH=0), ptrs, num_warps=4, num_stages=5)
    desc = dict(ptrs, X="tensordesc<bf16[64,64]>", W="tensordesc<bf16[64,256]>")
    k = _compile(_skinny_kernel, dict(base, BK=64, BN=256, SPLIT=1, TMA=True, PDL=True, PREFETCH=2), desc,
                 num_warps=4, num_stages=4, launch_pdl=True)
    ptx = k.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx and "prefetch.global.L2" in ptx
    assert "cp.async.bulk.tensor" in ptx and "wgmma" in ptx


def test_kernels_compile_for_sm90():
    import triton.backends.nvidia  # noqa: F401  (ships with every Linux triton wheel)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.split() == ["decode", "decode_nv4", "prefill", "append", "mla_decode", "mla_decode_wg", "mla_prefill",
                                "skinny_gemm", "pdl"]


if __name__ == "__main__":
    for name, fn in (("decode", compile_decode), ("decode_nv4", compile_decode_nv4), ("prefill", compile_prefill), ("append", compile_append),
                     ("mla_decode", compile_mla_decode), ("mla_decode_wg", compile_mla_decode_wg),
                     ("mla_prefill", compile_mla_prefill), ("skinny_gemm", compile_skinny_gemm),
                     ("pdl", compile_pdl_small_kernels)):
        fn()
        print(name, flush=True)

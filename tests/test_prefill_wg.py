"""The Hopper prefill kernel (``kernels/prefill_wg.py``) on the CPU: compiled for sm_90 (a subprocess with the
interpreter off: the MMA shapes and counts, the TMA copies, shared memory within an sm_90 program's 227 KB, no
register spills, no MMA serialized by ptxas), and ``paged_prefill``'s routing (``PrefillOptions.wgmma``).  Its
arithmetic is checked against the float64 reference on a GPU (``tests/test_gpu_kernels.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch


def _compile(fn, d: int, page: int, warps: int, bn: int, **consts):
    """``fn`` (a kernel of ``prefill_wg``) compiled for sm_90 with bf16 descriptors at head dim ``d``, tiles of ``bn``
    keys and pages of ``page`` → the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from kvbench.kernels import prefill_wg as wg

    lay = repr(wg._layout(d, gl.bfloat16, bn))
    qlay = repr(gl.NVMMASharedLayout.get_default_for([wg.BLOCK_M, d], gl.bfloat16))
    rows = min(page, bn)
    ptrs = dict(Q_DESC=f"tensordesc<bf16[{wg.BLOCK_M},{d}],{qlay}>", KN_DESC=f"tensordesc<bf16[{bn},{d}],{lay}>",
                VN_DESC=f"tensordesc<bf16[{bn},{d}],{lay}>", KC_DESC=f"tensordesc<bf16[{rows},{d}],{lay}>",
                VC_DESC=f"tensordesc<bf16[{rows},{d}],{lay}>", PT="*i32", SEQ_LENS="*i32", CU_Q="*i32", OUT="*bf16",
                K_SCALE="*fp32", V_SCALE="*fp32")
    consts = dict(G=4, D=d, PAGE=page, HKV=8, HEAVY_FIRST=True, **consts)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "scale" else "i32") for n in fn.arg_names}
    aligned = [i for i, n in enumerate(fn.arg_names) if n in ptrs and "DESC" not in n]
    src = GluonASTSource(fn, sig, constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def compile_prefill_ws(d: int, page: int, bn: int, scaled: bool = False, hnd: bool = True):
    """The warp-specialized kernel at ``bn`` keys per tile: each warpgroup partition's MMAs (scores at two sites,
    tile 0's and the loop's, q from shared memory; P·V at two, the loop's and the last tile's), the copies (q once,
    K and V per tile in the producer's loop), register reallocation between the partitions, shared memory.  (Spills
    are not asserted: with 128 keys per tile Triton 3.6, the GPU machine's, spills 8 bytes.)  ``scaled``: a
    dequantized prefix with per-head scales (``SCALED``); ``hnd``: HND pages (else NHD)."""
    from kvbench.kernels import prefill_wg as wg

    stages = 4 if bn == 64 else 3
    k = _compile(wg._prefill_ws, d, page, 4, bn, STAGES=stages, HND=hnd, REGS=wg.WS_REGS, SCALED=scaled)
    rows = min(page, bn)
    ptx = k.asm["ptx"]
    mma = {n: len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k16\.f32\.bf16\.bf16", ptx)) for n in (64, 128)}
    want = {64: 0, 128: 0}
    want[bn] += 2 * 2 * d // 16  # two warpgroups, two sites, D / 16 steps
    want[d] += 2 * 2 * bn // 16
    assert mma == want, (mma, want)
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)) >= 1 + 2 * (bn // rows + 1)
    assert "setmaxnreg" in ptx and ptx.count("mbarrier.arrive") >= 2
    assert k.metadata.shared <= 232448, k.metadata.shared


def test_prefill_wg_compiles_for_sm90():
    import triton.backends.nvidia  # noqa: F401  (ships with every Linux triton wheel)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.split() == ["ws-128-16-128-HND", "ws-64-64-128-HND", "ws-128-32-64-HND", "ws-128-16-128-HND-scaled",
                                "ws-128-64-128-NHD", "ws-64-32-64-NHD"]


def test_wgmma_routing_on_the_cpu():
    from kvbench.kernels import PagedKV, PrefillOptions, paged_prefill
    from kvbench.kernels import prefill as P
    from kvbench.kernels import prefill_wg
    from kvbench.kernels._triton_utils import check_kv
    from kvbench.kernels.config import AttentionParams
    from kvbench.tools.kernel_check import _attn_inputs

    kv, table = _attn_inputs("bf16", [40], 2, 64, 16, "cpu", torch.Generator().manual_seed(1))
    q, k = torch.randn(8, 8, 64, dtype=torch.bfloat16), torch.randn(8, 2, 64, dtype=torch.bfloat16)
    args = (q, k, k.clone(), torch.tensor([0, 8], dtype=torch.int32), 8, PagedKV("bf16", **kv), table,
            torch.tensor([40], dtype=torch.int32))
    with pytest.raises(ValueError, match="wgmma=True needs a CUDA device"):
        paged_prefill(*args, opts=PrefillOptions(wgmma=True))
    out = paged_prefill(*args)  # the Triton kernel (the interpreter here)
    assert torch.isfinite(out.float()).all()
    kc, vc = check_kv(PagedKV("bf16", **kv), 64)
    assert prefill_wg.unsupported(q, k, k, kc, vc, "bf16", AttentionParams(), True) == "needs an sm_90 (Hopper) GPU"


def test_wgmma_default_takes_extends_at_head_dim_128(monkeypatch):
    """``wgmma=None`` on a GPU (faked here): the Hopper kernel for an extend with a known cached prefix at head dim
    128, where it applies; the Triton kernel for prompts only, an unknown prefix, other head dims, or any Triton
    launch option."""
    from types import SimpleNamespace

    from kvbench.kernels import PrefillOptions
    from kvbench.kernels import prefill as P
    from kvbench.kernels import prefill_wg

    monkeypatch.setattr(P, "interpreting", lambda: False)
    monkeypatch.setattr(P, "tma_ok", lambda x: True)
    why = {"value": None}
    monkeypatch.setattr(prefill_wg, "unsupported", lambda *a, **k: why["value"])

    def use(d=128, **kw):
        q = SimpleNamespace(is_cuda=True, shape=(8, 32, d))
        return P._use_wgmma(PrefillOptions(**kw), q, q, q, None, None, "bf16", None)

    assert P.WGMMA_DEFAULT is True
    assert use(max_prefix_len=7168)
    assert not use(max_prefix_len=0) and not use() and not use(64, max_prefix_len=7168)
    assert not use(max_prefix_len=7168, block_m=64) and not use(max_prefix_len=7168, wgmma=False)
    assert use(wgmma=True)  # asked for: prompts too
    why["value"] = "needs a bf16 or float16 cache"
    assert not use(max_prefix_len=7168)  # does not apply: the Triton kernel, silently
    with pytest.raises(ValueError, match="wgmma=True: needs a bf16"):
        use(wgmma=True)


def test_wgmma_default_over_a_quantized_prefix(monkeypatch):
    """A quantized cache: the Hopper kernel over a workspace of q's dtype (``_use_wgmma`` returns the workspace
    plan) for an extend from ``WGMMA_WORKSPACE_MIN_Q`` new tokens; fewer, or ``prefix_workspace=False``, or a
    prefix past the workspace cap: the Triton kernel (a ValueError where ``wgmma=True`` asked for it)."""
    from types import SimpleNamespace

    from kvbench.kernels import PrefillOptions
    from kvbench.kernels import prefill as P
    from kvbench.kernels import prefill_wg

    monkeypatch.setattr(P, "interpreting", lambda: False)
    monkeypatch.setattr(P, "tma_ok", lambda x: True)
    seen = []
    monkeypatch.setattr(prefill_wg, "unsupported", lambda *a, workspace=False: seen.append(workspace))
    q = SimpleNamespace(is_cuda=True, shape=(8, 32, 128))
    kc = SimpleNamespace(num_kv_heads=8, head_dim=128, page_size=16)

    def use(fmt, new, bsz=4, **kw):
        return P._use_wgmma(PrefillOptions(**kw), q, q, q, kc, kc, fmt, None, new, bsz)

    for fmt, code in (("fp8_e4m3", 1), ("fp8_e5m2", 1), ("nvfp4", 2)):
        n = P.WGMMA_WORKSPACE_MIN_Q[code]
        plan = use(fmt, n, max_prefix_len=7168)
        assert isinstance(plan, P._WorkspacePlan) and plan.npp == 448 and plan.group == 4 and seen[-1] is True
        assert use(fmt, n - 1, max_prefix_len=7168) is False
        assert use(fmt, n, max_prefix_len=7168, prefix_workspace=False) is False
        assert isinstance(use(fmt, 1, max_prefix_len=7168, wgmma=True), P._WorkspacePlan)
        with pytest.raises(ValueError, match="prefix_workspace=False refuses"):
            use(fmt, n, max_prefix_len=7168, prefix_workspace=False, wgmma=True)
        with pytest.raises(ValueError, match="needs max_prefix_len"):
            use(fmt, n, max_prefix_len=1 << 24, wgmma=True)  # one prefix over WORKSPACE_CAP_BYTES
    assert use("bf16", 1, max_prefix_len=7168) is True and seen[-1] is False


def test_too_few_stages_refused(monkeypatch):
    # a tile's stage is released only after the next tile's scores were issued on the other
    from kvbench.kernels import prefill_wg

    monkeypatch.setattr(prefill_wg, "WS_STAGES", 1)
    with pytest.raises(ValueError, match="WS_STAGES must be at least 2, got 1"):
        prefill_wg.launch(*([None] * 9), out=None, sm_scale=1.0)


if __name__ == "__main__":
    for d, page, bn, scaled, hnd in ((128, 16, 128, False, True), (64, 64, 128, False, True), (128, 32, 64, False, True),
                                     (128, 16, 128, True, True), (128, 64, 128, False, False), (64, 32, 64, False, False)):
        compile_prefill_ws(d, page, bn, scaled, hnd)
        print(f"ws-{d}-{page}-{bn}-{'HND' if hnd else 'NHD'}" + ("-scaled" if scaled else ""), flush=True)

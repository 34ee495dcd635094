"""Correctness check of the Triton KV kernels against ``reference.py`` on fresh random inputs.

``python -m kvbench.tools.kernel_check`` runs every kernel × format × feature at real shapes on the GPU
(head_dim 64/128, H_q/H_kv 32/8 and 64/8, pages of 16 and 64, contexts up to 32k, batch up to 256,
ragged lengths) and exits non-zero on any failure.  The CPU tests use the same case builders at small
shapes under ``TRITON_INTERPRET=1``, and ``tests/gpu`` runs a sample of them on a CUDA device
(``pytest -m gpu``).  The grid of the GPU run is in ``kernel_check_grid.py``; each case's line is printed
as soon as it has run, with a progress line on stderr.

Rules: inputs are random with outliers and drawn anew for every case; outputs are poisoned (NaN, or
random bytes for the caches) before each run; errors are ``‖out − ref‖ / ‖ref‖`` against float64 and
NaN never passes.  Append kernels are compared bit for bit (``exact=True``, the GPU); on the CPU
interpreter, whose float32→fp8 cast mis-rounds values that round up to a power of two, an fp8 value
may be exactly half its reference when the reference is a power of two, and nvfp4 codes are then
checked against the block scale the kernel chose (docs/design.md §12).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvbench.kernels import reference as R
from kvbench.kernels import AttentionParams, DecodeOptions, PagedKV, PrefillOptions
from kvbench.kernels import get_format, quantize_e2m1, scale_from_amax, unpack_nibbles

__all__ = ["Case", "rel_err", "fp8_mismatch", "nvfp4_mismatch", "check_append", "check_decode", "check_prefill",
           "check_prefill_q_split", "CASE_HEADER", "main"]

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-3}


@dataclass
class Case:
    kernel: str
    label: str
    err: float
    tol: float
    detail: str = ""
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        self.ok = math.isfinite(self.err) and self.err <= self.tol

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.kernel:<8} {self.label:<58} err {self.err:.2e} (tol {self.tol:.0e}) {self.detail}"


CASE_HEADER = f"{'check':<6}{'kernel':<9}{'case':<58} error (tolerance)"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-300))


def randn_outliers(shape, gen, device, dtype, scale=1.0, frac=1e-3, mult=20.0) -> torch.Tensor:
    """Gaussian values with a fraction ``frac`` of outliers ``mult`` times larger, drawn on ``device``
    from a generator seeded by ``gen``."""
    dg = torch.Generator(device=device).manual_seed(int(torch.randint(1 << 62, (1,), generator=gen)))
    x = torch.randn(shape, generator=dg, device=device) * scale
    hit = torch.rand(shape, generator=dg, device=device) < frac
    return torch.where(hit, x * mult, x).to(dtype)


def calibrated_scale(fmt_name: str, x: torch.Tensor) -> torch.Tensor:
    """Per-kv-head scale from the amax of ``x`` ``[..., H_kv, D]`` (fp32 ``[H_kv]``)."""
    amax = x.float().abs().flatten(0, -3).amax(dim=(0, 2))
    return scale_from_amax(fmt_name, amax.cpu()).to(x.device)


# ------------------------------------------------------------------------------ comparisons
def fp8_mismatch(got: torch.Tensor, ref: torch.Tensor, exact: bool) -> int:
    """Number of fp8 values that differ.  Not exact (CPU interpreter): a neighbour on the grid passes
    (its float32→fp8 cast double-rounds), and so does half the reference when the reference is a power
    of two (it rounds those down across the binade)."""
    if exact:
        return int((got.view(torch.uint8) != ref.view(torch.uint8)).sum())
    g, r = got.float(), ref.float()
    gb, rb = got.view(torch.uint8).int(), ref.view(torch.uint8).int()
    same_sign = (gb >> 7) == (rb >> 7)
    neighbour = same_sign & ((gb - rb).abs() <= 1)
    pow2 = (r != 0) & (torch.exp2(torch.floor(torch.log2(r.abs()))) == r.abs())
    ok = (g == r) | (torch.isnan(g) & torch.isnan(r)) | neighbour | (pow2 & (g == r / 2))
    return int((~ok).sum())


def nvfp4_mismatch(data, bs, ref_data, ref_bs, src, scale, exact: bool) -> int:
    """Mismatching bytes + block scales of nvfp4 entries; ``src`` ``[N, H, D]`` is what was quantized."""
    if exact:
        return int((data != ref_data).sum()) + fp8_mismatch(bs, ref_bs, True)
    bad = fp8_mismatch(bs, ref_bs, False)
    d = src.shape[-1]
    y = src.float().reshape(*src.shape[:-1], d // 16, 16) / (bs.float()[..., None] * scale.float()[:, None, None])
    codes = quantize_e2m1(y).reshape(src.shape)
    return bad + int((unpack_nibbles(data) != codes).sum())


def cache_mismatch(fmt: str, got, ref, got_bs, ref_bs, src, slots, scale, exact: bool) -> int:
    """Compare whole cache planes: rows at ``slots`` as quantized values, every other row unchanged."""
    hk, dp = got.shape[-2], got.shape[-1]
    g, r = got.reshape(-1, hk, dp), ref.reshape(-1, hk, dp)  # logical slot order, any page layout
    keep = torch.ones(g.shape[0], dtype=torch.bool, device=g.device)
    keep[slots] = False
    bad = int((g[keep].view(torch.uint8) != r[keep].view(torch.uint8)).sum())
    if fmt == "nvfp4":
        gb, rb = got_bs.reshape(-1, hk, got_bs.shape[-1]), ref_bs.reshape(-1, hk, ref_bs.shape[-1])
        bad += int((gb[keep].view(torch.uint8) != rb[keep].view(torch.uint8)).sum())
        return bad + nvfp4_mismatch(g[slots], gb[slots], r[slots], rb[slots], src, scale, exact)
    if fmt in ("fp8_e4m3", "fp8_e5m2"):
        return bad + fp8_mismatch(g[slots], r[slots], exact)
    return bad + plain_mismatch(g[slots], r[slots], exact)


def plain_mismatch(got: torch.Tensor, ref: torch.Tensor, exact: bool) -> int:
    """bf16/fp16/fp32 values: bitwise, or within one bf16 step (the interpreter truncates to bf16)."""
    if exact or got.dtype != torch.bfloat16:
        return int((got.view(torch.uint8) != ref.view(torch.uint8)).sum())
    g, r = got.float(), ref.float()
    return int(((g - r).abs() > r.abs() * 2**-7).sum())


# -------------------------------------------------------------------------------- case builders
def as_layout(t: Optional[torch.Tensor], layout: str) -> Optional[torch.Tensor]:
    """``[P+1, page, H_kv, X]`` values in the page layout ``layout``: NHD contiguous, or HND memory
    (``[P+1, H_kv, page, X]`` contiguous) seen through ``permute(0, 2, 1, 3)``."""
    if t is None:
        return None
    if layout == "NHD":
        return t.contiguous()
    if layout == "HND":
        return t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    raise ValueError(f"layout must be NHD or HND, got {layout!r}")


def make_cache(fmt_name, num_pages, page, hk, d, device, gen, layout="NHD"):
    """Random stored values in every page (scratch included), as raw bytes: poison for unwritten rows."""
    fmt = get_format(fmt_name)
    dp = fmt.packed_dim(d)
    x = randn_outliers((num_pages + 1, page, hk, d), gen, device, torch.float32)
    scale = calibrated_scale(fmt_name, x)
    q = fmt.quantize(x, scale)
    return as_layout(q.data, layout), as_layout(q.block_scale, layout), scale, dp


def random_page_table(lens, page, num_pages, gen, device):
    per = [max(1, -(-n // page)) for n in lens]
    width = max(per)
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(lens), width), num_pages, dtype=torch.int32)
    at = 0
    for b, p in enumerate(per):
        table[b, :p] = perm[at : at + p].to(torch.int32)
        at += p
    return table.to(device)


def _pages_for(lens, page):
    return sum(max(1, -(-n // page)) for n in lens) + 2


# ----------------------------------------------------------------------------------- runners
def _tokens(gen, t, heads, d, dtype, device, scale=1.0):
    return randn_outliers((t, heads, d), gen, device, dtype, scale)


def check_append(fmt, t, hq, hk, d, page, *, rot=None, style="neox", dtype=torch.bfloat16, q_fp8=False,
                 fused=True, device="cuda", seed=0, exact=True, layout="NHD") -> Case:
    from kvbench.kernels import fused_rope_quant_append, unfused_rope_quant_append

    gen = torch.Generator().manual_seed(seed)
    rot = rot or d
    num_pages = -(-t // page) + 3
    kc, kbs, _, _ = make_cache(fmt, num_pages, page, hk, d, device, gen, layout)
    vc, vbs, _, _ = make_cache(fmt, num_pages, page, hk, d, device, gen, layout)
    q, k, v = (_tokens(gen, t, h, d, dtype, device, s) for h, s in ((hq, 1.0), (hk, 2.0), (hk, 0.5)))
    ks, vs = calibrated_scale(fmt, k) * 0.8, calibrated_scale(fmt, v)  # 0.8: some values saturate
    pos = torch.randint(0, 4096, (t,), generator=gen).to(device)
    slots = torch.randperm(num_pages * page, generator=gen)[:t]
    slots = torch.where(torch.rand(t, generator=gen) < 0.1, -1, slots).to(device)
    cs = R.build_cos_sin_cache(4096, rot, device=device)
    qs = (q.float().abs().amax() / 448).reshape(1).to(device) if q_fp8 else None
    kw = dict(rotary_dim=rot, rope_style=style, q_scale=qs)
    # The reference runs on the CPU: torch's CUDA kernels divide by a Python scalar as a multiplication
    # by its reciprocal (nvfp4's ``amax / 6``), which is not the correctly rounded division of the spec.
    cpu = [x.cpu() if isinstance(x, torch.Tensor) else x for x in (q, k, v, pos, slots, cs, kc, vc, ks, vs, kbs, vbs, qs)]
    ref = R.append_reference(*cpu[:6], PagedKV(fmt, *cpu[6:12]), q_scale=cpu[12], rotary_dim=rot, rope_style=style)
    ref = tuple(x.to(device) if x is not None else None for x in ref)
    kc2, vc2 = kc.clone(), vc.clone()  # clone keeps the strides, so the copies keep the page layout
    kbs2 = kbs.clone() if kbs is not None else None
    vbs2 = vbs.clone() if vbs is not None else None
    fn = fused_rope_quant_append if fused else unfused_rope_quant_append
    out = fn(q, k, v, pos, slots, cs, PagedKV(fmt, kc2, vc2, ks, vs, kbs2, vbs2), **kw)
    bad = plain_mismatch(out.q, ref[0], exact) + plain_mismatch(out.k, ref[1], exact)
    if q_fp8:
        bad += fp8_mismatch(out.q_fp8, ref[2], exact)
    keep = slots >= 0
    src = ref[1][keep]
    sl = slots[keep].long()
    bad += cache_mismatch(fmt, kc2, ref[3], kbs2, ref[5], src, sl, ks, exact)
    bad += cache_mismatch(fmt, vc2, ref[4], vbs2, ref[6], v[keep], sl, vs, exact)
    label = f"{fmt} T={t} {hq}/{hk} D={d} rot={rot} {style} {str(dtype)[6:]}{' q8' if q_fp8 else ''} {'fused' if fused else 'unfused'}"
    if layout != "NHD":
        label += f" {layout}"
    return Case("append", label, float(bad), 0.0, "mismatches")


def _attn_inputs(fmt, lens, hk, d, page, device, gen, layout="NHD"):
    num_pages = _pages_for(lens, page)
    kc, kbs, ks, _ = make_cache(fmt, num_pages, page, hk, d, device, gen, layout)
    vc, vbs, vs, _ = make_cache(fmt, num_pages, page, hk, d, device, gen, layout)
    table = random_page_table(lens, page, num_pages, gen, device)
    return dict(k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs, k_block_scale=kbs, v_block_scale=vbs), table


def _query(gen, shape, dtype, device, q_fp8):
    q = randn_outliers(shape, gen, device, dtype)
    if not q_fp8:
        return q, None
    qs = (q.float().abs().amax() / 448).reshape(1)
    return get_format("fp8_e4m3").quantize(q, qs).data, qs


def _features(window, sinks, q_fp8, layout="NHD"):
    return "".join((f" win={window}" if window else "", " sinks" if sinks else "", " q8" if q_fp8 else "",
                    f" {layout}" if layout != "NHD" else ""))


def check_decode(fmt, lens, hq, hk, d, page, *, dtype=torch.bfloat16, window=None, sinks=False, q_fp8=False,
                 device="cuda", seed=0, layout="NHD", **launch) -> Case:
    from kvbench.kernels import paged_decode

    gen = torch.Generator().manual_seed(seed)
    kv, table = _attn_inputs(fmt, lens, hk, d, page, device, gen, layout)
    q, qs = _query(gen, (len(lens), hq, d), dtype, device, q_fp8)
    sk = (torch.randn(hq, generator=gen) * 2).to(device) if sinks else None
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = torch.full((len(lens), hq, d), float("nan"), dtype=dtype, device=device)
    attn = AttentionParams(sliding_window=window, sinks=sk, q_scale=qs)
    paged_decode(q, PagedKV(fmt, **kv), table, seq_lens, attn=attn, out=out, opts=DecodeOptions(**launch))
    ref = R.decode_reference(q, PagedKV(fmt, **kv), table, seq_lens, attn)
    label = f"{fmt} B={len(lens)} ctx<={max(lens)} {hq}/{hk} D={d} page={page}{_features(window, sinks, q_fp8, layout)}"
    return Case("decode", label, rel_err(out, ref), TOL[dtype])


def _prefill_run(fmt, q_lens, prefixes, hq, hk, d, page, *, dtype, window, sinks, q_fp8, device, seed, variants,
                 layout="NHD", v_scale_factors=None):
    """The prefill kernel once per launch-option dict in ``variants`` on the same fresh inputs (outputs
    poisoned first) → (outputs, float64 reference, label)."""
    from kvbench.kernels import paged_prefill

    gen = torch.Generator().manual_seed(seed)
    lens = [a + b for a, b in zip(q_lens, prefixes)]
    kv, table = _attn_inputs(fmt, lens, hk, d, page, device, gen, layout)
    if v_scale_factors is not None:  # per kv head: zero, negative, ... scales
        kv["v_scale"] = kv["v_scale"] * torch.tensor(v_scale_factors, device=device)
    t = sum(q_lens)
    q, qs = _query(gen, (t, hq, d), dtype, device, q_fp8)
    k_new, v_new = _tokens(gen, t, hk, d, dtype, device), _tokens(gen, t, hk, d, dtype, device)
    sk = (torch.randn(hq, generator=gen) * 2).to(device) if sinks else None
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    attn = AttentionParams(sliding_window=window, sinks=sk, q_scale=qs)
    outs = []
    for launch in variants:
        out = torch.full((t, hq, d), float("nan"), dtype=dtype, device=device)
        paged_prefill(q, k_new, v_new, cu, max(q_lens), PagedKV(fmt, **kv), table, seq_lens, attn=attn, out=out,
                      opts=PrefillOptions(**launch))
        outs.append(out)
    ref = R.prefill_reference(q, k_new, v_new, cu.cpu(), PagedKV(fmt, **kv), table, seq_lens, attn)
    label = f"{fmt} new={q_lens} prefix={prefixes} {hq}/{hk} D={d} page={page}{_features(window, sinks, q_fp8, layout)}"
    return outs, ref, label


def check_prefill(fmt, q_lens, prefixes, hq, hk, d, page, *, dtype=torch.bfloat16, window=None, sinks=False,
                  q_fp8=False, device="cuda", seed=0, layout="NHD", v_scale_factors=None, **launch) -> Case:
    (out,), ref, label = _prefill_run(fmt, q_lens, prefixes, hq, hk, d, page, dtype=dtype, window=window, sinks=sinks,
                                      q_fp8=q_fp8, device=device, seed=seed, variants=[launch], layout=layout,
                                      v_scale_factors=v_scale_factors)
    label += f" v_scale x {v_scale_factors}" if v_scale_factors is not None else ""
    if "tma" in launch:
        label += " tma" if launch["tma"] else " no-tma"
    if "fp8_qk" in launch:
        label += " fp8-qk" if launch["fp8_qk"] else " converted-k"
    return Case("prefill", label, rel_err(out, ref), TOL[dtype])


def check_prefill_workspace(fmt, q_lens, prefixes, hq, hk, d, page, *, dtype=torch.bfloat16, window=None,
                            sinks=False, q_fp8=False, device="cuda", seed=0, layout="NHD", **launch) -> Case:
    """The extend over its prefix dequantized once into a float16 workspace (``prefix_workspace=True``,
    ``max_prefix_len`` given) against the float64 reference; the detail gives the in-register path's error
    on the same inputs and the two outputs' difference."""
    (ws, reg), ref, label = _prefill_run(
        fmt, q_lens, prefixes, hq, hk, d, page, dtype=dtype, window=window, sinks=sinks, q_fp8=q_fp8, device=device,
        seed=seed, layout=layout, variants=[dict(launch, prefix_workspace=True, max_prefix_len=max(prefixes)),
                                            dict(launch, prefix_workspace=False)])
    detail = f"(in registers {rel_err(reg, ref):.2e}, workspace vs registers {rel_err(ws, reg):.2e})"
    return Case("prefill", f"{label} prefix workspace", rel_err(ws, ref), TOL[dtype], detail)


SPLIT_TOL = 4e-3  # two bf16 outputs of the same attention that differ in rounding: a few units in the last place


def check_prefill_wgmma() -> list[Case]:
    """The Hopper prefill kernel (``wgmma=True``) against the float64 reference: prefixes of whole and partial
    tiles, prompts only, pages of 16 / 32 / 64, HND and NHD, head dims 128 and 64, bf16 and float16, GQA groups of
    4, 8 and 1; and over quantized prefixes (fp8_e4m3, fp8_e5m2, nvfp4, calibrated per-head scales; one case with
    zero and negative V scales) dequantized into a workspace of q's dtype first (an sm_90 GPU)."""
    out = []
    extends = (([256, 1, 77, 300], [0, 500, 1000, 31]), ([200, 1, 64, 129], [1000, 64, 0, 127]))
    for fmt, dtype, hq, hk, d, page, layout in (("bf16", torch.bfloat16, 32, 8, 128, 16, "HND"),
                                               ("bf16", torch.bfloat16, 32, 8, 128, 64, "NHD"),
                                               ("fp16", torch.float16, 64, 8, 64, 64, "HND"),
                                               ("bf16", torch.bfloat16, 8, 8, 128, 32, "NHD")):
        for q_lens, prefixes in extends + (([256, 1, 77], [0, 0, 0]),):
            out.append(check_prefill(fmt, q_lens, prefixes, hq, hk, d, page, dtype=dtype, layout=layout,
                                     seed=len(q_lens), wgmma=True))
    for fmt, dtype, hq, hk, d, page, layout in (("fp8_e4m3", torch.bfloat16, 32, 8, 128, 16, "HND"),
                                               ("fp8_e5m2", torch.bfloat16, 32, 8, 128, 32, "NHD"),
                                               ("nvfp4", torch.bfloat16, 32, 8, 128, 16, "HND"),
                                               ("nvfp4", torch.float16, 64, 8, 64, 64, "HND")):
        for q_lens, prefixes in extends:
            out.append(check_prefill(fmt, q_lens, prefixes, hq, hk, d, page, dtype=dtype, layout=layout,
                                     seed=len(q_lens), wgmma=True, max_prefix_len=max(prefixes)))
    out.append(check_prefill("fp8_e4m3", *extends[0], 32, 8, 128, 16, layout="HND", seed=5, wgmma=True,
                             max_prefix_len=1000, v_scale_factors=[0.0, -1.0, 1.0, 2.0, 0.0, -0.5, 1.0, 1.0]))
    return out


def check_prefill_q_split(q_lens, prefixes, hq, hk, d, page, *, window=None, sinks=False, device="cuda", seed=0,
                          **launch) -> Case:
    """A bf16 q over an e4m3 prefix: the default path (q split exactly into two e4m3 terms, fp8 dots on the
    stored K) against converting each K tile (``fp8_qk=False``), on the same inputs.  The two should agree
    to rounding; the error against the float64 reference alone could not tell a lost low term (about 2e-2
    here) from the tolerance."""
    (split, conv), ref, label = _prefill_run(
        "fp8_e4m3", q_lens, prefixes, hq, hk, d, page, dtype=torch.bfloat16, window=window, sinks=sinks, q_fp8=False,
        device=device, seed=seed, variants=[dict(launch), dict(launch, fp8_qk=False)])
    detail = f"(vs reference: split {rel_err(split, ref):.2e}, converted {rel_err(conv, ref):.2e})"
    return Case("prefill", f"{label} q split vs converted K", rel_err(split, conv), SPLIT_TOL, detail)


# -------------------------------------------------------------------------------------- GPU run
def run_cases(cases, out=None, progress=None) -> list[Case]:
    """Run ``(label, thunk)`` cases in order, printing each case's line as soon as it has run (a crash is a
    failed case, reported with the others) → the cases."""
    from kvbench.tools.streaming import Step, run_steps

    def step(label, thunk):
        def run():
            case = thunk()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return case
        return Step(label, run)

    def crashed(st, e):
        return Case("error", f"{st.label}: {e!r}"[:120], float("inf"), 0.0)

    return run_steps([step(*c) for c in cases], fmt=Case.line, header=CASE_HEADER, out=out, progress=progress,
                     on_error=crashed)


def markdown(results: list[Case], summary: str) -> str:
    rows = ["| result | kernel | case | error | tol |", "|---|---|---|---|---|"]
    rows += [f"| {'PASS' if c.ok else 'FAIL'} | {c.kernel} | {c.label} | {c.err:.2e} {c.detail} | {c.tol:.0e} |" for c in results]
    return summary + "\n\n" + "\n".join(rows) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    from kvbench.core import atomic_write_text
    from kvbench.tools.kernel_check_grid import gpu_cases

    ap = argparse.ArgumentParser(prog="python -m kvbench.tools.kernel_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer append sizes")
    ap.add_argument("--out", help="also write the results as a Markdown table to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU check needs one (the CPU tests run the same checks at small shapes)")
        return 2
    t0 = time.time()
    results = run_cases(list(gpu_cases(sys.modules[__name__], args.quick)))
    failed = [c for c in results if not c.ok]
    summary = f"{len(results) - len(failed)}/{len(results)} passed on {torch.cuda.get_device_name()} in {time.time() - t0:.0f} s"
    print(summary, flush=True)
    if args.out:
        atomic_write_text(args.out, markdown(results, summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

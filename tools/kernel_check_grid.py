"""The GPU run of ``kernel_check``: every kernel × format × feature at real shapes (head_dim 64/128, H_q/H_kv
32/8 and 64/8, pages of 16 and 64, contexts up to 32k, batch up to 256, ragged lengths), as labelled cases
``(label, thunk)``; the label names the case on the progress line before it runs."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from kvbench.tools.common import kernel_formats

__all__ = ["SHAPES", "gpu_cases"]

SHAPES = [(32, 8, 128, 16), (64, 8, 64, 64)]  # (H_q, H_kv, head_dim, page)
PREFILL_BATCHES = (([512, 300, 1024, 1, 77], [0, 1000, 3000, 5, 31]), ([200, 1, 640], [4000, 64, 0]),
                   ([128, 2048], [32768 - 128, 0]))


def _shape(a) -> str:
    hq, hk, d, page = a
    return f"{hq}/{hk} D={d} page={page}"


def _feat(window=None, sinks=False, q8=False, layout="NHD") -> str:
    return "".join((f" win={window}" if window else "", " sinks" if sinks else "", " q8" if q8 else "",
                    f" {layout}" if layout != "NHD" else ""))


def gpu_cases(checks, quick: bool = False) -> Iterator[tuple[str, Callable]]:
    """Every case of the GPU run, in order, as ``(label, thunk)``; seeds are drawn here, so a case is the
    same whichever cases ran before it."""
    # the check functions come from the caller (kvbench.tools.kernel_check), which runs these cases
    gen = torch.Generator().manual_seed(1234)

    def seed() -> int:
        return int(torch.randint(1 << 30, (1,), generator=gen))

    fmts = kernel_formats()
    for fmt in fmts:
        yield from _append_cases(checks, fmt, seed, quick)
    for fmt in fmts:
        yield from _attention_cases(checks, fmt, gen, seed)
    # the head-major page layout (HND): every kernel and feature once more on the first shape
    for fmt in fmts:
        yield from _hnd_cases(checks, fmt, gen, seed)
    # the extend over its prefix dequantized once into a float16 workspace (the GPU default for nvfp4 from
    # ``prefill.WORKSPACE_MIN_Q`` new tokens, and for fp8 prefixes whose scores cannot run on the stored K):
    # every quantized format and feature, both layouts, every prefill batch
    for fmt in [f for f in fmts if f not in ("bf16", "fp16")]:
        yield from _workspace_cases(checks, fmt, seed)


def _append_cases(checks, fmt: str, seed, quick: bool) -> Iterator[tuple[str, Callable]]:
    check_append = checks.check_append
    for a in SHAPES:
        d = a[2]
        for style, rot in (("neox", d), ("interleaved", d), ("neox", d // 2)):
            for t in ((1, 512) if not quick else (37,)):
                for fused in (True, False):
                    yield (f"append {fmt} T={t} {_shape(a)} {style} rot={rot} {'fused' if fused else 'unfused'}",
                           lambda f=fmt, t=t, a=a, s=style, r=rot, fu=fused, sd=seed(): check_append(
                               f, t, *a, rot=r, style=s, fused=fu, q_fp8=(t == 512), seed=sd))


def _attention_cases(checks, fmt: str, gen, seed) -> Iterator[tuple[str, Callable]]:
    """Decode and prefill of one format at both shapes, with the prefill's alternative paths."""
    check_decode, check_prefill = checks.check_decode, checks.check_prefill
    ragged = [int(x) for x in torch.randint(1, 4097, (64,), generator=gen)]
    many = [int(x) for x in torch.randint(1, 1025, (256,), generator=gen)]
    for lens, a in ((ragged, SHAPES[0]), (many, SHAPES[1]), ([32768, 17, 20000, 1], SHAPES[0])):
        for window, sinks, q8 in ((None, False, False), (1000, True, False), (None, False, True)):
            yield (f"decode {fmt} B={len(lens)} L<={max(lens)} {_shape(a)}{_feat(window, sinks, q8)}",
                   lambda f=fmt, l=lens, a=a, w=window, s=sinks, q=q8, sd=seed(): check_decode(
                       f, l, *a, window=w, sinks=s, q_fp8=q, seed=sd))
    for (ql, pre), a in zip(PREFILL_BATCHES, (SHAPES[0], SHAPES[1], SHAPES[0])):
        for window, sinks, q8 in ((None, False, False), (700, True, False), (None, False, True), (700, True, True)):
            yield (f"prefill {fmt} B={len(ql)} new={sum(ql)} L<={max(map(sum, zip(ql, pre)))} {_shape(a)}"
                   f"{_feat(window, sinks, q8)}",
                   lambda f=fmt, ql=ql, pre=pre, a=a, w=window, s=sinks, q=q8, sd=seed(): check_prefill(
                       f, ql, pre, *a, window=w, sinks=s, q_fp8=q, seed=sd))
    # a bf16 q over an e4m3 prefix runs the prefix's scores as two fp8 dots of an exact split of q by
    # default: against the converted-K path it replaces (which keeps its own coverage here)
    if fmt == "fp8_e4m3":
        yield from _q_split_cases(checks, seed)
    # the GPU reads q and the new tokens through tensor descriptors by default (TMA; not for nvfp4): the
    # pointer loads it replaces, on the same features
    if fmt != "nvfp4":
        ql, pre = PREFILL_BATCHES[0]
        for window, sinks, q8 in ((None, False, False), (700, True, True)):
            yield (f"prefill {fmt} no-tma{_feat(window, sinks, q8)}",
                   lambda f=fmt, w=window, s=sinks, q=q8, sd=seed(): check_prefill(
                       f, ql, pre, *SHAPES[0], window=w, sinks=s, q_fp8=q, tma=False, seed=sd))


def _q_split_cases(checks, seed) -> Iterator[tuple[str, Callable]]:
    check_prefill, check_prefill_q_split = checks.check_prefill, checks.check_prefill_q_split
    for (ql, pre), a in zip(PREFILL_BATCHES, (SHAPES[0], SHAPES[1], SHAPES[0])):
        for window, sinks in ((None, False), (700, True)):
            yield (f"prefill q split vs converted K B={len(ql)} {_shape(a)}{_feat(window, sinks)}",
                   lambda ql=ql, pre=pre, a=a, w=window, s=sinks, sd=seed(): check_prefill_q_split(
                       ql, pre, *a, window=w, sinks=s, seed=sd))
    ql, pre = PREFILL_BATCHES[0]
    yield ("prefill fp8_e4m3 converted K win=700 sinks",
           lambda sd=seed(): check_prefill("fp8_e4m3", ql, pre, *SHAPES[0], window=700, sinks=True,
                                           fp8_qk=False, seed=sd))


def _hnd_cases(checks, fmt: str, gen, seed) -> Iterator[tuple[str, Callable]]:
    check_append, check_decode, check_prefill = checks.check_append, checks.check_decode, checks.check_prefill
    a = SHAPES[0]
    for t, fused in ((512, True), (512, False), (1, True)):
        yield (f"append {fmt} T={t} {'fused' if fused else 'unfused'} HND",
               lambda f=fmt, t=t, fu=fused, sd=seed(): check_append(
                   f, t, *a, fused=fu, q_fp8=(t == 512), layout="HND", seed=sd))
    ragged = [int(x) for x in torch.randint(1, 4097, (64,), generator=gen)]
    for lens, w, s, q8 in ((ragged, None, False, False), ([32768, 17, 20000, 1], 1000, True, False),
                           (ragged, None, False, True)):
        yield (f"decode {fmt} B={len(lens)} L<={max(lens)}{_feat(w, s, q8, 'HND')}",
               lambda f=fmt, l=lens, w=w, s=s, q=q8, sd=seed(): check_decode(
                   f, l, *a, window=w, sinks=s, q_fp8=q, layout="HND", seed=sd))
    ql, pre = PREFILL_BATCHES[0]
    for w, s, q8 in ((None, False, False), (700, True, True)):
        yield (f"prefill {fmt}{_feat(w, s, q8, 'HND')}",
               lambda f=fmt, w=w, s=s, q=q8, sd=seed(): check_prefill(
                   f, ql, pre, *a, window=w, sinks=s, q_fp8=q, layout="HND", seed=sd))


def _workspace_cases(checks, fmt: str, seed) -> Iterator[tuple[str, Callable]]:
    check_prefill_workspace = checks.check_prefill_workspace
    for (ql, pre), a in zip(PREFILL_BATCHES, (SHAPES[0], SHAPES[1], SHAPES[0])):
        for window, sinks, q8, layout in ((None, False, False, "NHD"), (700, True, False, "HND"),
                                          (None, False, True, "HND")):
            yield (f"prefill {fmt} prefix workspace B={len(ql)} L<={max(map(sum, zip(ql, pre)))} {_shape(a)}"
                   f"{_feat(window, sinks, q8, layout)}",
                   lambda f=fmt, ql=ql, pre=pre, a=a, w=window, s=sinks, q=q8, lay=layout, sd=seed():
                   check_prefill_workspace(f, ql, pre, *a, window=w, sinks=s, q_fp8=q, layout=lay, seed=sd))

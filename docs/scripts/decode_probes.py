"""GPU probes behind issue 44's decode targets (docs/kernels.md, "Speed targets of issue 44 (H200)").

Subcommands (graph replays of ``paged_decode``; 32/8 heads, D 128, pages of 16, HND, as ``kvbench bench kernels``):

- ``nv4-unpack [--shapes 64x8192,8x32768]``: the explicit-layout nvfp4 decode with each unpacking
  (``decode_nv4.UNPACK``: 0 the e4m3 conversions, 1 byte permutes, 9 none: a timing floor whose output is not
  attention) × tiles copied ahead into shared memory (``decode_nv4.STAGES``) × register caps, against bf16.
- ``splits [--shapes 8x32768] [--formats bf16,fp8_e4m3,nvfp4]``: the decode at split counts around the default's.
- ``ncu [--unpack 1] [--stages 2] [--shape 64x8192]``: five eager launches, for Nsight Compute.
- ``check [--unpack 0,1] [--stages 0,2]``: the explicit-layout nvfp4 decode with each unpacking and pipeline depth
  (``decode_nv4.STAGES``) against the float64 reference
  (speed_probes.py ``nv4-check``'s 15 cases, one seed).  Exit 1 if any case fails.
"""

from __future__ import annotations

import argparse
import sys

HQ, HK, D, PAGE, LAYOUT = 32, 8, 128, 16, "HND"
# ``nv4-unpack --short``: the kernel before 2026-11-29, the defaults (also under register caps), the floor, halves off
SHORT = {(0, 0, False), (1, 2, True), (9, 2, True), (1, 2, True, 3, False), (1, 2, True, 3, True), (1, 2, True, 4, True)}


def _cases(fmts, b, ctx):
    import torch

    from kvbench.tools.decode_bench import decode_case

    for fmt in fmts:
        torch.cuda.empty_cache()
        yield fmt, decode_case(fmt, b, ctx, HQ, HK, D, PAGE, torch.Generator().manual_seed(0), LAYOUT)


def _time(fmt, case, **kw) -> float:
    import torch

    from kvbench.kernels.config import DecodeOptions, PagedKV
    from kvbench.kernels.decode import paged_decode
    from kvbench.tools.common import bench_us

    q, table, seq, kv, _ = case
    out = torch.empty_like(q)
    pkv, opts = PagedKV(fmt, **kv), DecodeOptions(**kw)
    return bench_us(lambda: paged_decode(q, pkv, table, seq, out=out, opts=opts), graph=True)


DEFAULTS = (1, 2, True, 4, True)  # the module's defaults (``decode_nv4.UNPACK`` ...)


def _settings(unpack=1, stages=2, vswz=True, cpl=3, halves=True) -> str:
    """Sets the module settings (``cpl`` 3 unless given: what ``nv4-unpack``'s rows were measured with)."""
    from kvbench.kernels import decode_nv4

    decode_nv4.UNPACK, decode_nv4.STAGES, decode_nv4.VSWZ, decode_nv4.CPL = unpack, stages, vswz, cpl
    decode_nv4.HALVES = halves
    return f"unpack={unpack} stages={stages} vswz={int(vswz)} cpl={cpl} halves={int(halves)}"


def parse_sets(text: str) -> list:
    """``--sets``: settings separated by ';', each 'unpack,stages,vswz,cpl,halves' (a prefix: the rest from
    ``DEFAULTS``)."""
    out = []
    for item in filter(None, text.split(";")):
        full = [int(x) for x in item.split(",")] + list(DEFAULTS[len(item.split(",")):])
        out.append((full[0], full[1], bool(full[2]), full[3], bool(full[4])))
    return out


def _nvfp4_cases(shapes):
    """Per shape: bf16 timed and printed first, then ``(b, ctx, case, pct, base)`` for the nvfp4 case (``pct``: µs →
    % of copy bandwidth, ``base``: bf16's µs); the module settings are reset to ``DEFAULTS`` after each."""
    from kvbench.tools.common import copy_bandwidth

    copy = copy_bandwidth()
    print(f"copy {copy:.0f} GB/s", flush=True)
    for shape in shapes:
        b, ctx = map(int, shape.split("x"))
        base = None
        for fmt, case in _cases(("bf16", "nvfp4"), b, ctx):
            pct = lambda us, case=case: 100 * case[4] / (us * 1e-6) / 1e9 / copy  # noqa: E731
            if fmt == "bf16":
                base = _time(fmt, case)
                print(f"B={b} L={ctx} bf16: {base:.1f} us ({pct(base):.0f}% of copy)", flush=True)
                continue
            yield b, ctx, case, pct, base
            _settings(*DEFAULTS)


def nv4_sets(shapes, sets, rounds: int = 2) -> None:
    """Times each of ``sets`` (``parse_sets``) interleaved over ``rounds`` rounds at each shape, with bf16 first."""
    for b, ctx, case, pct, base in _nvfp4_cases(shapes):
        for r in range(rounds):
            for one in sets:
                label = _settings(*one)
                us = _time("nvfp4", case)
                print(f"B={b} L={ctx} nvfp4 round {r} {label}: {us:.1f} us ({pct(us):.0f}% of copy, "
                      f"{base / us:.2f}x bf16)", flush=True)


def nv4_unpack(shapes, short: bool = False) -> None:
    variants = [((0, 0, False), {}), ((1, 0, False), {}), ((9, 0, False), {})]
    variants += [((u, st, sw), {}) for u in (0, 1) for st in (2, 4) for sw in (False, True)]
    variants += [((1, 2, True), {"gluon": True, "maxnreg": r}) for r in (0, 112)] + [((9, 2, True), {})]
    variants += [((1, 2, True, c), {}) for c in (0, 1, 2)]
    variants += [((1, 2, True, 3, h), {"gluon": True, "maxnreg": r}) for h in (False, True) for r in (128, 104, 96)]
    variants += [(DEFAULTS, {})]
    variants = [v for v in variants if not short or v[0] in SHORT]
    for b, ctx, case, pct, base in _nvfp4_cases(shapes):
        extra = [((1, 2, True), {"num_splits": n}) for n in (8, 12, 16)] if b <= 16 else []
        for sets, kw in variants + extra:
            label = _settings(*sets)
            us = _time("nvfp4", case, **kw)
            print(f"B={b} L={ctx} nvfp4 {label} {kw or 'defaults'}: {us:.1f} us ({pct(us):.0f}% of copy, "
                  f"{base / us:.2f}x bf16)", flush=True)


def splits(shapes, fmts) -> None:
    from kvbench.tools.common import copy_bandwidth

    copy = copy_bandwidth()
    for shape in shapes:
        b, ctx = map(int, shape.split("x"))
        for fmt, case in _cases(fmts, b, ctx):
            pct = lambda us: 100 * case[4] / (us * 1e-6) / 1e9 / copy  # noqa: E731
            us = _time(fmt, case)
            print(f"B={b} L={ctx} {fmt} defaults: {us:.1f} us ({pct(us):.0f}% of copy)", flush=True)
            for unpack in ((0, 1) if fmt == "nvfp4" else (0,)):
                _settings(unpack, 2 if unpack else 0, bool(unpack))
                for s in (3, 4, 5, 6, 8, 12, 16, 17, 24, 33, 48, 64):
                    us = _time(fmt, case, num_splits=s)
                    print(f"B={b} L={ctx} {fmt} unpack={unpack} splits={s}: {us:.1f} us ({pct(us):.0f}% of copy)",
                          flush=True)
            _settings(*DEFAULTS)


def check(unpacks, stages=(0,), vswz=(False,), sets=None) -> int:
    import torch

    from kvbench.tools.kernel_check import check_decode

    from speed_probes import nv4_cases  # this folder

    cases = nv4_cases(torch)
    ok = n = 0
    for one in (sets or [(u, st, sw) for u in unpacks for st in stages for sw in vswz]):
        label = _settings(*one)
        for lens, hq, hk, page, kw in cases:
            c = check_decode("nvfp4", lens, hq, hk, D, page, seed=0, gluon=True, **kw)
            n += 1
            ok += bool(c.ok)
            print(f"{'ok  ' if c.ok else 'FAIL'} {label} {c.label} {kw}: rel err {c.err:.2e} (tol {c.tol})",
                  flush=True)
    _settings(*DEFAULTS)
    print(f"{ok}/{n} passed", flush=True)
    return 0 if ok == n else 1


def ncu(unpack: int, stages: int, vswz: bool, shape: str = "64x8192") -> None:
    """Five eager launches of the nvfp4 decode at ``shape`` with the given unpacking and pipeline depth, for
    ``ncu --clock-control none --kernel-name regex:_decode_nv4 --launch-skip 3 --launch-count 1 ...``."""
    import torch

    _settings(unpack, stages, vswz)
    b, ctx = map(int, shape.split("x"))
    for fmt, case in _cases(("nvfp4",), b, ctx):
        for _ in range(5):
            _run_once(fmt, case)
    torch.cuda.synchronize()


def _run_once(fmt, case) -> None:
    import torch

    from kvbench.kernels.config import PagedKV
    from kvbench.kernels.decode import paged_decode

    q, table, seq, kv, _ = case
    paged_decode(q, PagedKV(fmt, **kv), table, seq, out=torch.empty_like(q))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("nv4-unpack")
    s.add_argument("--shapes", default="64x8192,8x32768")
    s.add_argument("--short", action="store_true")
    s = sub.add_parser("splits")
    s.add_argument("--shapes", default="8x32768")
    s.add_argument("--formats", default="bf16,fp8_e4m3,nvfp4")
    s = sub.add_parser("ncu")
    s.add_argument("--unpack", type=int, default=1)
    s.add_argument("--stages", type=int, default=2)
    s.add_argument("--vswz", type=int, default=0)
    s.add_argument("--shape", default="64x8192")
    s = sub.add_parser("check")
    s.add_argument("--unpack", default="0,1")
    s.add_argument("--stages", default="0,2")
    s.add_argument("--vswz", default="0")
    s.add_argument("--sets", default="", help="settings to check instead (see parse_sets)")
    s = sub.add_parser("nv4-sets")
    s.add_argument("--shapes", default="64x8192,8x32768")
    s.add_argument("--sets", required=True, help="see parse_sets")
    s.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    if a.cmd == "nv4-unpack":
        nv4_unpack(a.shapes.split(","), a.short)
    elif a.cmd == "ncu":
        ncu(a.unpack, a.stages, bool(a.vswz), a.shape)
    elif a.cmd == "splits":
        splits(a.shapes.split(","), a.formats.split(","))
    elif a.cmd == "nv4-sets":
        nv4_sets(a.shapes.split(","), parse_sets(a.sets), a.rounds)
    else:
        return check([int(u) for u in a.unpack.split(",")], [int(x) for x in a.stages.split(",")],
                     [x == "1" for x in a.vswz.split(",")], parse_sets(a.sets) or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

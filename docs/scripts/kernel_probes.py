"""GPU timing probes of the Triton paged-attention kernels at chosen launch settings (docs/kernels.md).

Every subcommand calls public functions only — ``kernels.decode.paged_decode`` and ``kernels.prefill.paged_prefill``
with their launch options (``kernels.config.DecodeOptions`` / ``PrefillOptions``), the appends through ``tools.append_bench.append_rows`` — on the inputs the
benchmarks build (``tools.decode_bench.decode_case``, ``tools.prefill_bench.PrefillBench``: random caches
over pages in random order, 32 / 8 heads, head dim 128, page 16 unless a case says otherwise), timed as the
benchmark times them (``tools.common.bench_us``: median of ``triton.testing.do_bench``), and
prints Markdown tables:

* ``decode``: ``paged_decode`` at launch settings given as keyword sets (``--configs`` or ``--preset``), per
  format and batch size (µs, and µs per sequence);
* ``hnd-emulated``: head-major pages emulated without the kernels' layout support (each (sequence, kv head)
  as a sequence of its own over a ``[P·H_kv, page, 1, D]`` view of HND memory) against the product kernel
  on NHD and on HND pages, with the emulation's relative difference from the product output;
* ``layouts``: the product kernels at their launch defaults on NHD and HND pages: decode, extend, fused append;
* ``prefill``: ``paged_prefill`` at keyword sets per (batch, prefix, new) shape (``--preset`` or the options).

    python docs/scripts/kernel_probes.py decode --preset caps-1424
    python docs/scripts/kernel_probes.py decode --formats fp8_e4m3 --batches 60,64,66,128 --layout NHD
    python docs/scripts/kernel_probes.py hnd-emulated
    python docs/scripts/kernel_probes.py layouts --rounds 2
    python docs/scripts/kernel_probes.py prefill --preset tiles-1717

Keyword sets: ``defaults`` (or empty) for the launch defaults, else ``key=value`` pairs joined by commas
(``none``, ``true`` / ``false`` and integers are understood); several sets are joined by ``;``.  Prefill
sets also take ``fp8_q=true`` (e4m3 queries with a scale).  These are reconstructions, from docs/kernels.md's
descriptions, of throw-away drivers that produced some of its figures; those figures come from the kernels
of their date, so a run at a later commit measures the kernels as they are now.
"""

from __future__ import annotations

import argparse
import sys

DECODE_KEYS = ("block_n", "num_splits", "num_warps", "num_stages", "maxnreg", "prefetch", "units16", "split_reduce")
PREFILL_KEYS = ("block_m", "block_n", "block_n_prefix", "num_warps", "num_stages", "tma", "fp8_qk", "prefix_full",
                "heavy_first", "fp8_q")
LAYOUT_DECODE_FORMATS = ("bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4")
LAYOUT_EXTEND_FORMATS = ("bf16", "fp8_e4m3", "nvfp4")
APPEND_TOKENS = (1, 16, 128, 512)

_T = "block_n={},num_warps={},num_stages={},maxnreg={}"  # maxnreg=0: no register cap
DECODE_PRESETS = {
    # 16:34 UTC: more splits at the fp8 defaults
    "splits-1634": dict(layout="NHD", formats={"fp8_e4m3": ["defaults", "num_splits=2", "num_splits=4"]}),
    # 16:34 UTC: every combination of 1-2 warps, tiles 32-128, caps 128 / 168 / none, 2-3 stages, 2-8 splits
    "grid-1634": dict(layout="NHD", formats={"fp8_e4m3": ["defaults"] + [
        _T.format(bn, nw, st, cap) + f",num_splits={ns}" for nw in (1, 2) for bn in (32, 64, 128)
        for cap in (128, 168, 0) for st in (2, 3) for ns in (2, 4, 8)]}),
    # 14:24-14:26 UTC: the register cap (before: the defaults of that date, written out)
    "caps-1424": dict(layout="NHD", formats={
        "fp8_e4m3": [_T.format(256, 8, 2, 0), _T.format(128, 4, 2, 128), _T.format(128, 4, 3, 128),
                     _T.format(128, 4, 3, 0), _T.format(128, 4, 3, 112), _T.format(128, 4, 3, 144),
                     _T.format(128, 4, 3, 96), _T.format(64, 4, 3, 128), _T.format(256, 4, 3, 168)],
        "nvfp4": [_T.format(64, 4, 2, 0) + ",num_splits=2", _T.format(128, 4, 2, 128) + ",num_splits=1",
                  _T.format(128, 4, 2, 128) + ",num_splits=2", _T.format(128, 4, 2, 112) + ",num_splits=1",
                  _T.format(128, 4, 2, 144) + ",num_splits=1", _T.format(128, 4, 3, 128) + ",num_splits=1"],
        "bf16": ["defaults", "maxnreg=96", "maxnreg=128", "maxnreg=72"]}),
}

# prefill shapes: (batch, cached prefix, new tokens, H_q, H_kv, head dim, page)
EXTEND = (4, 7168, 1024, 32, 8, 128, 16)
PROMPT_8K = (1, 0, 8192, 32, 8, 128, 16)
PROMPTS_512 = (16, 0, 512, 32, 8, 128, 16)
_X64 = "block_m=128,block_n=64,block_n_prefix=128,num_warps=8,num_stages=3"
_X128 = "block_m=128,block_n=128,block_n_prefix=128,num_warps=8,num_stages=3"
_P64 = "block_m=128,block_n=64,num_warps=8,num_stages=3"
PREFILL_PRESETS = {
    # 17:17 UTC: the extend tile through tensor descriptors, new default against the previous one
    "tiles-1717": dict(layout="HND", cases=[(EXTEND, f, c) for f in ("bf16", "fp8_e4m3") for c in (_X128, _X64)]),
    # 12:41-12:55 UTC: pointer loads against tensor descriptors (bf16-query fp8 extends converted K then)
    "tma-1241": dict(layout="NHD", cases=[
        (PROMPT_8K, "bf16", _P64 + ",tma=false"), (PROMPT_8K, "bf16", _P64 + ",tma=true"),
        (PROMPT_8K, "bf16", "block_m=128,block_n=128,num_warps=8,num_stages=3,tma=true"),
        (PROMPTS_512, "bf16", _P64 + ",tma=false"), (PROMPTS_512, "bf16", _P64 + ",tma=true"),
        (PROMPTS_512, "bf16", "block_m=64,block_n=64,num_warps=4,num_stages=3,tma=true")] + [
        (EXTEND, f, f"{_X64},tma={t}{extra}") for f, extra in (("bf16", ""), ("fp8_e4m3", ",fp8_qk=false"),
                                                              ("fp8_e4m3", ",fp8_q=true")) for t in ("false", "true")]),
    # 11:58-12:05 UTC: page size alone, bf16 extend at the tile of that date, pointer loads
    "pages-1158": dict(layout="NHD", cases=[((4, 7168, 1024, 32, 8, 128, p), "bf16", _X64 + ",tma=false")
                                            for p in (16, 64, 128)]),
}


def parse_value(v: str):
    s = v.strip().lower()
    if s in ("none", "true", "false"):
        return {"none": None, "true": True, "false": False}[s]
    return int(s)


def parse_config(text: str, keys=None) -> dict:
    """``"defaults"`` / ``""`` → ``{}``; ``"block_n=128,maxnreg=0"`` → ``{"block_n": 128, "maxnreg": 0}``; a key
    outside ``keys`` (when given) is a ValueError."""
    text = text.strip()
    if text in ("", "defaults"):
        return {}
    out = {}
    for part in text.split(","):
        k, sep, v = part.partition("=")
        k = k.strip()
        if not sep or not k:
            raise ValueError(f"expected key=value, got {part!r}")
        if keys is not None and k not in keys:
            raise ValueError(f"unknown launch option {k!r}: choose from {', '.join(keys)}")
        out[k] = parse_value(v)
    return out


def parse_configs(text: str, keys=None) -> list[dict]:
    return [parse_config(t, keys) for t in text.split(";")]


def label(cfg: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in cfg.items()) or "defaults"


def extend_flops(batch: int, prefix: int, new: int, hq: int, d: int) -> float:
    """FLOPs of a causal extend (QKᵀ and PV over the prefix and the causal half of the new tokens), as the
    benchmark counts them."""
    return batch * (4 * hq * d * new * prefix + 4 * hq * d * new * new / 2)


def emulated_hnd_args(q, k, v, kbs, vbs, table, seq_lens):
    """Decode inputs that read HND pages through a kernel that knows only one head per token: ``k`` / ``v``
    (and block scales) are HND planes (``[P+1, H_kv, page, X]`` memory seen as ``[P+1, page, H_kv, X]``);
    each (sequence b, kv head h) becomes sequence ``b·H_kv + h`` over the ``[(P+1)·H_kv, page, 1, X]`` view,
    page ``p`` of it at ``p·H_kv + h``, its GQA group of queries as its heads → (q, k, v, kbs, vbs, table, lens)."""
    import torch

    b, hq, d = q.shape
    hk = k.shape[2]

    def view(t):
        if t is None:
            return None
        mem = t.permute(0, 2, 1, 3)
        if not mem.is_contiguous():
            raise ValueError("emulated_hnd_args needs HND planes")
        return mem.reshape(mem.shape[0] * hk, mem.shape[2], 1, mem.shape[3])

    heads = torch.arange(hk, device=table.device, dtype=torch.int64)
    tab = (table.long()[:, None, :] * hk + heads[None, :, None]).reshape(b * hk, -1).to(torch.int32)
    return (q.reshape(b * hk, hq // hk, d), view(k), view(v), view(kbs), view(vbs), tab,
            seq_lens.repeat_interleave(hk))


def _torch():
    import torch

    if not torch.cuda.is_available():
        sys.exit("these probes time GPU kernels: no CUDA device")
    return torch


def _us(fn) -> float:
    from kvbench.tools.common import bench_us

    return bench_us(fn)


def _try(fn):
    try:
        return fn()
    except Exception as e:  # out of resources / an unsupported combination: shown in the table
        return f"{type(e).__name__}: {' '.join(str(e).split())[:60]}"


def _cell(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def _rounds(fn, n: int) -> list:
    return [_try(fn) for _ in range(n)]


def _cells(ts) -> str:
    return " / ".join(map(_cell, ts))


def _extend(paged_prefill, x: dict, fmt: str, new: int, pre: int, fp8_q: bool, kw: dict):
    """A call of ``paged_prefill`` over ``PrefillBench.extend_inputs`` (bf16 queries, or e4m3 ones with their
    scale) into one preallocated output, as the benchmark calls it."""
    from kvbench.kernels.config import AttentionParams, PagedKV, PrefillOptions

    qq, qs = (x["q8"], x["qsc"]) if fp8_q else (x["qx"], None)
    out = x["qx"].clone()
    kv = PagedKV(fmt, x["kc"], x["vc"], x["ks"], x["vs"], x["kbs"], x["vbs"])
    attn, opts = AttentionParams(q_scale=qs), PrefillOptions(max_prefix_len=pre, **kw)
    return lambda: paged_prefill(qq, x["knx"], x["vnx"], x["cux"], new, kv, x["table"], x["lx"], attn=attn, out=out,
                                 opts=opts)


def cmd_decode(a) -> None:
    torch = _torch()
    from kvbench.kernels.config import DecodeOptions, PagedKV
    from kvbench.kernels.decode import paged_decode
    from kvbench.tools.decode_bench import decode_case

    preset = DECODE_PRESETS.get(a.preset, {})
    layout = a.layout or preset.get("layout", "HND")
    plan = preset.get("formats") or {f: a.configs.split(";") for f in a.formats.split(",")}
    print(f"| format | layout | batch × context | launch options | µs ({a.rounds} round(s)) | µs per sequence |")
    print("|---|---|---|---|---|---|")
    for fmt, cfgs in plan.items():
        for batch in a.batches:
            gen = torch.Generator().manual_seed(0)
            q, table, seq, kv, _ = decode_case(fmt, batch, a.ctx, 32, 8, 128, 16, gen, layout)
            out = torch.empty_like(q)
            pkv = PagedKV(fmt, **kv)
            for cfg in (parse_config(c, DECODE_KEYS) for c in cfgs):
                opts = DecodeOptions(**cfg)
                ts = _rounds(lambda: _us(lambda: paged_decode(q, pkv, table, seq, out=out, opts=opts)), a.rounds)
                per = f"{ts[0] / batch:.2f}" if isinstance(ts[0], float) else ""
                print(f"| {fmt} | {layout} | {batch} × {a.ctx} | {label(cfg)} | {_cells(ts)} | {per} |", flush=True)
            del q, table, seq, kv, pkv, out
            torch.cuda.empty_cache()


def cmd_hnd_emulated(a) -> None:
    torch = _torch()
    from kvbench.kernels.config import PagedKV
    from kvbench.kernels.decode import paged_decode
    from kvbench.kernels.formats import get_format
    from kvbench.tools.kernel_check import as_layout, calibrated_scale, randn_outliers, random_page_table

    b, ctx, hk, d, page = a.batches[0], a.ctx, 8, 128, 16
    print(f"batch {b} × {ctx}, 32/8 heads, D 128, page 16, launch defaults; one scale for all heads\n")
    print("| format | NHD pages µs | HND emulated µs | HND pages µs | emulated vs product (rel.) |")
    print("|---|---|---|---|---|")
    for fmt in a.formats.split(","):
        gen = torch.Generator().manual_seed(0)
        npg = b * (ctx // page) + 2
        planes = {}
        for name in ("k", "v"):
            x = randn_outliers((npg + 1, page, hk, d), gen, "cuda", torch.float32)
            scale = calibrated_scale(fmt, x).max().expand(hk).contiguous()  # the emulation has one head's scale
            qz = get_format(fmt).quantize(x, scale)
            planes[name] = {lay: (as_layout(qz.data, lay), as_layout(qz.block_scale, lay)) for lay in ("NHD", "HND")}
            planes[name]["scale"] = scale
            del x
        table = random_page_table([ctx] * b, page, npg, gen, "cuda")
        seq = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(b, 32, d, device="cuda", dtype=torch.bfloat16)
        ks, vs = planes["k"]["scale"], planes["v"]["scale"]

        def product(lay):
            (kc, kbs), (vc, vbs) = planes["k"][lay], planes["v"][lay]
            kv = PagedKV(fmt, kc, vc, ks, vs, kbs, vbs)
            return lambda: paged_decode(q, kv, table, seq)

        (kc, kbs), (vc, vbs) = planes["k"]["HND"], planes["v"]["HND"]
        qe, ke, ve, kbe, vbe, te, le = emulated_hnd_args(q, kc, vc, kbs, vbs, table, seq)
        kve = PagedKV(fmt, ke, ve, ks[:1], vs[:1], kbe, vbe)

        def emul():
            return paged_decode(qe, kve, te, le)

        ref, got = product("NHD")().double(), emul().reshape(b, 32, d).double()
        diff = float((got - ref).norm() / ref.norm())
        cells = [_cells(_rounds(lambda f=f: _us(f), a.rounds)) for f in (product("NHD"), emul, product("HND"))]
        print(f"| {fmt} | " + " | ".join(cells) + f" | {diff:.1e} |", flush=True)
        del planes, table, q
        torch.cuda.empty_cache()


def cmd_layouts(a) -> None:
    torch = _torch()
    from kvbench.kernels.config import PagedKV
    from kvbench.kernels.decode import paged_decode
    from kvbench.kernels.prefill import paged_prefill
    from kvbench.tools.append_bench import append_rows
    from kvbench.tools.decode_bench import BenchResults, decode_case
    from kvbench.tools.prefill_bench import PrefillBench

    print(f"launch defaults; µs per round ({a.rounds})\n")
    print("| part | format | NHD µs | HND µs |")
    print("|---|---|---|---|")
    for fmt in LAYOUT_DECODE_FORMATS:
        cells = []
        for lay in ("NHD", "HND"):
            q, table, seq, kv, _ = decode_case(fmt, 64, 8192, 32, 8, 128, 16, torch.Generator().manual_seed(0), lay)
            out = torch.empty_like(q)
            pkv = PagedKV(fmt, **kv)
            cells.append(_cells(_rounds(lambda: _us(lambda: paged_decode(q, pkv, table, seq, out=out)), a.rounds)))
            del q, table, seq, kv, pkv, out
            torch.cuda.empty_cache()
        print(f"| decode 64 × 8192 | {fmt} | " + " | ".join(cells) + " |", flush=True)
    ext = {lay: PrefillBench(BenchResults(), flashinfer=False, layout=lay, formats=LAYOUT_EXTEND_FORMATS)
           for lay in ("NHD", "HND")}
    for fmt in LAYOUT_EXTEND_FORMATS:
        cells = []
        for lay, pb in ext.items():
            x = pb.extend_inputs(fmt)
            run = _extend(paged_prefill, x, fmt, pb.new, pb.pre, False, {})
            cells.append(_cells(_rounds(lambda: _us(run), a.rounds)))
        print(f"| extend 4 × (7168 + 1024) | {fmt} | " + " | ".join(cells) + " |", flush=True)
    del ext
    torch.cuda.empty_cache()
    for t in APPEND_TOKENS:
        fused = {}
        for lay in ("NHD", "HND"):
            for _ in range(a.rounds):
                res = BenchResults()
                list(append_rows(res, t, layout=lay, formats=LAYOUT_DECODE_FORMATS))
                for fmt in LAYOUT_DECODE_FORMATS:
                    fused.setdefault((fmt, lay), []).append(res.app[(t, fmt)][0])
        for fmt in LAYOUT_DECODE_FORMATS:
            cells = [" / ".join(f"{v:.2f}" for v in fused[(fmt, lay)]) for lay in ("NHD", "HND")]
            print(f"| fused append T={t} (graph) | {fmt} | " + " | ".join(cells) + " |", flush=True)


def cmd_prefill(a) -> None:
    torch = _torch()
    from kvbench.kernels.prefill import paged_prefill
    from kvbench.tools.decode_bench import BenchResults
    from kvbench.tools.prefill_bench import PrefillBench

    preset = PREFILL_PRESETS.get(a.preset, {})
    layout = a.layout or preset.get("layout", "HND")
    cases = preset.get("cases") or [((bt, pre, new, a.heads[0], a.heads[1], a.head_dim, a.page), f, c)
                                    for bt, pre, new in a.shapes for f in a.formats.split(",")
                                    for c in a.configs.split(";")]
    print(f"| batch × (prefix + new), heads, D, page | format | layout | launch options | µs ({a.rounds} round(s)) "
          "| TFLOP/s |")
    print("|---|---|---|---|---|---|")
    groups: dict = {}
    for shape, fmt, cfg in cases:
        groups.setdefault(shape, []).append((fmt, parse_config(cfg, PREFILL_KEYS)))
    for (bt, pre, new, hq, hk, d, page), runs in groups.items():
        fmts = tuple(dict.fromkeys(f for f, _ in runs))
        pb = PrefillBench(BenchResults(), seq=pre + new, hq=hq, hk=hk, d=d, page=page, flashinfer=False,
                          layout=layout, formats=fmts, batch=bt, new=new)
        for fmt, cfg in runs:
            x = pb.extend_inputs(fmt)
            kw = dict(cfg)
            q8 = kw.pop("fp8_q", False)
            run = _extend(paged_prefill, x, fmt, new, pre, q8, kw)
            ts = _rounds(lambda: _us(run), a.rounds)
            fl = extend_flops(bt, pre, new, hq, d)
            tf = f"{fl / (ts[0] * 1e-6) / 1e12:.0f}" if isinstance(ts[0], float) else ""
            print(f"| {bt} × ({pre} + {new}), {hq}/{hk}, D{d}, p{page} | {fmt} | {layout} | {label(cfg)} | "
                  f"{_cells(ts)} | {tf} |", flush=True)
        del pb
        torch.cuda.empty_cache()


COMMANDS = {"decode": cmd_decode, "hnd-emulated": cmd_hnd_emulated, "layouts": cmd_layouts, "prefill": cmd_prefill}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=sorted(COMMANDS))
    ap.add_argument("--preset", default=None, choices=sorted({*DECODE_PRESETS, *PREFILL_PRESETS}),
                    help="decode: " + ", ".join(DECODE_PRESETS) + "; prefill: " + ", ".join(PREFILL_PRESETS))
    ap.add_argument("--formats", default=None, help="comma-separated KV formats (default per command)")
    ap.add_argument("--configs", default="defaults", help="decode / prefill: keyword sets joined by ';'")
    ap.add_argument("--layout", default=None, choices=("HND", "NHD"),
                    help="page layout (default: the preset's, else HND)")
    ap.add_argument("--batches", default="64", help="decode / hnd-emulated: comma-separated batch sizes")
    ap.add_argument("--ctx", type=int, default=8192, help="decode / hnd-emulated: context per sequence")
    ap.add_argument("--shapes", default="4:7168:1024", help="prefill: BATCH:PREFIX:NEW,...")
    ap.add_argument("--heads", default="32:8", help="prefill: H_q:H_kv")
    ap.add_argument("--head-dim", type=int, default=128, help="prefill: head dim")
    ap.add_argument("--page", type=int, default=16, help="prefill: page size")
    ap.add_argument("--rounds", type=int, default=1, help="timings of each case (printed a / b / ...)")
    a = ap.parse_args(argv)
    if a.preset and a.preset not in (DECODE_PRESETS if a.command == "decode" else
                                     PREFILL_PRESETS if a.command == "prefill" else {}):
        ap.error(f"--preset {a.preset} does not apply to {a.command}")
    default_formats = {"decode": "fp8_e4m3", "hnd-emulated": "fp8_e4m3,bf16", "prefill": "bf16"}
    a.formats = a.formats or default_formats.get(a.command, "")
    a.batches = [int(x) for x in a.batches.split(",")]
    a.shapes = [tuple(int(x) for x in s.split(":")) for s in a.shapes.split(",")]
    a.heads = tuple(int(x) for x in a.heads.split(":"))
    keys = DECODE_KEYS if a.command == "decode" else PREFILL_KEYS
    try:
        parse_configs(a.configs, keys)
    except ValueError as e:
        ap.error(str(e))
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    torch = _torch()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, command {a.command}\n")
    COMMANDS[a.command](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())

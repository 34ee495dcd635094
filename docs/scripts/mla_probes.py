"""GPU timing probes of the MLA kernels at launch settings other than their defaults (docs/mla.md).

Each subcommand times ``mla_decode`` / ``mla_prefill`` through their public keyword arguments only
(``num_splits``, ``num_stages``, ``chunks``, ``block_n``, ``prefix_workspace``) at DeepSeek-V3 attention
shapes (kv_lora_rank 512, rope 64, page 64), bf16 compute, and prints a Markdown table:

* ``workspace``: prefill/extend with the quantized prefix dequantized in registers against the prefix
  workspace (``prefix_workspace=False`` / ``True``), ``do_bench`` µs, with one prefix split (the state
  before the prefix split existed) unless ``--splits`` says otherwise; also the relative difference of
  the two outputs;
* ``prefill-splits``: prefill/extend with one prefix split against ``mla_prefill``'s default, CUDA-graph µs
  (``--e4m3-query``: e4m3 queries with ``q_scale``);
* ``decode-splits``: decode at 64 / 128 / 192 / 256 splits, CUDA-graph µs (batch 1 with a long context);
* ``decode-stages``: the decode at 16 heads (``--heads``) with the pipeline depth and the token tile varied
  (and the column chunks for fp8), CUDA-graph µs and in brackets the output's relative difference from
  the defaults';
* ``decode``: decode at the defaults for a list of formats, CUDA-graph and ``do_bench`` µs;
* ``decode-wg``: the Hopper kernel (``mla_decode_wg``) against the Triton kernel at 128 heads (``--heads``):
  bf16 with ``wgmma`` on / off; an e4m3 latent with bf16 queries (Triton ``q_split``; the Hopper kernel's split
  query with a float16 ``P·c`` on the converted tile), with e4m3 queries (Triton ``fp8_scores``; the Hopper kernel
  with a float16 ``P·c`` at three, the default, and two tile buffers) and with ``fp8_pv`` at three and two tile
  buffers; an e5m2 latent with bf16 queries (Triton; the Hopper kernel's split query).  Tile buffers other than
  the default are set in the module constant ``mla_decode_wg.STAGES`` for that row and restored.
  CUDA-graph µs and TFLOP/s; ``--ncu bf16`` / ``--ncu fp8_pv`` only launches that
  case three times, for ``ncu --kernel-name regex:_mla_decode_wg --launch-skip 2 --launch-count 1``; ``--page 16``
  for the engine's default page size; ``--parts`` times bf16 and ``fp8_pv`` whole and taken apart
  (``mla_decode_wg.PARTS``: without the softmax, the score MMAs alone, ``P·c`` alone), the floor of fp8's gain.

    python docs/scripts/mla_probes.py workspace [--heads 16,128]
    python docs/scripts/mla_probes.py prefill-splits [--e4m3-query] [--cases 2:8192:4,...]
    python docs/scripts/mla_probes.py decode-splits --heads 16
    python docs/scripts/mla_probes.py decode-stages [--formats fp8_e4m3,bf16,nvfp4]
    python docs/scripts/mla_probes.py decode --formats fp8_e4m3,fp8_e5m2,bf16
    python docs/scripts/mla_probes.py decode-wg [--ncu bf16|fp8_pv] [--parts]

These are reconstructions, from docs/mla.md's descriptions, of the throw-away drivers that produced some of
its tables; those tables come from the kernels of their date, so a run at a later commit measures the
kernels as they are now (see the note beside each table).
"""

from __future__ import annotations

import argparse
import math
import sys

RANK, ROPE, PAGE = 512, 64, 64
SM_SCALE = (128 + ROPE) ** -0.5  # qk_nope_head_dim 128 + rope 64, as DeepSeek-V3

# (batch, cached prefix, new tokens) of the docs' prefill tables
WORKSPACE_CASES = ((2, 8192, 1), (2, 8192, 16), (2, 8192, 64), (16, 4096, 4), (16, 4096, 64), (1, 32768, 512))
SPLIT_CASES = ((2, 8192, 1), (2, 8192, 16), (2, 8192, 64), (16, 4096, 4), (1, 32768, 16), (64, 2048, 4))


def _torch():
    import torch

    if not torch.cuda.is_available():
        sys.exit("these probes time GPU kernels: no CUDA device")
    return torch


def do_bench_us(fn, rep_ms: int = 100) -> float:
    import triton.testing as tt

    return 1e3 * float(tt.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def graph_us(fn, rep_ms: int = 100) -> float:
    """Median µs of ``fn`` replayed as a CUDA graph (compiled and run once outside the capture first)."""
    torch = _torch()
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    return 1e3 * float(tt.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def make_cache(kv_dtype: str, lens: list[int], filled: list[int], dev, seed: int = 0, page: int = PAGE):
    """A latent cache over shuffled pages with ``filled[i]`` random tokens of sequence ``i`` written
    (quantized with the format's reference quantizer, k_scale 0.02 for quantized formats)."""
    torch = _torch()
    from kvbench.kernels.formats import get_format
    from kvbench.kernels.mla import LatentCache, LatentLayout
    from kvbench.kernels.mla_reference import sequence_slots

    gen = torch.Generator().manual_seed(seed)
    lay = LatentLayout(RANK, ROPE, kv_dtype)
    pages = [max(1, math.ceil(n / page)) for n in lens]
    cache = LatentCache.allocate(lay, sum(pages) + 1, page, device=dev, k_scale=1.0 if kv_dtype == "bf16" else 0.02)
    perm = torch.randperm(sum(pages), generator=gen).int()
    pt = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    off = 0
    for i, k in enumerate(pages):
        pt[i, :k] = perm[off: off + k]
        off += k
    pt = pt.to(dev)
    fmt = get_format(kv_dtype)
    rows = fmt.quantize(torch.randn(4096, RANK + ROPE, generator=gen).to(dev) * 2, cache.k_scale[0])
    for b, n in enumerate(filled):
        if n:
            slots = sequence_slots(pt[b], n, page)
            idx = torch.arange(n, device=dev) % rows.data.shape[0]
            cache.data.view(-1, lay.packed_dim)[slots] = rows.data[idx]
            if rows.block_scale is not None:
                cache.block_scale.view(-1, (RANK + ROPE) // 16)[slots] = rows.block_scale[idx]
    return cache, pt


def prefill_inputs(kv_dtype: str, batch: int, prefix: int, new: int, heads: int, e4m3_query: bool, dev):
    torch = _torch()
    from kvbench.kernels.mla_reference import quantize_absorbed_query

    cache, pt = make_cache(kv_dtype, [prefix + new] * batch, [prefix] * batch, dev)
    t = batch * new
    g = torch.Generator(device=dev).manual_seed(1)
    ql = torch.randn(t, heads, RANK, device=dev, generator=g).bfloat16()
    qp = torch.randn(t, heads, ROPE, device=dev, generator=g).bfloat16()
    cn = torch.randn(t, RANK, device=dev, generator=g).bfloat16()
    kn = torch.randn(t, ROPE, device=dev, generator=g).bfloat16()
    kw = {}
    if e4m3_query:
        ql, qp, kw["q_scale"] = quantize_absorbed_query(ql, qp)
    cu = torch.arange(0, t + 1, new, dtype=torch.int32, device=dev)
    sl = torch.full((batch,), prefix + new, dtype=torch.int32, device=dev)
    return (ql, qp, cn, kn, cache, pt, sl, cu), dict(kw, max_q_len=new)


def decode_inputs(kv_dtype: str, batch: int, ctx: int, heads: int, dev, page: int = PAGE):
    torch = _torch()
    cache, pt = make_cache(kv_dtype, [ctx] * batch, [ctx] * batch, dev, page=page)
    g = torch.Generator(device=dev).manual_seed(2)
    ql = torch.randn(batch, heads, RANK, device=dev, generator=g).bfloat16()
    qp = torch.randn(batch, heads, ROPE, device=dev, generator=g).bfloat16()
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    return (ql, qp, cache, pt, sl), {"max_seq_len": ctx}


def _decode(args, kw: dict):
    """``mla_decode(*args, SM_SCALE)`` as a thunk; ``kw``: the query's ``q_scale`` (if any) and launch options
    (``kernels.config.MLADecodeOptions``)."""
    from kvbench.kernels.config import MLADecodeOptions
    from kvbench.kernels.mla_decode import mla_decode

    kw = dict(kw)
    q_scale = kw.pop("q_scale", None)
    opts = MLADecodeOptions(**kw)
    return lambda: mla_decode(*args, SM_SCALE, q_scale=q_scale, opts=opts)


def _prefill(args, kw: dict):
    """``mla_prefill(*args, SM_SCALE)`` as a thunk; ``kw``: the query's ``q_scale`` (if any) and launch options
    (``kernels.config.MLAPrefillOptions``)."""
    from kvbench.kernels.config import MLAPrefillOptions
    from kvbench.kernels.mla_prefill import mla_prefill

    kw = dict(kw)
    q_scale = kw.pop("q_scale", None)
    opts = MLAPrefillOptions(**kw)
    return lambda: mla_prefill(*args, SM_SCALE, q_scale=q_scale, opts=opts)


def _try(fn):
    try:
        return fn()
    except Exception as e:  # out of shared memory / an unsupported combination: shown in the table
        return f"{type(e).__name__}: {str(e)[:60]}"


def _cell(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def cmd_workspace(a, dev) -> None:
    cases = [("fp8_e4m3", False), ("fp8_e4m3", True), ("nvfp4", False)]
    shapes = a.cases or WORKSPACE_CASES
    print("| heads | format | query | " + " | ".join(f"{b} × {p} + {n}" for b, p, n in shapes) + " |")
    print("|---|---|---|" + "---|" * len(shapes))
    for h in a.heads:
        for fmt, q8 in cases:
            if fmt not in a.formats:
                continue
            cells = []
            for b, p, n in shapes:
                args, kw = prefill_inputs(fmt, b, p, n, h, q8, dev)
                kw["num_splits"] = a.splits
                regs = _prefill(args, dict(kw, prefix_workspace=False))
                ws = _prefill(args, dict(kw, prefix_workspace=True))
                r_us, w_us = _try(lambda: do_bench_us(regs)), _try(lambda: do_bench_us(ws))
                diff = _try(lambda: rel(ws(), regs()))
                cells.append(f"{_cell(r_us)} → {_cell(w_us)} ({diff:.1e})" if isinstance(diff, float)
                             else f"{_cell(r_us)} → {_cell(w_us)}")
            print(f"| {h} | {fmt} | {'e4m3' if q8 else 'bf16'} | " + " | ".join(cells) + " |")


def cmd_prefill_splits(a, dev) -> None:
    cases = a.cases or SPLIT_CASES
    print(f"query: {'e4m3' if a.e4m3_query else 'bf16'}\n")
    print("| heads | format | " + " | ".join(f"{b} × {p} + {n}" for b, p, n in cases) + " |")
    print("|---|---|" + "---|" * len(cases))
    for h in a.heads:
        for fmt in a.formats:
            cells = []
            for b, p, n in cases:
                args, kw = prefill_inputs(fmt, b, p, n, h, a.e4m3_query, dev)
                one = _try(lambda: graph_us(_prefill(args, dict(kw, num_splits=1))))
                dflt = _try(lambda: graph_us(_prefill(args, kw)))
                cells.append(f"{_cell(one)} → {_cell(dflt)}")
            print(f"| {h} | {fmt} | " + " | ".join(cells) + " |")


def cmd_decode_splits(a, dev) -> None:
    splits = (None, 64, 128, 192, 256)
    print("| heads | format | batch × context | " + " | ".join("default" if s is None else f"{s} splits" for s in splits) + " |")
    print("|---|---|---|" + "---|" * len(splits))
    for h in a.heads:
        for fmt in a.formats:
            for b, ctx in ((1, 131072), (1, 32768), (2, 32768)):
                args, kw = decode_inputs(fmt, b, ctx, h, dev)
                cells = [_cell(_try(lambda: graph_us(_decode(args, dict(kw, num_splits=s)))))
                         for s in splits]
                print(f"| {h} | {fmt} | {b} × {ctx} | " + " | ".join(cells) + " |")


def cmd_decode_stages(a, dev) -> None:
    stages = (None, 4, 5, 6)
    for h in a.heads:
        for fmt in a.formats:
            args, kw = decode_inputs(fmt, a.batch, a.ctx, h, dev)
            ref = _decode(args, kw)()
            variants = [("64-token tiles", {"block_n": 64}), ("32-token tiles", {"block_n": 32})]
            if fmt.startswith("fp8"):  # column chunks apply to fp8 latents read as 16-bit units
                variants = [(f"64-token tiles, {c} chunk{'s' if c > 1 else ''}", {"block_n": 64, "chunks": c}) for c in (4, 2, 1)]
                variants.append(("32-token tiles, 4 chunks", {"block_n": 32, "chunks": 4}))
            print(f"\n| {fmt}, {h} heads, {a.batch} × {a.ctx} | "
                  + " | ".join("default" if s is None else f"{s} stages" for s in stages) + " |")
            print("|---|" + "---|" * len(stages))
            for label, extra in variants:
                cells = []
                for s in stages:
                    fn = _decode(args, dict(kw, num_stages=s, **extra))
                    us = _try(lambda: graph_us(fn))
                    d = _try(lambda: rel(fn(), ref))
                    cells.append(f"{_cell(us)} ({d:.0e})" if isinstance(d, float) else _cell(us))
                print(f"| {label} | " + " | ".join(cells) + " |")


def cmd_decode(a, dev) -> None:
    print("| heads | format | batch × context | graph µs | do_bench µs |")
    print("|---|---|---|---|---|")
    for h in a.heads:
        for fmt in a.formats:
            args, kw = decode_inputs(fmt, a.batch, a.ctx, h, dev)
            fn = _decode(args, kw)
            print(f"| {h} | {fmt} | {a.batch} × {a.ctx} | {_cell(_try(lambda: graph_us(fn)))} | {_cell(_try(lambda: do_bench_us(fn)))} |")


def cmd_decode_wg(a, dev) -> None:
    from kvbench.kernels import mla_decode_wg
    from kvbench.kernels.mla_reference import quantize_absorbed_query

    cases = [("bf16", "bf16", "Triton", {"wgmma": False}, None), ("bf16", "bf16", "wgmma", {"wgmma": True}, None),
             ("fp8_e4m3", "bf16", "Triton (q_split)", {"wgmma": False}, None),
             ("fp8_e4m3", "bf16", "wgmma, split query, fp16 P·c", {"wgmma": True}, None),
             ("fp8_e4m3", "e4m3", "Triton (fp8_scores)", {"wgmma": False}, None),
             ("fp8_e4m3", "e4m3", "wgmma, fp16 P·c", {"wgmma": True}, None),
             ("fp8_e4m3", "e4m3", "wgmma, fp16 P·c, 2 tile buffers", {"wgmma": True}, 2),
             ("fp8_e4m3", "e4m3", "wgmma, fp8_pv", {"fp8_pv": True}, None),
             ("fp8_e4m3", "e4m3", "wgmma, fp8_pv, 2 tile buffers", {"fp8_pv": True}, 2),
             ("fp8_e5m2", "bf16", "Triton (16-bit units)", {"wgmma": False}, None),
             ("fp8_e5m2", "bf16", "wgmma, split query, fp16 P·c", {"wgmma": True}, None)]
    if a.ncu:
        cases = [c for c in cases if c[2] == {"bf16": "wgmma", "fp8_pv": "wgmma, fp8_pv"}[a.ncu]]
    elif a.parts:
        # the kernel taken apart (mla_decode_wg.PARTS; the outputs of parts 1-3 are not attention)
        cases = [c[:2] + (f"{c[2]}: {label}", c[3], c[4], parts) for c in (cases[1], cases[7])
                 for parts, label in ((0, "whole"), (1, "no softmax"), (2, "scores only"), (3, "P·c only"))]
        print(f"pages of {a.page} tokens; parts: 1 = P is the raw scores (no maxima, exponentials or rescaling), "
              "2 = the score MMAs without P·c or softmax, 3 = P·c (and fp8's transposition) without score MMAs "
              "or softmax\n")
        print("| heads | KV | queries | kernel | batch × context | graph µs | TFLOP/s |")
        print("|---|---|---|---|---|---|---|")
    else:
        print(f"pages of {a.page} tokens\n")
        print("| heads | KV | queries | kernel | batch × context | graph µs | TFLOP/s |")
        print("|---|---|---|---|---|---|---|")
    for h in a.heads:
        for fmt, query, name, extra, stages, *parts in cases:
            (ql, qp, cache, pt, sl), kw = decode_inputs(fmt, a.batch, a.ctx, h, dev, a.page)
            kw.update(extra)
            if query == "e4m3":
                ql, qp, kw["q_scale"] = quantize_absorbed_query(ql, qp)
            saved = dict(mla_decode_wg.STAGES)
            if stages:  # the tile buffers of this row's kernel variant (mla_decode_wg.STAGES's keys)
                variant = True if "fp8_pv" in name else "e4m3" if query == "e4m3" else "split"
                mla_decode_wg.STAGES[variant] = stages
            mla_decode_wg.PARTS["value"] = parts[0] if parts else 0
            try:
                fn = _decode((ql, qp, cache, pt, sl), kw)
                if a.ncu:
                    for _ in range(3):
                        fn()
                    continue
                us = _try(lambda: graph_us(fn))
            finally:
                mla_decode_wg.STAGES.update(saved)
                mla_decode_wg.PARTS["value"] = 0
            tf = 2 * a.batch * h * a.ctx * (2 * RANK + ROPE) / (us * 1e-6) / 1e12 if isinstance(us, float) else ""
            print(f"| {h} | {fmt} | {query} | {name} | {a.batch} × {a.ctx} | {_cell(us)} | {_cell(tf)} |")


COMMANDS = {"workspace": cmd_workspace, "prefill-splits": cmd_prefill_splits, "decode-splits": cmd_decode_splits,
            "decode-stages": cmd_decode_stages, "decode": cmd_decode, "decode-wg": cmd_decode_wg}
DEFAULT_FORMATS = {"workspace": "fp8_e4m3,nvfp4", "prefill-splits": "bf16,fp8_e4m3,nvfp4",
                   "decode-splits": "bf16,fp8_e4m3,nvfp4", "decode-stages": "fp8_e4m3,bf16,nvfp4", "decode": "fp8_e4m3,fp8_e5m2,bf16",
                   "decode-wg": "bf16,fp8_e4m3"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=sorted(COMMANDS))
    ap.add_argument("--heads", default=None, help="comma-separated head counts (default 16,128; decode: 16)")
    ap.add_argument("--formats", default=None, help="comma-separated KV formats")
    ap.add_argument("--splits", type=int, default=1, help="workspace: prefix splits of both paths (default 1)")
    ap.add_argument("--cases", default=None, help="workspace / prefill-splits: BATCH:PREFIX:NEW,... (default: the docs' cases)")
    ap.add_argument("--e4m3-query", action="store_true", help="prefill-splits: e4m3 queries with q_scale")
    ap.add_argument("--batch", type=int, default=64, help="decode, decode-stages: batch")
    ap.add_argument("--ctx", type=int, default=8192, help="decode, decode-stages: context")
    ap.add_argument("--ncu", choices=("bf16", "fp8_pv"), default=None, help="decode-wg: three launches of one case")
    ap.add_argument("--parts", action="store_true", help="decode-wg: the Hopper kernel taken apart (timing only)")
    ap.add_argument("--page", type=int, default=PAGE, help=f"decode-wg: tokens per page (default {PAGE})")
    a = ap.parse_args(argv)
    default_heads = {"decode": "16", "decode-stages": "16", "decode-wg": "128"}.get(a.command, "16,128")
    a.heads = [int(h) for h in (a.heads or default_heads).split(",")]
    a.formats = (a.formats or DEFAULT_FORMATS[a.command]).split(",")
    a.cases = [tuple(int(x) for x in c.split(":")) for c in a.cases.split(",")] if a.cases else None
    torch = _torch()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, command {a.command}\n")
    COMMANDS[a.command](a, torch.device("cuda"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Markdown of the MLA check and benchmarks (``mla_check.py``), and the one-line form of each row printed
while the run goes on (``row_line``)."""

from __future__ import annotations

import json

from kvbench.tools.common import mla_formats

__all__ = ["CHECK_NAMES", "ROW_HEADER", "row_line", "report_md", "stages_md"]

# the checks of every format, in the order of the run and of the table
CHECK_NAMES = ("append", "decode", "decode H=16", "decode H=16 bytes", "decode H=128 units", "decode fp8 q",
               "decode fp8 q H=16", "decode H=128 triton", "decode H=96 7 splits", "decode tile ends", "decode pages of 16", "decode fp8 P",
               "decode bytes 128-token tiles", "prefill", "prefill fp8 q", "prefill 128-token tiles",
               "prefill in registers", "prefill fp8 q in registers", "prefill 128-token tiles in registers",
               "prefill split prefix", "prefill split prefix in registers")

ROW_HEADER = f"{'kind':<8} {'format':<9} row (checks: result and ‖out−ref‖/‖ref‖; timings: µs, graph µs, GB/s)"


def _check_cell(r: dict) -> str:
    if "error" in r:
        return "ERROR " + r["error"][:100]
    if "refused" in r:
        return "refused (as it must)"
    if "rel_err" in r:
        return f"{'pass' if r['pass'] else 'FAIL'} ({r['rel_err']:.1e})"
    return ("pass" if r.get("pass") else "FAIL") + (f" (rope bytes off {r['rope_bytes_differing']:.1e})"
                                                     if "rope_bytes_differing" in r else "")


def row_line(kind: str, r: dict) -> str:
    """One streamed row: ``kind`` is check, tune, decode, prefill, append or stages."""
    f = r.get("format", "")
    if kind == "copy":
        return f"{kind:<8} {f:<9} {r['GBps']:.0f} GB/s (device-to-device copy, read + write)"
    if kind == "check":
        body = f"{r['name']:<38} {_check_cell(r['result'])}"
    elif "error" in r and kind != "stages":
        body = f"{json.dumps({k: v for k, v in r.items() if k not in ('format', 'error')})} {r['error'][:100]}"
    elif kind == "tune":
        cfg = {k: v for k, v in r["config"].items() if k != "max_seq_len"}
        body = f"H={r['heads']} {cfg or 'defaults'}: {r['us']:.1f} us {r['GBps']:.0f} GB/s"
    elif kind == "decode":
        body = (f"H={r['heads']} B={r['batch']} L={r['ctx']} q={r['query']}: {r['us']:.1f} us, graph {r['graph_us']:.1f} us, "
                f"{r['GBps']:.0f} GB/s, {r['TFLOPs']:.0f} TFLOP/s")
    elif kind == "prefill":
        body = (f"H={r['heads']} B={r['batch']} prefix={r['prefix']} new={r['new']} q={r['query']} "
                f"prefix read {r['prefix_read']}: {r['us']:.1f} us, graph {r['graph_us']:.1f} us, {r['TFLOPs']:.0f} TFLOP/s")
    elif kind == "append":
        body = f"T={r['tokens']}: fused {r['fused_us']:.1f} us, unfused {r['unfused_us']:.1f} us ({r['ratio']:.2f}x)"
    elif kind == "stages":
        body = f"H={r['heads']} q={r['query']} stages={r['stages']}: " + (
            r["error"][:100] if "error" in r else f"graph {r['graph_us']:.1f} us (diff {r['diff']:.0e})")
    else:
        body = json.dumps(r)
    return f"{kind:<8} {f:<9} {body}"


def _decode_row(r: dict, copy_gbps: float) -> str:
    g = f"{r['graph_us']:.1f}" if "graph_us" in r else "–"
    return (f"| {r['format']} | {r['heads']} | {r['batch']} | {r['ctx']} | {r['us']:.1f} | {g} | {r['GBps']:.0f} | "
            f"{100 * r['GBps'] / copy_gbps:.0f}% | {r['TFLOPs']:.0f} |")


def report_md(report: dict) -> str:
    formats = tuple(report.get("formats") or mla_formats())
    L = [f"Device: {report['device']}; torch {report['torch']}, triton {report['triton']}; {report['date']}.",
         f"Copy bandwidth (read + write): {report['copy_GBps']:.0f} GB/s.", "",
         "| check | " + " | ".join(formats) + " |", "|---|" + "---|" * len(formats)]
    for name in CHECK_NAMES:
        cells = []
        for f in formats:
            r = report["checks"].get(f, {}).get(name, {})
            if "error" in r:
                cells.append("ERROR")
            elif "refused" in r:
                cells.append("refused")
            elif "rel_err" in r:
                cells.append(f"{'pass' if r['pass'] else 'FAIL'} ({r['rel_err']:.1e})")
            else:
                cells.append(("pass" if r.get("pass") else "FAIL") + (f" (rope bytes off {r['rope_bytes_differing']:.1e})" if r else ""))
        L.append(f"| {name} | " + " | ".join(cells) + " |")
    L += ["", "Decode (absorbed, bf16 q, latent 512+64, page 64, mla_decode's defaults).  µs: `do_bench` (launches "
          "from Python, the host's gaps included); graph µs: the same call replayed as a CUDA graph (the kernels' own "
          "time); GB/s = cache bytes read / graph time, % of copy bandwidth, TFLOP/s from the graph time:", "",
          "| format | heads | batch | context | µs | graph µs | GB/s | % copy | TFLOP/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["decode"]:
        if r.get("query", "bf16") != "bf16":
            continue
        L.append(_decode_row(r, report["copy_GBps"]))
    q8 = [r for r in report["decode"] if r.get("query", "bf16") != "bf16"]
    if q8:
        base = {(r["heads"], r["batch"], r["ctx"]): r.get("graph_us", r["us"]) for r in report["decode"]
                if r["format"] == "bf16" and r.get("query", "bf16") == "bf16"}
        L += ["", "Decode with e4m3 queries (`quantize_query`; the runtime's `--quantize-query`), same shapes and columns; "
              "speed-up (graph times) against the bf16 cache with bf16 queries:", "",
              "| format | heads | batch | context | µs | graph µs | GB/s | % copy | TFLOP/s | vs bf16 |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for r in q8:
            ref = base.get((r["heads"], r["batch"], r["ctx"]))
            L.append(_decode_row(r, report["copy_GBps"]) + (f" {ref / r.get('graph_us', r['us']):.2f}x |" if ref else " |"))
    if report["tuning"]:
        L += ["", "Launch-configuration sweep at batch 64 x 8192 ({} = the defaults):", "",
              "| format | config | µs | GB/s | % copy |", "|---|---|---|---|---|"]
        for name, rows in report["tuning"].items():
            for r in rows:
                cfg = {k: v for k, v in r.get("config", {}).items() if k != "max_seq_len"}
                if "us" in r:
                    L.append(f"| {name} | {cfg} | {r['us']:.1f} | {r['GBps']:.0f} | {100 * r['GBps'] / report['copy_GBps']:.0f}% |")
                else:
                    L.append(f"| {name} | {cfg} | {r.get('error', 'error')[:60]} | | |")
    if report.get("prefill"):
        L += ["", "Prefill/extend (absorbed, mla_prefill's defaults: a few new tokens split the prefix over programs); "
              "the cached prefix read as stored (16-bit), through the prefix workspace (dequantized once; the default) "
              "or dequantized in registers by every program.  µs: `do_bench` (the host's launches included: several "
              "per call); graph µs: replayed as a CUDA graph; TFLOP/s over the visible keys of each new token, from "
              "the graph time:",
              "", "| format | query | prefix read | heads | batch | cached prefix | new tokens | µs | graph µs | TFLOP/s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for r in report["prefill"]:
            g = r.get("graph_us")
            L.append(f"| {r['format']} | {r['query']} | {r.get('prefix_read', '')} | {r['heads']} | {r['batch']} | "
                     f"{r['prefix']} | {r['new']} | {r['us']:.1f} | {'' if g is None else f'{g:.1f}'} | {r['TFLOPs']:.0f} |")
    L += ["", "Append (H=128 q_pe heads): fused Triton vs unfused torch (RoPE, formats.quantize, indexed store):", "",
          "| format | tokens | fused µs | unfused µs | fused / unfused |", "|---|---|---|---|---|"]
    for r in report["append"]:
        L.append(f"| {r['format']} | {r['tokens']} | {r['fused_us']:.1f} | {r['unfused_us']:.1f} | {r['ratio']:.2f} |")
    return "\n".join(L) + "\n"


def stages_md(rows: list) -> str:
    cols = list(dict.fromkeys(r["stages"] for r in rows))
    lines = [f"| heads | format | query | {' | '.join(f'{c} stages' if c != 'default' else c for c in cols)} |",
             "|---|---|---|" + "---|" * len(cols)]
    for key in dict.fromkeys((r["heads"], r["format"], r["query"]) for r in rows):
        cells = {r["stages"]: r for r in rows if (r["heads"], r["format"], r["query"]) == key}
        out = []
        for c in cols:
            r = cells.get(c)
            if r is None:
                out.append("")
            elif "error" in r:
                out.append(r["error"].split(":")[0])
            else:
                out.append(f"{r['graph_us']:.1f}" + ("" if r["diff"] < 1e-3 else f" (diff {r['diff']:.0e})"))
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {' | '.join(out)} |")
    return "\n".join(lines) + "\n"

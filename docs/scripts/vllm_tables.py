"""The tables of docs/performance.md "kvbench's engine against vLLM" from the results of docs/scripts/vllm_gpu.py.

    python docs/scripts/vllm_tables.py OUT_DIR          # OUT_DIR = vllm_gpu.py's --out (WORK/out)

1. The two load clients on the same vLLM server and the same text prompts (kvbench load --dataset custom vs
   vllm bench serve --dataset-name custom): throughput, TTFT, TPOT, and what each counted (chunks per request).
2. kvbench's engine against vLLM: same shape (Llama-3-8B, vocab 49152), KV format, KV memory and load (kvbench
   load, random token ids, same seeds), per concurrency and for 8k-token prompts; KV capacity from each log.
"""

from __future__ import annotations

import json
import re
import statistics as st
import sys
from pathlib import Path


def level(path: Path) -> dict:
    return json.loads(path.read_text())["levels"][0]


def fmt(v, nd=1) -> str:
    return "—" if v is None else f"{v:,.{nd}f}"


def clients(out: Path, kv: str = "fp8") -> list[str]:
    """One row per client run (repeat r ran kvbench first when r is even, vllm first when odd), then each client's
    mean over its repeats; files kvb-custom-cC-rR/ and vllm-custom-cC-rR.json (without -rR: one run, no warm-up)."""
    rows = ["| concurrency | client | run | req/s | out tok/s | mean TTFT ms | median TTFT ms | mean TPOT ms | "
            "median TPOT ms | chunks / request (mean) |", "|---|---|---|---|---|---|---|---|---|---|"]
    d = out / f"vllm-{kv}"
    keys = ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms")
    for c in (16, 64, 256):
        runs = sorted({p.name.rsplit("-r", 1)[1] for p in d.glob(f"kvb-custom-c{c}-r*")}) or [""]
        per = {"kvbench load": [], "vllm bench serve": []}
        for r in runs:
            sfx = f"-r{r}" if r else ""
            k, v = d / f"kvb-custom-c{c}{sfx}", d / f"vllm-custom-c{c}{sfx}.json"
            if not ((k / "summary.json").exists() and v.exists()):
                continue
            s = level(k / "summary.json")
            recs = [json.loads(x) for x in (k / f"c{c}" / "requests.jsonl").read_text().splitlines()]
            per["kvbench load"].append(({x: s[x] for x in keys}, st.mean(len(q["itl_s"]) + 1 for q in recs if q["success"]), r))
            b = json.loads(v.read_text())
            per["vllm bench serve"].append(({x: b[x] for x in keys}, st.mean(len(x) + 1 for x in b["itls"]), r))
        for name, got in per.items():
            for m, ch, r in got:
                first = r == "" or (int(r) % 2 == 0) == (name == "kvbench load")
                label = f"{r} ({'first' if first else 'second'})" if r else "1"
                rows.append(f"| {c} | {name} | {label} | {m['request_throughput']:.2f} | {m['output_throughput']:,.0f} | "
                            f"{fmt(m['mean_ttft_ms'])} | {fmt(m['median_ttft_ms'])} | {fmt(m['mean_tpot_ms'], 2)} | "
                            f"{fmt(m['median_tpot_ms'], 2)} | {ch:.1f} |")
            if len(got) > 1:
                mean = {x: st.mean(g[0][x] for g in got) for x in keys}
                rows.append(f"| {c} | **{name}** | mean of {len(got)} | {mean['request_throughput']:.2f} | "
                            f"{mean['output_throughput']:,.0f} | {fmt(mean['mean_ttft_ms'])} | {fmt(mean['median_ttft_ms'])} | "
                            f"{fmt(mean['mean_tpot_ms'], 2)} | {fmt(mean['median_tpot_ms'], 2)} | {st.mean(g[1] for g in got):.1f} |")
    return rows


def capacity(log: Path) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    m = re.search(r"GPU KV cache size:\s*([\d,]+) tokens", text) or re.search(r"KV cache:\s*(\d+) tokens", text)
    return f"{int(m.group(1).replace(',', '')):,}" if m else "—"


def engines(out: Path) -> list[str]:
    rows = ["| KV | load | vLLM req/s | kvbench req/s | kvbench / vLLM | vLLM TTFT ms (mean) | kvbench TTFT ms | "
            "vLLM TPOT ms (mean) | kvbench TPOT ms | kvbench / vLLM TPOT |", "|---|---|---|---|---|---|---|---|---|---|"]
    for kv in ("bf16", "fp8"):
        for name, label in (("c16", "1024/128, c=16"), ("c64", "1024/128, c=64"), ("c256", "1024/128, c=256"),
                            ("long", "8192/128, c=16")):
            v, k = out / f"vllm-{kv}" / f"kvb-random-{name}" / "summary.json", out / f"kvbench-{kv}" / f"kvb-random-{name}" / "summary.json"
            if not (v.exists() and k.exists()):
                continue
            a, b = level(v), level(k)
            rows.append(f"| {kv} | {label} | {a['request_throughput']:.2f} | {b['request_throughput']:.2f} | "
                        f"{b['request_throughput'] / a['request_throughput']:.2f}× | {fmt(a['mean_ttft_ms'])} | {fmt(b['mean_ttft_ms'])} | "
                        f"{fmt(a['mean_tpot_ms'], 2)} | {fmt(b['mean_tpot_ms'], 2)} | {b['mean_tpot_ms'] / a['mean_tpot_ms']:.2f}× |")
    rows.append("")
    rows.append("| KV | vLLM KV cache (40 GiB) | kvbench KV cache (40 GiB) |")
    rows.append("|---|---|---|")
    for kv in ("bf16", "fp8"):
        rows.append(f"| {kv} | {capacity(out / f'vllm-{kv}.log')} tokens | {capacity(out / f'kvbench-{kv}.log')} tokens |")
    return rows


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="/tmp/kvb-vllm/out", help="vllm_gpu.py's --out (default /tmp/kvb-vllm/out)")
    out = Path(ap.parse_args().out)
    print("## The two clients on one vLLM server (fp8 KV, same 1024-token text prompts, 128 out)\n")
    print("\n".join(clients(out)))
    print("\n## kvbench's engine against vLLM (same shape, KV memory and requests)\n")
    print("\n".join(engines(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

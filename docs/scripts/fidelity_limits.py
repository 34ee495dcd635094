"""The measurement behind the gate's default fidelity limits (docs/verdict.md "Default limits").

Runs the fidelity suite on the embedded default model in every KV format (calibrated scales, torch backend)
and prints, per format, the token-weighted KL mean, perplexity ratio and top-1 agreement with the gate's
one-sided bounds over texts, and the word each check gets at the default limits (reports/gate/types.py):

    python docs/scripts/fidelity_limits.py --out runs/fid-limits [--limit 32] [--data-dir ../shared/data]
    python docs/scripts/fidelity_limits.py --out runs/fid-limits --table-only   # reprint from finished runs

Each format is one `kvbench eval --suite fidelity` (skipped when its summary.json exists); the first run
computes the bf16 reference into OUT/cache and the others reuse it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from kvbench.reports.gate.check import _limit_check
from kvbench.reports.gate.types import DEFAULT_MAX_KL_MEAN, DEFAULT_MAX_PPL_RATIO
from kvbench.reports.stats.intervals import weighted_mean_upper

FORMATS = ("bf16:unit", "fp8_e4m3:calibrate", "fp8_e5m2:calibrate", "nvfp4:calibrate")


def run_evals(out: Path, limit: int, data_dir: str, extra: list[str]) -> None:
    for cfg in FORMATS:
        kv, scales = cfg.split(":")
        d = out / f"{kv}-{scales}"
        if (d / "summary.json").exists():
            continue
        t0 = time.time()
        cmd = [sys.executable, "-m", "kvbench.harness", "eval", "--suite", "fidelity", "--limit", str(limit),
               "--data-dir", data_dir, "--kv-dtype", kv, "--kv-scales", scales, "--fidelity-cache", str(out / "cache"),
               "--no-progress", "--out", str(d), *extra]
        with open(out / f"{kv}-{scales}.log", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        print(f"{kv} {scales}: exit {rc}, {time.time() - t0:.0f} s", file=sys.stderr)


def _scores(d: Path) -> list[dict]:
    recs = [json.loads(x) for x in (d / "items.jsonl").read_text().splitlines() if x.strip()]
    return [r["scores"] for r in recs if r.get("suite") == "fidelity" and r.get("scores", {}).get("kl_mean") is not None]


def table(out: Path, confidence: float = 0.95) -> str:
    rows = ["| kv | scales | texts | tokens | KL mean [UB] | perplexity ratio [UB] | top-1 agreement [LB] | "
            f"KL ≤ {DEFAULT_MAX_KL_MEAN:g} | ppl ≤ {DEFAULT_MAX_PPL_RATIO:g}× |",
            "|---|---|---|---|---|---|---|---|---|"]
    for cfg in FORMATS:
        kv, scales = cfg.split(":")
        d = out / f"{kv}-{scales}"
        if not (d / "items.jsonl").exists():
            continue
        recs = _scores(d)
        w = [float(r.get("n_tokens") or 1) for r in recs]
        kl = _limit_check(None, "fidelity KL", [r["kl_mean"] for r in recs], w, DEFAULT_MAX_KL_MEAN, confidence)
        ppl = _limit_check(None, "perplexity ratio", [r["nll_cand"] - r["nll_ref"] for r in recs], w,
                           DEFAULT_MAX_PPL_RATIO, confidence)
        dis, dis_ub = weighted_mean_upper([1 - r["top1_agree"] for r in recs], w, confidence)
        word = {True: "PASS", False: "FAIL"}

        def verdict(c) -> str:
            return word[c.passed] if c.passed or not c.inconclusive else "INCONCLUSIVE"

        rows.append(f"| {kv} | {scales} | {len(recs)} | {sum(w):,.0f} | {kl.cand_value:.4f} [{kl.bound:.4f}] | "
                    f"{ppl.cand_value:.4f} [{ppl.bound:.4f}] | {1 - dis:.2%} [{1 - dis_ub:.2%}] | {verdict(kl)} | "
                    f"{verdict(ppl)} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--table-only", action="store_true")
    args, extra = ap.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        run_evals(args.out, args.limit, args.data_dir, extra)
    print(table(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

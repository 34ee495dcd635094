"""How repeatable each KV format is on the embedded default model: configs/default.yaml with an A/A control for
every accuracy cell (`aa_control: all`), then, per format, how many items of each suite got a different answer
or score in the control (the same configuration rerun in a fresh engine at another concurrency).

    python docs/scripts/aa_noise.py --out runs/aa-noise [--data-dir ../shared/data]   # the sweep, then the table
    python docs/scripts/aa_noise.py --out runs/aa-noise --table-only

docs/verdict.md "A/A controls" quotes its table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def run_sweep(out: Path, data_dir: str) -> None:
    cfg = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    cfg["aa_control"] = "all"
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
    cmd = [sys.executable, "-m", "kvbench.harness", "sweep", f.name, "--out", str(out), "--data-dir", data_dir,
           "--no-progress"] + (["--resume"] if (out / "manifest.json").exists() else [])
    subprocess.check_call(cmd)


def _cells(out: Path) -> dict[tuple[str, bool], dict]:
    cells = {}
    for d in sorted((out / "cells").iterdir()):
        meta = json.loads((d / "cell.json").read_text())
        cfg = meta.get("config", meta)
        items = d / "items.jsonl"
        if items.exists():
            recs = [json.loads(x) for x in items.read_text().splitlines() if x.strip()]
            cells[(cfg["kv_dtype"], bool(cfg.get("aa_control")))] = {(r["suite"], r["item_id"]): r for r in recs}
    return cells


def table(out: Path) -> str:
    cells = _cells(out)
    rows = ["| kv | suite | items | different output | different score |", "|---|---|---|---|---|"]
    for kv in sorted(dict.fromkeys(k for k, _ in cells), key=lambda k: (k != "bf16", k)):
        a, b = cells.get((kv, False)), cells.get((kv, True))
        if a is None or b is None:
            continue
        for suite in sorted({s for s, _ in a}):
            keys = [k for k in a if k[0] == suite and k in b]
            out_diff = sum(a[k].get("raw_output") != b[k].get("raw_output") for k in keys)
            if suite == "fidelity":  # teacher-forced floats: a last-bit difference is no different answer
                score_diff = "—"
            else:
                score = lambda r: (r.get("correct"), (r.get("scores") or {}).get(suite))  # noqa: E731
                score_diff = sum(score(a[k]) != score(b[k]) for k in keys)
            rows.append(f"| {kv} | {suite} | {len(keys)} | {out_diff} | {score_diff} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args(argv)
    if not args.table_only:
        run_sweep(args.out, args.data_dir)
    print(table(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

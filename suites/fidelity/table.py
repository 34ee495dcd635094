"""Markdown table of fidelity summaries from ``kvbench eval --suite fidelity --out DIR`` directories.

    python -m kvbench.suites.fidelity.table DIR [DIR ...]
    python -m kvbench.suites.fidelity.table --paired DIR_A DIR_B   # per-text A − B, mean ± standard error

When the summaries hold ``by_position`` (fidelity by position bucket), a second table follows: one column
per bucket, each entry ``KL mean / KL p99 / top-1 agreement`` over the tokens at those absolute positions.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvbench.core import plain_names

COLUMNS = (
    ("kl_mean", "KL mean", "{:.2e}"),
    ("kl_p99", "KL p99", "{:.2e}"),
    ("kl_max", "KL max", "{:.3f}"),
    ("top1_agree", "top-1 agree", "{:.2%}"),
    ("ppl_ref", "ppl ref", "{:.4f}"),
    ("ppl_cand", "ppl cand", "{:.4f}"),
    ("first_divergence", "first div.", "{:.1f}"),
    ("n_tokens", "tokens", "{:.0f}"),
)


def _summary(out_dir: Path) -> tuple[dict, dict]:
    s = json.loads((Path(out_dir) / "summary.json").read_text())
    if s.get("error"):
        raise SystemExit(f"{out_dir}: run failed: {s['error']}")
    fid = s["suites"].get("fidelity")
    if fid is None:
        raise SystemExit(f"{out_dir}: no fidelity suite in summary.json")
    return s, fid


def _config(s: dict) -> list[str]:
    eng = s.get("engine") or {}
    target = s.get("target") or {}
    scales = eng.get("kv_scales", "?")
    if eng.get("kv_dtype") in plain_names():  # stored as is: no scales to show
        scales = "-"
    backend = eng.get("prefill_backend", "?") if eng.get("prefill_backend") == eng.get("decode_backend") else f"{eng.get('prefill_backend')}+{eng.get('decode_backend')}"
    return [str(eng.get("kv_dtype", target.get("kv_dtype", "?"))), scales, backend]


def row(out_dir: Path) -> list[str]:
    s, fid = _summary(out_dir)
    return _config(s) + [fmt.format(fid[k]) if fid.get(k) is not None else "-" for k, _, fmt in COLUMNS]


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def position_table(dirs: list[Path]) -> str:
    """KL mean / p99 / top-1 per position bucket (columns: the union of the runs' buckets); "" when no
    summary has ``by_position``."""
    rows = []
    for d in dirs:
        s, fid = _summary(d)
        rows.append((_config(s), {(int(b["lo"]), int(b["hi"])): b for b in fid.get("by_position") or []}))
    buckets = sorted({k for _, by in rows for k in by})
    if not buckets:
        return ""
    head = ["kv", "scales", "backend"] + [f"{_k(lo)}–{_k(hi)}" for lo, hi in buckets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cfg, by in rows:
        vals = [f"{by[k]['kl_mean']:.2e} / {by[k]['kl_p99']:.2e} / {by[k]['top1_agree']:.2%}" if k in by else "-"
                for k in buckets]
        lines.append("| " + " | ".join(cfg + vals) + " |")
    return "\n".join(lines)


def table(dirs: list[Path]) -> str:
    head = ["kv", "scales", "backend"] + [h for _, h, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row(d)) + " |" for d in dirs]
    return "\n".join(lines)


def _items(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "items.jsonl").read_text().splitlines() if line.strip()]


def paired(a: Path, b: Path, metrics: tuple[str, ...] = ("kl_mean", "nll_cand", "top1_agree", "first_divergence")) -> str:
    """Per-text differences A − B (same texts, same order): mean ± standard error, and A's and B's
    per-text first-divergence positions."""
    ia, ib = _items(a), _items(b)
    if [r["item_id"] for r in ia] != [r["item_id"] for r in ib]:
        raise SystemExit(f"{a} and {b} hold different texts")
    n = len(ia)
    lines = [f"{a} − {b} over {n} texts"]
    for m in metrics:
        d = [x["scores"][m] - y["scores"][m] for x, y in zip(ia, ib)]
        mean = sum(d) / n
        se = (sum((v - mean) ** 2 for v in d) / (n - 1)) ** 0.5 / n**0.5 if n > 1 else float("nan")
        lines.append(f"  {m}: {mean:+.4f} ± {se:.4f}")
    for label, items in ((a, ia), (b, ib)):
        lines.append(f"  first_divergence {label}: {[int(r['scores']['first_divergence']) for r in items]}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if argv[0] == "--paired":
        if len(argv) != 3:
            print(__doc__.strip(), file=sys.stderr)
            return 2
        print(paired(Path(argv[1]), Path(argv[2])))
        return 0
    dirs = [Path(a) for a in argv]
    print(table(dirs))
    pos = position_table(dirs)
    if pos:
        print("\nKL mean / KL p99 / top-1 agreement by absolute token position:\n")
        print(pos)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

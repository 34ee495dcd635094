"""Markdown table of fidelity summaries from ``kvbench eval --suite fidelity --out DIR`` directories.

    python -m kvbench.suites.fidelity_table DIR [DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

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


def row(out_dir: Path) -> list[str]:
    s = json.loads((Path(out_dir) / "summary.json").read_text())
    if s.get("error"):
        raise SystemExit(f"{out_dir}: run failed: {s['error']}")
    fid = s["suites"].get("fidelity")
    if fid is None:
        raise SystemExit(f"{out_dir}: no fidelity suite in summary.json")
    eng = s.get("engine") or {}
    target = s.get("target") or {}
    scales = eng.get("kv_scales", "?")
    if eng.get("kv_dtype") in ("bf16", "fp16"):
        scales = "-"
    backend = eng.get("prefill_backend", "?") if eng.get("prefill_backend") == eng.get("decode_backend") else f"{eng.get('prefill_backend')}+{eng.get('decode_backend')}"
    cells = [str(eng.get("kv_dtype", target.get("kv_dtype", "?"))), scales, backend]
    return cells + [fmt.format(fid[k]) if fid.get(k) is not None else "-" for k, _, fmt in COLUMNS]


def table(dirs: list[Path]) -> str:
    head = ["kv", "scales", "backend"] + [h for _, h, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row(d)) + " |" for d in dirs]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print(table([Path(a) for a in argv]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

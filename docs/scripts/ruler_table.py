"""Markdown table of mean ruler score by KV configuration x context length (and task) from eval output
directories named <kv>-<scales> under one folder.   python docs/scripts/ruler_table.py runs/ruler-table"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def main(root: str) -> None:
    rows = {}
    lengths: set[int] = set()
    tasks: set[str] = set()
    for d in sorted(Path(root).iterdir()):
        items = d / "items.jsonl"
        if not items.is_file():
            continue
        by = defaultdict(list)
        for line in items.read_text().splitlines():
            r = json.loads(line)
            by[(r["task"], r["context_length"])].append(r["scores"]["ruler"])
            by[("all", r["context_length"])].append(r["scores"]["ruler"])
            lengths.add(r["context_length"])
            tasks.add(r["task"])
        rows[d.name] = by
    order = sorted(lengths)
    head = "| KV (scales) | task | " + " | ".join(str(n) for n in order) + " |"
    print(head)
    print("|" + "---|" * (2 + len(order)))
    for name, by in rows.items():
        for task in ["all", *sorted(tasks)]:
            vals = []
            for n in order:
                v = by.get((task, n), [])
                vals.append(f"{100 * sum(v) / len(v):.0f}% (n={len(v)})" if v else "-")
            print(f"| {name} | {task} | " + " | ".join(vals) + " |")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", help="folder of eval output directories named <kv>-<scales>")
    main(ap.parse_args().root)

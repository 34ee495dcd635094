"""The design is in the repository: every design citation in the code and docs names a section that
docs/design.md has, nothing cites a document outside the repository, and the README's layout table names every
top-level folder of the code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("core", "kernels", "runtime", "suites", "reports", "harness", "tools", "configs", "tests", "docs")


def _files():
    for d in CODE_DIRS:
        for p in (ROOT / d).rglob("*"):
            if p.suffix in (".py", ".md", ".yaml", ".sh") and p.is_file() and "example-report" not in p.parts:
                yield p


def test_design_citations_point_at_sections_of_docs_design_md():
    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "design.md").read_text(), re.M))
    assert sections == {str(i) for i in range(1, 13)}
    cited, outside = [], []
    for p in _files():
        if p.name == "test_design_doc.py":
            continue
        text = p.read_text(errors="replace")
        outside += [f"{p.relative_to(ROOT)}" for _ in re.findall(r"DESIGN §|DESIGN \"", text)]
        cited += [(p.relative_to(ROOT), n) for n in re.findall(r"design\.md §(\d+)", text)]
    assert not outside, outside
    assert cited, "no design citations found"
    assert not [(str(p), n) for p, n in cited if n not in sections]


def test_readme_layout_names_every_code_folder():
    text = (ROOT / "README.md").read_text()
    layout = text[text.index("## Layout"):]
    for d in ("core", "kernels", "runtime", "suites", "reports", "harness", "tools", "configs", "tests", "docs"):
        assert f"| `{d}/` |" in layout, d

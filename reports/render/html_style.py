"""What every kvbench HTML page shares: the stylesheet and images inlined as data URIs (no network), used by
the run report (reports/render/html.py) and the diagnostics report (reports/diagnostics_report.py)."""

from __future__ import annotations

import base64
import html
from pathlib import Path

__all__ = ["CSS", "img"]

CSS = """
body{font-family:-apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:2em auto;
max-width:1300px;padding:0 1.5em;color:#1b1f23;line-height:1.45}
h1{font-size:1.7em;border-bottom:2px solid #e1e4e8;padding-bottom:.3em}
h2{font-size:1.3em;margin-top:2em;border-bottom:1px solid #e1e4e8;padding-bottom:.2em}
h3{font-size:1.05em;margin-top:1.4em}
table{border-collapse:collapse;margin:.6em 0;font-size:.86em;font-variant-numeric:tabular-nums}
th,td{border:1px solid #d0d7de;padding:.3em .6em;text-align:right;white-space:normal;overflow-wrap:break-word}
th{background:#f6f8fa;text-align:center}
td:first-child,td:nth-child(2),td:nth-child(3){text-align:left}
tr:nth-child(even) td{background:#fbfcfd}
tr.fail td{background:#ffebe9}
.meta td{text-align:left;white-space:normal;word-break:break-word}
.note{color:#57606a;font-size:.85em;max-width:1100px}
.empty{color:#57606a;font-style:italic}
img{max-width:100%;border:1px solid #e1e4e8;margin:.5em 0}
ul.headline li{margin:.2em 0}
code{background:#f6f8fa;padding:.1em .3em;border-radius:3px}
"""


def img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{data}'>"

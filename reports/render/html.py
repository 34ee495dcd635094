"""Write a report directory: ``report.md`` (PNG files next to it) and ``report.html`` (one self-contained
file: CSS and PNGs inlined as base64, no network access needed to open it)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from kvbench.core import atomic_write_text
from kvbench.reports.render.plots import write_plots
from kvbench.reports.analysis import Analysis
from kvbench.reports.export import SCHEMA_VERSION, write_exports
from kvbench.reports.gate.discriminative import delta_blind
from kvbench.reports.verdict_render import VERDICT_CSS, verdict_html, verdict_markdown
from kvbench.reports.long_context_tables import NA_BASELINE_ZERO, fmt_ratio, long_context_tables, position_table
from kvbench.reports.tables import (
    Table,
    aa_table,
    accuracy_table,
    capacity_table,
    cells_table,
    delta_table,
    fidelity_table,
    fmt_p,
    fmt_pct,
    fmt_pp,
)
from kvbench.reports.serving import serving_tables

__all__ = ["ReportMeta", "write_report", "headline"]

from kvbench.reports.render.html_style import CSS as _CSS
from kvbench.reports.render.html_style import img as _img


@dataclass
class ReportMeta:
    title: str
    command: str  # the command that regenerates the report
    rows: list[tuple[str, str]] = field(default_factory=list)  # run metadata shown at the top


def headline(a: Analysis) -> list[str]:
    """One line per paired comparison, for pasting into a PR."""
    out = []
    for r in a.deltas:
        d = r.d
        sig = r.p_holm is not None and r.p_holm < 1 - a.confidence
        blind = delta_blind(d.base_mean, d.cand_mean)
        if blind:
            out.append(f"{r.cell.short} vs {r.base.short}, {r.suite}: {blind}: {fmt_pct(d.cand_mean)} vs "
                       f"{fmt_pct(d.base_mean)} says nothing about the format")
            continue
        out.append(f"{r.cell.short} vs {r.base.short}, {r.suite}: {fmt_pp(d.delta)} "
                   f"[{fmt_pp(d.ci_lo)}, {fmt_pp(d.ci_hi)}], p(Holm) {fmt_p(r.p_holm)}"
                   f"{' — significant' if sig else ''}")
    for r in a.aa:
        out.append(f"A/A control {r.suite}: {fmt_pp(r.d.delta)} [{fmt_pp(r.d.ci_lo)}, {fmt_pp(r.d.ci_hi)}], "
                   f"{100 * r.output_agreement:.1f}% identical outputs")
    for r in a.recovery:
        p = r.paired
        ratio = p.auc_ratio
        rec = NA_BASELINE_ZERO if ratio is None else f"{fmt_ratio(ratio)} [{fmt_ratio(p.auc_ratio_ci[0])}, {fmt_ratio(p.auc_ratio_ci[1])}]"
        blind = delta_blind(p.base_auc, p.cand_auc)
        if blind:
            out.append(f"{r.cell.short} vs {r.base.short}, {r.suite} AUC: {blind}: {fmt_pct(p.cand_auc)} vs "
                       f"{fmt_pct(p.base_auc)} says nothing about the format")
            continue
        out.append(f"{r.cell.short} vs {r.base.short}, {r.suite} AUC: {fmt_pct(p.cand_auc)} vs {fmt_pct(p.base_auc)}, "
                   f"recovery {rec}, {fmt_pp(p.delta)} [{fmt_pp(p.ci_lo)}, {fmt_pp(p.ci_hi)}]")
    return out


Part = Union[Table, str]  # a table, or the name of a plot (shown when it was written)


def _sections(a: Analysis, plots: dict[str, Path]) -> list[tuple[str, list[Part]]]:
    out: list[tuple[str, list[Part]]] = [
        ("Accuracy", ["accuracy", accuracy_table(a)]),
        ("Deltas against the baseline", ["deltas", delta_table(a), aa_table(a)]),
    ]
    if "accuracy_throughput" in plots:  # the trade-off: accuracy against serving throughput, Pareto front
        out.append(("Accuracy vs throughput", ["accuracy_throughput"]))
    if a.lengths:
        heatmaps = [n for r_suite in dict.fromkeys(r.suite for r in a.lengths) for n in plots
                    if n.startswith(f"{r_suite}_heatmap_")]
        out.append(("Long-context accuracy", ["long_context_length", *long_context_tables(a), *heatmaps]))
    fid: list[Part] = ["fidelity", fidelity_table(a)]
    if a.positions:
        fid += ["fidelity_position", position_table(a)]
    out += [
        ("Fidelity", fid),
        ("Serving", ["serving", "latency", *serving_tables(a)]),
        ("Capacity", ["capacity", capacity_table(a)]),
        ("Cells", [cells_table(a)]),
    ]
    return out


def _markdown(a: Analysis, meta: ReportMeta, plots: dict[str, Path], verdicts=None, tail: str = "") -> str:
    out = [f"# {meta.title}", ""]
    out += [f"- **{k}**: {v}" for k, v in meta.rows]
    out += [f"- **regenerate**: `{meta.command}`", ""]
    if a.warnings:  # e.g. a comparison whose item sets differ: shown before any number
        out += ["## Warnings", ""] + [f"- {w}" for w in a.warnings] + [""]
    if verdicts is not None:
        out.append(verdict_markdown(verdicts))
    lines = headline(a)
    if lines:
        out += ["## Summary", ""] + [f"- {line}" for line in lines] + [""]
    for title, parts in _sections(a, plots):
        out += [f"## {title}", ""]
        for part in parts:
            if isinstance(part, Table):
                out.append(part.to_markdown())
            elif part in plots:
                out += [f"![{part}]({plots[part].name})", ""]
    if tail:  # sections appended after the report's own (the cells' KV error diagnostics)
        out.append(tail)
    return "\n".join(out).rstrip() + "\n"


def _html(a: Analysis, meta: ReportMeta, plots: dict[str, Path], verdicts=None, tail: str = "") -> str:
    out = ["<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
           "<meta name='viewport' content='width=device-width, initial-scale=1'>",
           f"<title>{html.escape(meta.title)}</title><style>{_CSS}{VERDICT_CSS}</style></head><body>",
           f"<h1>{html.escape(meta.title)}</h1>", "<table class='meta'>"]
    for k, v in meta.rows + [("regenerate", meta.command)]:
        out.append(f"<tr><th>{html.escape(k)}</th><td><code>{html.escape(str(v))}</code></td></tr>")
    out.append("</table>")
    if a.warnings:
        out.append("<h2>Warnings</h2><ul class='warnings'>" + "".join(f"<li>{html.escape(w)}</li>" for w in a.warnings)
                   + "</ul>")
    if verdicts is not None:
        out.append(verdict_html(verdicts))
    lines = headline(a)
    if lines:
        out.append("<h2>Summary</h2><ul class='headline'>" + "".join(f"<li>{html.escape(x)}</li>" for x in lines) + "</ul>")
    for title, parts in _sections(a, plots):
        out.append(f"<h2>{html.escape(title)}</h2>")
        for part in parts:
            if isinstance(part, Table):
                out.append(part.to_html())
            elif part in plots:
                out.append(_img(plots[part], part))
    if tail:
        out.append(tail)
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_report(a: Analysis, out_dir: Path | str, meta: ReportMeta, max_drop: Optional[float] = None,
                 extra: Optional[dict[str, list[dict]]] = None, verdicts=None) -> dict[str, Path]:
    """Write PNGs, report.md and report.html into ``out_dir``, and the machine-readable tables
    (``report.json``, ``tables/*.csv``; ``reports.export``, with the ``extra`` tables); returns {name: path}
    of what was written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(a, out_dir, max_drop=max_drop)
    from kvbench.reports.diagnostics_report import sweep_sections  # imports this module

    diag_md, diag_html, diag_plots = sweep_sections(a.cells, out_dir)
    md, page = out_dir / "report.md", out_dir / "report.html"
    shown = ReportMeta(meta.title, meta.command, [*meta.rows, ("tables", f"report.json, tables/*.csv ({SCHEMA_VERSION})")])
    atomic_write_text(md, _markdown(a, shown, plots, verdicts, tail=diag_md))
    atomic_write_text(page, _html(a, shown, plots, verdicts, tail=diag_html))
    exports = write_exports(a, out_dir, extra=extra,
                            meta={"title": meta.title, "command": meta.command, "info": dict(meta.rows)})
    return {"markdown": md, "html": page, **plots, **diag_plots, **exports}

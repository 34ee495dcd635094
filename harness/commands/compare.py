"""`kvbench compare RUN_A RUN_B... --out DIR`: the runs side by side.

Cells are matched by configuration (reports/run_diff.py: the config keys that vary inside a run; what is
constant per run, such as a model path, goes to the configuration diff).  Prints, and writes to
``DIR/compare.md``, per later run against the first: the configuration differences as paths, accuracy
and serving deltas per matched cell, and the cells with no partner; ``report.md`` / ``report.html`` hold
the full report with paired deltas against the first run's matching cell."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import List

import typer

from kvbench.harness.errors import UserError


def _fail(msg: str) -> None:
    raise UserError(msg)


def register(app: typer.Typer) -> None:
    @app.command("compare", help="Compare runs: configuration diff, accuracy and serving deltas per matched cell (printed and compare.md), plus report.md + report.html.")
    def compare(
        runs: List[Path] = typer.Argument(..., help="Two or more run directories; the first is the reference."),
        out: Path = typer.Option(..., "--out", help="Output directory."),
        confidence: float = typer.Option(0.95, "--confidence", help="Confidence level of intervals."),
        n_boot: int = typer.Option(10_000, "--bootstrap", help="Paired-bootstrap resamples."),
        seed: int = typer.Option(0, "--seed", help="Bootstrap seed."),
    ) -> None:
        from kvbench.core import OutDirError, check_out_dir
        from kvbench.reports import compare_analysis, load_runs, run_meta
        from kvbench.reports import ReportMeta
        from kvbench.reports.render.html import write_report
        from kvbench.reports import RunLoadError

        if not 0.5 < confidence < 1.0:
            _fail(f"--confidence must be in (0.5, 1), got {confidence}")
        if n_boot < 100:
            _fail(f"--bootstrap must be at least 100, got {n_boot}")
        try:
            check_out_dir(out, "--out")
        except OutDirError as e:
            raise UserError(str(e)) from None
        try:
            data = load_runs(list(runs))
            analysis = compare_analysis(data, confidence=confidence, n_boot=n_boot, seed=seed)
        except (RunLoadError, ValueError) as e:
            _fail(str(e))
            return
        rows = []
        for r in data:
            rows += [(f"{r.name}: {k}", v) for k, v in run_meta(r)]
        rows.append(("reference", f"{data[0].name} (each cell is compared with the same config there)"))
        cmd = ["kvbench", "compare", *map(str, runs), "--out", str(out)]
        meta = ReportMeta(title=f"kvbench compare: {' vs '.join(r.name for r in data)}", command=shlex.join(cmd), rows=rows)
        written = write_report(analysis, out, meta)
        from kvbench.reports import diff_runs, format_diff

        text = "\n".join(format_diff(diff_runs(data[0], r)) for r in data[1:])
        (out / "compare.md").write_text(text)
        typer.echo(text)
        typer.echo(f"wrote {len(written) + 1} files to {out}")
        typer.echo(f"markdown: {written['markdown']}")
        typer.echo(f"html:     {written['html'].resolve()}")

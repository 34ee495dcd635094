"""`kvbench compare RUN RUN... --out DIR`: one report across runs; each cell is compared with the cell of
the same config in the first run (paired on items when both hold item records)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import List

import typer


def _fail(msg: str) -> None:
    typer.echo(f"kvbench compare: {msg}", err=True)
    raise typer.Exit(2)


def register(app: typer.Typer) -> None:
    @app.command("compare", help="Compare runs: report.md + report.html with each cell against the same cell of the first run.")
    def compare(
        runs: List[Path] = typer.Argument(..., help="Two or more run directories; the first is the reference."),
        out: Path = typer.Option(..., "--out", help="Output directory."),
        confidence: float = typer.Option(0.95, "--confidence", help="Confidence level of intervals."),
        n_boot: int = typer.Option(10_000, "--bootstrap", help="Paired-bootstrap resamples."),
        seed: int = typer.Option(0, "--seed", help="Bootstrap seed."),
    ) -> None:
        from kvbench.harness.store import OutDirError, check_out_dir
        from kvbench.reports.compare import compare_analysis, load_runs, run_meta
        from kvbench.reports.html import ReportMeta, write_report
        from kvbench.reports.load import RunLoadError

        if not 0.5 < confidence < 1.0:
            _fail(f"--confidence must be in (0.5, 1), got {confidence}")
        if n_boot < 100:
            _fail(f"--bootstrap must be at least 100, got {n_boot}")
        try:
            check_out_dir(out, "--out")
        except OutDirError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
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
        typer.echo(f"wrote {len(written)} files to {out}")
        typer.echo(f"markdown: {written['markdown']}")
        typer.echo(f"html:     {written['html'].resolve()}")

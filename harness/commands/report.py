"""`kvbench report RUN --out DIR`: Markdown + one self-contained HTML report (and PNGs) from a run."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

import typer

from kvbench.harness.errors import UserError


def _fail(msg: str) -> None:
    raise UserError(msg)


def register(app: typer.Typer) -> None:
    @app.command("report", help="Write report.md, report.html (self-contained) and PNG plots for a run.")
    def report(
        run: Path = typer.Argument(..., help="Run directory written by `kvbench sweep`."),
        out: Optional[Path] = typer.Option(None, "--out", help="Output directory (default: RUN/report)."),
        baseline: Optional[str] = typer.Option(None, "--baseline", help="Baseline cell selector key=value[,key=value] (default: the run config's baseline)."),
        confidence: float = typer.Option(0.95, "--confidence", help="Confidence level of intervals."),
        n_boot: int = typer.Option(10_000, "--bootstrap", help="Paired-bootstrap resamples."),
        seed: int = typer.Option(0, "--seed", help="Bootstrap seed."),
    ) -> None:
        from kvbench.core import OutDirError, check_out_dir
        from kvbench.reports import report_analysis, run_meta
        from kvbench.reports import ReportMeta
        from kvbench.reports.render.html import write_report
        from kvbench.reports import RunLoadError, load_run, selector_text
        from kvbench.reports import series_label

        if not 0.5 < confidence < 1.0:
            _fail(f"--confidence must be in (0.5, 1), got {confidence}")
        if n_boot < 100:
            _fail(f"--bootstrap must be at least 100, got {n_boot}")
        out_dir = out or (run / "report")
        if out is not None or run.is_dir():  # a RUN that is no directory is load_run's to report
            try:
                check_out_dir(out_dir, "--out" if out is not None else "report directory")
            except OutDirError as e:
                raise UserError(str(e)) from None
        try:
            data = load_run(run)
            analysis = report_analysis(data, baseline, confidence=confidence, n_boot=n_boot, seed=seed)
        except (RunLoadError, ValueError) as e:
            _fail(str(e))
            return
        cmd = ["kvbench", "report", str(run), "--out", str(out_dir)] + (["--baseline", baseline] if baseline else [])
        meta_rows = run_meta(data)
        base = analysis.baseline
        if base is None:
            base_text = "none (no cell has item records)"
        elif not base.items:  # a serving-only run: the configured series the serving ratios divide by
            base_text = f"{series_label(base)} (serving only: the × base ratios divide by this series)"
        else:
            base_text = f"{base.short} [{base.key}]"
        meta_rows.append(("baseline", base_text))
        meta_rows.append(("statistics", f"{100 * confidence:g}% intervals; paired deltas: Newcombe for 0/1 scores (K=1), else paired bootstrap {n_boot} resamples, seed {seed}; Holm; long-context AUC: bootstrap over questions within each length, same resamples and seed"))
        meta = ReportMeta(title=f"kvbench report: {data.config.get('name') or data.name}", command=shlex.join(cmd),
                          rows=meta_rows)
        from kvbench.reports import build_verdicts, verdict_records

        verdicts = build_verdicts(data, analysis, baseline)
        if verdicts is not None:
            meta_rows.insert(0, ("verdict", verdicts.word or f"none: {verdicts.error}"))
        written = write_report(analysis, out_dir, meta, max_drop=_default_drop(data.config), verdicts=verdicts,
                               extra=verdict_records(verdicts))
        typer.echo(f"wrote {len(written)} files to {out_dir}")
        typer.echo(f"markdown: {written['markdown']}")
        typer.echo(f"html:     {written['html'].resolve()}")


def _default_drop(config: dict) -> Optional[float]:
    """A single δ line for the delta plot, when the config's gate has one value for every suite."""
    md = (config.get("gate") or {}).get("max_drop")
    if isinstance(md, (int, float)):
        return float(md)
    if isinstance(md, dict) and md and len(set(md.values())) == 1:
        return float(next(iter(md.values())))
    return None

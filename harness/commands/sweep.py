"""`kvbench sweep CONFIG [--out RUN] [--resume] [--only SELECTOR]`: run a sweep matrix into a run directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

DATA_DIR_ENV = "KVBENCH_DATA_DIR"  # suites.data.DATA_DIR_ENV (not imported: --help stays light)


def _check_run_dir(run_dir: Path) -> None:
    """A run directory must be a directory or creatable (``store.check_out_dir``), as a config error."""
    from kvbench.harness.store import OutDirError, check_out_dir
    from kvbench.harness.sweep_config import SweepConfigError

    try:
        check_out_dir(run_dir, "--out")
    except OutDirError as e:
        raise SweepConfigError(str(e)) from None


def register(app: typer.Typer) -> None:
    @app.command("sweep")
    def sweep(
        config: str = typer.Argument(..., help="Sweep config YAML (e.g. configs/default.yaml)"),
        out: Optional[str] = typer.Option(None, "--out", help="Run directory (default: runs/<config name>)"),
        resume: bool = typer.Option(False, "--resume", help="Finish an interrupted run: skip done cells, redo the rest"),
        only: Optional[str] = typer.Option(None, "--only", help="Run only cells matching key=value[,key=value]"),
        data_dir: Optional[str] = typer.Option(None, "--data-dir", help="Local dataset directory (overrides the config's data_dir)"),
        dry_run: bool = typer.Option(False, "--dry-run", help="List the cells and exit"),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar (off: one plain line per cell)"),
    ) -> None:
        """Run the matrix of a sweep config: accuracy suites, fidelity, load tests and capacity per cell."""
        import logging

        from kvbench.harness.matrix import expand, select
        from kvbench.harness.sweep_config import SweepConfigError, load_config

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        try:
            cfg = load_config(config)
            if data_dir is not None:
                if not Path(data_dir).is_dir():
                    raise SweepConfigError(f"--data-dir {data_dir} is not a directory")
                cfg.data_dir = data_dir
            elif cfg.data_dir is None and os.environ.get(DATA_DIR_ENV) and Path(os.environ[DATA_DIR_ENV]).is_dir():
                # the suites would read it from the environment: record it (the manifest, --resume checks)
                cfg.data_dir = os.environ[DATA_DIR_ENV]
            cells = select(expand(cfg), only)
            run_dir = Path(out or Path("runs") / cfg.name)
            _check_run_dir(run_dir)
        except SweepConfigError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)
        if dry_run:
            for c in cells:
                typer.echo(f"{c.key}  {c.label}{'  [accuracy]' if c.run_accuracy else ''}")
            typer.echo(f"{len(cells)} cells -> {run_dir}")
            return

        from kvbench.harness.runner import run_sweep

        try:
            outcome = run_sweep(cfg, run_dir, resume=resume, only=only, progress=True if progress else None)
        except SweepConfigError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)
        typer.echo(
            f"{run_dir}: {len(outcome.done)} cells done, {len(outcome.failed)} failed, "
            f"{len(outcome.skipped)} already done (skipped)"
        )
        if outcome.failed:
            typer.echo(f"failed cells (see {run_dir}/cells/<key>/summary.json and error.txt):", err=True)
            for key in outcome.failed:
                typer.echo(f"  {key}", err=True)
            raise typer.Exit(1)

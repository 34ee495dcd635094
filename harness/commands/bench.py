"""`kvbench bench`: GPU benchmarks (kernels, MLA kernels)."""

from __future__ import annotations

from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    from kvbench.harness.term import Typer

    bench = Typer(help="Benchmarks on a CUDA device: kernels (paged decode / prefill / append, MLA), mla (the MLA latent-cache kernels).", no_args_is_help=True)
    app.add_typer(bench, name="bench")

    @bench.command("kernels")
    def kernels(
        check: bool = typer.Option(False, "--check", help="Run the correctness check against float64 references first."),
        quick: bool = typer.Option(False, "--quick", help="Smaller grid, no tile tuning."),
        out: Optional[str] = typer.Option(None, "--out", help="Write the results as JSON to this file."),
        flashinfer: bool = typer.Option(True, "--flashinfer/--no-flashinfer", help="Time flashinfer's decode and prefill as anchors when importable (torch SDPA rows are always there)."),
        parts: str = typer.Option("decode,prefill,append,mla", "--parts",
                                  help="Comma list of decode, prefill, append, mla (the MLA latent-cache kernels; "
                                       "`kvbench bench mla` has their own options)."),
        layout: str = typer.Option("HND", "--layout", help="Page layout of the caches: HND (the runtime's default) or NHD."),
    ) -> None:
        """Paged decode / prefill / fused append vs copy bandwidth, flashinfer and SDPA anchors; MLA kernels.

        Rows are printed as they are measured (progress on stderr); the targets table and --out follow."""
        from kvbench.tools.kernel_bench import main, parse_parts

        if layout not in ("HND", "NHD"):
            raise typer.BadParameter(f"--layout must be HND or NHD, got {layout!r}")
        try:
            parse_parts(parts)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--parts") from None
        raise typer.Exit(main(check=check, quick=quick, out=out, flashinfer=flashinfer, parts=parts, layout=layout) or 0)

    @bench.command("mla")
    def mla(
        out: Optional[str] = typer.Option(None, "--out", help="Directory for mla_check.json / .md."),
        quick: bool = typer.Option(False, "--quick", help="Smaller benchmark grid."),
        skip_checks: bool = typer.Option(False, "--skip-checks", help="Only time, do not check."),
        heads: str = typer.Option("16,128", "--heads", help="Query head counts for the decode benchmark (comma list)."),
        no_sweep: bool = typer.Option(False, "--no-sweep", help="Skip the launch-configuration sweep."),
        stages: bool = typer.Option(False, "--stages", help="Only the decode's pipeline-depth table at 64 x 8192."),
        targets: bool = typer.Option(False, "--targets", help="Only the decode per format at 64 x 8192 against "
                                     "flashinfer's MLA decode, with the speed targets (MET / MISS); the full run "
                                     "ends with the same table unless --quick."),
    ) -> None:
        """MLA latent-cache kernels: checks at DeepSeek-V3 shapes, decode/append/prefill timings, the speed targets."""
        from kvbench.tools.mla_check import main

        if stages and targets:
            raise typer.BadParameter("--stages and --targets each run one table; give one", param_hint="--targets")
        argv = (["--out", out] if out else []) + (["--quick"] if quick else []) + (["--skip-checks"] if skip_checks else [])
        argv += ["--heads", heads] + (["--no-sweep"] if no_sweep else []) + (["--stages"] if stages else [])
        argv += ["--flashinfer"] if targets else []
        raise typer.Exit(main(argv) or 0)

"""`kvbench gate RUN --baseline SELECTOR --candidate SELECTOR`: non-inferiority exit code for CI.

Exit 0 PASS, 1 FAIL, 3 INCONCLUSIVE, 4 NOT DISCRIMINATIVE (reports/gate/check.py says which wins), 2 for missing
data or a usage error: the same word the report's verdict card shows for the same run.  The long-context score gates as ``--metric ruler`` (per-item scores.ruler), ``ruler:L<length>`` or ``ruler:auc``.  Prints the
deciding table and, last, one summary line: under GitHub Actions (``GITHUB_ACTIONS=true``) or with
``--annotations`` a workflow command (``::notice::`` / ``::warning::`` / ``::error::``) that the runner shows as
an annotation, elsewhere plain ``kvbench gate: <word> ...`` (``--no-annotations`` forces that).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List, Optional

import typer

_HELP = ("Non-inferiority gate: pass when the one-sided lower confidence bound of (candidate − baseline) "
         "is above −δ for every gated metric. 0/1 metrics (one repeat) use Newcombe's hybrid score interval for "
         "paired proportions; --method applies to other scores. Baseline and candidate must hold the same items "
         "(pairs with a failed request on either side are left out and counted; each cell's error rate is a check). "
         "A metric whose baseline sits at the floor or ceiling, or that the run's A/A control moves by the margin, "
         "is NOT DISCRIMINATIVE: the gate refuses to certify on it. "
         "Exit 0 PASS, 1 FAIL, 3 INCONCLUSIVE, 4 NOT DISCRIMINATIVE, 2 missing data or usage error. "
         "The last line sums the result up; under GitHub Actions (or with --annotations) it is a workflow "
         "command (::notice:: / ::warning:: / ::error::) shown as an annotation.")

# a workflow command: ::<level> <properties>::<message>
_WORKFLOW_COMMAND = re.compile(r"::(notice|warning|error)( [^:]*)?::(.*)", re.S)


def _annotating(flag: Optional[bool]) -> bool:
    """Whether to print workflow-command lines: as --annotations / --no-annotations says, else only under
    GitHub Actions (other CI systems and terminals show them as noise)."""
    return flag if flag is not None else os.environ.get("GITHUB_ACTIONS") == "true"


def _summary_text(line: str, annotate: bool) -> str:
    """The gate's summary line (a workflow command, reports/gate/output.py) as printed: unchanged when
    annotating, else its message alone after ``kvbench gate:``."""
    m = _WORKFLOW_COMMAND.fullmatch(line)
    if annotate or m is None:
        return line
    return f"kvbench gate: {m.group(3)}"


def _error(msg: str, annotate: bool) -> None:
    from kvbench.harness.errors import UserError

    if annotate:
        typer.echo(f"::error title=kvbench gate::missing data or usage error: {msg}")
    err = UserError(msg)
    err.annotated = True  # the gate prints its own annotation (or none): harness/cli_errors.py adds none
    raise err


def _apply_flags(t, max_drop, metric, max_invalid_increase, max_truncation_increase, max_kl, confidence, method,
                 max_error_rate=None, no_aa=False, max_ppl_ratio=None, min_top1=None):
    from dataclasses import replace

    t = replace(t, max_drop=dict(t.max_drop))
    for spec in max_drop or []:
        suite, sep, value = spec.rpartition("=")
        try:
            v = float(value)
        except ValueError:
            raise ValueError(f"--max-drop {spec!r}: expected D or SUITE=D with D a number (0.05 = 5 points)") from None
        if sep:
            t.max_drop[suite] = v
        else:
            t.default_max_drop, t.max_drop = v, {}
    if metric:
        t.metrics = list(metric)
    for name, v in (("max_invalid_rate_increase", max_invalid_increase), ("max_truncation_rate_increase", max_truncation_increase),
                    ("max_kl_mean", max_kl), ("confidence", confidence), ("method", method),
                    ("max_error_rate", max_error_rate), ("max_ppl_ratio", max_ppl_ratio),
                    ("min_top1_agreement", min_top1)):
        if v is not None:
            setattr(t, name, v)
    for name, v in (("max_kl_mean", max_kl), ("max_ppl_ratio", max_ppl_ratio), ("min_top1_agreement", min_top1)):
        if v is not None:  # a fidelity limit named on the command line needs fidelity records
            t.fidelity_required = True
    if no_aa:
        t.use_aa = False
    return t


def _step_summary(result) -> None:
    path = os.environ.get("GITHUB_STEP_SUMMARY")
    if not path:
        return
    from kvbench.reports import GATE_COLUMNS, check_row

    lines = [f"### kvbench gate: {result.word}", "",
             "| " + " | ".join(GATE_COLUMNS) + " |", "|" + "---|" * len(GATE_COLUMNS)]
    lines += ["| " + " | ".join(check_row(c, result.thresholds.confidence)) + " |" for c in result.checks]
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n\n")


def register(app: typer.Typer) -> None:
    @app.command("gate", help=_HELP)
    def gate(
        run: Path = typer.Argument(..., help="Run directory written by `kvbench sweep`."),
        candidate: Optional[str] = typer.Option(None, "--candidate", help="Cell selector key=value[,key=value]; every matching cell with accuracy records is gated (default: every cell with accuracy records except the baseline and the A/A control, as the report's verdict cards)."),
        baseline: Optional[str] = typer.Option(None, "--baseline", help="Cell selector of the baseline (default: the run config's baseline)."),
        metric: Optional[List[str]] = typer.Option(None, "--metric", help="Gated metric: SUITE or SUITE:METRIC or a score name (repeatable; default: every suite's primary metric). Long-context suites (ruler) also take SUITE:auc (area under the accuracy-vs-length curve) and SUITE:L<length> (one context length)."),
        max_drop: Optional[List[str]] = typer.Option(None, "--max-drop", help="Allowed drop δ as a fraction (0.05 = 5 points), or SUITE=δ, or SUITE:METRIC=δ such as ruler:auc=0.1 (repeatable)."),
        max_invalid_increase: Optional[float] = typer.Option(None, "--max-invalid-increase", help="Allowed increase of the invalid-answer rate, a fraction in [0, 1] (default 0.05)."),
        max_truncation_increase: Optional[float] = typer.Option(None, "--max-truncation-increase", help="Allowed increase of the truncation rate, a fraction in [0, 1] (default 0.05)."),
        max_kl: Optional[float] = typer.Option(None, "--max-kl", help="Largest allowed fidelity KL mean over every token (summary.json's kl_mean; its one-sided upper bound over texts is gated). Default 0.02 (docs/verdict.md: the KL of a 2% perplexity rise); `max_kl_mean: false` in the config turns it off."),
        max_ppl_ratio: Optional[float] = typer.Option(None, "--max-ppl-ratio", help="Largest allowed perplexity ratio candidate / reference on the fidelity texts (its upper bound is gated). Default 1.02 (+2%)."),
        min_top1: Optional[float] = typer.Option(None, "--min-top1", help="Smallest allowed top-1 agreement with the reference on the fidelity texts, a fraction (its lower bound is gated). Default: reported, not gated."),
        confidence: Optional[float] = typer.Option(None, "--confidence", help="One-sided confidence level, strictly between 0.5 and 1 (default 0.95)."),
        method: Optional[str] = typer.Option(None, "--method", help="Bound method for scores that are not 0/1 (and K>1): bootstrap (default) or t. 0/1 scores with one repeat always use Newcombe's interval."),
        config: Optional[Path] = typer.Option(None, "--config", help="Sweep config whose gate: section sets the thresholds (instead of the run's own)."),
        max_error_rate: Optional[float] = typer.Option(None, "--max-error-rate", help="Largest allowed share of failed requests (timeouts, HTTP errors, dropped streams) per cell and gated suite, a fraction in [0, 1] (default 0.01)."),
        no_aa: bool = typer.Option(False, "--no-aa", help="Ignore the run's A/A control when judging whether a metric discriminates."),
        plan: bool = typer.Option(False, "--plan", help="Also print how many questions would certify each gated accuracy check that did not pass, at the observed rates and agreement."),
        power: float = typer.Option(0.8, "--power", help="Power of the --plan estimate (the 50%% figure is printed too)."),
        json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the decision as JSON here."),
        annotations: Optional[bool] = typer.Option(None, "--annotations/--no-annotations", show_default=False, help="Print the summary line and errors as GitHub Actions workflow commands (::notice:: / ::warning:: / ::error::). Default: only under GitHub Actions (GITHUB_ACTIONS=true); elsewhere a plain 'kvbench gate: ...' line."),
    ) -> None:
        from kvbench.core import atomic_write_json
        from kvbench.reports import GateError, GateThresholds, format_table, merge_gate_config, run_gate, summary_line, to_json
        from kvbench.reports import RunLoadError, load_run

        try:
            data = load_run(run)
            t = merge_gate_config(GateThresholds(), data.config.get("gate"))
            if config is not None:
                from dataclasses import asdict

                from kvbench.harness.sweep.config import SweepConfigError, load_config

                try:
                    t = merge_gate_config(t, asdict(load_config(config).gate))
                except SweepConfigError as e:
                    raise GateError(f"--config: {e}") from None
            t = _apply_flags(t, max_drop, metric, max_invalid_increase, max_truncation_increase, max_kl, confidence, method,
                             max_error_rate, no_aa, max_ppl_ratio, min_top1)
            if not 0.5 <= power < 1:
                raise GateError(f"--power must be in [0.5, 1), got {power}")
            if baseline is None:
                sel = data.config.get("baseline")
                if not sel:
                    raise GateError("no --baseline given and the run's config names no baseline")
                baseline = sel if isinstance(sel, str) else ",".join(f"{k}={v}" for k, v in sel.items())
            result = run_gate(data, baseline, candidate, t)
        except (GateError, RunLoadError, ValueError) as e:
            _error(str(e), _annotating(annotations))
            return
        typer.echo(format_table(result))
        doc = to_json(result)
        if plan:
            from kvbench.reports import format_plan, plan_result

            plans = plan_result(result, power)
            typer.echo("")
            typer.echo(format_plan(plans))
            doc["plan"] = [{"candidate": p.check.candidate.key, "suite": p.check.suite, "metric": p.check.metric,
                            "status": p.check.status, "questions_now": p.n_now, "needed_expected": p.n_expected,
                            "needed_power": p.n_power, "power": p.power, "note": p.note} for p in plans]
        if json_out is not None:
            atomic_write_json(json_out, doc)
        _step_summary(result)
        typer.echo(_summary_text(summary_line(result), _annotating(annotations)))
        raise typer.Exit(result.exit_code)

"""`kvbench diagnose`: where a KV format's error comes from, and which layers to keep in bf16.

    kvbench diagnose --kv-dtype nvfp4 --kv-scales calibrate --data-dir ../shared/data --limit 4 \\
        --kl-limit 0.02 --out runs/diagnose-nvfp4

Runs fidelity texts (GSM8K solutions, or ``--text-tokens N`` long texts) through the embedded engine in the
candidate format and writes ``OUT/diagnostics.json`` (``harness/diagnose.py``), ``report.md`` /
``report.html`` with the heatmaps, and, with ``--kl-limit``, the suggested skip set and ``confirm.yaml``: the
sweep that checks the suggestion on the fidelity and long-context suites (``--confirm`` runs it into
``OUT/confirm``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from kvbench.harness.errors import UserError
from kvbench.harness.options import engine_options

DEFAULT_TEXTS = 8


def register(app: typer.Typer) -> None:
    @app.command("diagnose")
    @engine_options
    def diagnose_cmd(
        engine,
        out: str = typer.Option(..., "--out", help="Directory for diagnostics.json, report.md / report.html, the plots and confirm.yaml"),
        limit: int = typer.Option(DEFAULT_TEXTS, "--limit", help="Texts to run (fidelity texts, dataset order)"),
        data_dir: Optional[str] = typer.Option(None, "--data-dir", help="Local GSM8K files (env KVBENCH_DATA_DIR)"),
        text_tokens: Optional[int] = typer.Option(None, "--text-tokens", help="Long texts of this many tokens (GSM8K solutions concatenated, or --haystack-file)"),
        haystack_file: Optional[str] = typer.Option(None, "--haystack-file", help="Natural text for --text-tokens (a UTF-8 file)"),
        kl_limit: Optional[float] = typer.Option(None, "--kl-limit", help="Suggest the fewest layers (by KL contribution) to keep in bf16 so KL <= this; every step is measured"),
        leave_one_out: bool = typer.Option(True, "--leave-one-out/--no-leave-one-out", help="Measure each layer's KL contribution (one run per quantized layer)"),
        capacity_context: Optional[int] = typer.Option(None, "--capacity-context", help="Context per sequence of the capacity rows (default: the engine's max length)"),
        confirm: bool = typer.Option(False, "--confirm", help="Run confirm.yaml (bf16, the candidate, the suggestion on fidelity + ruler) into OUT/confirm"),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a diagnosis OUT already holds"),
    ) -> None:
        """Per-layer and per-head KV error (K and V), each layer's KL contribution, and a checked skip-layer suggestion."""
        from kvbench.core import atomic_write_json, atomic_write_text
        from kvbench.harness.diagnose import DiagnoseSettings, check_diagnosable, diagnosis_texts, load_for, run_diagnosis
        from kvbench.runtime import context_length

        out_dir = Path(out)
        if (out_dir / "diagnostics.json").exists() and not overwrite:
            raise UserError(f"--out {out} already holds a diagnosis (diagnostics.json); give --overwrite to replace it")
        if kl_limit is not None and not kl_limit >= 0:
            raise UserError(f"--kl-limit must be >= 0, got {kl_limit}")
        if limit <= 0:
            raise UserError(f"--limit must be positive, got {limit}")
        try:
            check_diagnosable(engine)
        except ValueError as e:
            raise UserError(str(e)) from None
        if kl_limit is not None and not leave_one_out:
            raise UserError("--kl-limit ranks layers by their leave-one-out KL contribution; drop --no-leave-one-out")
        data_dir = data_dir or None
        from types import SimpleNamespace

        say = lambda s: print(f"diagnose: {s}", file=sys.stderr, flush=True)  # noqa: E731
        loaded = load_for(engine)
        m = loaded.config
        max_len = context_length(engine.max_model_len, m.max_position_embeddings, loaded.model_id)  # refuses a longer one
        counter = SimpleNamespace(engine=SimpleNamespace(tokenizer=loaded.tokenizer))  # token counts for long texts
        try:
            texts, label = diagnosis_texts(loaded.tokenizer, counter, limit, data_dir, text_tokens, haystack_file, max_len)
        except Exception as e:  # missing data and the like: one line
            raise UserError(str(e)) from None
        settings = DiagnoseSettings(kl_limit=kl_limit, leave_one_out=leave_one_out, context_len=capacity_context, label=label)
        say(f"{len(texts)} texts ({label}, {sum(len(c) for _, c in texts)} scored tokens), {engine.kv_dtype}/{engine.kv_scales}")
        diag = run_diagnosis(engine, texts, settings, loaded=loaded, progress=say)
        out_dir.mkdir(parents=True, exist_ok=True)
        if diag.get("suggestion"):
            import yaml

            from kvbench.harness.diagnose_confirm import confirm_config

            fid_params = {"text_tokens": text_tokens} if text_tokens else {}
            if haystack_file:
                fid_params["haystack_file"] = haystack_file
            conf = confirm_config(engine, diag, len(texts), fidelity_params=fid_params, data_dir=data_dir)
            atomic_write_text(out_dir / "confirm.yaml", yaml.safe_dump(conf, sort_keys=False))
            cmd = f"kvbench sweep {out_dir / 'confirm.yaml'} --out {out_dir / 'confirm'}"
            diag["confirm"] = {"config": "confirm.yaml", "command": cmd}
        atomic_write_json(out_dir / "diagnostics.json", diag)
        _write_report(diag, out_dir)
        _print(diag)
        typer.echo(f"wrote {out_dir / 'diagnostics.json'} and {out_dir / 'report.html'}")
        if confirm and diag.get("confirm"):
            import subprocess

            typer.echo(f"running {diag['confirm']['command']}")
            rc = subprocess.call([sys.executable, "-m", "kvbench.harness", "sweep", str(out_dir / "confirm.yaml"),
                                  "--out", str(out_dir / "confirm")])
            if rc:
                raise typer.Exit(rc)


def _write_report(diag: dict, out_dir: Path) -> None:
    from kvbench.reports.diagnostics_report import write_report

    write_report(diag, out_dir)


def _print(diag: dict) -> None:
    from kvbench.harness.term import console, table

    layers = [d for d in diag["layers"] if d.get("kl_contribution") is not None]
    typer.echo(f"KL {diag['kl']['full']:.4g} over {diag['kl']['tokens']} tokens (top-1 agreement {diag['kl']['top1_agree']:.1%})")
    if layers:
        t = table("KL contribution by layer (leave-one-out), largest first",
                  ("layer", "format", "K err", "V err", "attn err", "KL with layer in bf16", "contribution"), justify="right")
        for d in sorted(layers, key=lambda d: -d["kl_contribution"])[:10]:
            k, v = d.get("k") or {}, d.get("v") or {}
            t.add_row(str(d["layer"]), d["format"], _mean(k.get("rel_err")), _mean(v.get("rel_err")), _mean(d.get("attn_rel_err")),
                      f"{d['kl_loo']:.4g}", f"{d['kl_contribution']:+.4g}")
        console().print(t)
    s = diag.get("suggestion")
    if s:
        verdict = "meets" if s["met"] else "does NOT meet"
        typer.echo(f"suggestion: keep layers {s['skip_layers'] or '(none)'} in bf16 -> KL {s['kl']:.4g} ({verdict} the limit {s['limit']:g}; "
                   f"{len(s['steps'])} measured steps)")
        for r in s["capacity"]["rows"]:
            typer.echo(f"  {r['name']}: {r['bytes_per_token']:,.0f} B/token, {r['tokens']:,} tokens, max concurrency "
                       f"{r['max_concurrency']} at {s['capacity']['context_len']}")
        if diag.get("confirm"):
            typer.echo(f"confirm: {diag['confirm']['command']}")


def _mean(xs) -> str:
    xs = [x for x in (xs or []) if x is not None]
    return f"{sum(xs) / len(xs):.3g}" if xs else "-"

"""Build the analysis behind ``kvbench report RUN`` (cells against the run's baseline) and
``kvbench compare RUN...`` (each cell against the cell with the same config in the first run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from kvbench.reports.load import RunData, RunLoadError, assign_short_labels, load_run, resolve_baseline
from kvbench.reports.analysis import Analysis, analyze

__all__ = ["report_analysis", "compare_analysis", "load_runs", "run_meta"]


def report_analysis(run: RunData, baseline: Optional[str] = None, confidence: float = 0.95, n_boot: int = 10_000,
                    seed: int = 0) -> Analysis:
    base = resolve_baseline(run, baseline)
    return analyze(run.cells, lambda cell: base, baseline=base, confidence=confidence, n_boot=n_boot, seed=seed)


def load_runs(paths: list[Path | str]) -> list[RunData]:
    """Load several runs with distinct names (the directory name, made unique with its parent's)."""
    if len(paths) < 2:
        raise RunLoadError("compare needs at least two runs")
    resolved = [Path(p).resolve() for p in paths]
    if len(set(resolved)) != len(resolved):
        raise RunLoadError("the same run directory is given twice")
    names = [p.name for p in resolved]
    if len(set(names)) != len(names):
        names = [f"{p.parent.name}/{p.name}" for p in resolved]
    if len(set(names)) != len(names):
        names = [str(p) for p in resolved]
    return [load_run(p, name=n) for p, n in zip(paths, names)]


def _config_id(config: dict) -> str:
    return json.dumps(config, sort_keys=True, default=str)


def compare_analysis(runs: list[RunData], confidence: float = 0.95, n_boot: int = 10_000, seed: int = 0) -> Analysis:
    cells = [c for r in runs for c in r.cells]
    assign_short_labels(cells, with_run=True)
    first = runs[0]
    # matched on the config keys that vary inside a run (reports/run_diff.py): a model path or target name
    # that differs between the runs does not keep a cell from its partner
    from kvbench.reports.run_diff import match_id, match_keys

    keys = match_keys(runs)
    reference = {match_id(c, keys): c for c in first.done_cells if c.items}

    def baseline_for(cell):
        if cell.run == first.name:
            return None
        return reference.get(match_id(cell, keys))

    base = resolve_baseline(first)
    return analyze(cells, baseline_for, baseline=base, confidence=confidence, n_boot=n_boot, seed=seed)


def _short(v) -> str:
    if isinstance(v, dict):
        for k in ("sha", "commit", "name"):
            if k in v:
                extra = " (dirty)" if v.get("dirty") else ""
                return f"{v[k]}{extra}"
        return json.dumps(v, sort_keys=True, default=str)[:160]
    return str(v)


def device_text(d: dict) -> str:
    """The run's machine in one line, GPUs first: ``NVIDIA H200 (143771 MiB), driver 580.159.03, CUDA 13.0;
    CPU AMD EPYC 9654 ×16; host h``."""
    if not isinstance(d, dict):
        return _short(d)
    parts = []
    gpus = d.get("gpus") or []
    if gpus:
        mem = d.get("gpu_memory_mib") or []
        names = [f"{g} ({m} MiB)" if m else str(g) for g, m in zip(gpus, list(mem) + [None] * len(gpus))]
        groups: dict = {}
        for n in names:
            groups[n] = groups.get(n, 0) + 1
        text = ", ".join(f"{n} ×{k}" if k > 1 else n for n, k in groups.items())
        text += "".join(f", {label} {d[key]}" for key, label in (("driver", "driver"), ("cuda", "CUDA")) if d.get(key))
        parts.append(text)
    else:
        parts.append("no GPU seen")
    if d.get("cpu") or d.get("cpu_count"):
        parts.append(f"CPU {d.get('cpu') or '?'} ×{d.get('cpu_count') or '?'}")
    if d.get("host"):
        parts.append(f"host {d['host']}")
    return "; ".join(parts)


def run_meta(run: RunData) -> list[tuple[str, str]]:
    """Rows describing a run at the top of a report."""
    m, cfg = run.manifest, run.config
    rows = [("run", str(run.path))]
    if cfg.get("name"):
        rows.append(("config", str(cfg["name"])))
    for key, label in (("created", "created"), ("date", "date"), ("git", "git"), ("git_sha", "git"), ("device", "device")):
        if m.get(key) not in (None, "", {}):
            rows.append((label, device_text(m[key]) if key == "device" else _short(m[key])))
    done = len(run.done_cells)
    failed = sum(1 for c in run.cells if c.status == "failed")
    planned = {c.get("key") for c in m.get("cells") or [] if isinstance(c, dict) and c.get("key")}
    total = len(planned | {c.key for c in run.cells})  # the manifest's plan: cells never started count as unfinished
    rows.append(("cells", f"{done} done, {failed} failed, {total - done - failed} unfinished, of {total}"))
    return rows

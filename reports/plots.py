"""Report figures as PNG files (matplotlib's object API with the Agg canvas: no pyplot state, no display).

Each function takes an ``Analysis`` and a path, writes one PNG atomically and returns True, or returns
False (writing nothing) when the run has no data for that figure.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Optional

from kvbench.harness.store import atomic_write_bytes
from kvbench.reports.analysis import Analysis
from kvbench.reports.load import primary_metric

__all__ = ["accuracy_plot", "delta_plot", "serving_plot", "capacity_plot", "fidelity_plot", "write_plots"]

_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> bool:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())
    return True


def _series_label(cell) -> str:
    c = cell.concurrency
    return cell.short.replace(f" c={c}", "") if c is not None else cell.short


def series_colors(a: Analysis) -> dict[str, str]:
    """One colour per format series, the same in every figure."""
    names = list(dict.fromkeys(_series_label(c) for c in a.cells if not c.aa_control))
    return {n: _COLORS[i % len(_COLORS)] for i, n in enumerate(names)}


def accuracy_plot(a: Analysis, path: Path) -> bool:
    rows = [r for r in a.accuracy if r.metric == primary_metric(r.suite)]
    suites = list(dict.fromkeys(r.suite for r in rows))
    if not suites:
        return False
    colors = series_colors(a)
    ncols = min(3, len(suites))
    nrows = math.ceil(len(suites) / ncols)
    n_cells = max(sum(1 for r in rows if r.suite == s) for s in suites)
    fig = _figure(4.6 * ncols, 0.9 + nrows * (0.45 * n_cells + 0.9))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat[len(suites):]:
        ax.set_visible(False)
    for ax, suite in zip(axes.flat, suites):
        sr = [r for r in rows if r.suite == suite]
        ys = list(range(len(sr)))[::-1]
        for y, r in zip(ys, sr):
            e = r.est
            lo, hi = max(0.0, e.lo), min(1.0, e.hi)
            base = a.baseline is not None and r.cell is a.baseline
            color = "#222222" if base else ("#999999" if r.cell.aa_control else colors.get(_series_label(r.cell), "#1f77b4"))
            ax.errorbar([100 * e.mean], [y], xerr=[[100 * (e.mean - lo)], [100 * (hi - e.mean)]], fmt="o", color=color,
                        capsize=4, markersize=6)
            ax.annotate(f"{100 * e.mean:.1f}", (100 * e.mean, y), textcoords="offset points", xytext=(0, 7),
                        ha="center", fontsize=8)
        if a.baseline is not None:
            base_rows = [r for r in sr if r.cell is a.baseline]
            if base_rows:
                ax.axvline(100 * base_rows[0].est.mean, color="#222222", lw=0.8, ls=":")
        ax.set_yticks(ys, [r.cell.short + (" (baseline)" if r.cell is a.baseline else "") for r in sr], fontsize=8)
        ax.set_ylim(-0.7, len(sr) - 0.3)
        ax.set_xlabel("accuracy (%)")
        k = max(r.est.k for r in sr)
        ax.set_title(f"{suite} (n={sr[0].est.n}{', K=' + str(k) if k > 1 else ''})", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"Accuracy with {100 * a.confidence:g}% intervals", fontsize=11)
    return _save(fig, path)


def delta_plot(a: Analysis, path: Path, max_drop: Optional[float] = None) -> bool:
    rows = a.deltas
    if not rows:
        return False
    fig = _figure(7.5, 1.0 + 0.42 * len(rows))
    ax = fig.subplots()
    ys = list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows):
        d = r.d
        sig = r.p_holm is not None and r.p_holm < 1 - a.confidence
        color = "#d62728" if sig and d.delta < 0 else ("#2ca02c" if sig else "#1f77b4")
        ax.errorbar([100 * d.delta], [y], xerr=[[100 * (d.delta - d.ci_lo)], [100 * (d.ci_hi - d.delta)]], fmt="o",
                    color=color, capsize=4)
    ax.axvline(0, color="#222222", lw=0.8)
    if max_drop:
        ax.axvline(-100 * max_drop, color="#d62728", lw=0.8, ls="--", label=f"−δ = −{100 * max_drop:g} pp")
        ax.legend(fontsize=8, loc="lower right")
    ax.set_yticks(ys, [f"{r.suite}: {r.cell.short}" for r in rows], fontsize=8)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_xlabel("candidate − baseline (percentage points)")
    ax.set_title(f"Paired deltas vs baseline, {100 * a.confidence:g}% bootstrap CI (red/green: Holm-significant)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def serving_plot(a: Analysis, path: Path) -> bool:
    if not a.serving:
        return False
    series: dict[str, list] = {}
    for cell, s in a.serving:
        series.setdefault(_series_label(cell), []).append((cell.concurrency or 0, s))
    fig = _figure(15, 4.4)
    ax_tp, ax_ttft, ax_tpot = fig.subplots(1, 3)
    levels = sorted({c for pts in series.values() for c, _ in pts})
    colors = series_colors(a)
    for i, (name, pts) in enumerate(series.items()):
        pts.sort(key=lambda t: t[0])
        xs = [c for c, _ in pts]
        color = colors.get(name, _COLORS[i % len(_COLORS)])
        ax_tp.plot(xs, [s["output_throughput"] for _, s in pts], "o-", color=color, label=name)
        ax_ttft.plot(xs, [s["median_ttft_ms"] for _, s in pts], "o-", color=color, label=f"{name} p50")
        ax_ttft.plot(xs, [s["p99_ttft_ms"] for _, s in pts], "s--", color=color, alpha=0.7, label=f"{name} p99")
        ax_tpot.plot(xs, [s["median_tpot_ms"] for _, s in pts], "o-", color=color, label=f"{name} p50")
        ax_tpot.plot(xs, [s["p99_tpot_ms"] for _, s in pts], "s--", color=color, alpha=0.7, label=f"{name} p99")
    for ax, title, ylabel in ((ax_tp, "Output throughput", "tokens/s"), (ax_ttft, "TTFT (solid p50, dashed p99)", "ms"),
                              (ax_tpot, "TPOT (solid p50, dashed p99)", "ms")):
        if len(levels) > 1 and min(levels) > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    ax_tp.legend(fontsize=8)
    return _save(fig, path)


def capacity_plot(a: Analysis, path: Path) -> bool:
    rows = [(cell, cap) for cell, cap, _ in a.capacity if cap.get("tokens")]
    if not rows:
        return False
    fig = _figure(max(5.0, 1.3 * len(rows) + 2), 4.2)
    ax = fig.subplots()
    xs = list(range(len(rows)))
    tokens = [float(cap["tokens"]) for _, cap in rows]
    colors = series_colors(a)
    bars = ax.bar(xs, tokens, color=[colors.get(_series_label(c), _COLORS[i % len(_COLORS)]) for i, (c, _) in enumerate(rows)])
    for bar, (_, cap) in zip(bars, rows):
        ax.annotate(f"{int(cap['tokens']):,} tok\n{float(cap.get('bytes_per_token') or 0):,.0f} B/tok\n"
                    f"max conc. {cap.get('max_concurrency', '—')}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
    ax.set_xticks(xs, [_series_label(c) for c, _ in rows], fontsize=8, rotation=15)
    ax.set_ylabel("KV cache capacity (tokens)")
    ax.yaxis.set_major_formatter(lambda v, _pos: f"{v:,.0f}")
    ax.set_ylim(0, max(tokens) * 1.3)
    ax.set_title("KV capacity by format (same memory budget)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def fidelity_plot(a: Analysis, path: Path) -> bool:
    rows = a.fidelity
    if not rows:
        return False
    fig = _figure(max(5.0, 1.2 * len(rows) + 2), 3.8)
    ax = fig.subplots()
    xs = list(range(len(rows)))
    ax.bar([x - 0.2 for x in xs], [f.kl_mean for f in rows], width=0.4, label="KL mean", color="#1f77b4")
    ax.bar([x + 0.2 for x in xs], [f.kl_p99 for f in rows], width=0.4, label="KL p99", color="#ff7f0e")
    ax.set_xticks(xs, [f.cell.short for f in rows], fontsize=8, rotation=15)
    ax.set_ylabel("KL(reference ‖ cell), nats/token")
    ax.set_title("Fidelity (teacher-forced against the reference)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def write_plots(a: Analysis, out_dir: Path, max_drop: Optional[float] = None) -> dict[str, Path]:
    """Write every figure that has data (the long-context ones too); returns {name: path}."""
    from kvbench.reports.long_context_plots import write_long_context_plots

    out: dict[str, Path] = {}
    for name, fn in (("accuracy", accuracy_plot), ("deltas", lambda a, p: delta_plot(a, p, max_drop)),
                     ("fidelity", fidelity_plot), ("serving", serving_plot), ("capacity", capacity_plot)):
        p = Path(out_dir) / f"{name}.png"
        if fn(a, p):
            out[name] = p
    out.update(write_long_context_plots(a, Path(out_dir)))
    return out

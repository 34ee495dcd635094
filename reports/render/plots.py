"""Report figures as PNG files (matplotlib's object API with the Agg canvas: no pyplot state, no display).

Each function takes an ``Analysis`` and a path, writes one PNG atomically and returns True, or returns
False (writing nothing) when the run has no data for that figure.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from kvbench.reports.analysis import Analysis
from kvbench.suites import primary_metric

__all__ = ["accuracy_plot", "delta_plot", "serving_plot", "capacity_plot", "fidelity_plot", "write_plots", "series_colors",
           "series_key", "is_baseline_series", "dodge"]

from kvbench.reports.render.plot_style import (  # noqa: F401 - series_key / dodge / colours are imported from here too
    _COLORS,
    _color,
    _figure,
    _save,
    series_label,
    dodge,
    is_baseline_series,
    series_colors,
    series_key,
)


def accuracy_plot(a: Analysis, path: Path) -> bool:
    """Primary-metric accuracy per cell with its interval, one panel per suite; values in the row labels."""
    rows = [r for r in a.accuracy if r.metric == primary_metric(r.suite)]
    suites = list(dict.fromkeys(r.suite for r in rows))
    if not suites:
        return False
    ncols = min(3, len(suites))
    nrows = math.ceil(len(suites) / ncols)
    n_cells = max(sum(1 for r in rows if r.suite == s) for s in suites)
    fig = _figure(5.4 * ncols, 0.9 + nrows * (0.5 * n_cells + 1.0))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat[len(suites):]:
        ax.set_visible(False)
    for ax, suite in zip(axes.flat, suites):
        sr = [r for r in rows if r.suite == suite]
        ys = list(range(len(sr)))[::-1]
        labels = []
        for i, (y, r) in enumerate(zip(ys, sr)):
            e = r.est
            lo, hi = max(0.0, e.lo), min(1.0, e.hi)
            base = a.baseline is not None and r.cell is a.baseline
            ax.errorbar([100 * e.mean], [y], xerr=[[max(0.0, 100 * (e.mean - lo))], [max(0.0, 100 * (hi - e.mean))]],
                        fmt="D" if base else "o", color=_color(a, r.cell, i), capsize=4, markersize=7 if base else 6)
            labels.append(f"{r.cell.short}{' (baseline)' if base else ''}\n"
                          f"{100 * e.mean:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]")
        base_rows = [r for r in sr if a.baseline is not None and r.cell is a.baseline]
        if base_rows:
            ax.axvline(100 * base_rows[0].est.mean, color="#555555", lw=0.8, ls=":")
        ax.set_yticks(ys, labels, fontsize=8)
        ax.set_ylim(-0.7, len(sr) - 0.3)
        lo_x, hi_x = ax.get_xlim()
        ax.set_xlim(max(lo_x, -2), min(hi_x, 102))
        ax.set_xlabel(f"{sr[0].metric} (%)")
        k = max(r.est.k for r in sr)
        ax.set_title(f"{suite} (n={sr[0].est.n}{', K=' + str(k) if k > 1 else ''})", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"Accuracy with {100 * a.confidence:g}% intervals (dotted: baseline)", fontsize=11)
    return _save(fig, path)


def delta_plot(a: Analysis, path: Path, max_drop: Optional[float] = None) -> bool:
    """Paired deltas against the baseline with intervals; filled markers are Holm-significant."""
    from matplotlib.lines import Line2D

    order = list(dict.fromkeys(r.suite for r in a.deltas))
    rows = sorted(a.deltas, key=lambda r: order.index(r.suite))  # grouped by suite, stable within a suite
    if not rows:
        return False
    fig = _figure(8.5, 1.3 + 0.5 * len(rows))
    ax = fig.subplots()
    ys = list(range(len(rows)))[::-1]
    labels = []
    for i, (y, r) in enumerate(zip(ys, rows)):
        d = r.d
        sig = r.p_holm is not None and r.p_holm < 1 - a.confidence
        color = _color(a, r.cell, i)
        ax.errorbar([100 * d.delta], [y], xerr=[[max(0.0, 100 * (d.delta - d.ci_lo))], [max(0.0, 100 * (d.ci_hi - d.delta))]], fmt="o",
                    color=color, capsize=4, markersize=7, markerfacecolor=color if sig else "white", markeredgewidth=1.5)
        p = "—" if r.p_holm is None else ("<0.001" if r.p_holm < 0.001 else f"{r.p_holm:.3f}")
        labels.append(f"{r.suite}: {r.cell.short}\n{100 * d.delta:+.1f} pp [{100 * d.ci_lo:+.1f}, {100 * d.ci_hi:+.1f}],"
                      f" p(Holm) {p}")
    for y, (r0, r1) in zip(ys[1:], zip(rows, rows[1:])):
        if r0.suite != r1.suite:
            ax.axhline(y + 0.5, color="#bbbbbb", lw=0.8)
    ax.axvline(0, color="#222222", lw=0.8)
    handles = [Line2D([], [], color="#555555", marker="o", ls="none", markerfacecolor="#555555"),
               Line2D([], [], color="#555555", marker="o", ls="none", markerfacecolor="white")]
    names = ["Holm-significant", "not significant"]
    if max_drop:
        ax.axvline(-100 * max_drop, color="#d62728", lw=1.0, ls="--")
        handles.append(Line2D([], [], color="#d62728", lw=1.0, ls="--"))
        names.append(f"−δ = −{100 * max_drop:g} pp (gate)")
    fig.legend(handles, names, fontsize=8, loc="outside lower center", ncols=len(names), frameon=False)
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_xlabel("candidate − baseline (percentage points)")
    ax.set_title(f"Paired deltas vs baseline, {100 * a.confidence:g}% intervals", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def serving_plot(a: Analysis, path: Path) -> bool:
    """Output throughput against concurrency per format series and, with a baseline series, relative to it; with
    repeated load tests the bars span the lowest to the highest repeat (and, relative, every pairing of a repeat
    with a baseline repeat: ``reports.serving_spread.ratio_range``)."""
    from kvbench.reports.serving_spread import ratio_range

    series: dict[str, list] = {}
    dicts: dict[tuple[str, int], dict] = {}
    for cell, s in a.serving:
        if not cell.aa_control:
            series.setdefault(series_label(cell), []).append((cell.concurrency or 0, float(s["output_throughput"])))
            dicts[(series_label(cell), cell.concurrency or 0)] = s
    if not series:
        return False
    base_name = next((series_label(c) for c, _ in a.serving if is_baseline_series(a, c)), None)
    base = dict(series[base_name]) if base_name else {}

    def bars(name: str, pts: list, rel: bool):
        """Error bar lengths (below, above) of each point, or None when no point has repeats."""
        out = []
        for c, v in pts:
            s = dicts.get((name, c), {})
            if rel:
                rng = ratio_range(dicts.get((base_name, c), {}), s, "output_throughput")
            else:
                sp = (s.get("spread") or {}).get("output_throughput") or {}
                rng = (sp["min"], sp["max"]) if (s.get("repeats") or 1) > 1 and "min" in sp and "max" in sp else None
            out.append((v - rng[0], rng[1] - v) if rng else (0.0, 0.0))
        return [[max(0.0, lo) for lo, _ in out], [max(0.0, hi) for _, hi in out]] if any(any(x) for x in out) else None
    fig = _figure(13 if base else 7.5, 4.6)
    axes = fig.subplots(1, 2 if base else 1, squeeze=False)[0]
    levels = sorted({c for pts in series.values() for c, _ in pts})
    log_x = len(levels) >= 3 and min(levels) > 0
    colors = series_colors(a)
    for i, (name, pts) in enumerate(series.items()):
        pts.sort(key=lambda t: t[0])
        color = colors.get(name, _COLORS[i % len(_COLORS)])
        label = name + (" (baseline)" if name == base_name else "")
        axes[0].errorbar(dodge([c for c, _ in pts], i, len(series), log_x, levels), [v for _, v in pts],
                         yerr=bars(name, pts, False), fmt="o-", color=color, label=label, capsize=3)
        if base:
            rel = [(c, v / base[c]) for c, v in pts if base.get(c)]
            axes[1].errorbar(dodge([c for c, _ in rel], i, len(series), log_x, levels), [v for _, v in rel],
                             yerr=bars(name, rel, True), fmt="o-", color=color, label=label, capsize=3)
    titles = [("Output throughput", "output tokens/s")]
    if base:
        titles.append((f"Throughput relative to {base_name}", "× baseline throughput"))
        axes[1].axhline(1.0, color="#555555", lw=0.8, ls=":")
    for ax, (title, ylabel) in zip(axes, titles):
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight" + (", log scale)" if log_x else ")"))
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def capacity_plot(a: Analysis, path: Path) -> bool:
    """Planned KV capacity per format (``reports.plots_ship.capacity_plot``)."""
    from kvbench.reports.render.plots_ship import capacity_plot as plot

    return plot(a, path)


def fidelity_plot(a: Analysis, path: Path) -> bool:
    """KL mean, KL p99 and top-1 agreement per cell (horizontal bars, values written at the bar ends)."""
    rows = a.fidelity
    if not rows:
        return False
    fig = _figure(14, 1.4 + 0.5 * len(rows))
    axes = fig.subplots(1, 3, sharey=True)
    ys = list(range(len(rows)))[::-1]
    cols = [_color(a, f.cell, i) for i, f in enumerate(rows)]
    panels = ((lambda f: f.kl_mean, "KL mean (nats/token)", "{:.3g}"), (lambda f: f.kl_p99, "KL p99 (nats/token)", "{:.3g}"),
              (lambda f: 100 * f.top1_agree, "top-1 agreement (%)", "{:.1f}%"))
    for ax, (get, title, fmt) in zip(axes, panels):
        vals = [get(f) for f in rows]
        ok = [v if math.isfinite(v) else 0.0 for v in vals]
        ax.barh(ys, ok, color=cols, height=0.6)
        for y, v in zip(ys, vals):
            ax.annotate(fmt.format(v) if math.isfinite(v) else "n/a", (v if math.isfinite(v) else 0, y),
                        textcoords="offset points", xytext=(4, 0), va="center", fontsize=8)
        if fmt.endswith("%"):
            ax.set_xlim(0, 115)
            ax.set_xticks(range(0, 101, 20))
        else:
            ax.set_xlim(0, max([v for v in ok if v > 0] or [1.0]) * 1.3)
        ax.set_xlabel(title)
        ax.set_title(title.split(" (")[0], fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(ys, [f.cell.short + (" (baseline)" if a.baseline is not None and f.cell is a.baseline else "")
                            for f in rows], fontsize=9)
    axes[0].set_ylim(-0.6, len(rows) - 0.4)
    fig.suptitle("Fidelity, teacher-forced against the reference: KL(reference ‖ cell); lower KL and higher "
                 "agreement are better", fontsize=11)
    return _save(fig, path)


def write_plots(a: Analysis, out_dir: Path, max_drop: Optional[float] = None) -> dict[str, Path]:
    """Write every figure that has data (the long-context ones too); returns {name: path}.

    Names: accuracy, deltas, accuracy_throughput, fidelity, serving, latency, capacity, and those of
    ``reports.long_context_plots.write_long_context_plots``."""
    from kvbench.reports.render.long_context_plots import write_long_context_plots
    from kvbench.reports.render.plots_ship import accuracy_throughput_plot, latency_plot

    out: dict[str, Path] = {}
    for name, fn in (("accuracy", accuracy_plot), ("deltas", lambda a, p: delta_plot(a, p, max_drop)),
                     ("accuracy_throughput", accuracy_throughput_plot), ("fidelity", fidelity_plot),
                     ("serving", serving_plot), ("latency", latency_plot), ("capacity", capacity_plot)):
        p = Path(out_dir) / f"{name}.png"
        if fn(a, p):
            out[name] = p
    out.update(write_long_context_plots(a, Path(out_dir)))
    return out

"""Figures of the long-context and position views: accuracy vs context length (one line per cell, interval
bars), a length × depth heatmap of mean scores per cell, and fidelity KL mean vs position (one line per
cell).  Same conventions as ``reports.plots`` (Agg canvas, atomic PNG writes)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from kvbench.reports.analysis import Analysis
from kvbench.reports.long_context import Heatmap, heatmap, length_label
from kvbench.reports.render.plot_style import _color, _figure, _save, dodge
from kvbench.reports.position import bucket_label

__all__ = ["length_plot", "heatmap_plot", "position_plot", "write_long_context_plots"]


def length_plot(a: Analysis, path: Path) -> bool:
    """Accuracy (%) against requested context length (log2 x), one line per cell and suite."""
    rows = a.lengths
    if not rows:
        return False
    suites = list(dict.fromkeys(r.suite for r in rows))
    n_rows = max(sum(1 for r in rows if r.suite == s) for s in suites)
    fig = _figure(max(7.0, 6.5 * len(suites)), 4.6 + 0.22 * math.ceil(n_rows / 2))
    axes = fig.subplots(1, len(suites), squeeze=False)[0]
    for ax, suite in zip(axes, suites):
        sr = [r for r in rows if r.suite == suite]
        lengths = sorted({n for r in sr for n in r.by_length})
        log_x = len(lengths) > 1
        for i, r in enumerate(sr):
            ls = sorted(r.by_length)
            ys = [100 * r.by_length[n].mean for n in ls]
            lo = [100 * (r.by_length[n].mean - max(0.0, r.by_length[n].lo)) for n in ls]
            hi = [100 * (min(1.0, r.by_length[n].hi) - r.by_length[n].mean) for n in ls]
            base = a.baseline is not None and r.cell is a.baseline
            label = f"{r.cell.short}{' (baseline)' if base else ''}: AUC {100 * r.auc.value:.1f}%"
            ax.errorbar(dodge(ls, i, len(sr), log_x, lengths), ys, yerr=[lo, hi], fmt="D-" if base else "o-", capsize=3,
                        color=_color(a, r.cell, i), label=label, lw=2 if base else 1.4, markersize=6 if base else 5)
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [length_label(n) for n in lengths])
        ax.minorticks_off()
        ax.set_ylim(-3, 103)
        ax.set_xlabel("context length (tokens" + (", log scale)" if log_x else ")"))
        ax.set_ylabel("mean score (%)")
        ax.set_title(f"{suite}: accuracy vs context length ({100 * a.confidence:g}% intervals)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=2, frameon=False)
    return _save(fig, path)


def heatmap_plot(hm: Heatmap, path: Path, baseline: bool = False) -> bool:
    """Mean score (%) per (needle depth, context length) of one cell, values and item counts annotated."""
    nd, nl = hm.mean.shape
    fig = _figure(max(5.6, 1.1 * nl + 3.0), max(3.6, 0.5 * nd + 2.0))
    ax = fig.subplots()
    data = np.ma.masked_invalid(100 * hm.mean)
    im = ax.imshow(data, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto", origin="upper")
    small = nd * nl > 48  # many tiles: values only
    for i in range(nd):
        for j in range(nl):
            v = hm.mean[i, j]
            if not math.isnan(v):
                color = "black" if 25 <= 100 * v <= 85 else "white"
                ax.text(j, i, f"{100 * v:.0f}%", ha="center", va="center" if small else "bottom", fontsize=10,
                        color=color)
                if not small:
                    ax.text(j, i, f"n={int(hm.count[i, j])}", ha="center", va="top", fontsize=7, color=color)
    ax.set_xticks(range(nl), [length_label(n) for n in hm.lengths])
    ax.set_yticks(range(nd), [f"{d:g}%" for d in hm.depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (% of the context)")
    ax.set_title(f"{hm.suite}: {hm.cell.short}{' (baseline)' if baseline else ''}\nmean score by length × depth",
                 fontsize=10)
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("mean score (%)")
    return _save(fig, path)


def position_plot(a: Analysis, path: Path) -> bool:
    """KL mean and top-1 agreement per position bucket (buckets evenly spaced, in order), one line per cell."""
    rows = [r for r in a.positions if r.buckets]
    if not rows:
        return False
    buckets = sorted({(b.lo, b.hi) for r in rows for b in r.buckets})
    index = {bk: j for j, bk in enumerate(buckets)}
    fig = _figure(12 if len(buckets) > 2 else 9, 4.6)
    ax_kl, ax_t1 = fig.subplots(1, 2)
    for i, r in enumerate(rows):
        xs = dodge([float(index[(b.lo, b.hi)]) for b in r.buckets], i, len(rows), False, [0.0, max(1.0, len(buckets) - 1.0)])
        color = _color(a, r.cell, i)
        base = a.baseline is not None and r.cell is a.baseline
        label = r.cell.short + (" (baseline)" if base else "")
        ax_kl.plot(xs, [b.kl_mean for b in r.buckets], "D-" if base else "o-", color=color, label=label)
        ax_t1.plot(xs, [100 * b.top1_agree for b in r.buckets], "D-" if base else "o-", color=color)
    for ax, ylabel, title in ((ax_kl, "KL(reference ‖ cell), nats/token", "Fidelity KL mean by position"),
                              (ax_t1, "top-1 agreement (%)", "Top-1 agreement by position")):
        ax.set_xticks(range(len(buckets)), [bucket_label(lo, hi) for lo, hi in buckets], fontsize=8,
                      rotation=20 if len(buckets) > 6 else 0)
        ax.set_xlim(-0.6, len(buckets) - 0.4)
        ax.set_xlabel("absolute token position (bucket, tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    top = ax_kl.get_ylim()[1]
    ax_kl.set_ylim(-0.03 * top, top)
    fig.legend(loc="outside lower center", ncols=min(4, len(rows)), fontsize=8, frameon=False)
    return _save(fig, path)


def write_long_context_plots(a: Analysis, out_dir: Path) -> dict[str, Path]:
    """{name: path}: ``long_context_length``, ``<suite>_heatmap_<n>`` per cell whose records carry depths
    (n counts from 1 in the order of ``a.lengths``), and ``fidelity_position``; only those with data."""
    out: dict[str, Path] = {}
    p = Path(out_dir) / "long_context_length.png"
    if length_plot(a, p):
        out["long_context_length"] = p
    n = 0
    for r in a.lengths:
        hm = heatmap(r.cell, r.suite)
        if hm is None:
            continue
        n += 1
        p = Path(out_dir) / f"{r.suite}_heatmap_{n}.png"
        if heatmap_plot(hm, p, baseline=a.baseline is not None and r.cell is a.baseline):
            out[heatmap_name(r.suite, n)] = p
    p = Path(out_dir) / "fidelity_position.png"
    if position_plot(a, p):
        out["fidelity_position"] = p
    return out


def heatmap_name(suite: str, n: int) -> str:
    return f"{suite}_heatmap_{n}"

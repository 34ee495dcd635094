"""Figures for deciding whether to ship a KV-cache format: accuracy against serving throughput with its
Pareto front, planned (and measured) KV capacity per format, and latency percentiles against concurrency.
Same conventions as ``reports.plots`` (Agg canvas, atomic PNG writes, one colour per format series)."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from kvbench.reports.stats import paired as stats
from kvbench.reports.analysis import Analysis
from kvbench.reports.capacity import load_request_sizes, planned_at_request
from kvbench.suites import primary_metric
from kvbench.reports.render.plot_style import (
    _COLORS,
    _figure,
    _save,
    series_label,
    dodge,
    is_baseline_series,
    series_colors,
    series_key,
)

__all__ = ["pareto_front", "ThroughputPoint", "accuracy_throughput_points", "measured_concurrency",
           "accuracy_throughput_plot", "capacity_plot", "latency_plot", "PERCENTILE_STYLES", "MAX_SUITE_PANELS"]

MAX_SUITE_PANELS = 4  # more accuracy suites than this: only the first (primary) suite is drawn
# (legend label, serving-dict key prefix, line style, marker)
PERCENTILE_STYLES = (("p50", "median", "-", "o"), ("p90", "p90", "--", "s"), ("p99", "p99", ":", "^"))


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points that no other point dominates, both coordinates better when higher.

    A point is dominated by one that is at least as high in both coordinates and strictly higher in one, so
    equal points are all kept; a point with a NaN coordinate is never on the front. The indices come sorted
    by x ascending (hence y descending along the front), ties by y descending, then by index."""
    ok = [i for i, (x, y) in enumerate(points) if not (math.isnan(x) or math.isnan(y))]
    front = []
    for i in ok:
        xi, yi = points[i]
        if not any(points[j][0] >= xi and points[j][1] >= yi and (points[j][0] > xi or points[j][1] > yi) for j in ok):
            front.append(i)
    return sorted(front, key=lambda i: (points[i][0], -points[i][1], i))


@dataclass
class ThroughputPoint:
    label: str  # format series label (the cell label without its concurrency)
    suite: str
    metric: str
    est: stats.Estimate
    throughput: float  # output tokens/s of the series at ``concurrency``
    concurrency: Optional[int]  # the highest concurrency measured for the series
    baseline: bool


def _top_serving(a: Analysis) -> dict[tuple, tuple[Optional[int], dict]]:
    """series key -> (concurrency, serving dict) of its highest measured concurrency (A/A cells left out)."""
    out: dict[tuple, tuple[Optional[int], dict]] = {}
    for cell, s in a.serving:
        if cell.aa_control:
            continue
        k = series_key(cell)
        if k not in out or (cell.concurrency or 0) > (out[k][0] or 0):
            out[k] = (cell.concurrency, s)
    return out


def accuracy_throughput_points(a: Analysis) -> tuple[dict[str, list[ThroughputPoint]], dict[str, list[str]]]:
    """({suite: points}, {suite: labels of series left out for lack of serving data}): one point per format
    series and accuracy suite (primary metric; the series' first accuracy cell), A/A controls excluded."""
    top = _top_serving(a)
    points: dict[str, list[ThroughputPoint]] = {}
    missing: dict[str, list[str]] = {}
    seen: set[tuple] = set()
    for r in a.accuracy:
        if r.cell.aa_control or r.metric != primary_metric(r.suite):
            continue
        k = series_key(r.cell)
        if (r.suite, k) in seen:
            continue
        seen.add((r.suite, k))
        points.setdefault(r.suite, [])
        missing.setdefault(r.suite, [])
        label = series_label(r.cell)
        conc, s = top.get(k, (None, {}))
        tp = s.get("output_throughput")
        if tp is None or not math.isfinite(float(tp)):
            missing[r.suite].append(label)
            continue
        points[r.suite].append(ThroughputPoint(label, r.suite, r.metric, r.est, float(tp), conc,
                                               is_baseline_series(a, r.cell)))
    return points, missing


def _legend_below(fig, handles, labels, max_cols: int = 4) -> None:
    fig.legend(handles, labels, loc="outside lower center", ncols=max(1, min(max_cols, len(labels))), fontsize=8,
               frameon=False)


def accuracy_throughput_plot(a: Analysis, path: Path) -> bool:
    """Accuracy (primary metric, with intervals) against output throughput at the highest measured concurrency,
    one point per format series, baseline cross-hairs, Pareto front as a step line with ringed points."""
    from matplotlib.lines import Line2D

    points, missing = accuracy_throughput_points(a)
    suites = [s for s, pts in points.items() if pts]
    if not suites:
        return False
    n_suites = len(suites)
    if n_suites > MAX_SUITE_PANELS:
        suites = suites[:1]
    colors = series_colors(a)
    ncols = len(suites) if len(suites) <= 3 else 2
    nrows = math.ceil(len(suites) / ncols)
    fig = _figure(max(6.8, 5.4 * ncols), 1.3 + 4.2 * nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in axes.flat[len(suites):]:
        ax.set_visible(False)
    concs = {p.concurrency for s in suites for p in points[s]}
    one_conc = len(concs) == 1
    seen_labels: dict[str, Line2D] = {}
    for ax, suite in zip(axes.flat, suites):
        pts = points[suite]
        xy = [(p.throughput, 100 * p.est.mean) for p in pts]
        front = pareto_front(xy)
        for p in pts:
            e = p.est
            lo, hi = 100 * max(0.0, e.lo), 100 * min(1.0, e.hi)
            color = colors.get(p.label, _COLORS[0])
            ax.errorbar([p.throughput], [100 * e.mean], yerr=[[100 * e.mean - lo], [hi - 100 * e.mean]],
                        fmt="D" if p.baseline else "o", color=color, markersize=8 if p.baseline else 7, capsize=4,
                        elinewidth=1.3, zorder=3)
            name = p.label + (" (baseline)" if p.baseline else "") + ("" if one_conc else f", c={p.concurrency}")
            seen_labels.setdefault(name, Line2D([], [], color=color, marker="D" if p.baseline else "o", ls="none"))
        if front:
            fx, fy = [xy[i][0] for i in front], [xy[i][1] for i in front]
            # a wide pale band under a thin line: the vertical steps stay visible next to the error bars
            ax.step(fx, fy, where="pre", color="#888888", lw=8, alpha=0.3, zorder=1, solid_capstyle="round")
            ax.step(fx, fy, where="pre", color="#333333", lw=1.2, ls="--", zorder=2)
            ax.scatter(fx, fy, s=230, facecolors="none", edgecolors="#111111", linewidths=1.4, zorder=4)
        base = [p for p in pts if p.baseline]
        if base:
            ax.axhline(100 * base[0].est.mean, color="#777777", lw=0.9, ls=":", zorder=1)
            ax.axvline(base[0].throughput, color="#777777", lw=0.9, ls=":", zorder=1)
        xmax = max(p.throughput for p in pts)
        ax.set_xlim(0, xmax * 1.12 if xmax > 0 else 1)
        lo_y, hi_y = ax.get_ylim()
        ax.set_ylim(max(lo_y, -3), min(hi_y, 103))
        ax.set_xlabel("output throughput (tok/s)" + (f" at concurrency {next(iter(concs))}" if one_conc and None not in concs
                                                      else " at the series' highest measured concurrency"))
        ax.set_ylabel(f"accuracy, {pts[0].metric} (%)")
        n = max(p.est.n for p in pts)
        title = f"{suite} (n={n})"
        if missing.get(suite):
            title += "\n" + textwrap.fill("not plotted, no serving data: " + ", ".join(missing[suite]), 70)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    handles = list(seen_labels.values()) + [
        (Line2D([], [], color="#888888", lw=8, alpha=0.3),
         Line2D([], [], color="#333333", lw=1.2, ls="--", marker="o", markersize=12, markerfacecolor="none",
                markeredgecolor="#111111")),
        Line2D([], [], color="#777777", lw=0.9, ls=":")]
    labels = list(seen_labels) + ["Pareto front (ringed points)", "baseline accuracy / throughput"]
    _legend_below(fig, handles, labels)
    sup = f"Accuracy vs throughput ({100 * a.confidence:g}% intervals; up and right is better)"
    if n_suites > len(suites):
        sup += f": {suites[0]} only, the other {n_suites - 1} suites are in the accuracy table"
    unplotted = [s for s, pts in points.items() if not pts]
    if unplotted:  # suites none of whose series has serving data
        sup += "\n" + textwrap.fill("no series with serving data, not plotted: " + ", ".join(unplotted), 110)
    fig.suptitle(sup, fontsize=11)
    return _save(fig, path)


def measured_concurrency(a: Analysis) -> dict[tuple, float]:
    """series key -> the largest ``max_running_without_queueing`` measured over the series' serving cells."""
    out: dict[tuple, float] = {}
    for cell, s in a.serving:
        v = s.get("max_running_without_queueing")
        if cell.aa_control or v is None or not math.isfinite(float(v)):
            continue
        k = series_key(cell)
        out[k] = max(out.get(k, float(v)), float(v))
    return out


def _tested_concurrency(a: Analysis) -> dict[tuple, float]:
    """series key -> the highest concurrency its serving cells ran at."""
    out: dict[tuple, float] = {}
    for cell, _ in a.serving:
        if not cell.aa_control and cell.concurrency is not None:
            out[series_key(cell)] = max(out.get(series_key(cell), 0.0), float(cell.concurrency))
    return out


def capacity_plot(a: Analysis, path: Path) -> bool:
    """Planned KV capacity (tokens) per format, labelled with the ratio to the baseline; next to it, when the
    serving data measured it, the largest running batch without queueing against the planned max concurrency."""
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    rows = [(cell, cap, ratio) for cell, cap, ratio in a.capacity if cap.get("tokens")]
    if not rows:
        return False
    measured = measured_concurrency(a)
    meas = [measured.get(series_key(cell)) for cell, _, _ in rows]
    two = any(v is not None for v in meas)
    colors = series_colors(a)
    fig = _figure(13.5 if two else 8.0, 1.4 + 0.55 * len(rows))
    axes = fig.subplots(1, 2 if two else 1, squeeze=False, sharey=True)[0]
    ys = list(range(len(rows)))[::-1]
    names = [series_label(c) + (" (baseline)" if is_baseline_series(a, c) else "") for c, _, _ in rows]
    cols = [colors.get(series_label(c), _COLORS[i % len(_COLORS)]) for i, (c, _, _) in enumerate(rows)]
    ax = axes[0]
    tokens = [float(cap["tokens"]) for _, cap, _ in rows]
    ax.barh(ys, tokens, color=cols, height=0.6)
    for y, t, (_, cap, ratio) in zip(ys, tokens, rows):
        bpt = cap.get("bytes_per_token")
        detail = f"{int(t):,} tok" + (f", {float(bpt):,.0f} B/tok" if bpt else "")
        if ratio is not None:
            ax.annotate(f"{ratio:.2f}×", (t, y), textcoords="offset points", xytext=(5, 1), va="bottom", fontsize=11)
        ax.annotate(detail, (t, y), textcoords="offset points", xytext=(5, -1 if ratio is not None else 0),
                    va="top" if ratio is not None else "center", fontsize=8, color="#333333")
    ax.set_xlim(0, max(tokens) * 1.55)
    ax.set_yticks(ys, names, fontsize=9)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.xaxis.set_major_formatter(lambda v, _pos: f"{v:,.0f}")
    ax.set_xlabel("planned KV cache capacity (tokens, same memory budget)")
    ax.set_title("KV capacity per format (label: tokens vs baseline)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    if two:
        ax = axes[1]
        sizes = load_request_sizes(a)
        # planned at the load test's own request size, so the two bars count the same requests
        planned = [planned_at_request(cap, *sizes[series_key(cell)]) if series_key(cell) in sizes
                   else cap.get("max_concurrency") for cell, cap, _ in rows]
        req = {sizes[series_key(cell)][0] for cell, _, _ in rows if series_key(cell) in sizes}
        ctx = {cap.get("context_len") for _, cap, _ in rows} - {None}
        top = max([float(v) for v in planned + meas if v is not None] or [1.0])
        tested = _tested_concurrency(a)
        for y, p, m, c, (cell, _, _) in zip(ys, planned, meas, cols, rows):
            for is_m, dy, v, style in ((False, 0.19, p, dict(alpha=0.45, hatch="//", edgecolor=c)),
                                       (True, -0.19, m, dict())):
                if v is None:
                    ax.annotate("n/a", (0, y + dy), textcoords="offset points", xytext=(4, 0), va="center", fontsize=8)
                    continue
                # measured at the highest concurrency tested: the real limit may be higher
                at_top = is_m and tested.get(series_key(cell)) is not None and float(v) >= tested[series_key(cell)]
                ax.barh([y + dy], [float(v)], height=0.36, color=c, **style)
                ax.annotate(f"{'≥' if at_top else ''}{float(v):g}", (float(v), y + dy), textcoords="offset points",
                            xytext=(4, 0), va="center", fontsize=8)
        ax.set_xlim(0, top * 1.2)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(axis="y", labelleft=False)
        ax.set_xlabel("concurrent requests")
        if req:
            note = (f" for the load test's {next(iter(req)):,}-token requests" if len(req) == 1 else
                    " for each series' load-test requests")
        else:
            note = f" (capacity ÷ {next(iter(ctx)):,}-token context)" if len(ctx) == 1 else ""
        ax.set_title(f"Max concurrency{note}: planned vs measured", fontsize=10)
        ax.legend([Patch(facecolor="#999999", alpha=0.45, hatch="//", edgecolor="#555555"), Patch(facecolor="#555555")],
                  ["planned max concurrency", "measured max running without queueing (≥: at the highest tested)"],
                  fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=2, frameon=False)
        ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def latency_plot(a: Analysis, path: Path) -> bool:
    """TTFT, TPOT and ITL percentiles (p50 / p90 / p99 by line style) against concurrency, one colour per series."""
    from matplotlib.lines import Line2D

    series: dict[str, list[tuple[int, dict]]] = {}
    for cell, s in a.serving:
        if not cell.aa_control:
            series.setdefault(series_label(cell), []).append((cell.concurrency or 0, s))
    if not series:
        return False
    colors = series_colors(a)
    levels = sorted({c for pts in series.values() for c, _ in pts})
    log_x = len(levels) >= 3 and min(levels) > 0
    fig = _figure(15, 4.9)
    axes = fig.subplots(1, 3)
    panels = (("ttft", "TTFT: time to first token"), ("tpot", "TPOT: time per output token"),
              ("itl", "ITL: inter-token latency"))
    n = len(series)
    for ax, (metric, title) in zip(axes, panels):
        drawn = False
        for i, (name, pts) in enumerate(series.items()):
            pts = sorted(pts, key=lambda t: t[0])
            xs = dodge([c for c, _ in pts], i, n, log_x, levels)
            color = colors.get(name, _COLORS[i % len(_COLORS)])
            for _, key, ls, marker in PERCENTILE_STYLES:
                xy = [(x, s.get(f"{key}_{metric}_ms")) for x, (_, s) in zip(xs, pts)]
                xy = [(x, float(v)) for x, v in xy if v is not None and math.isfinite(float(v))]
                if not xy:
                    continue
                drawn = True
                ax.plot([x for x, _ in xy], [v for _, v in xy], ls=ls, marker=marker, color=color,
                        lw=2.0 if key == "median" else 1.3,
                        markersize=5 if key == "median" else 5.5, markerfacecolor=color if key == "median" else "white",
                        markeredgewidth=1.2)
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight" + (", log scale)" if log_x else ")"))
        ax.set_ylabel("ms")
        ax.set_title(title + ("" if drawn else " (no data)"), fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    handles = [Line2D([], [], color=colors.get(name, _COLORS[i % len(_COLORS)]), lw=3) for i, name in enumerate(series)]
    labels = [name + (" (baseline)" if any(is_baseline_series(a, c) for c, _ in a.serving if series_label(c) == name)
                      else "") for name in series]
    handles += [Line2D([], [], color="#333333", ls=ls, marker=m, lw=2.0 if k == "median" else 1.3,
                       markerfacecolor="#333333" if k == "median" else "white")
                for _, k, ls, m in PERCENTILE_STYLES]
    labels += [p for p, _, _, _ in PERCENTILE_STYLES]
    _legend_below(fig, handles, labels, max_cols=n + 3 if n + 3 <= 8 else max(4, n))
    fig.suptitle("Latency percentiles vs concurrency (colour: format series; line style: percentile)", fontsize=11)
    return _save(fig, path)

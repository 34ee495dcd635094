"""What every report plot shares: the palette, a figure without a display, an atomic PNG save, a series'
label, key and colour (the baseline series first), and horizontal dodging of points at shared x values.  The
plots themselves are in reports/render/plots.py, plots_ship.py and long_context_plots.py."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from kvbench.core import atomic_write_bytes
from kvbench.reports.analysis import Analysis
from kvbench.reports.tables import series_label

__all__ = ["series_key", "is_baseline_series", "series_colors", "dodge"]

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


def series_key(cell) -> tuple:
    """Identifies a format series (a cell's config without concurrency and A/A flag, and its run)."""
    return (cell.run, json.dumps(cell.series_config, sort_keys=True, default=str))


def is_baseline_series(a: Analysis, cell) -> bool:
    """Whether ``cell`` belongs to the baseline's format series (the A/A control does not)."""
    return a.baseline is not None and not cell.aa_control and series_key(cell) == series_key(a.baseline)


def series_colors(a: Analysis) -> dict[str, str]:
    """One colour per format series, the same in every figure."""
    names = list(dict.fromkeys(series_label(c) for c in a.cells if not c.aa_control))
    return {n: _COLORS[i % len(_COLORS)] for i, n in enumerate(names)}


def dodge(xs: list[float], i: int, n: int, log_x: bool, levels: list[float]) -> list[float]:
    """Shift series ``i`` of ``n`` a little along x so that equal values of several series stay visible."""
    k = (i - (n - 1) / 2) * min(0.025, 0.2 / max(n, 1))  # the whole group spans at most ~20% of the axis
    if log_x:
        span = math.log2(max(levels) / min(levels)) if len(levels) > 1 else 1.0
        return [x * 2 ** (k * span) for x in xs]
    span = (max(levels) - min(levels)) if len(levels) > 1 else 1.0
    return [x + k * span for x in xs]


def _color(a: Analysis, cell, i: int = 0) -> str:
    if cell.aa_control:
        return "#999999"
    return series_colors(a).get(series_label(cell), _COLORS[i % len(_COLORS)])

"""Long-context views of a suite whose item records carry a ``context_length`` (the ruler suite):
accuracy by context length, the area under the accuracy-vs-length curve, recovery against a baseline
cell, and the length × depth grid of mean scores.

The area under the curve (AUC) and its intervals (one cell's, and a candidate's paired against the
baseline) are in ``reports/stats/auc.py``, re-exported here.  Per-length paired deltas use ``stats.paired_delta``
(Newcombe for 0/1 scores with one repeat).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvbench.reports.stats import paired as stats
from kvbench.reports.stats.auc import AucEstimate, PairedAuc, auc, auc_estimate, auc_weights, paired_auc  # noqa: F401
from kvbench.reports.load import FIDELITY_SUITE, CellData
from kvbench.reports.item_records import item_scores
from kvbench.suites import primary_metric

__all__ = ["LENGTH_FIELD", "length_suites", "scores_by_length", "auc_weights", "auc", "AucEstimate", "auc_estimate",
           "PairedAuc", "paired_auc", "LengthRow", "length_row", "RecoveryRow", "recovery_row", "Heatmap", "heatmap",
           "parse_length_metric", "length_label"]

LENGTH_FIELD = "context_length"
DEPTH_FIELD = "depth"

Key = tuple[str, int]


def length_label(n: int) -> str:
    """1024 -> "1k", 1536 -> "1.5k", 131072 -> "128k", 500 -> "500"."""
    if n >= 1024 and n % 512 == 0:
        v = n / 1024
        return f"{v:g}k"
    return str(n)


def parse_length_metric(metric: str) -> Optional[int]:
    """``L4096`` -> 4096; None for other metric names."""
    if len(metric) > 1 and metric[0] in "Ll" and metric[1:].isdigit():
        return int(metric[1:])
    return None


def _length(rec: dict) -> Optional[int]:
    v = rec.get(LENGTH_FIELD)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or isinstance(v, float) and not v.is_integer():
        return None
    return int(v)


def length_suites(cell: CellData) -> list[str]:
    """Suites (not fidelity) whose records carry an integer ``context_length``, in first-seen order."""
    seen: list[str] = []
    for rec in cell.items:
        s = rec.get("suite")
        if s != FIDELITY_SUITE and s not in seen and _length(rec) is not None:
            seen.append(s)
    return seen


def scores_by_length(cell: CellData, suite: str, metric: Optional[str] = None) -> dict[int, dict[Key, float]]:
    """{requested length: {(item_id, repeat): score}} of one suite's metric (default: its primary)."""
    lengths = {(str(r.get("item_id")), int(r.get("repeat") or 0)): _length(r) for r in cell.items if r.get("suite") == suite}
    out: dict[int, dict[Key, float]] = {}
    for key, v in item_scores(cell, suite, metric).items():
        n = lengths.get(key)
        if n is not None:
            out.setdefault(n, {})[key] = v
    return dict(sorted(out.items()))


# ------------------------------------------------------------------------------ report rows


@dataclass
class LengthRow:
    """One cell's accuracy by context length (``stats.estimate`` per length) and its AUC."""

    cell: CellData
    suite: str
    metric: str
    by_length: dict[int, stats.Estimate]
    auc: AucEstimate


def length_row(cell: CellData, suite: str, confidence: float = 0.95, n_boot: int = 10_000, seed: int = 0) -> Optional[LengthRow]:
    by_len = scores_by_length(cell, suite)
    if not by_len:
        return None
    ests = {n: stats.estimate(s, confidence) for n, s in by_len.items()}
    return LengthRow(cell, suite, primary_metric(suite), ests, auc_estimate(by_len, confidence, n_boot, seed))


@dataclass
class RecoveryRow:
    """A cell against its baseline: ``paired`` (ratios, AUC delta) and per-length ``stats.paired_delta``."""

    base: CellData
    cell: CellData
    suite: str
    paired: PairedAuc
    deltas: dict[int, stats.PairedDelta] = field(default_factory=dict)


def recovery_row(base: CellData, cell: CellData, suite: str, confidence: float = 0.95, n_boot: int = 10_000,
                 seed: int = 0) -> Optional[RecoveryRow]:
    b, c = scores_by_length(base, suite), scores_by_length(cell, suite)
    try:
        p = paired_auc(b, c, confidence, n_boot, seed)
    except ValueError:
        return None  # nothing shared: the caller's warning covers it
    deltas = {n: stats.paired_delta(b[n], c[n], confidence=confidence, n_boot=n_boot, seed=seed) for n in p.lengths}
    return RecoveryRow(base, cell, suite, p, deltas)


@dataclass
class Heatmap:
    """Mean score per (depth, length); NaN where no item sits.  Only records with a depth count."""

    cell: CellData
    suite: str
    lengths: list[int]
    depths: list[float]
    mean: np.ndarray  # [len(depths), len(lengths)]
    count: np.ndarray


def heatmap(cell: CellData, suite: str) -> Optional[Heatmap]:
    scores = item_scores(cell, suite)
    cells: dict[tuple[float, int], list[float]] = {}
    for rec in cell.items:
        if rec.get("suite") != suite:
            continue
        n, d = _length(rec), rec.get(DEPTH_FIELD)
        key = (str(rec.get("item_id")), int(rec.get("repeat") or 0))
        if n is None or isinstance(d, bool) or not isinstance(d, (int, float)) or key not in scores:
            continue
        cells.setdefault((round(float(d), 2), n), []).append(scores[key])
    if not cells:
        return None
    depths = sorted({d for d, _ in cells})
    lengths = sorted({n for _, n in cells})
    mean = np.full((len(depths), len(lengths)), np.nan)
    count = np.zeros((len(depths), len(lengths)), dtype=np.int64)
    for (d, n), v in cells.items():
        i, j = depths.index(d), lengths.index(n)
        mean[i, j], count[i, j] = float(np.mean(v)), len(v)
    return Heatmap(cell, suite, lengths, depths, mean, count)

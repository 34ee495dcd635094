"""The analysis behind a report: accuracy with intervals, paired deltas (Holm-corrected), the A/A control,
fidelity (overall and by position bucket), long-context accuracy by context length (AUC, recovery against the
baseline; ``reports.long_context``), serving metrics and capacity, computed from loaded cells (``analyze``).  ``reports.tables``
renders them.

``analyze`` takes a ``baseline_for(cell)`` function, so one code path serves ``kvbench report`` (one
baseline cell for the run) and ``kvbench compare`` (each cell against the same config in the first run).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

from kvbench.reports.stats import paired as stats
from kvbench.reports.load import FIDELITY_SUITE, CellData, original_of
from kvbench.reports.item_records import accuracy_suites, error_counts, error_keys, item_scores, paired_scores, suite_metrics
from kvbench.suites import primary_metric
from kvbench.reports.long_context import LengthRow, RecoveryRow, length_row, length_suites, recovery_row
from kvbench.reports.position import PositionRow, position_row

__all__ = ["Analysis", "AccuracyRow", "DeltaRow", "AARow", "FidelityRow", "analyze", "fidelity_records", "fidelity_kl",
           "mismatch_warning"]

log = logging.getLogger("kvbench.report")


@dataclass
class AccuracyRow:
    cell: CellData
    suite: str
    metric: str
    est: stats.Estimate  # over answered records (failed requests are not wrong answers)
    invalid_rate: float  # over answered records
    truncation_rate: float  # over answered records
    pass_at_k: Optional[float]
    n_errors: int = 0  # the suite's error records (failed requests) in the cell
    error_rate: float = 0.0  # n_errors / all the suite's records in the cell


@dataclass
class DeltaRow:
    base: CellData
    cell: CellData
    suite: str
    metric: str
    d: stats.PairedDelta
    p_holm: Optional[float] = None
    n_error_pairs: int = 0  # (item, repeat) keys left out because either cell's request failed


@dataclass
class AARow:
    base: CellData
    cell: CellData
    suite: str
    d: stats.PairedDelta
    output_agreement: float  # fraction of shared (item, repeat) keys with byte-identical raw output
    n_error_pairs: int = 0  # (item, repeat) keys left out because either cell's request failed


@dataclass
class FidelityRow:
    cell: CellData
    n_texts: int
    n_tokens: int
    kl_mean: float  # mean KL over every token (= token-weighted mean of per-text means; summary.json's kl_mean)
    kl_p99: float  # p99 of KL over every token: summary.json's pooled kl_p99; NaN when the summary lacks it
    kl_max: float
    top1_agree: float  # token-weighted
    ppl_ref: float  # exp of the token-weighted mean NLL (pooled over texts)
    ppl_cand: float
    first_divergence_median: Optional[float]  # token index; the greedy window length when nothing diverged
    first_divergence_min: Optional[float]
    kl_p99_text_mean: float = math.nan  # mean over texts of per-text p99s (a different quantity from kl_p99)


@dataclass
class Analysis:
    cells: list[CellData]
    baseline: Optional[CellData]
    confidence: float
    accuracy: list[AccuracyRow] = field(default_factory=list)
    deltas: list[DeltaRow] = field(default_factory=list)
    aa: list[AARow] = field(default_factory=list)
    fidelity: list[FidelityRow] = field(default_factory=list)
    serving: list[tuple[CellData, dict]] = field(default_factory=list)
    capacity: list[tuple[CellData, dict, Optional[float]]] = field(default_factory=list)
    lengths: list[LengthRow] = field(default_factory=list)  # long-context suites: accuracy by context length, AUC
    recovery: list[RecoveryRow] = field(default_factory=list)  # long-context suites: cell / baseline
    positions: list[PositionRow] = field(default_factory=list)  # fidelity by position bucket
    warnings: list[str] = field(default_factory=list)  # e.g. comparisons whose item sets differ


def _rate(cell: CellData, suite: str, metric: str) -> float:
    """Mean of a 0/1 record metric (``invalid``, ``truncated``) over the suite's answered records
    (``item_scores`` leaves error records out); NaN when none answered."""
    v = list(item_scores(cell, suite, metric).values())
    return sum(v) / len(v) if v else math.nan


def _pass_at_k(scores: dict, errored: frozenset = frozenset()) -> Optional[float]:
    """Share of questions solved by at least one of their K samples; None for K=1 and for scores that are
    not 0/1 (a fraction > 0, e.g. one of four ruler strings found, is not "solved").  ``errored``: the
    (item, repeat) keys whose request failed; a question with a failed sample is left out (it did not get
    its K tries), and K counts those samples too.  None when no question got all its K samples."""
    per_q = stats.group_by_question(scores)
    counts = {q: len(v) for q, v in per_q.items()}  # K of a question: its answered and failed samples
    for q, _ in errored:
        counts[q] = counts.get(q, 0) + 1
    if not counts or max(counts.values()) < 2 or any(v not in (0.0, 1.0) for v in scores.values()):
        return None
    failed_q = {q for q, _ in errored}
    full = {q: v for q, v in per_q.items() if q not in failed_q}
    if not full:
        return None
    return sum(1 for v in full.values() if max(v) > 0) / len(full)


def fidelity_records(cell: CellData) -> list[dict]:
    """The ``scores`` of a cell's fidelity records that hold a KL value."""
    recs = [r.get("scores") or {} for r in cell.items if r.get("suite") == FIDELITY_SUITE]
    return [s for s in recs if s.get("kl_mean") is not None]


def fidelity_kl(cell: CellData) -> tuple[list[float], list[float]]:
    """(per-text mean KL, per-text token count) of a cell: the one definition of "KL mean" that the report,
    the gate and summary.json share is sum(w·kl)/sum(w), the mean over every token (a record without
    ``n_tokens`` counts as one token)."""
    recs = fidelity_records(cell)
    return [float(s["kl_mean"]) for s in recs], [float(s.get("n_tokens") or 1) for s in recs]


def _pooled_summary_value(cell: CellData, key: str) -> Optional[float]:
    suite = ((cell.summary or {}).get("suites") or {}).get(FIDELITY_SUITE) or {}
    v = suite.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _fidelity(cell: CellData) -> Optional[FidelityRow]:
    recs = fidelity_records(cell)
    if not recs:
        return None
    w = [float(s.get("n_tokens") or 1) for s in recs]
    tw = sum(w)

    def wmean(k):
        vals = [(float(s[k]), wi) for s, wi in zip(recs, w) if s.get(k) is not None]
        return sum(v * wi for v, wi in vals) / sum(wi for _, wi in vals) if vals else math.nan

    def mean(k):
        vals = [float(s[k]) for s in recs if s.get(k) is not None]
        return sum(vals) / len(vals) if vals else math.nan

    # a percentile does not pool from per-text percentiles: the pooled p99 over every token is the one
    # fidelity suite's summary (summary.json) computed from the token values; without it, no "KL p99"
    p99 = _pooled_summary_value(cell, "kl_p99")
    pooled_n = _pooled_summary_value(cell, "n_tokens")
    if p99 is not None and pooled_n is not None and int(pooled_n) != int(tw):
        p99 = None  # the summary covers other texts than the records: do not mix them
    divs = [float(s["first_divergence"]) for s in recs if s.get("first_divergence") is not None]
    return FidelityRow(
        cell=cell, n_texts=len(recs), n_tokens=int(tw), kl_mean=wmean("kl_mean"),
        kl_p99=math.nan if p99 is None else p99,
        kl_max=max((float(s.get("kl_max") or 0.0) for s in recs), default=math.nan), top1_agree=wmean("top1_agree"),
        ppl_ref=math.exp(wmean("nll_ref")), ppl_cand=math.exp(wmean("nll_cand")),
        first_divergence_median=statistics.median(divs) if divs else None,
        first_divergence_min=min(divs) if divs else None,
        kl_p99_text_mean=mean("kl_p99"),
    )


def mismatch_warning(base: CellData, cell: CellData, suite: str, d: stats.PairedDelta) -> str:
    return (f"warning: {suite}: {cell.short} vs {base.short}: item sets differ, {d.base_unpaired} (item, repeat) "
            f"key(s) only in the baseline and {d.cand_unpaired} only in the cell; the paired delta uses the "
            f"{d.n_pairs} shared ones")


def _serving(cell: CellData) -> dict:
    """The cell's serving metrics: ``reports.serving.serving_summary`` (recomputed from requests.jsonl, with the
    load settings and server /metrics values of summary.json)."""
    from kvbench.reports.serving_summary import serving_summary  # imported here: reports.serving imports this module

    return serving_summary(cell)


def analyze(
    cells: list[CellData],
    baseline_for: Callable[[CellData], Optional[CellData]],
    baseline: Optional[CellData] = None,
    confidence: float = 0.95,
    n_boot: int = 10_000,
    seed: int = 0,
) -> Analysis:
    done = [c for c in cells if c.done]
    a = Analysis(cells=cells, baseline=baseline, confidence=confidence)
    for cell in done:
        for suite in accuracy_suites(cell):
            inv, trunc = _rate(cell, suite, "invalid"), _rate(cell, suite, "truncated")
            n_err, n_all = error_counts(cell, suite)
            errored = frozenset(error_keys(cell, suite))
            for metric in suite_metrics(cell, suite):
                scores = item_scores(cell, suite, metric)
                if scores:
                    a.accuracy.append(AccuracyRow(cell, suite, metric, stats.estimate(scores, confidence), inv, trunc,
                                                  _pass_at_k(scores, errored), n_err, n_err / n_all if n_all else 0.0))
        for suite in length_suites(cell):
            row = length_row(cell, suite, confidence, n_boot, seed)
            if row:
                a.lengths.append(row)
        fid = _fidelity(cell)
        if fid:
            a.fidelity.append(fid)
        pos = position_row(cell)
        if pos:
            a.positions.append(pos)
        if cell.requests:
            a.serving.append((cell, _serving(cell)))
    for cell in done:
        # an A/A control is compared with the cell it reruns (the baseline's, or a candidate's own)
        base = (original_of(done, cell) or baseline_for(cell)) if cell.aa_control else baseline_for(cell)
        if base is None or base is cell or not cell.items:
            continue
        for suite in accuracy_suites(cell):
            # keys whose request failed in either cell are left out of the pairs (and counted), so a failed
            # request on one side is neither a lost item nor an "item sets differ" warning
            b, c, n_error_pairs = paired_scores(base, cell, suite)
            if not (set(b) & set(c)):
                if b and c:
                    a.warnings.append(f"warning: {suite}: {cell.short} vs {base.short}: no shared (item, repeat) keys "
                                      f"({len(b)} in the baseline, {len(c)} in the cell); no paired delta")
                    log.warning("%s", a.warnings[-1])
                continue
            d = stats.paired_delta(b, c, confidence=confidence, n_boot=n_boot, seed=seed)
            if d.mismatched:
                a.warnings.append(mismatch_warning(base, cell, suite, d))
                log.warning("%s", a.warnings[-1])
            if cell.aa_control:
                shared = set(b) & set(c)
                raw_b = {(str(r["item_id"]), int(r.get("repeat") or 0)): r.get("raw_output") for r in base.items if r.get("suite") == suite}
                raw_c = {(str(r["item_id"]), int(r.get("repeat") or 0)): r.get("raw_output") for r in cell.items if r.get("suite") == suite}
                agree = sum(1 for k in shared if raw_b.get(k) == raw_c.get(k)) / len(shared)
                a.aa.append(AARow(base, cell, suite, d, agree, n_error_pairs))
            else:
                a.deltas.append(DeltaRow(base, cell, suite, primary_metric(suite), d, n_error_pairs=n_error_pairs))
                if suite in length_suites(cell) and suite in length_suites(base):
                    rec = recovery_row(base, cell, suite, confidence, n_boot, seed)
                    if rec:
                        a.recovery.append(rec)
    for row, p in zip(a.deltas, stats.holm([r.d.p_value for r in a.deltas])):
        row.p_holm = p
    # capacity: one row per format series (capacity does not depend on concurrency)
    seen: dict[str, tuple[CellData, dict]] = {}
    for cell in done:
        if cell.capacity and not cell.aa_control:
            seen.setdefault(json.dumps(cell.series_config, sort_keys=True, default=str) + cell.run, (cell, cell.capacity))
    base_tokens = None
    if baseline is not None:
        for cell, cap in seen.values():
            if cell.series_config == baseline.series_config and cell.run == baseline.run:
                base_tokens = cap.get("tokens")
    for cell, cap in seen.values():
        ratio = (cap.get("tokens") or 0) / base_tokens if base_tokens else None
        a.capacity.append((cell, cap, ratio))
    return a

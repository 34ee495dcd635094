"""A cell's item records as scores: per (item, repeat) scores of a suite's metric, error records kept apart
(a failed request is no answer), the pairs two cells share, and which suites a cell holds accuracy for.
The metric a suite is judged on is the suite's own declaration (suites/registry.py ``primary_metric``)."""

from __future__ import annotations

from typing import Optional

from kvbench.reports.load import CellData
from kvbench.suites import needs_reference, primary_metric

__all__ = ["item_scores", "is_error", "error_keys", "error_counts", "paired_scores", "accuracy_suites", "suite_metrics"]


def _score(rec: dict, metric: str) -> Optional[float]:
    if metric == "correct":
        v = rec.get("correct")
    elif metric == "invalid":
        v = rec.get("invalid")
    elif metric == "truncated":
        v = rec.get("finish_reason") == "length"
    else:
        v = (rec.get("scores") or {}).get(metric)
    if v is None:
        return None
    return float(v)


def is_error(rec: dict) -> bool:
    """Whether an item record is a failed request (timeout, HTTP error, dropped stream ...), not an answer: it
    holds an ``error`` message, or (stores written before that field) its finish_reason is ``error``."""
    return bool(rec.get("error")) or rec.get("finish_reason") == "error"


def _key(rec: dict) -> tuple[str, int]:
    return (str(rec.get("item_id")), int(rec.get("repeat") or 0))


def item_scores(cell: CellData, suite: str, metric: Optional[str] = None) -> dict[tuple[str, int], float]:
    """{(item_id, repeat): score} of one suite's metric; records without the metric and error records
    (``is_error``: failed requests are no answer, for every metric, ``invalid`` and ``truncated`` included)
    are skipped.

    ``metric`` is None (the suite's primary metric, ``primary_metric``), ``correct`` (the record's 0/1
    ``correct``), ``invalid``, ``truncated`` (finish_reason ``length``) or any key of the records'
    ``scores``."""
    metric = primary_metric(suite) if metric is None else metric
    out: dict[tuple[str, int], float] = {}
    for rec in cell.items:
        if rec.get("suite") != suite or is_error(rec):
            continue
        v = _score(rec, metric)
        if v is not None:
            out[_key(rec)] = v
    return out


def error_keys(cell: CellData, suite: str) -> set[tuple[str, int]]:
    """The (item_id, repeat) keys of one suite's error records."""
    return {_key(rec) for rec in cell.items if rec.get("suite") == suite and is_error(rec)}


def error_counts(cell: CellData, suite: str) -> tuple[int, int]:
    """(error records, all records) of one suite in a cell."""
    recs = [rec for rec in cell.items if rec.get("suite") == suite]
    return sum(1 for rec in recs if is_error(rec)), len(recs)


def paired_scores(base: CellData, cand: CellData, suite: str,
                  metric: Optional[str] = None) -> tuple[dict[tuple[str, int], float], dict[tuple[str, int], float], int]:
    """(baseline scores, candidate scores, dropped) for a paired comparison: both ``item_scores`` restricted
    to the (item, repeat) keys that errored in neither cell; ``dropped`` counts the keys left out because
    either side errored (keys present in one cell only and errored there count too)."""
    drop = error_keys(base, suite) | error_keys(cand, suite)
    b = {k: v for k, v in item_scores(base, suite, metric).items() if k not in drop}
    c = {k: v for k, v in item_scores(cand, suite, metric).items() if k not in drop}
    return b, c, len(drop)


def accuracy_suites(cell: CellData) -> list[str]:
    """Suites with a primary metric (``correct``, or the score the suite declares), in first-seen order.

    A suite whose records all errored is listed too when it is an accuracy suite by name (a generation
    suite's error records hold no score): its accuracy is then unknown, its errors still count."""
    seen: list[str] = []
    only_errors: list[str] = []
    for rec in cell.items:
        s = rec.get("suite")
        if needs_reference(s) or s in seen:  # fidelity records compare with a reference: no accuracy
            continue
        if is_error(rec):
            if s not in only_errors:
                only_errors.append(s)
            continue
        primary = primary_metric(s)
        if (rec.get("correct") is not None if primary == "correct" else _score(rec, primary) is not None):
            seen.append(s)
    # a suite seen only through error records: keep it (in first-seen order) unless answered records show it
    # is not an accuracy suite
    answered = {rec.get("suite") for rec in cell.items if not is_error(rec)}
    order = list(dict.fromkeys(rec.get("suite") for rec in cell.items))
    keep = set(seen) | {s for s in only_errors if s not in answered}
    return [s for s in order if s in keep]


def suite_metrics(cell: CellData, suite: str) -> list[str]:
    """The suite's primary metric followed by its other per-item metrics (``correct`` when the primary is a
    score and the records hold ``correct``, then the other score names)."""
    primary = primary_metric(suite)
    names: list[str] = [primary]
    for rec in cell.items:
        if rec.get("suite") == suite:
            if rec.get("correct") is not None and "correct" not in names:
                names.append("correct")
            for k in (rec.get("scores") or {}):
                if k not in names:
                    names.append(k)
    if primary == "correct":  # the historical order: correct, then the score names
        return ["correct"] + [n for n in names if n != "correct"]
    return names

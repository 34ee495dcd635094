"""Tables of the long-context and position views of a report: accuracy by context length with the AUC,
recovery (cell / baseline) and paired deltas by length, and fidelity by position bucket."""

from __future__ import annotations

import math
from typing import Optional

from kvbench.reports.analysis import Analysis
from kvbench.reports.long_context import length_label
from kvbench.reports.position import bucket_label
from kvbench.reports.tables import Table, fmt_pct, fmt_pp

__all__ = ["length_table", "recovery_table", "long_delta_table", "position_table", "long_context_tables", "fmt_ratio",
           "NA_BASELINE_ZERO"]

NA_BASELINE_ZERO = "n/a (baseline 0)"


def fmt_ratio(x: Optional[float]) -> str:
    if x is None or math.isnan(x):
        return "—"
    return "∞" if math.isinf(x) else f"{x:.3f}×"


def _ci_pct(lo: float, hi: float) -> str:
    return f"[{fmt_pct(max(0.0, lo))}, {fmt_pct(min(1.0, hi))}]"


def _lengths(rows) -> list[int]:
    return sorted({n for r in rows for n in r})


AUC_NOTE = ("AUC: area under the accuracy-vs-length curve, trapezoid over log2(context length) divided by the "
            "log2 span, so a mean score in [0, 1] that weighs each doubling equally (one length: that length's score); "
            "its interval is a percentile bootstrap resampling questions within each length (seeded).")


def length_table(a: Analysis) -> Table:
    conf = f"{100 * a.confidence:g}%"
    lengths = _lengths([r.by_length for r in a.lengths])
    rows = []
    for r in a.lengths:
        vals = []
        for n in lengths:
            e = r.by_length.get(n)
            vals.append("—" if e is None else f"{fmt_pct(e.mean)} {_ci_pct(e.lo, e.hi)} (n={e.n})")
        rows.append([r.suite, r.cell.short, *vals, f"{fmt_pct(r.auc.value)} {_ci_pct(r.auc.lo, r.auc.hi)}"])
    return Table("Long-context accuracy by context length", ["suite", "cell", *(length_label(n) for n in lengths),
                 "AUC"], rows,
                 note=f"Mean per-item score (ruler: fraction of expected strings found) at each requested context length "
                      f"in tokens, with {conf} intervals (Wilson for 0/1 scores asked once, else t over per-question "
                      f"means). " + AUC_NOTE)


def recovery_table(a: Analysis) -> Table:
    conf = f"{100 * a.confidence:g}%"
    lengths = _lengths([r.paired.lengths for r in a.recovery])
    rows = []
    for r in a.recovery:
        p = r.paired
        vals = []
        for n in lengths:
            if n not in p.lengths:
                vals.append("—")
                continue
            i = p.lengths.index(n)
            ratio = p.ratio(i)
            lo, hi = p.ratio_ci[i]
            vals.append(NA_BASELINE_ZERO if ratio is None else f"{fmt_ratio(ratio)} [{fmt_ratio(lo)}, {fmt_ratio(hi)}]")
        auc_r = p.auc_ratio
        vals.append(NA_BASELINE_ZERO if auc_r is None
                    else f"{fmt_ratio(auc_r)} [{fmt_ratio(p.auc_ratio_ci[0])}, {fmt_ratio(p.auc_ratio_ci[1])}]")
        rows.append([r.suite, r.cell.short, r.base.short, *vals])
    return Table("Long-context recovery against the baseline (cell / baseline)",
                 ["suite", "cell", "baseline", *(length_label(n) for n in lengths), "AUC"], rows,
                 note=f"Ratio of the cell's mean score to the baseline's on shared (item, repeat) keys; {conf} paired "
                      "bootstrap interval drawing the same questions for both cells within each length (seeded). "
                      f"{NA_BASELINE_ZERO}: the ratio is undefined because the baseline scores 0.")


def long_delta_table(a: Analysis) -> Table:
    conf = f"{100 * a.confidence:g}%"
    lengths = _lengths([r.paired.lengths for r in a.recovery])
    rows = []
    for r in a.recovery:
        p = r.paired
        vals = []
        for n in lengths:
            d = r.deltas.get(n)
            vals.append("—" if d is None else f"{fmt_pp(d.delta)} [{fmt_pp(d.ci_lo)}, {fmt_pp(d.ci_hi)}]")
        vals.append(f"{fmt_pp(p.delta)} [{fmt_pp(p.ci_lo)}, {fmt_pp(p.ci_hi)}]")
        vals.append(f"{fmt_pp(p.lower_bound)} ({p.bound_method})")
        rows.append([r.suite, r.cell.short, r.base.short, str(p.n_pairs), *vals])
    return Table("Long-context paired deltas by context length", ["suite", "cell", "baseline", "pairs",
                 *(length_label(n) for n in lengths), "AUC Δ", f"AUC Δ one-sided LB{conf}"], rows,
                 note="Per length: the paired delta of the accuracy section (Newcombe for 0/1 scores asked once, else "
                      "paired bootstrap over questions). AUC Δ: paired bootstrap resampling questions within each length "
                      "and recomputing both AUCs (newcombe-bonferroni: 0/1 scores with a length whose pairs all agree, where "
                      "the bootstrap has no width, take the weighted Newcombe intervals at 1 − α/m when they are wider); "
                      "its one-sided lower bound is what `kvbench gate --metric ruler:auc` compares with −δ.")


def position_table(a: Analysis) -> Table:
    buckets = sorted({(b.lo, b.hi) for r in a.positions for b in r.buckets})
    rows = []
    for r in a.positions:
        by = {(b.lo, b.hi): b for b in r.buckets}
        vals = []
        for key in buckets:
            b = by.get(key)
            p99 = "—" if b is None or math.isnan(b.kl_p99) else f"{b.kl_p99:.3g}"
            vals.append("—" if b is None else f"{b.kl_mean:.3g} / {p99} / {fmt_pct(b.top1_agree, 2)}")
        rows.append([r.cell.short, f"{sum(b.n_tokens for b in r.buckets):,}", *vals])
    return Table("Fidelity by position", ["cell", "tokens", *(bucket_label(lo, hi) for lo, hi in buckets)], rows,
                 note="Each entry: KL mean / KL p99 (nats per token, KL(reference ‖ cell)) / top-1 agreement over the "
                      "scored tokens whose absolute position (context tokens + index in the continuation) falls in the "
                      "bucket. Means are pooled over every token of the bucket; the p99 is the fidelity summary's, pooled "
                      "over the same tokens (— when the summary does not cover them).")


def long_context_tables(a: Analysis) -> list[Table]:
    """The long-context tables that have rows (none for a run without a long-context suite)."""
    out = []
    if a.lengths:
        out.append(length_table(a))
    if a.recovery:
        out += [recovery_table(a), long_delta_table(a)]
    return out

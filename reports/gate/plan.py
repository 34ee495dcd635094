"""Sample-size planning for the gate (``kvbench gate --plan``, the report's planning table): how many
questions would certify the margin at the observed rates and agreement, so INCONCLUSIVE says what to do.

For an accuracy check with observed paired difference Δ (candidate − baseline) and margin δ the bound
clears −δ once its half-width is below Δ + δ:

* ``n_expected``: the number of questions at which the bound computed from the observed proportions clears
  the margin, i.e. the certificate comes out half the time (50% power).  For 0/1 scores asked once this
  is found by search on the same Newcombe interval the gate uses, with the observed 2×2 table of pairs
  scaled to n questions (so a run with no discordant pair still needs enough questions: the interval keeps
  a width of order 1/n); otherwise from the normal approximation with the per-question standard
  deviation of the differences, n = (z₁₋α · s / (Δ + δ))²;
* ``n_power``: the same at the requested power (default 80%), n = ((z₁₋α + z_power) · s / (Δ + δ))², never
  fewer than ``n_expected``.  For the AUC check, s is taken from the bootstrap bound's half-width.

When Δ < −δ but the interval still holds −δ (INCONCLUSIVE on the losing side), the same sizes are those at
which the upper bound would fall below −δ and confirm the loss; a conclusive FAIL gets no plan (more items would
not certify the format).  A metric that is not discriminative (floor, ceiling, noise)
is not helped by more items either.  The numbers assume the next items behave like these; they are a
planning estimate, not a guarantee.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvbench.reports.stats import paired as stats
from kvbench.reports.gate.discriminative import errored, scores

__all__ = ["Plan", "plan_check", "plan_result", "format_plan", "MAX_PLAN"]

MAX_PLAN = 10_000_000  # beyond this the answer is "not practical"


@dataclass
class Plan:
    check: object  # reports.gate.Check
    n_now: int  # questions compared now
    k: int  # repeats per question
    n_expected: Optional[int]  # questions at which the expected bound clears the margin (50% power)
    n_power: Optional[int]  # questions for ``power``
    power: float
    note: str

    @property
    def more_needed(self) -> Optional[int]:
        return None if self.n_power is None else max(0, self.n_power - self.n_now)


def _newcombe_search(p11: float, p10: float, p01: float, p00: float, margin: float, confidence: float,
                     confirm_loss: bool = False) -> Optional[int]:
    """Smallest n (questions) whose Newcombe lower bound, at the observed pair proportions, is above −margin
    (``confirm_loss``: whose upper bound is below −margin)."""
    alpha = 1.0 - confidence

    def clears(n: int) -> bool:
        lo, hi_b = stats.newcombe_paired_interval(n * p11, n * p10, n * p01, n * p00, 1.0 - 2.0 * alpha)
        return hi_b < -margin if confirm_loss else lo > -margin

    hi = 2
    while not clears(hi):
        hi *= 2
        if hi > MAX_PLAN:
            return None
    lo = max(1, hi // 2)
    while lo < hi:  # the bound tightens with n at fixed proportions
        mid = (lo + hi) // 2
        if clears(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def _normal_n(sd: float, gap: float, z: float) -> Optional[int]:
    if gap <= 0:
        return None
    n = math.ceil((z * sd / gap) ** 2)
    return n if n <= MAX_PLAN else None


def plan_check(chk, base, cand, thresholds, power: float = 0.8) -> Optional[Plan]:
    """The plan of one gated accuracy check (None for other kinds)."""
    if chk.kind != "accuracy" or chk.threshold is None or chk.delta is None:
        return None
    margin = -chk.threshold
    conf = thresholds.confidence
    z_c, z_p = stats.normal_ppf(conf), stats.normal_ppf(power)
    gap = chk.delta + margin
    if chk.status == "not discriminative":
        return Plan(chk, chk.n, 1, None, None, power, f"more items do not help: {chk.reason}")
    confirm = gap <= 0  # the observed drop is at or beyond the margin: more items would confirm the loss
    if confirm and chk.status == "fail":
        return Plan(chk, chk.n, 1, None, None, power,
                    f"the candidate loses more than the margin (Δ {100 * chk.delta:+.1f} pp, upper bound below "
                    f"−{100 * margin:.1f} pp): more items would not certify the format")
    if confirm and gap == 0:
        return Plan(chk, chk.n, 1, None, None, power, "Δ sits exactly on the margin: no number of items decides it")
    gap = abs(gap)
    what = ("questions to confirm the loss (upper bound below −δ)" if confirm else "")
    if chk.metric == "auc":
        n_q = chk.n
        if math.isinf(chk.bound):
            return Plan(chk, n_q, 1, None, None, power, "no spread in the differences to plan from: add items and rerun")
        sd = (chk.delta - chk.bound) / z_c * math.sqrt(n_q)
        n_exp = _normal_n(sd, gap, z_c)
        n_pow = _normal_n(sd, gap, z_c + z_p)
        return Plan(chk, n_q, 1, n_exp, max(n_pow or 0, n_exp or 0) or None, power,
                    "; ".join(x for x in (what, "questions per length, from the bootstrap bound's width") if x))
    drop = errored(base, cand, chk.suite)
    b = scores(base, chk.suite, chk.metric, drop)
    c = scores(cand, chk.suite, chk.metric, drop)
    keys = sorted(set(b) & set(c), key=lambda t: (str(t[0]), t[1]))
    bq = stats.group_by_question({k: b[k] for k in keys})
    cq = stats.group_by_question({k: c[k] for k in keys})
    items = sorted(bq, key=str)
    k = max(len(v) for v in bq.values())
    diffs = np.array([np.mean(cq[i]) - np.mean(bq[i]) for i in items])
    sd = float(diffs.std(ddof=1)) if diffs.size > 1 else 0.0
    binary = all(v in (0.0, 1.0) for v in (*b.values(), *c.values()))
    n_exp: Optional[int]
    if binary and k == 1:
        n = len(keys)
        p11 = sum(1 for x in keys if b[x] == 1 and c[x] == 1) / n
        p10 = sum(1 for x in keys if c[x] == 1 and b[x] == 0) / n  # candidate right, baseline wrong
        p01 = sum(1 for x in keys if c[x] == 0 and b[x] == 1) / n
        p00 = 1.0 - p11 - p10 - p01
        n_exp = _newcombe_search(p11, p10, p01, p00, margin, conf, confirm)
        note = "Newcombe interval at the observed pair proportions"
    elif sd > 0:
        n_exp = _normal_n(sd, gap, z_c)
        note = f"normal approximation, per-question s.d. {sd:.3g}" + (f", {k} repeats each" if k > 1 else "")
    else:
        return Plan(chk, len(items), k, None, None, power,
                    "every question's difference is the same: no spread to plan from; add items and rerun")
    n_pow = _normal_n(sd, gap, z_c + z_p) if sd > 0 else None
    n_pow = max(n_pow or 0, n_exp or 0) or None
    return Plan(chk, len(items), k, n_exp, n_pow, power, "; ".join(x for x in (what, note) if x))


def plan_result(result, power: float = 0.8) -> list[Plan]:
    """Plans for the gated accuracy checks of a ``GateResult`` that did not pass."""
    out = []
    for chk in result.checks:
        if chk.gated and chk.kind == "accuracy" and chk.status != "pass":
            p = plan_check(chk, result.baseline, chk.candidate, result.thresholds, power)
            if p is not None:
                out.append(p)
    return out


PLAN_COLUMNS = ["candidate", "suite", "metric", "status", "Δ", "margin", "questions now", "needed (50%)", "needed (power)",
                "how"]


def plan_row(p: Plan) -> list[str]:
    c = p.check

    def n(x: Optional[int]) -> str:
        return "—" if x is None else f"{x:,}"

    return [c.candidate.short, c.suite, c.metric, c.status, f"{100 * c.delta:+.1f} pp", f"{100 * -c.threshold:.1f} pp",
            f"{p.n_now:,}", n(p.n_expected), n(p.n_power) + (f" ({100 * p.power:.0f}%)" if p.n_power else ""), p.note]


def format_plan(plans: list[Plan]) -> str:
    if not plans:
        return "plan: every gated accuracy check passed; nothing to plan"
    rows = [PLAN_COLUMNS] + [plan_row(p) for p in plans]
    widths = [max(len(r[i]) for r in rows) for i in range(len(PLAN_COLUMNS))]
    lines = ["sample-size plan (questions, each asked as often as now; the next items assumed to behave like these):"]
    for i, r in enumerate(rows):
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)

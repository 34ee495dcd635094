"""Can a metric tell formats apart here?  The status of a gate check (``classify``) and the A/A noise floor.

A non-inferiority check certifies "the candidate loses at most δ".  That certificate means nothing when the
metric could not have shown a loss, and the gate then refuses to certify (status ``not discriminative``,
the gate's own exit reason) instead of printing a zero delta:

* **floor**: the baseline scores 0, or less than the margin δ: no candidate can drop by more than the
  baseline has, so the check cannot fail (GSM8K at 0% on a tiny model);
* **ceiling**: the baseline scores 100% on every item: the items are too easy for this model to show a
  loss, and a candidate that did not fail conclusively is not certified by them (a conclusive failure at the
  ceiling stays a failure: the metric did tell the formats apart);
* **noise** (the run has an A/A control: the baseline's accuracy cell run again in a fresh engine under
  different batching): the baseline differs from its own rerun by at least the margin (the stack's
  nondeterminism is as large as what the gate tries to bound), or a candidate's conclusive drop is no larger
  than the A/A difference (the metric moves that much by chance).  The invalid-answer and truncation rate
  checks follow the same noise rule against their allowed increase.

Everything else is ``pass`` / ``fail`` (conclusive: the whole one-sided interval past the threshold) /
``inconclusive`` (the interval holds the threshold: more items would decide).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from kvbench.reports import stats
from kvbench.reports.load import CellData, RunData, error_keys, item_scores
from kvbench.reports.long_context import length_suites, paired_auc, parse_length_metric, scores_by_length

if TYPE_CHECKING:  # pragma: no cover
    from kvbench.reports.gate import Check, GateThresholds

__all__ = ["Noise", "aa_cell_for", "noise_for", "classify", "scores", "errored", "at_floor", "at_ceiling",
           "delta_blind"]

_CEILING = 1.0 - 1e-12


@dataclass(frozen=True)
class Noise:
    """The A/A control against the baseline on one metric: what the stack's own nondeterminism moves it by."""

    delta: float  # A/A − baseline
    ci: tuple[float, float]  # two-sided interval of that difference
    n: int  # (item, repeat) pairs
    agreement: Optional[float] = None  # share of pairs with the same score


def scores(cell: CellData, suite: str, metric: str, drop: frozenset = frozenset()) -> dict:
    """The (item, repeat) scores a metric compares, without the keys in ``drop`` (errored on either side):
    a length metric keeps the items of that length."""
    length = parse_length_metric(metric)
    if length is not None and suite in length_suites(cell):
        got = scores_by_length(cell, suite).get(length, {})
    else:
        got = item_scores(cell, suite, metric)
    return {k: v for k, v in got.items() if k not in drop}


def errored(base: CellData, cand: CellData, suite: str) -> frozenset:
    """(item, repeat) keys whose request failed in either cell: left out of their comparison."""
    return frozenset(error_keys(base, suite) | error_keys(cand, suite))


def _same_config(a: dict, b: dict) -> bool:
    skip = ("aa_control", "concurrency")
    return {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}


def aa_cell_for(run: RunData, base: CellData) -> Optional[CellData]:
    """The A/A control of ``base``: a done cell with items, ``aa_control`` set, and the baseline's config
    otherwise (its concurrency may differ: the control runs under different batching)."""
    for c in run.done_cells:
        if c.aa_control and c.items and c is not base and c.run == base.run and _same_config(c.config, base.config):
            return c
    return None


def noise_for(base: CellData, aa: CellData, suite: str, metric: str, t: "GateThresholds") -> Optional[Noise]:
    """The A/A difference on ``suite:metric`` (None when the control lacks the metric or shares no items)."""
    drop = errored(base, aa, suite)
    try:
        if metric == "auc" and suite in length_suites(base) and suite in length_suites(aa):
            b = {n: {k: v for k, v in m.items() if k not in drop} for n, m in scores_by_length(base, suite).items()}
            a = {n: {k: v for k, v in m.items() if k not in drop} for n, m in scores_by_length(aa, suite).items()}
            p = paired_auc(b, a, confidence=t.confidence, n_boot=t.n_boot, seed=t.seed)
            return Noise(p.delta, (p.ci_lo, p.ci_hi), p.n_pairs)
        b, a = scores(base, suite, metric, drop), scores(aa, suite, metric, drop)
        shared = set(b) & set(a)
        if not shared:
            return None
        d = stats.paired_delta(b, a, confidence=t.confidence, n_boot=t.n_boot, seed=t.seed, bound_method=t.method)
    except ValueError:
        return None
    agree = sum(1 for k in shared if b[k] == a[k]) / len(shared)
    return Noise(d.delta, (d.ci_lo, d.ci_hi), d.n_pairs, agree)


def at_floor(base_value: Optional[float], margin: float) -> bool:
    """The baseline leaves no room for a drop beyond the margin (0, or below δ)."""
    return base_value is not None and (base_value <= 0.0 or base_value < margin)


def at_ceiling(base_value: Optional[float]) -> bool:
    return base_value is not None and base_value >= _CEILING


def delta_blind(base_mean: float, cand_mean: float) -> str:
    """For report tables without a margin: why a paired delta says nothing ('' when it may): the baseline
    at 0 (nothing to lose), or both cells at 100% (no item could show a loss)."""
    if base_mean <= 0.0:
        return "not discriminative (baseline 0%)"
    if at_ceiling(base_mean) and at_ceiling(cand_mean):
        return "not discriminative (both 100%)"
    return ""


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _pp(x: float) -> str:
    v = round(100 * x, 1) + 0.0
    return f"{v:+.1f} pp"


def _accuracy_status(c: "Check") -> tuple[str, str]:
    margin = -c.threshold if c.threshold is not None else 0.0
    noise = c.noise
    if c.passed is False:
        if (noise is not None and c.delta is not None and c.delta <= -margin and abs(noise.delta) >= abs(c.delta)):
            return "not discriminative", (f"the drop {_pp(c.delta)} is no larger than the A/A control's difference "
                                          f"{_pp(noise.delta)}: the metric moves that much between two runs of the baseline")
        if not c.inconclusive:
            far = "" if c.far_bound is None else f"the upper bound {_pp(c.far_bound)} of Δ is below "
            return "fail", f"{far}−δ {_pp(c.threshold)}: the candidate loses more than the margin (Δ {_pp(c.delta)})"
    if at_floor(c.base_value, margin):
        return "not discriminative", (f"baseline at the floor ({_pct(c.base_value)}, margin δ {_pct(margin)}): no "
                                      "candidate can drop by more than the margin, so this metric cannot fail; "
                                      "use a task the model can do")
    if at_ceiling(c.base_value):
        return "not discriminative", ("baseline at the ceiling (100% on every item): these items are too easy to show "
                                      "a loss; use harder items (longer contexts, a harder suite)")
    if noise is not None and margin > 0 and abs(noise.delta) >= margin:
        return "not discriminative", (f"the A/A control differs from the baseline by {_pp(noise.delta)}, at least "
                                      f"the margin δ {_pct(margin)}: the stack's own nondeterminism is as large as "
                                      "what the gate would certify")
    if c.passed:
        return "pass", ""
    far = _pp(c.far_bound) if c.far_bound is not None else "?"
    return "inconclusive", (f"Δ {_pp(c.delta)}: its interval [{_pp(c.bound)}, {far}] holds −δ = {_pp(c.threshold)}; "
                            "more items would decide (kvbench gate --plan)")


def _rate_noise(c: "Check") -> str:
    """Why a failing rate check is noise: the A/A control moves the rate by the allowed increase, or by as
    much as the candidate does ('' when it is not)."""
    n = c.noise
    if n is None or c.delta is None or c.threshold is None:
        return ""
    if c.threshold > 0 and abs(n.delta) >= c.threshold:
        return (f"the A/A control moves the rate by {_pp(n.delta)}, at least the allowed increase "
                f"{_pp(c.threshold)}: the stack's own nondeterminism is as large as the limit")
    if c.delta >= c.threshold and abs(n.delta) >= abs(c.delta):
        return (f"the increase {_pp(c.delta)} is no larger than the A/A control's difference {_pp(n.delta)}")
    return ""


def classify(c: "Check") -> "Check":
    """Set ``c.status`` and ``c.reason`` (see the module docstring)."""
    if not c.gated:
        c.status, c.reason = "info", ""
    elif c.kind == "accuracy":
        c.status, c.reason = _accuracy_status(c)
    elif c.kind == "error rate":
        c.status = "pass" if c.passed else "fail"
        c.reason = "" if c.passed else (f"{c.subject} error rate {_pct(c.cand_value)} over the limit "
                                        f"{_pct(c.threshold)}: failed requests, not wrong answers")
    elif c.kind in ("invalid rate", "truncation rate") and c.passed is False and _rate_noise(c):
        c.status, c.reason = "not discriminative", _rate_noise(c)
    elif c.passed:
        c.status, c.reason = "pass", ""
    elif c.inconclusive:
        c.status, c.reason = "inconclusive", "the interval holds the limit: more items would decide"
    else:
        c.status = "fail"
        c.reason = (f"the fidelity KL's lower bound {c.far_bound:.4g} is above the maximum {c.threshold:g}"
                    if c.kind == "fidelity KL" else
                    f"the {c.kind}'s increase {_pp(c.delta)} has its lower bound {_pp(c.far_bound)} above the allowed "
                    f"{_pp(c.threshold)}" if c.far_bound is not None else "")
    return c

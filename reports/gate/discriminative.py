"""Can a metric tell formats apart here?  The status of a gate check (``classify``) and the A/A noise floor.

A non-inferiority check certifies "the candidate loses at most δ".  That certificate means nothing when no
candidate result could have failed it, and the gate then refuses to certify (status ``not discriminative``,
the gate's own exit reason) instead of printing a zero delta.  That is the case only when:

* **floor**: the baseline scores at most the margin δ (0% on GSM8K for a tiny model): no candidate can drop
  by more than the baseline has, so the check cannot fail;
* **ceiling, on both sides**: the baseline *and* the candidate score 100% on every item: the items are too
  easy for this model to show a loss — unless another candidate of the same run provably lost on them
  (``Check.loss_shown_by``), which shows they can.  A candidate that dropped from a 100% baseline did show
  one: that is an ordinary comparison (FAIL when the interval proves the loss, else INCONCLUSIVE with a plan);
* **noise** (the run has an A/A control: a cell run again in a fresh engine under different batching): the
  baseline or the candidate differs from its own rerun by at least the margin (the stack's nondeterminism is
  as large as what the gate tries to bound), or a candidate's drop past the margin is no larger than that
  A/A difference (the metric moves that much by chance).

The invalid-answer and truncation rate checks follow the same rules turned over: a rate cannot rise by more
than ``1 − baseline rate``, so a baseline whose rate is within the allowed increase of 100% leaves the check
unable to fail (every answer of the baseline already cut off, say), and the A/A rule applies against the
allowed increase.

Everything else is ``pass`` / ``fail`` (conclusive: the whole one-sided interval past the threshold) /
``inconclusive`` (the interval holds the threshold: more items would decide).  ``floor_cause`` says when the
baseline's own truncation or invalid answers explain a floor, and which setting to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from kvbench.reports.stats import paired as stats
from kvbench.reports.load import CellData, RunData, same_but_batching
from kvbench.reports.item_records import error_keys, is_error, item_scores
from kvbench.reports.long_context import length_suites, paired_auc, parse_length_metric, scores_by_length

if TYPE_CHECKING:  # pragma: no cover
    from kvbench.reports.gate.check import Check, GateThresholds

__all__ = ["Noise", "aa_cell_for", "noise_for", "classify", "scores", "errored", "at_floor", "at_ceiling",
           "rate_cannot_rise", "floor_cause", "delta_blind"]

RATE_KINDS = ("invalid rate", "truncation rate")
LOWER_LIMIT_KINDS = ("top-1 agreement",)  # fidelity checks with a minimum; the others have a maximum
_CEILING = 1.0 - 1e-12
_EPS = 1e-12


@dataclass(frozen=True)
class Noise:
    """The A/A control against the baseline on one metric: what the stack's own nondeterminism moves it by."""

    delta: float  # A/A − baseline
    ci: tuple[float, float]  # two-sided interval of that difference
    n: int  # (item, repeat) pairs
    agreement: Optional[float] = None  # share of pairs with the same score
    subject: str = "the baseline"  # whose rerun: "the baseline", "the candidate"


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


def aa_cell_for(run: RunData, base: CellData) -> Optional[CellData]:
    """The A/A control of ``base`` (the baseline or a candidate): a done cell with items, ``aa_control`` set,
    and ``base``'s config otherwise (its concurrency may differ: the control runs under different batching)."""
    for c in run.done_cells:
        if c.aa_control and c.items and c is not base and c.run == base.run and same_but_batching(c.config, base.config):
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
    """The baseline leaves no room for a drop beyond the margin: 0, or at most δ (a drop of exactly δ is not
    past the margin, so a baseline of δ cannot fail either)."""
    return base_value is not None and (base_value <= 0.0 or base_value <= margin + _EPS)


def at_ceiling(value: Optional[float]) -> bool:
    """100% on every item."""
    return value is not None and value >= _CEILING


def rate_cannot_rise(base_rate: Optional[float], allowed: float) -> bool:
    """A rate check that cannot fail: the baseline's rate is so high that no candidate can exceed it by more
    than the allowed increase (the rate's own ceiling)."""
    return base_rate is not None and base_rate >= 1.0 - allowed - _EPS


def floor_cause(base: CellData, suite: str) -> str:
    """What in the baseline's own records explains a floor, and the setting to change ('' when nothing does):
    answers cut off at ``max_tokens`` (with the budget that would have fitted them, where the records can
    tell), or answers that finished without an extractable answer."""
    recs = [r for r in base.items if r.get("suite") == suite and not is_error(r)]
    if not recs:
        return ""
    wrong = [r for r in recs if not r.get("correct")]
    cut = [r for r in wrong if r.get("finish_reason") == "length"]
    if wrong and len(cut) * 2 >= len(wrong):
        return _truncation_advice(suite, recs, cut)
    invalid = [r for r in wrong if r.get("invalid")]
    if wrong and len(invalid) * 2 >= len(wrong):
        return (f"{len(invalid)} of {len(recs)} baseline answers finished without an answer the suite could extract: "
                f"check {suite}'s prompt style and answer format for this model (the records' raw_output shows them)")
    return ""


def _truncation_advice(suite: str, recs: list[dict], cut: list[dict]) -> str:
    budgets = sorted({int((r.get("request_options") or {}).get("max_tokens") or r.get("output_tokens") or 0) for r in cut})
    limit = budgets[-1] if budgets else 0
    head = (f"{len(cut)} of {len(recs)} baseline answers were cut off at max_tokens={limit}: raise {suite}'s "
            f"max_tokens (max_tokens: under the suite in the sweep config, --max-tokens for kvbench eval)")
    need = [int(r["answer_tokens"]) for r in recs if isinstance(r.get("answer_tokens"), int)]
    if need:
        return f"{head}; the expected answers need up to {max(need)} tokens, so max_tokens {max(need)} would have fitted them"
    done = [int(r.get("output_tokens") or 0) for r in recs if r.get("finish_reason") == "stop"]
    if done:
        return (f"{head}; the {len(done)} answers that finished used up to {max(done)} tokens, the cut-off ones "
                f"more than {limit}")
    return (f"{head}; none finished within {limit} tokens, so these records cannot say how many would suffice: "
            f"rerun a few items with a larger budget (e.g. --max-tokens {4 * max(limit, 1)}) to see")


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
    return f"{v:+.1f} pp".replace("-", "−")  # the minus sign of the card's tables


def _accuracy_status(c: "Check") -> tuple[str, str]:
    margin = -c.threshold if c.threshold is not None else 0.0
    noise = c.noise
    if c.passed is False:
        if (noise is not None and c.delta is not None and c.delta <= -margin and abs(noise.delta) >= abs(c.delta)):
            return "not discriminative", (f"the drop {_pp(c.delta)} is no larger than the A/A control's difference "
                                          f"{_pp(noise.delta)}: the metric moves that much between two runs of "
                                          f"{noise.subject}")
        if not c.inconclusive:
            far = "" if c.far_bound is None else f"the upper bound {_pp(c.far_bound)} of Δ is below "
            return "fail", f"{far}−δ {_pp(c.threshold)}: the candidate loses more than the margin (Δ {_pp(c.delta)})"
    if at_floor(c.base_value, margin):
        return "not discriminative", (f"baseline at the floor ({_pct(c.base_value)}, margin δ {_pct(margin)}): no "
                                      "candidate can drop by more than the margin, so this metric cannot fail; "
                                      + (c.floor_cause or "use a task the model can do"))
    if at_ceiling(c.base_value) and at_ceiling(c.cand_value) and not c.loss_shown_by:
        return "not discriminative", ("baseline and candidate both at the ceiling (100% on every item): these items "
                                      "are too easy to show a loss; use harder items (longer contexts, a harder suite)")
    if noise is not None and margin > 0 and abs(noise.delta) >= margin:
        return "not discriminative", (f"the A/A control of {noise.subject} differs from it by {_pp(noise.delta)}, at "
                                      f"least the margin δ {_pct(margin)}: the stack's own nondeterminism is as large "
                                      "as what the gate would certify")
    if c.passed:
        return "pass", (f"both at 100%, and these items can show a loss: {c.loss_shown_by} lost on them"
                        if c.loss_shown_by and at_ceiling(c.base_value) and at_ceiling(c.cand_value) else "")
    return "inconclusive", _inconclusive_reason(c)


def _inconclusive_reason(c: "Check") -> str:
    """Which side of −δ the estimate is on, and what more items would do."""
    far = _pp(c.far_bound) if c.far_bound is not None else "?"
    interval = f"its one-sided bounds [{_pp(c.bound)}, {far}] hold −δ = {_pp(c.threshold)}"
    if c.delta is not None and c.threshold is not None and c.delta < c.threshold:
        return (f"Δ {_pp(c.delta)} is past the margin, but {interval}: the loss is not proven; more items would "
                "confirm it (kvbench gate --plan)")
    return f"Δ {_pp(c.delta)}: {interval}; more items would decide (kvbench gate --plan)"


def _rate_noise(c: "Check") -> str:
    """Why a failing rate check is noise: the A/A control moves the rate by the allowed increase, or by as
    much as the candidate does ('' when it is not)."""
    n = c.noise
    if n is None or c.delta is None or c.threshold is None:
        return ""
    if c.threshold > 0 and abs(n.delta) >= c.threshold:
        return (f"the A/A control of {n.subject} moves the rate by {_pp(n.delta)}, at least the allowed increase "
                f"{_pp(c.threshold)}: the stack's own nondeterminism is as large as the limit")
    if c.delta >= c.threshold and abs(n.delta) >= abs(c.delta):
        return (f"the increase {_pp(c.delta)} is no larger than the A/A control's difference {_pp(n.delta)}")
    return ""


def _rate_status(c: "Check") -> tuple[str, str]:
    """Invalid and truncation rates: the accuracy rules turned over (the rate's ceiling is its floor)."""
    if c.passed is False and _rate_noise(c):
        return "not discriminative", _rate_noise(c)
    if c.passed is False and not c.inconclusive:
        return "fail", (f"the {c.kind}'s increase {_pp(c.delta)} has its lower bound {_pp(c.far_bound)} above the "
                        f"allowed {_pp(c.threshold)}" if c.far_bound is not None else "")
    if rate_cannot_rise(c.base_value, c.threshold or 0.0):
        return "not discriminative", (f"the baseline's {c.kind} is {_pct(c.base_value)}: no candidate can raise it by "
                                      f"more than the allowed {_pp(c.threshold)}, so this check cannot fail"
                                      + (f"; {c.floor_cause}" if c.floor_cause else ""))
    if c.passed:
        return "pass", ""
    side = "past" if c.delta is not None and c.threshold is not None and c.delta > c.threshold else "within"
    return "inconclusive", (f"the increase {_pp(c.delta)} is {side} the allowed {_pp(c.threshold)}, and its interval "
                            "holds the limit: more items would decide")


def _limit_status(c: "Check") -> tuple[str, str]:
    """Fidelity checks against a fixed limit (KL and perplexity ratio at most, top-1 agreement at least)."""
    if c.passed:
        return "pass", ""
    if c.inconclusive:
        return "inconclusive", f"the {c.kind}'s interval holds the limit {_limit(c, c.threshold)}: more texts would decide"
    at_least = c.kind in LOWER_LIMIT_KINDS
    return "fail", (f"the {c.kind}'s {'upper' if at_least else 'lower'} bound {_limit(c, c.far_bound)} is "
                    f"{'below the minimum' if at_least else 'above the maximum'} {_limit(c, c.threshold)}")


def _limit(c: "Check", v: Optional[float]) -> str:
    if v is None:
        return "?"
    return _pct(v) if c.kind in LOWER_LIMIT_KINDS else (f"{v:.4g}×" if c.kind == "perplexity ratio" else f"{v:.4g}")


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
    elif c.kind in RATE_KINDS:
        c.status, c.reason = _rate_status(c)
    else:
        c.status, c.reason = _limit_status(c)
    return c

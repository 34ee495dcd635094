"""Non-inferiority gate (DESIGN §10): candidate cell(s) against a baseline cell of one run.

A gated accuracy metric passes when the one-sided lower confidence bound of (candidate − baseline),
paired on (item, repeat), is above −δ.  Invalid-answer and truncation rates pass when the one-sided upper
bound of their increase is below the allowed increase; fidelity KL passes when the upper bound of the
token-weighted mean KL (the ``kl_mean`` of summary.json and of the report) is at most the allowed maximum
(only when a maximum is configured).

Bounds (``stats.paired_delta``): Newcombe's hybrid score interval for paired proportions when every score
is 0/1 and each question was asked once (accuracy, invalid, truncated); the paired bootstrap or t bound
(``method``) otherwise.  Those cannot be estimated with fewer than 2 questions or differences without
spread: 0/1 scores then use Newcombe's interval over the (item, repeat) pairs, other scores get an unknown
bound (±inf, so the check fails as inconclusive).  The baseline and the candidate must hold the same (item, repeat) keys for every gated metric:
otherwise the gate stops with exit 2 (missing data) instead of comparing a silently shrunk set.

Long-context suites (records with ``context_length``; the ruler suite, whose primary metric is the per-item
``scores.ruler``) add two metric names: ``SUITE:L<length>`` gates the items of one requested length like any
accuracy metric, and ``SUITE:auc`` gates the area under the accuracy-vs-length curve: its lower bound is a
paired bootstrap resampling questions within each length and recomputing both AUCs
(``reports.long_context.paired_auc``; deterministic with ``seed``).  ``max_drop`` may name ``SUITE:METRIC``
(e.g. ``ruler:auc``) to set a margin for one metric; otherwise the suite's margin applies.

Thresholds, lowest precedence first: built-in defaults, the run manifest's ``config.gate`` section,
a ``--config`` sweep file's ``gate:`` section, command-line flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from kvbench.reports import stats
from kvbench.reports.analysis import fidelity_kl
from kvbench.reports.load import (FIDELITY_SUITE, CellData, RunData, RunLoadError, accuracy_suites, item_scores,
                                  primary_metric, select)
from kvbench.reports.long_context import length_label, length_suites, paired_auc, parse_length_metric, scores_by_length

__all__ = ["GateError", "GateThresholds", "Check", "GateResult", "merge_gate_config", "run_gate", "EXIT_PASS",
           "EXIT_FAIL", "EXIT_ERROR"]

EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 2
DEFAULT_MAX_DROP = 0.05
DEFAULT_MAX_RATE_INCREASE = 0.05


class GateError(RuntimeError):
    """Missing data or a usage error: exit code 2."""


@dataclass
class GateThresholds:
    max_drop: dict[str, float] = field(default_factory=dict)  # suite or suite:metric -> δ (absolute, 0.05 = 5 pp)
    default_max_drop: float = DEFAULT_MAX_DROP
    confidence: float = 0.95
    max_invalid_rate_increase: float = DEFAULT_MAX_RATE_INCREASE
    max_truncation_rate_increase: float = DEFAULT_MAX_RATE_INCREASE
    max_kl_mean: Optional[float] = None  # None: KL is reported, not gated
    metrics: Optional[list[str]] = None  # "suite" or "suite:metric"; None = every accuracy suite, primary metric
    method: str = "bootstrap"  # lower-bound method: "bootstrap" (paired, seeded) or "t"
    n_boot: int = 10_000
    seed: int = 0

    def drop_for(self, suite: str, metric: Optional[str] = None) -> float:
        if metric is not None and f"{suite}:{metric}" in self.max_drop:
            return self.max_drop[f"{suite}:{metric}"]
        return self.max_drop.get(suite, self.default_max_drop)

    def validate(self) -> "GateThresholds":
        try:
            stats.check_confidence(self.confidence)
        except ValueError as e:
            raise GateError(str(e)) from None
        for name, v in [("max_drop", self.default_max_drop), *((f"max_drop.{k}", v) for k, v in self.max_drop.items()),
                        ("max_invalid_rate_increase", self.max_invalid_rate_increase),
                        ("max_truncation_rate_increase", self.max_truncation_rate_increase),
                        ("max_kl_mean", self.max_kl_mean)]:
            if v is not None and (not isinstance(v, (int, float)) or math.isnan(v) or v < 0):
                raise GateError(f"{name} must be a number >= 0, got {v!r}")
        for name, flag, v in (("max_invalid_rate_increase", "--max-invalid-increase", self.max_invalid_rate_increase),
                              ("max_truncation_rate_increase", "--max-truncation-increase", self.max_truncation_rate_increase)):
            if v is not None and v > 1:
                raise GateError(f"{name} ({flag}) must be a fraction in [0, 1] (0.05 = 5 points), got {v!r}")
        if self.method not in ("bootstrap", "t"):
            raise GateError(f"method must be 'bootstrap' or 't', got {self.method!r}")
        return self


def merge_gate_config(t: GateThresholds, gate: Optional[dict]) -> GateThresholds:
    """Overlay a config ``gate:`` section (harness/sweep_config.GateSpec as a dict) onto ``t``."""
    if not gate:
        return t
    if not isinstance(gate, dict):
        raise GateError(f"gate section must be a mapping, got {type(gate).__name__}")
    t = replace(t, max_drop=dict(t.max_drop))
    md = gate.get("max_drop")
    if isinstance(md, (int, float)) and not isinstance(md, bool):
        t.default_max_drop, t.max_drop = float(md), {}
    elif isinstance(md, dict):
        for k, v in md.items():
            if k in ("default", "*"):
                t.default_max_drop = float(v)
            else:
                t.max_drop[str(k)] = float(v)
    elif md is not None:
        raise GateError(f"gate.max_drop must be a number or a mapping suite -> number, got {md!r}")
    for k in ("confidence", "max_invalid_rate_increase", "max_truncation_rate_increase", "max_kl_mean"):
        if gate.get(k) is not None:
            setattr(t, k, float(gate[k]))
    if gate.get("metrics"):
        t.metrics = [str(m) for m in gate["metrics"]]
    return t.validate()


@dataclass
class Check:
    candidate: CellData
    kind: str  # "accuracy" | "invalid rate" | "truncation rate" | "fidelity KL"
    suite: str
    metric: str
    base_value: Optional[float]
    cand_value: float
    delta: Optional[float]
    bound: float  # accuracy: lower bound of Δ; rates: upper bound of the increase; KL: upper bound of the mean
    threshold: Optional[float]  # −δ for accuracy, +allowed increase for rates, max for KL; None = not gated
    n: int
    passed: Optional[bool]  # None = informational

    @property
    def gated(self) -> bool:
        return self.passed is not None

    @property
    def inconclusive(self) -> bool:
        """The point estimate is within the margin but the bound is not: more items would decide it."""
        if self.kind == "fidelity KL":
            return self.threshold is not None and self.cand_value <= self.threshold
        if self.delta is None or self.threshold is None:
            return False
        return self.delta > self.threshold if self.kind == "accuracy" else self.delta < self.threshold


@dataclass
class GateResult:
    baseline: CellData
    candidates: list[CellData]
    checks: list[Check]
    thresholds: GateThresholds

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks if c.gated)

    @property
    def exit_code(self) -> int:
        return EXIT_PASS if self.passed else EXIT_FAIL

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.passed is False]


def _resolve(run: RunData, selector: str, what: str) -> list[CellData]:
    try:
        cells = select(run.cells, selector, need_items=True)
    except RunLoadError as e:
        raise GateError(f"--{what}: {e}") from None
    if not cells:
        matching = select(run.cells, selector) if run.cells else []
        others = [c for c in run.cells if c not in matching]
        hint = ("it matches done cells without item records" if matching else
                f"no done cell matches; {len([c for c in others if not c.done])} cell(s) of the run are not done")
        raise GateError(f"--{what} {selector!r}: no done cell with accuracy records ({hint})")
    return cells


def _metric_specs(t: GateThresholds, base: CellData) -> list[tuple[str, str]]:
    suites = accuracy_suites(base)
    if not t.metrics:
        if not suites:
            raise GateError(f"baseline cell {base.short} has no accuracy records")
        return [(s, primary_metric(s)) for s in suites]
    out = []
    for m in t.metrics:
        if m in suites:  # the suite alone (its name may hold a colon: lm_eval:<task>)
            suite, metric = m, ""
        elif m.rpartition(":")[0] in suites:
            suite, _, metric = m.rpartition(":")
        else:
            suite, _, metric = m.partition(":")
        if suite in suites:
            metric = metric or primary_metric(suite)
            _check_length_metric(base, suite, metric, m)
            out.append((suite, metric))
        elif not metric and any(item_scores(base, s, suite) for s in suites):
            out += [(s, suite) for s in suites if item_scores(base, s, suite)]  # a metric name across suites
        else:
            raise GateError(f"--metric {m!r}: no such suite or metric in the baseline; suites: {', '.join(suites)}")
    return out


def _check_length_metric(base: CellData, suite: str, metric: str, spec: str) -> None:
    """``auc`` and ``L<length>`` need a long-context suite (and, for a length, items of that length)."""
    length = parse_length_metric(metric)
    if metric != "auc" and length is None:
        return
    if suite not in length_suites(base):
        raise GateError(f"--metric {spec!r}: {suite} records carry no context_length; auc and L<length> apply to "
                        "long-context suites (ruler)")
    if length is not None:
        have = sorted(scores_by_length(base, suite))
        if length not in have:
            raise GateError(f"--metric {spec!r}: the baseline has no {suite} items of context length {length}; "
                            f"lengths: {', '.join(map(str, have))}")


def _scores(cell: CellData, suite: str, metric: str) -> dict:
    """The (item, repeat) scores a metric compares: a length metric keeps the items of that length."""
    length = parse_length_metric(metric)
    if length is not None and suite in length_suites(cell):
        return scores_by_length(cell, suite).get(length, {})
    return item_scores(cell, suite, metric)


def _same_items(base: CellData, cand: CellData, suite: str, metric: str, b: dict, c: dict) -> None:
    """Raise GateError (exit 2) unless baseline and candidate hold the same (item, repeat) keys."""
    only_b, only_c = stats.key_mismatch(b, c)
    if only_b or only_c:
        raise GateError(f"{suite}:{metric}: baseline {base.short} and candidate {cand.short} hold different items: "
                        f"{only_b} only in the baseline, {only_c} only in the candidate "
                        f"({len(set(b) & set(c))} shared (item, repeat) keys); rerun both on the same items")


def _rate_check(base, cand, suite, metric, kind, allowed, t) -> Optional[Check]:
    b, c = item_scores(base, suite, metric), item_scores(cand, suite, metric)
    if not b and not c:
        return None  # neither cell records this rate
    _same_items(base, cand, suite, metric, b, c)
    # paired delta of (base − cand): its lower bound is minus the upper bound of the increase
    d = stats.paired_delta(c, b, confidence=t.confidence, n_boot=t.n_boot, seed=t.seed, bound_method=t.method,
                           strict=True)
    upper = -d.lower_bound
    return Check(cand, kind, suite, metric, d.cand_mean, d.base_mean, -d.delta, upper, allowed, d.n_pairs, upper < allowed)


def _kl_check(cand: CellData, t: GateThresholds) -> Optional[Check]:
    vals, weights = fidelity_kl(cand)
    if not vals:
        if t.max_kl_mean is not None:
            raise GateError(f"max_kl_mean is set but candidate {cand.short} has no fidelity records")
        return None
    if any(math.isnan(v) for v in vals):
        raise GateError(f"candidate {cand.short} has NaN fidelity KL")
    mean, upper = stats.weighted_mean_upper(vals, weights, t.confidence)
    passed = None if t.max_kl_mean is None else upper <= t.max_kl_mean
    return Check(cand, "fidelity KL", FIDELITY_SUITE, "kl_mean", None, mean, None, upper, t.max_kl_mean, len(vals), passed)


def _auc_check(base: CellData, cand: CellData, suite: str, t: GateThresholds) -> Check:
    b, c = scores_by_length(base, suite), scores_by_length(cand, suite)
    if not c:
        raise GateError(f"candidate {cand.short} has no records for {suite}:auc")
    flat_b = {k: v for m in b.values() for k, v in m.items()}
    flat_c = {k: v for m in c.values() for k, v in m.items()}
    _same_items(base, cand, suite, "auc", flat_b, flat_c)
    for n in sorted(set(b) | set(c)):
        if set(b.get(n, {})) != set(c.get(n, {})):
            raise GateError(f"{suite}:auc: baseline {base.short} and candidate {cand.short} place the same items at "
                            f"different context lengths (length {n}); rerun both with the same lengths")
    p = paired_auc(b, c, confidence=t.confidence, n_boot=t.n_boot, seed=t.seed, strict=True)
    delta_max = t.drop_for(suite, "auc")
    return Check(cand, "accuracy", suite, "auc", p.base_auc, p.cand_auc, p.delta, p.lower_bound, -delta_max, p.n_pairs,
                 p.lower_bound > -delta_max)


def gate_one(base: CellData, cand: CellData, t: GateThresholds) -> list[Check]:
    checks: list[Check] = []
    specs = _metric_specs(t, base)
    for suite, metric in specs:
        if metric == "auc" and suite in length_suites(base):
            checks.append(_auc_check(base, cand, suite, t))
            continue
        b, c = _scores(base, suite, metric), _scores(cand, suite, metric)
        if not c:
            raise GateError(f"candidate {cand.short} has no records for {suite}:{metric}")
        if not b:
            raise GateError(f"baseline {base.short} has no records for {suite}:{metric}")
        _same_items(base, cand, suite, metric, b, c)
        d = stats.paired_delta(b, c, confidence=t.confidence, n_boot=t.n_boot, seed=t.seed, bound_method=t.method,
                               strict=True)
        delta_max = t.drop_for(suite, metric)
        checks.append(Check(cand, "accuracy", suite, metric, d.base_mean, d.cand_mean, d.delta, d.lower_bound,
                            -delta_max, d.n_pairs, d.lower_bound > -delta_max))
    for suite in dict.fromkeys(s for s, _ in specs):
        for metric, kind, allowed in (("invalid", "invalid rate", t.max_invalid_rate_increase),
                                      ("truncated", "truncation rate", t.max_truncation_rate_increase)):
            chk = _rate_check(base, cand, suite, metric, kind, allowed, t)
            if chk:
                checks.append(chk)
    kl = _kl_check(cand, t)
    if kl:
        checks.append(kl)
    return checks


def run_gate(run: RunData, baseline: str, candidate: str, t: GateThresholds) -> GateResult:
    """Gate every done candidate cell with item records matching ``candidate`` against the one baseline."""
    t.validate()
    bases = _resolve(run, baseline, "baseline")
    if len(bases) > 1:
        raise GateError(f"--baseline {baseline!r} matches {len(bases)} cells ({'; '.join(c.short for c in bases)}); "
                        "add keys to make it unique")
    base = bases[0]
    cands = [c for c in _resolve(run, candidate, "candidate") if c is not base]
    if not cands:
        raise GateError(f"--candidate {candidate!r} matches only the baseline cell")
    checks = [chk for cand in cands for chk in gate_one(base, cand, t)]
    return GateResult(base, cands, checks, t)


# ------------------------------------------------------------------------------ output


def _pct(x: Optional[float]) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _pp(x: Optional[float], sign: bool = True) -> str:
    if x is None:
        return "—"
    if math.isinf(x):
        return "-inf" if x < 0 else "+inf"
    v = round(100 * x, 1) + 0.0  # no "-0.0"
    return f"{v:+.1f} pp" if sign else f"{v:.1f} pp"


def _plain(c: Check) -> bool:
    """A check on the suite's primary metric (or a rate / KL check): named by its kind alone."""
    return c.metric in ("correct", "invalid", "truncated", "kl_mean") or c.metric == primary_metric(c.suite)


def _metric_name(metric: str) -> str:
    n = parse_length_metric(metric)
    return f"{metric} ({length_label(n)} tokens)" if n is not None else ("AUC over context lengths" if metric == "auc" else metric)


def check_row(c: Check, conf: float) -> list[str]:
    result = "info" if c.passed is None else ("PASS" if c.passed else "FAIL")
    if c.passed is False and c.inconclusive:
        result = "FAIL (inconclusive)"
    side = f"{100 * conf:g}%"
    if c.kind == "accuracy":
        bound, thr = f"LB{side} {_pp(c.bound)}", f"> {_pp(c.threshold)}"
        vals = [_pct(c.base_value), _pct(c.cand_value), _pp(c.delta)]
    elif c.kind == "fidelity KL":
        bound = f"UB{side} {c.bound:.4g}"
        thr = "not gated" if c.threshold is None else f"<= {c.threshold:g}"
        vals = ["—", f"{c.cand_value:.4g}", "—"]
    else:
        bound, thr = f"UB{side} {_pp(c.bound)}", f"< {_pp(c.threshold)}"
        vals = [_pct(c.base_value), _pct(c.cand_value), _pp(c.delta)]
    name = c.kind if _plain(c) else f"{c.kind} [{_metric_name(c.metric)}]"
    return [c.candidate.short, name, c.suite, *vals, bound, thr, str(c.n), result]


GATE_COLUMNS = ["candidate", "check", "suite", "baseline", "candidate value", "Δ", "bound", "threshold", "n", "result"]


def format_table(r: GateResult) -> str:
    rows = [GATE_COLUMNS] + [check_row(c, r.thresholds.confidence) for c in r.checks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(GATE_COLUMNS))]
    lines = [f"baseline: {r.baseline.short} [{r.baseline.key}]   method: one-sided {100 * r.thresholds.confidence:g}% "
             f"bounds paired on (item, repeat): Newcombe hybrid score for 0/1 metrics, {r.thresholds.method} otherwise; "
             "KL: t bound of the token-weighted mean"
             + ("; auc: paired bootstrap over questions within each length" if any(c.metric == "auc" for c in r.checks) else "")]
    for n, row in enumerate(rows):
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_line(r: GateResult) -> str:
    gated = [c for c in r.checks if c.gated]
    cands = ", ".join(c.short for c in r.candidates)
    if r.passed:
        acc = [c for c in gated if c.kind == "accuracy"]
        worst = min(acc, key=lambda c: c.bound - c.threshold) if acc else None
        detail = f"; tightest: {worst.suite} LB {_pp(worst.bound)} > {_pp(worst.threshold)}" if worst else ""
        return (f"::notice title=kvbench gate::PASS {cands} vs {r.baseline.short}: "
                f"{len(gated)}/{len(gated)} checks passed{detail}")
    fails = "; ".join(
        f"{c.candidate.short} {c.suite} {c.kind}{'' if _plain(c) else ' [' + _metric_name(c.metric) + ']'} "
        + (f"LB {_pp(c.bound)} <= {_pp(c.threshold)}" if c.kind == "accuracy" else
           f"UB {c.bound:.4g} > {c.threshold:g}" if c.kind == "fidelity KL" else f"UB {_pp(c.bound)} >= {_pp(c.threshold)}")
        + (" (inconclusive: the point estimate is within the margin; more items would decide)" if c.inconclusive else "")
        for c in r.failures)
    return f"::error title=kvbench gate::FAIL {len(r.failures)}/{len(gated)} checks vs {r.baseline.short}: {fails}"


def to_json(r: GateResult) -> dict:
    return {
        "passed": r.passed,
        "exit_code": r.exit_code,
        "baseline": {"key": r.baseline.key, "label": r.baseline.short, "config": r.baseline.config},
        "candidates": [{"key": c.key, "label": c.short, "config": c.config} for c in r.candidates],
        "thresholds": {k: v for k, v in r.thresholds.__dict__.items()},
        "checks": [{"candidate": c.candidate.key, "kind": c.kind, "suite": c.suite, "metric": c.metric,
                    "baseline": c.base_value, "candidate_value": c.cand_value, "delta": c.delta,
                    "bound": None if math.isinf(c.bound) else c.bound, "threshold": c.threshold, "n": c.n,
                    "passed": c.passed, "inconclusive": c.inconclusive} for c in r.checks],
    }

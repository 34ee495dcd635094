"""Non-inferiority gate (DESIGN §10): candidate cell(s) against a baseline cell of one run.

A gated accuracy metric passes when the one-sided lower confidence bound of (candidate − baseline),
paired on (item, repeat), is above −δ.  Invalid-answer and truncation rates pass when the one-sided upper
bound of their increase is below the allowed increase; fidelity KL passes when the upper bound of the
token-weighted mean KL (the ``kl_mean`` of summary.json and of the report) is at most the allowed maximum
(only when a maximum is configured).

Failed requests (timeouts, HTTP errors, dropped streams: records with ``error``) are not wrong answers: the
pairs where either cell errored are left out of every comparison (and counted), and each cell's error rate
per gated suite is its own check: above ``max_error_rate`` it fails the gate with that reason.

Every gated check gets one status (``Check.status``), and the run one word (``GateResult.word``) that
``kvbench report`` prints on its verdict card and ``kvbench gate`` returns as its exit code:

* ``FAIL`` (exit 1): a check failed conclusively: its whole interval is past the threshold (the candidate
  loses more than the margin: the one-sided upper bound of Δ is below −δ; a rate's lower bound is above its
  allowed increase; the KL's lower bound is above its maximum), or an error rate is over its limit;
* ``NOT DISCRIMINATIVE`` (exit 4): the gate refuses to certify on a metric that cannot tell formats apart
  (``reports.discriminative``: the baseline at the floor or the ceiling, or the run's A/A control moving
  the metric by the margin or by as much as the candidate);
* ``INCONCLUSIVE`` (exit 3): the interval holds the threshold, whichever side the point estimate is on —
  more items would decide (``kvbench gate --plan`` says how many);
* ``PASS`` (exit 0): every gated check passed and every gated metric discriminates;
* exit 2: missing data or a usage error.
The first word that applies wins, in that order.

Bounds (``stats.paired_delta``): Newcombe's hybrid score interval for paired proportions when every score
is 0/1 and each question was asked once (accuracy, invalid, truncated); the paired bootstrap or t bound
(``method``) otherwise.  Those cannot be estimated with fewer than 2 questions or differences without
spread: 0/1 scores then use Newcombe's interval over the (item, repeat) pairs, other scores get an unknown
bound (±inf, so the check is inconclusive).  The baseline and the candidate must hold the same (item, repeat)
keys for every gated metric (errored pairs aside): otherwise the gate stops with exit 2 (missing data)
instead of comparing a silently shrunk set.

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
from kvbench.reports.discriminative import Noise, aa_cell_for, classify, errored, noise_for, scores
from kvbench.reports.load import (FIDELITY_SUITE, CellData, RunData, RunLoadError, accuracy_suites, error_counts,
                                  item_scores, primary_metric, select)
from kvbench.reports.long_context import length_suites, paired_auc, parse_length_metric, scores_by_length

__all__ = ["GateError", "GateThresholds", "Check", "GateResult", "merge_gate_config", "run_gate", "gate_one",
           "candidate_cells", "EXIT_PASS", "EXIT_FAIL", "EXIT_ERROR", "EXIT_INCONCLUSIVE", "EXIT_NOT_DISCRIMINATIVE",
           "PASS", "FAIL", "INCONCLUSIVE", "NOT_DISCRIMINATIVE", "WORD_EXIT", "worst_word", "format_table",
           "summary_line", "to_json", "check_row", "GATE_COLUMNS"]

EXIT_PASS, EXIT_FAIL, EXIT_ERROR, EXIT_INCONCLUSIVE, EXIT_NOT_DISCRIMINATIVE = 0, 1, 2, 3, 4
PASS, FAIL, INCONCLUSIVE, NOT_DISCRIMINATIVE = "PASS", "FAIL", "INCONCLUSIVE", "NOT DISCRIMINATIVE"
WORD_EXIT = {PASS: EXIT_PASS, FAIL: EXIT_FAIL, INCONCLUSIVE: EXIT_INCONCLUSIVE, NOT_DISCRIMINATIVE: EXIT_NOT_DISCRIMINATIVE}
_WORD_ORDER = (FAIL, NOT_DISCRIMINATIVE, INCONCLUSIVE, PASS)  # the first that applies wins
_STATUS_WORD = {"fail": FAIL, "not discriminative": NOT_DISCRIMINATIVE, "inconclusive": INCONCLUSIVE, "pass": PASS}
DEFAULT_MAX_DROP = 0.05
DEFAULT_MAX_RATE_INCREASE = 0.05
DEFAULT_MAX_ERROR_RATE = 0.01


class GateError(RuntimeError):
    """Missing data or a usage error: exit code 2."""


@dataclass
class GateThresholds:
    max_drop: dict[str, float] = field(default_factory=dict)  # suite or suite:metric -> δ (absolute, 0.05 = 5 pp)
    default_max_drop: float = DEFAULT_MAX_DROP
    confidence: float = 0.95
    max_invalid_rate_increase: float = DEFAULT_MAX_RATE_INCREASE
    max_truncation_rate_increase: float = DEFAULT_MAX_RATE_INCREASE
    max_error_rate: float = DEFAULT_MAX_ERROR_RATE  # failed requests / all requests of a gated suite, per cell
    max_kl_mean: Optional[float] = None  # None: KL is reported, not gated
    metrics: Optional[list[str]] = None  # "suite" or "suite:metric"; None = every accuracy suite, primary metric
    method: str = "bootstrap"  # lower-bound method: "bootstrap" (paired, seeded) or "t"
    n_boot: int = 10_000
    seed: int = 0
    use_aa: bool = True  # judge discriminativeness against the run's A/A control when it has one

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
                        ("max_error_rate", self.max_error_rate), ("max_kl_mean", self.max_kl_mean)]:
            if v is not None and (not isinstance(v, (int, float)) or math.isnan(v) or v < 0):
                raise GateError(f"{name} must be a number >= 0, got {v!r}")
        for name, flag, v in (("max_invalid_rate_increase", "--max-invalid-increase", self.max_invalid_rate_increase),
                              ("max_truncation_rate_increase", "--max-truncation-increase", self.max_truncation_rate_increase),
                              ("max_error_rate", "--max-error-rate", self.max_error_rate)):
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
    for k in ("confidence", "max_invalid_rate_increase", "max_truncation_rate_increase", "max_error_rate", "max_kl_mean"):
        if gate.get(k) is not None:
            setattr(t, k, float(gate[k]))
    if gate.get("metrics"):
        t.metrics = [str(m) for m in gate["metrics"]]
    return t.validate()


@dataclass
class Check:
    candidate: CellData
    kind: str  # "accuracy" | "invalid rate" | "truncation rate" | "error rate" | "fidelity KL"
    suite: str
    metric: str
    base_value: Optional[float]
    cand_value: float
    delta: Optional[float]
    bound: float  # accuracy: lower bound of Δ; rates: upper bound of the increase; KL: upper bound of the mean
    threshold: Optional[float]  # −δ for accuracy, +allowed increase for rates, max for KL / error rate; None = not gated
    n: int
    passed: Optional[bool]  # the bound against the threshold; None = informational
    far_bound: Optional[float] = None  # the other one-sided bound: accuracy the upper bound of Δ, rates the lower
    # bound of the increase, KL the lower bound of the mean; past the threshold it makes a failure conclusive
    ci: Optional[tuple[float, float]] = None  # accuracy: two-sided interval of Δ
    n_error_pairs: int = 0  # (item, repeat) keys left out because either cell's request failed
    subject: str = "candidate"  # error rate: whose rate ("candidate" or "baseline")
    noise: Optional[Noise] = None  # the A/A control's Δ on this metric, when the run has one
    status: str = ""  # "pass" | "fail" | "inconclusive" | "not discriminative" | "info" (set by ``classify``)
    reason: str = ""  # why the status is what it is, in words (not discriminative, error rate)

    @property
    def gated(self) -> bool:
        return self.passed is not None

    @property
    def inconclusive(self) -> bool:
        """The interval holds the threshold: neither the bound that would pass nor the one that would fail
        clears it, so more items would decide (without ``far_bound``: the point estimate is within the margin)."""
        if self.kind == "error rate" or self.threshold is None:
            return False
        if self.far_bound is not None:
            return self.far_bound >= self.threshold if self.kind == "accuracy" else self.far_bound <= self.threshold
        if self.kind == "fidelity KL":
            return self.cand_value <= self.threshold
        if self.delta is None:
            return False
        return self.delta > self.threshold if self.kind == "accuracy" else self.delta < self.threshold

    @property
    def word(self) -> Optional[str]:
        return _STATUS_WORD.get(self.status)


def worst_word(words) -> str:
    ws = set(words)
    return next((w for w in _WORD_ORDER if w in ws), PASS)


@dataclass
class GateResult:
    baseline: CellData
    candidates: list[CellData]
    checks: list[Check]
    thresholds: GateThresholds
    aa: Optional[CellData] = None  # the A/A control cell the noise came from

    def checks_of(self, cand: CellData) -> list[Check]:
        return [c for c in self.checks if c.candidate is cand]

    def word_of(self, cand: Optional[CellData] = None) -> str:
        """The one word for ``cand`` (every candidate when None): see the module docstring."""
        checks = self.checks if cand is None else self.checks_of(cand)
        return worst_word(c.word for c in checks if c.gated and c.word)

    @property
    def word(self) -> str:
        return self.word_of(None)

    @property
    def passed(self) -> bool:
        return self.word == PASS

    @property
    def exit_code(self) -> int:
        return WORD_EXIT[self.word]

    @property
    def failures(self) -> list[Check]:
        """Gated checks that keep the gate from passing."""
        return [c for c in self.checks if c.gated and c.status != "pass"]


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


def candidate_cells(run: RunData, base: CellData) -> list[CellData]:
    """Every done cell with item records except the baseline and A/A controls: what ``kvbench gate`` gates
    when no ``--candidate`` is given, and what the report draws a verdict card for."""
    return [c for c in run.done_cells if c.items and c is not base and not c.aa_control]


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


def _same_items(base: CellData, cand: CellData, suite: str, metric: str, b: dict, c: dict) -> None:
    """Raise GateError (exit 2) unless baseline and candidate hold the same (item, repeat) keys."""
    only_b, only_c = stats.key_mismatch(b, c)
    if only_b or only_c:
        raise GateError(f"{suite}:{metric}: baseline {base.short} and candidate {cand.short} hold different items: "
                        f"{only_b} only in the baseline, {only_c} only in the candidate "
                        f"({len(set(b) & set(c))} shared (item, repeat) keys); rerun both on the same items")


def _rate_check(base, cand, suite, metric, kind, allowed, t) -> Optional[Check]:
    drop = errored(base, cand, suite)
    b, c = scores(base, suite, metric, drop), scores(cand, suite, metric, drop)
    if not b and not c:
        return None  # neither cell records this rate (or every pair errored: the error-rate check says so)
    _same_items(base, cand, suite, metric, b, c)
    # paired delta of (base − cand): its lower bound is minus the upper bound of the increase
    d = stats.paired_delta(c, b, confidence=t.confidence, n_boot=t.n_boot, seed=t.seed, bound_method=t.method,
                           strict=True)
    upper = -d.lower_bound
    return Check(cand, kind, suite, metric, d.cand_mean, d.base_mean, -d.delta, upper, allowed, d.n_pairs,
                 upper < allowed, far_bound=-d.upper_bound, n_error_pairs=len(drop))


def _error_checks(base: CellData, cand: CellData, suite: str, t: GateThresholds) -> list[Check]:
    """The error rate of each cell on ``suite``: failed requests are not wrong answers, and a cell with too
    many of them cannot be compared (the baseline's rate is checked with every candidate)."""
    out = []
    for subject, cell in (("baseline", base), ("candidate", cand)):
        n_err, n = error_counts(cell, suite)
        if n == 0:
            continue
        rate = n_err / n
        out.append(Check(cand, "error rate", suite, "error", None, rate, None, rate, t.max_error_rate, n,
                         rate <= t.max_error_rate, far_bound=rate, subject=subject))
    return out


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
    lower = mean - (upper - mean) if math.isfinite(upper) else -math.inf  # the t bound is symmetric
    return Check(cand, "fidelity KL", FIDELITY_SUITE, "kl_mean", None, mean, None, upper, t.max_kl_mean, len(vals), passed,
                 far_bound=lower)


def _auc_check(base: CellData, cand: CellData, suite: str, t: GateThresholds) -> Check:
    drop = errored(base, cand, suite)
    b = {n: {k: v for k, v in m.items() if k not in drop} for n, m in scores_by_length(base, suite).items()}
    c = {n: {k: v for k, v in m.items() if k not in drop} for n, m in scores_by_length(cand, suite).items()}
    b, c = {n: m for n, m in b.items() if m}, {n: m for n, m in c.items() if m}
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
                 p.lower_bound > -delta_max, far_bound=p.upper_bound, ci=(p.ci_lo, p.ci_hi), n_error_pairs=len(drop))


def _accuracy_check(base: CellData, cand: CellData, suite: str, metric: str, t: GateThresholds) -> Check:
    if metric == "auc" and suite in length_suites(base):
        return _auc_check(base, cand, suite, t)
    drop = errored(base, cand, suite)
    b, c = scores(base, suite, metric, drop), scores(cand, suite, metric, drop)
    if not c:
        raise GateError(f"candidate {cand.short} has no records for {suite}:{metric}")
    if not b:
        raise GateError(f"baseline {base.short} has no records for {suite}:{metric}")
    _same_items(base, cand, suite, metric, b, c)
    d = stats.paired_delta(b, c, confidence=t.confidence, n_boot=t.n_boot, seed=t.seed, bound_method=t.method,
                           strict=True)
    delta_max = t.drop_for(suite, metric)
    return Check(cand, "accuracy", suite, metric, d.base_mean, d.cand_mean, d.delta, d.lower_bound, -delta_max,
                 d.n_pairs, d.lower_bound > -delta_max, far_bound=d.upper_bound, ci=(d.ci_lo, d.ci_hi),
                 n_error_pairs=len(drop))


def gate_one(base: CellData, cand: CellData, t: GateThresholds, aa: Optional[CellData] = None) -> list[Check]:
    """Every check of one candidate against the baseline (``aa``: the A/A control cell, for the noise)."""
    checks: list[Check] = []
    specs = _metric_specs(t, base)
    for suite, metric in specs:
        chk = _accuracy_check(base, cand, suite, metric, t)
        if aa is not None:
            chk.noise = noise_for(base, aa, suite, metric, t)
        checks.append(chk)
    for suite in dict.fromkeys(s for s, _ in specs):
        checks += _error_checks(base, cand, suite, t)
        for metric, kind, allowed in (("invalid", "invalid rate", t.max_invalid_rate_increase),
                                      ("truncated", "truncation rate", t.max_truncation_rate_increase)):
            chk = _rate_check(base, cand, suite, metric, kind, allowed, t)
            if chk:
                if aa is not None:
                    chk.noise = noise_for(base, aa, suite, metric, t)
                checks.append(chk)
    kl = _kl_check(cand, t)
    if kl:
        checks.append(kl)
    for chk in checks:
        classify(chk)
    return checks


def run_gate(run: RunData, baseline: str, candidate: Optional[str], t: GateThresholds) -> GateResult:
    """Gate every done candidate cell with item records matching ``candidate`` (None: every such cell but the
    baseline and A/A controls) against the one baseline."""
    t.validate()
    bases = _resolve(run, baseline, "baseline")
    if len(bases) > 1:
        raise GateError(f"--baseline {baseline!r} matches {len(bases)} cells ({'; '.join(c.short for c in bases)}); "
                        "add keys to make it unique")
    base = bases[0]
    if candidate is None:
        cands = candidate_cells(run, base)
        if not cands:
            raise GateError("the run has no done cell with accuracy records besides the baseline to gate")
    else:
        cands = [c for c in _resolve(run, candidate, "candidate") if c is not base]
        if not cands:
            raise GateError(f"--candidate {candidate!r} matches only the baseline cell")
    aa = aa_cell_for(run, base) if t.use_aa else None
    checks = [chk for cand in cands for chk in gate_one(base, cand, t, aa if aa not in cands else None)]
    return GateResult(base, cands, checks, t, aa)


from kvbench.reports.gate_output import GATE_COLUMNS, check_row, format_table, summary_line, to_json  # noqa: E402

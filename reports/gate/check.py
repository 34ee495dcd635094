"""Non-inferiority gate (docs/design.md §10): candidate cell(s) against a baseline cell of one run.

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

The thresholds, check and result types, words and exit codes are in ``reports/gate/types.py`` (re-exported
here); this module computes the checks.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from kvbench.reports.stats import paired as stats
from kvbench.reports.analysis import fidelity_records
from kvbench.reports.gate.discriminative import Noise, aa_cell_for, classify, errored, floor_cause, noise_for, scores
from kvbench.reports.gate.types import (  # noqa: F401 - re-exported for importers of this module
    _STATUS_WORD,
    _WORD_ORDER,
    DEFAULT_MAX_DROP,
    DEFAULT_MAX_ERROR_RATE,
    DEFAULT_MAX_RATE_INCREASE,
    EXIT_ERROR,
    EXIT_FAIL,
    EXIT_INCONCLUSIVE,
    EXIT_NOT_DISCRIMINATIVE,
    EXIT_PASS,
    FAIL,
    INCONCLUSIVE,
    NOT_DISCRIMINATIVE,
    PASS,
    WORD_EXIT,
    Check,
    GateError,
    GateResult,
    GateThresholds,
    merge_gate_config,
    worst_word,
)
from kvbench.reports.load import FIDELITY_SUITE, CellData, RunData, RunLoadError, select
from kvbench.reports.item_records import accuracy_suites, error_counts, item_scores
from kvbench.suites import primary_metric
from kvbench.reports.long_context import length_suites, paired_auc, parse_length_metric, scores_by_length

__all__ = ["GateError", "GateThresholds", "Check", "GateResult", "merge_gate_config", "run_gate", "gate_one",
           "candidate_cells", "EXIT_PASS", "EXIT_FAIL", "EXIT_ERROR", "EXIT_INCONCLUSIVE", "EXIT_NOT_DISCRIMINATIVE",
           "PASS", "FAIL", "INCONCLUSIVE", "NOT_DISCRIMINATIVE", "WORD_EXIT", "worst_word", "format_table",
           "summary_line", "to_json", "check_row", "GATE_COLUMNS"]


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


def _fidelity_checks(cand: CellData, t: GateThresholds) -> list[Check]:
    """KL (at most ``max_kl_mean``), perplexity ratio (at most ``max_ppl_ratio``) and top-1 agreement (at least
    ``min_top1_agreement``) against the bf16 reference, each a token-weighted mean over the texts with its
    one-sided t bound over texts; informational (reported, not gated) when its limit is None."""
    recs = fidelity_records(cand)
    limits = (("fidelity KL", t.max_kl_mean), ("perplexity ratio", t.max_ppl_ratio),
              ("top-1 agreement", t.min_top1_agreement))
    if not recs:
        named = [k for k, v in limits if v is not None]
        if named and t.fidelity_required:
            raise GateError(f"{', '.join(named)} limits are set but candidate {cand.short} has no fidelity records")
        return []
    w = [float(r.get("n_tokens") or 1) for r in recs]
    out = []
    for kind, limit in limits:
        vals = _fidelity_values(recs, kind)
        if vals is None:
            continue
        if any(math.isnan(v) for v in vals):
            raise GateError(f"candidate {cand.short} has NaN fidelity {kind}")
        out.append(_limit_check(cand, kind, vals, w, limit, t.confidence))
    return out


def _fidelity_values(recs: list[dict], kind: str) -> Optional[list[float]]:
    """Per-text values whose token-weighted mean the check bounds: KL, Δ NLL (log of the perplexity ratio),
    and the share of positions whose top-1 token disagrees (1 − agreement)."""
    keys = {"fidelity KL": ("kl_mean",), "perplexity ratio": ("nll_cand", "nll_ref"), "top-1 agreement": ("top1_agree",)}[kind]
    if not all(all(r.get(k) is not None for k in keys) for r in recs):
        return None
    if kind == "fidelity KL":
        return [float(r["kl_mean"]) for r in recs]
    if kind == "perplexity ratio":
        return [float(r["nll_cand"]) - float(r["nll_ref"]) for r in recs]
    return [1.0 - float(r["top1_agree"]) for r in recs]


def _limit_check(cand: CellData, kind: str, vals: list[float], w: list[float], limit: Optional[float],
                 confidence: float) -> Check:
    mean, upper = stats.weighted_mean_upper(vals, w, confidence)
    lower = mean - (upper - mean) if math.isfinite(upper) else -math.inf  # the t bound is symmetric
    if kind == "perplexity ratio":  # bounds on the mean Δ NLL, reported as ratios
        mean, upper, lower = math.exp(mean), (math.exp(upper) if math.isfinite(upper) else math.inf), math.exp(lower)
    if kind == "top-1 agreement":  # bounds on the disagreement, turned over
        mean, upper, lower = 1.0 - mean, 1.0 - lower, 1.0 - upper
        bound, far = lower, upper  # the lower bound must clear the minimum; the upper bound below it fails
        passed = None if limit is None else bound >= limit
    else:
        bound, far = upper, lower
        passed = None if limit is None else bound <= limit
    return Check(cand, kind, FIDELITY_SUITE, _FIDELITY_METRIC[kind], None, mean, None, bound, limit, len(vals), passed,
                 far_bound=far)


_FIDELITY_METRIC = {"fidelity KL": "kl_mean", "perplexity ratio": "ppl_ratio", "top-1 agreement": "top1_agree"}


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


def gate_one(base: CellData, cand: CellData, t: GateThresholds, aa: Optional[CellData] = None,
             cand_aa: Optional[CellData] = None) -> list[Check]:
    """Every check of one candidate against the baseline (``aa`` / ``cand_aa``: the A/A controls of the
    baseline and of the candidate, for the noise floor), classified on its own evidence."""
    return [classify(chk) for chk in _checks(base, cand, t, aa, cand_aa)]


def _checks(base: CellData, cand: CellData, t: GateThresholds, aa: Optional[CellData],
            cand_aa: Optional[CellData]) -> list[Check]:
    """The checks of one candidate, computed but not yet classified."""
    checks: list[Check] = []
    specs = _metric_specs(t, base)
    controls = [(base, aa, "the baseline"), (cand, cand_aa, "the candidate")]
    causes = {suite: floor_cause(base, suite) for suite in dict.fromkeys(s for s, _ in specs)}
    for suite, metric in specs:
        chk = _accuracy_check(base, cand, suite, metric, t)
        chk.noises, chk.floor_cause = _noises(controls, suite, metric, t), causes[suite]
        checks.append(chk)
    for suite in causes:
        checks += _error_checks(base, cand, suite, t)
        for metric, kind, allowed in (("invalid", "invalid rate", t.max_invalid_rate_increase),
                                      ("truncated", "truncation rate", t.max_truncation_rate_increase)):
            chk = _rate_check(base, cand, suite, metric, kind, allowed, t)
            if chk:
                chk.noises, chk.floor_cause = _noises(controls, suite, metric, t), causes[suite]
                checks.append(chk)
    checks += _fidelity_checks(cand, t)
    return checks


def _mark_losses_shown(checks: list[Check]) -> None:
    """Items on which the baseline scores 100% can still show a loss: where another candidate of the run lost
    on them provably (the upper bound of its Δ below 0), a candidate at 100% too is judged on its interval like
    any other, instead of being called not discriminative (``Check.loss_shown_by``)."""
    shown: dict[tuple[str, str], str] = {}
    for c in checks:
        if c.kind == "accuracy" and c.far_bound is not None and c.far_bound < 0:
            shown.setdefault((c.suite, c.metric), c.candidate.short)
    for c in checks:
        by = shown.get((c.suite, c.metric))
        if c.kind == "accuracy" and by is not None and by != c.candidate.short:
            c.loss_shown_by = by


def _noises(controls, suite: str, metric: str, t: GateThresholds) -> list[Noise]:
    """The A/A differences of the cells that have a control (the baseline's, the candidate's)."""
    out = []
    for cell, control, subject in controls:
        if control is not None:
            n = noise_for(cell, control, suite, metric, t)
            if n is not None:
                out.append(replace(n, subject=subject))
    return out


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
    cand_aa = {c.key: aa_cell_for(run, c) for c in cands} if t.use_aa else {}
    checks = [chk for cand in cands for chk in _checks(base, cand, t, aa if aa not in cands else None,
                                                       cand_aa.get(cand.key))]
    _mark_losses_shown(checks)
    for chk in checks:
        classify(chk)
    return GateResult(base, cands, checks, t, aa, {k: v for k, v in cand_aa.items() if v is not None})


from kvbench.reports.gate.output import GATE_COLUMNS, check_row, format_table, summary_line, to_json  # noqa: E402

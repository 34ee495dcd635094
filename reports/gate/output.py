"""What ``kvbench gate`` prints and writes: the deciding table, the one GitHub-Actions line, the JSON document.

Duck-typed on ``reports.gate.GateResult`` / ``Check`` (no import of the gate, which imports this module)."""

from __future__ import annotations

import math
from typing import Optional

from kvbench.suites import primary_metric
from kvbench.reports.long_context import length_label, parse_length_metric

__all__ = ["GATE_COLUMNS", "check_row", "check_name", "format_table", "summary_line", "to_json", "check_json", "pp", "pct"]

GATE_COLUMNS = ["candidate", "check", "suite", "baseline", "candidate value", "Δ", "bound", "threshold", "A/A Δ", "n",
                "result"]
_RESULT = {"pass": "PASS", "fail": "FAIL", "inconclusive": "INCONCLUSIVE", "not discriminative": "NOT DISCRIMINATIVE",
           "info": "info"}


def pct(x: Optional[float]) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def pp(x: Optional[float], sign: bool = True) -> str:
    if x is None:
        return "—"
    if math.isinf(x):
        return "-inf" if x < 0 else "+inf"
    v = round(100 * x, 1) + 0.0  # no "-0.0"
    return f"{v:+.1f} pp" if sign else f"{v:.1f} pp"


def _plain(c) -> bool:
    """A check on the suite's primary metric (or a rate / KL check): named by its kind alone."""
    return (c.metric in ("correct", "invalid", "truncated", "error", "kl_mean", "ppl_ratio", "top1_agree")
            or c.metric == primary_metric(c.suite))


def _metric_name(metric: str) -> str:
    n = parse_length_metric(metric)
    return f"{metric} ({length_label(n)} tokens)" if n is not None else ("AUC over context lengths" if metric == "auc" else metric)


def check_name(c) -> str:
    name = c.kind if _plain(c) else f"{c.kind} [{_metric_name(c.metric)}]"
    return f"{name} ({c.subject})" if c.kind == "error rate" else name


def check_row(c, conf: float) -> list[str]:
    result = _RESULT.get(c.status, "info" if c.passed is None else ("PASS" if c.passed else "FAIL"))
    side = f"{100 * conf:g}%"
    if c.kind == "accuracy":
        bound, thr = f"LB{side} {pp(c.bound)}", f"> {pp(c.threshold)}"
        vals = [pct(c.base_value), pct(c.cand_value), pp(c.delta)]
    elif c.kind in ("fidelity KL", "perplexity ratio"):
        unit = "×" if c.kind == "perplexity ratio" else ""
        bound = f"UB{side} {c.bound:.4g}{unit}"
        thr = "not gated" if c.threshold is None else f"<= {c.threshold:g}{unit}"
        vals = ["—", f"{c.cand_value:.4g}{unit}", "—"]
    elif c.kind == "top-1 agreement":
        bound = f"LB{side} {pct(c.bound)}"
        thr = "not gated" if c.threshold is None else f">= {pct(c.threshold)}"
        vals = ["—", pct(c.cand_value), "—"]
    elif c.kind == "error rate":
        bound, thr = "—", f"<= {pct(c.threshold)}"
        vals = ["—", pct(c.cand_value), "—"]
    else:
        bound, thr = f"UB{side} {pp(c.bound)}", f"< {pp(c.threshold)}"
        vals = [pct(c.base_value), pct(c.cand_value), pp(c.delta)]
    noise = pp(c.noise.delta) if getattr(c, "noise", None) is not None else "—"
    n = str(c.n) + (f" (−{c.n_error_pairs} err)" if getattr(c, "n_error_pairs", 0) else "")
    return [c.candidate.short, check_name(c), c.suite, *vals, bound, thr, noise, n, result]


def format_table(r) -> str:
    rows = [GATE_COLUMNS] + [check_row(c, r.thresholds.confidence) for c in r.checks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(GATE_COLUMNS))]
    lines = [f"baseline: {r.baseline.short} [{r.baseline.key}]   method: one-sided {100 * r.thresholds.confidence:g}% "
             f"bounds paired on (item, repeat): Newcombe hybrid score for 0/1 metrics, {r.thresholds.method} otherwise; "
             "KL: t bound of the token-weighted mean"
             + ("; auc: paired bootstrap over questions within each length" if any(c.metric == "auc" for c in r.checks) else "")
             + (f"; A/A control: {r.aa.short}" if getattr(r, "aa", None) is not None else "; no A/A control in the run")]
    for n, row in enumerate(rows):
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    reasons = [(c, c.reason) for c in r.checks if c.gated and c.status != "pass" and c.reason]
    if reasons:
        lines.append("")
        lines += [f"{c.candidate.short} {c.suite} {check_name(c)}: {_RESULT[c.status]}: {why}" for c, why in reasons]
    return "\n".join(lines)


def _failure_text(c) -> str:
    name = f"{c.candidate.short} {c.suite} {check_name(c)}"
    if c.status == "not discriminative":
        return f"{name} NOT DISCRIMINATIVE ({c.reason})"
    if c.kind == "accuracy":
        detail = f"LB {pp(c.bound)} <= {pp(c.threshold)}"
    elif c.kind in ("fidelity KL", "perplexity ratio"):
        detail = f"UB {c.bound:.4g} > {c.threshold:g}"
    elif c.kind == "top-1 agreement":
        detail = f"LB {pct(c.bound)} < {pct(c.threshold)}"
    elif c.kind == "error rate":
        detail = f"{pct(c.cand_value)} > {pct(c.threshold)}"
    else:
        detail = f"UB {pp(c.bound)} >= {pp(c.threshold)}"
    if c.status == "inconclusive":
        detail += f" (inconclusive: {c.reason})"
    return f"{name} {detail}"


def summary_line(r) -> str:
    gated = [c for c in r.checks if c.gated]
    cands = ", ".join(c.short for c in r.candidates)
    word = r.word
    if word == "PASS":
        acc = [c for c in gated if c.kind == "accuracy"]
        worst = min(acc, key=lambda c: c.bound - c.threshold) if acc else None
        detail = f"; tightest: {worst.suite} LB {pp(worst.bound)} > {pp(worst.threshold)}" if worst else ""
        return (f"::notice title=kvbench gate::PASS {cands} vs {r.baseline.short}: "
                f"{len(gated)}/{len(gated)} checks passed{detail}")
    fails = "; ".join(_failure_text(c) for c in r.failures)
    level = "error" if word == "FAIL" else "warning"
    return (f"::{level} title=kvbench gate::{word} (exit {r.exit_code}) {len(r.failures)}/{len(gated)} checks vs "
            f"{r.baseline.short}: {fails}")


def check_json(c) -> dict:
    noise = getattr(c, "noise", None)
    return {"candidate": c.candidate.key, "candidate_label": c.candidate.short, "kind": c.kind, "suite": c.suite,
            "metric": c.metric, "subject": c.subject, "baseline": c.base_value, "candidate_value": c.cand_value,
            "delta": c.delta, "ci": list(c.ci) if c.ci else None,
            "bound": None if c.bound is None or math.isinf(c.bound) else c.bound, "threshold": c.threshold, "n": c.n,
            "n_error_pairs": c.n_error_pairs, "passed": c.passed, "inconclusive": c.inconclusive, "status": c.status,
            "reason": c.reason, "aa_delta": noise.delta if noise else None,
            "aa_ci": list(noise.ci) if noise else None}


def to_json(r) -> dict:
    return {
        "word": r.word,
        "passed": r.passed,
        "exit_code": r.exit_code,
        "baseline": {"key": r.baseline.key, "label": r.baseline.short, "config": r.baseline.config},
        "aa_control": None if r.aa is None else {"key": r.aa.key, "label": r.aa.short},
        "candidates": [{"key": c.key, "label": c.short, "config": c.config, "word": r.word_of(c)} for c in r.candidates],
        "thresholds": {k: v for k, v in r.thresholds.__dict__.items()},
        "checks": [check_json(c) for c in r.checks],
    }

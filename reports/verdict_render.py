"""Render ``reports.verdict.Verdicts`` as the top of report.md / report.html: the overall word, one card per
candidate (tables built with ``reports.tables.Table``), and the sample-size plan for checks that did not pass."""

from __future__ import annotations

import html
import math
from typing import Optional

from kvbench.reports.gate.output import check_name
from kvbench.reports.gate.plan import plan_result, plan_row, PLAN_COLUMNS
from kvbench.reports.tables import Table, fmt_num, fmt_pct, fmt_pp, html_text
from kvbench.reports.verdict import Ratio, Verdict, Verdicts

__all__ = ["verdict_markdown", "verdict_html", "card_tables", "overall_line", "plan_table", "VERDICT_CSS"]

_RESULT = {"pass": "PASS", "fail": "FAIL", "inconclusive": "INCONCLUSIVE", "not discriminative": "NOT DISCRIMINATIVE",
           "info": "info"}
_COLOR = {"PASS": "#1a7f37", "FAIL": "#cf222e", "INCONCLUSIVE": "#9a6700", "NOT DISCRIMINATIVE": "#6639ba", None: "#57606a"}

VERDICT_CSS = """
.verdict{border:2px solid #d0d7de;border-radius:8px;padding:.4em 1.2em 1em;margin:1em 0;background:#fff}
.verdict h3{margin-top:.6em}
.badge{display:inline-block;padding:.12em .6em;border-radius:1em;color:#fff;font-weight:600;font-size:.9em;
letter-spacing:.02em;vertical-align:middle}
.overall{font-size:1.15em;margin:.6em 0}
ul.reasons li{margin:.15em 0}
.verdict td,.verdict th,table.wrap td,table.wrap th{white-space:normal}
.verdict td{min-width:4em}
"""


def _ratio(r: Optional[Ratio]) -> str:
    if r is None or r.value is None:
        return "n/a (baseline 0)"
    ci = f" [{r.lo:.2f}, {r.hi:.2f}]" if r.lo is not None and r.hi is not None else ""
    return f"{r.value:.2f}×{ci}"


def _x(v: Optional[float]) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}×"


def _chg(v: Optional[float]) -> str:
    return "—" if v is None else f"{100 * v:+.0f}%".replace("-", "−")


def overall_line(v: Verdicts) -> str:
    if v.word is None:
        return f"No verdict: {v.error} (`{v.command}` exits 2)."
    t = v.thresholds
    drops = ", ".join(f"{k} {100 * d:.1f} pp" for k, d in sorted(t.max_drop.items())) or ""
    margin = f"margins δ: {drops + '; ' if drops else ''}default {100 * t.default_max_drop:.1f} pp"
    n_own = len(getattr(v.result, "cand_aa", {}) or {})
    aa = (f"A/A control: {v.aa.short} (the baseline rerun under different batching; its difference is the noise floor)"
          if v.aa is not None else "No A/A control of the baseline in this run: deltas are shown without its noise floor")
    own = f"; {n_own} candidate(s) have an A/A control of their own" if n_own else ""
    return (f"Overall: {v.word} — `{v.command}` returns this word (exit {v.exit_code}). Baseline: {v.baseline.short}. "
            f"{aa}{own}. One-sided {100 * t.confidence:g}% bounds; {margin}; error-rate limit {100 * t.max_error_rate:g}% "
            f"per cell; {_fidelity_limits(t)}.")


def _fidelity_limits(t) -> str:
    parts = [f"KL ≤ {t.max_kl_mean:g}" if t.max_kl_mean is not None else "",
             f"perplexity ratio ≤ {t.max_ppl_ratio:g}×" if t.max_ppl_ratio is not None else "",
             f"top-1 agreement ≥ {100 * t.min_top1_agreement:g}%" if t.min_top1_agreement is not None else ""]
    parts = [p for p in parts if p]
    return "fidelity limits: " + ", ".join(parts) if parts else "fidelity not gated"


def _noise_text(c) -> str:
    """Each A/A control's Δ on this check (the baseline's, the candidate's): the larger is the noise floor."""
    if not c.noises:
        return "—"
    who = {"the baseline": "base", "the candidate": "cand"}
    return "; ".join(f"{who.get(n.subject, n.subject)} {fmt_pp(n.delta)} [{fmt_pp(n.ci[0])}, {fmt_pp(n.ci[1])}]"
                     for n in c.noises)


def _accuracy_table(card: Verdict, conf: float) -> Table:
    rows = []
    for line in card.suites:
        c = line.check
        ci = f" [{fmt_pp(c.ci[0])}, {fmt_pp(c.ci[1])}]" if c.ci else ""
        noise = _noise_text(c)
        metric = c.suite if c.metric in ("correct",) or c.metric == _primary(c.suite) else f"{c.suite}:{c.metric}"
        errs = next((e for e in card.checks if e.kind == "error rate" and e.suite == c.suite and e.subject == "candidate"), None)
        rows.append([metric, fmt_pct(c.base_value), fmt_pct(c.cand_value), fmt_pp(c.delta) + ci, _ratio(line.recovery),
                     f"{fmt_pp(c.bound)} vs {fmt_pp(c.threshold)}", noise,
                     "—" if errs is None else f"{fmt_pct(errs.cand_value)} ({c.n_error_pairs} pairs out)",
                     _RESULT.get(c.status, c.status)])
    side = f"{100 * conf:g}%"
    return Table("Accuracy against the baseline", ["suite", "baseline", "candidate", f"Δ [two-sided {side} CI]",
                 "recovery [CI]", f"one-sided {side} bound vs −δ", "A/A Δ (noise floor)", "errors", "result"], rows,
                 note=f"Δ: the paired difference over items (mean score; for a long-context suite's auc row, the area "
                      f"under its accuracy-vs-length curve). Two intervals at {side}, on purpose: the two-sided one "
                      f"describes Δ; the gate compares the one-sided bound (narrower) with −δ (Newcombe's score interval "
                      "for 0/1 scores asked once, a paired bootstrap over questions otherwise; the auc row: a bootstrap "
                      "over questions within each length). Recovery = candidate / baseline (paired bootstrap interval over "
                      "questions). A/A Δ: a cell against its own rerun (base: the baseline's control, cand: the "
                      "candidate's); the larger is the noise floor. Errors (failed requests) are counted apart and left "
                      "out of the pairs.")


def _primary(suite: str) -> str:
    from kvbench.suites import primary_metric

    return primary_metric(suite)


def _other_checks(card: Verdict) -> Table:
    rows = []
    for c in card.checks:
        if c.kind == "accuracy":
            continue
        if c.kind in ("fidelity KL", "perplexity ratio"):
            unit = "×" if c.kind == "perplexity ratio" else ""
            vals = ["—", f"{c.cand_value:.4g}{unit}", f"UB {c.bound:.4g}{unit}",
                    "not gated" if c.threshold is None else f"≤ {c.threshold:g}{unit}"]
        elif c.kind == "top-1 agreement":
            vals = ["—", fmt_pct(c.cand_value, 2), f"LB {fmt_pct(c.bound, 2)}",
                    "not gated" if c.threshold is None else f"≥ {fmt_pct(c.threshold)}"]
        elif c.kind == "error rate":
            vals = ["—", fmt_pct(c.cand_value), "—", f"≤ {fmt_pct(c.threshold)}"]
        else:
            vals = [fmt_pct(c.base_value), fmt_pct(c.cand_value), f"UB {fmt_pp(c.bound)}", f"< {fmt_pp(c.threshold)}"]
        rows.append([check_name(c), c.suite, *vals, _RESULT.get(c.status, c.status)])
    return Table("Other checks", ["check", "suite", "baseline", "candidate", "bound", "limit", "result"], rows)


def _context_table(card: Verdict, v: Verdicts) -> Table:
    rows = []
    for r in card.long_context:
        p = r.paired
        ratio = Ratio(p.auc_ratio, *p.auc_ratio_ci) if p.auc_ratio is not None else None
        rows.append([f"{r.suite} AUC (bootstrap CI)", fmt_pct(p.base_auc), fmt_pct(p.cand_auc),
                     f"{fmt_pp(p.delta)} [{fmt_pp(p.ci_lo)}, {fmt_pp(p.ci_hi)}]", _ratio(ratio)])
    f, bf, af = card.fidelity, v.base_fidelity, v.aa_fidelity
    if f is not None:
        base_kl = "—" if bf is None else f"{bf.kl_mean:.3g}"
        aa_kl = "" if af is None else f" (A/A {af.kl_mean:.3g})"
        rows.append(["fidelity KL mean (nats/token)", base_kl + aa_kl, f"{f.kl_mean:.3g}", "—", "—"])
        rows.append(["fidelity top-1 agreement", "—" if bf is None else fmt_pct(bf.top1_agree, 2), fmt_pct(f.top1_agree, 2),
                     "—", "—"])
        ppl = lambda x: "—" if x is None or not x.ppl_ref else f"{x.ppl_cand / x.ppl_ref:.4f}×"  # noqa: E731
        rows.append(["fidelity perplexity ratio (cell / reference)", ppl(bf), ppl(f), "—", "—"])
    cap = card.capacity
    if cap.cand_tokens is not None:
        rows.append(["KV capacity (planned tokens)", fmt_num(cap.base_tokens), fmt_num(cap.cand_tokens), "—", _x(cap.token_ratio)])
    if cap.cand_max_concurrency is not None:
        r = (cap.cand_max_concurrency / cap.base_max_concurrency) if cap.base_max_concurrency else None
        ctx = f"{cap.context_len:,}-token context" if cap.context_len else "context"
        rows.append([f"max concurrency at the {ctx} (planned)", fmt_num(cap.base_max_concurrency),
                     fmt_num(cap.cand_max_concurrency), "—", _x(r)])
    if cap.cand_at_request is not None:
        r = (cap.cand_at_request / cap.base_at_request) if cap.base_at_request else None
        rows.append([f"max concurrency of the load test's {cap.request_tokens:,}-token requests (planned)",
                     fmt_num(cap.base_at_request), fmt_num(cap.cand_at_request), "—", _x(r)])
    def running(v, tested) -> str:
        if v is None:
            return "—"
        return ("≥" if tested is not None and v >= tested else "") + fmt_num(v, 0)

    at_limit = any(v is not None and t is not None and v >= t for v, t in
                   ((cap.base_running, cap.base_tested), (cap.cand_running, cap.cand_tested)))
    ratio = ("not measured (no /metrics samples)" if cap.cand_running is None else
             "— (both at the highest concurrency tested)" if at_limit and cap.running_ratio == 1 else _x(cap.running_ratio))
    rows.append(["max running with an empty queue (measured)", running(cap.base_running, cap.base_tested),
                 running(cap.cand_running, cap.cand_tested), "—", ratio])
    conf = f"{100 * v.thresholds.confidence:g}%"
    return Table("Long context, fidelity and capacity", ["quantity", "baseline", "candidate", f"Δ [two-sided {conf} CI]",
                 "ratio [CI]"], rows,
                 note="Fidelity KL is against the reference cell; the baseline's own KL and the A/A control's are the floor. "
                      "The measured row counts the load test's requests: compare it with the planned row for the same "
                      "request size (capped by the server's running limit), not with the planned row at the context. "
                      "≥N: the most requests ever running with an empty queue equals the highest concurrency the load "
                      "test offered, so the server may hold more (measure at higher concurrency).")


def _serving_table(card: Verdict) -> Table:
    from kvbench.reports.serving_spread import (WarnedTable, fmt_ratio, goodput_text, machine_text, machine_warning,
                                                single_repeat_warning)

    rows, warnings = [], []
    for s in card.serving:
        lat = []
        for m in ("ttft", "tpot", "itl"):
            vals = [s.cand.get(f"{q}_{m}_ms") for _, q in [(m, q) for q in ("median", "p90", "p99")]]
            chg = [s.change(f"{q}_{m}_ms") for q in ("median", "p90", "p99")]
            lat.append(" / ".join(fmt_num(x, 1) for x in vals) + "  (" + " / ".join(_chg(x) for x in chg) + ")")
        good = s.cand.get("request_goodput")
        rows.append([str(s.concurrency), f"{fmt_num(s.cand.get('request_throughput'), 2)}, {fmt_ratio(s.base, s.cand, 'request_throughput')}",
                     f"{fmt_num(s.cand.get('output_throughput'))}, {fmt_ratio(s.base, s.cand, 'output_throughput')}",
                     "—" if good is None else f"{fmt_num(good, 2)}, {goodput_text(s.base, s.cand)}", *lat,
                     f"{machine_text(s.base)} vs {machine_text(s.cand)}"])
        warnings += s.warnings()
    one = single_repeat_warning(x for s in card.serving for x in (s.base, s.cand))
    loaded = machine_warning((f"{who} at c={s.concurrency}", d) for s in card.serving
                             for who, d in (("the baseline", s.base), ("the candidate", s.cand)))
    warnings += [loaded] if loaded else []
    return WarnedTable("Serving against the baseline, per concurrency", ["conc.", "req/s, × base (range)",
                       "out tok/s, × base (range)", "goodput req/s, × base (range)", "TTFT p50/p90/p99 ms (change)",
                       "TPOT p50/p90/p99 ms (change)", "ITL p50/p90/p99 ms (change)", "machine load (base vs cand)"], rows,
                       note="Candidate values (medians over the load repeats); × base = candidate median / baseline "
                            "median at the same concurrency, and in parentheses the lowest and highest ratio of a "
                            "candidate repeat to a baseline repeat (none with one repeat per cell); changes are relative "
                            "(+10% = 10% slower). Goodput: requests per second meeting the run's SLO. Machine load: "
                            "share of the CPU other processes took during the load test, and the highest 1-minute load "
                            "average over the CPU count.",
                       warnings=([one] if one else []) + warnings)


def card_tables(card: Verdict, v: Verdicts) -> list[Table]:
    out = [_accuracy_table(card, v.thresholds.confidence), _other_checks(card), _context_table(card, v)]
    if card.serving:
        out.append(_serving_table(card))
    return [t for t in out if t.rows]


def plan_table(v: Verdicts) -> Optional[Table]:
    if v.result is None:
        return None
    plans = [p for p in plan_result(v.result) if p.check.status == "inconclusive"]
    if not plans:
        return None
    return Table("Sample-size plan for the inconclusive checks", PLAN_COLUMNS, [plan_row(p) for p in plans],
                 note="Questions needed to certify the margin at the observed rates and agreement (the next items "
                      "assumed to behave like these): the 50% column is where the expected bound clears −δ, the power "
                      "column where it does with that probability. `kvbench gate RUN --plan` prints the same.")


def verdict_markdown(v: Verdicts) -> str:
    out = ["## Verdict", "", f"**{overall_line(v)}**", ""]
    for card in v.cards:
        out += [f"### {card.cell.short}: **{card.word}**", "", f"Reproduce: `{card.command}`", ""]
        out += [f"- {r}" for r in card.reasons] + ([""] if card.reasons else [])
        for t in card_tables(card, v):
            out.append(t.to_markdown().replace("### ", "#### ", 1))
    plan = plan_table(v)
    if plan is not None:
        out.append(plan.to_markdown())
    return "\n".join(out).rstrip() + "\n"


def _badge(word: Optional[str]) -> str:
    return f"<span class='badge' style='background:{_COLOR.get(word, _COLOR[None])}'>{html.escape(word or 'NO VERDICT')}</span>"


def verdict_html(v: Verdicts) -> str:
    out = ["<h2 id='verdict'>Verdict</h2>",
           f"<p class='overall'>{_badge(v.word)} {html_text(overall_line(v))}</p>"]
    for card in v.cards:
        color = _COLOR.get(card.word, _COLOR[None])
        out.append(f"<div class='verdict' style='border-color:{color}'>")
        out.append(f"<h3>{_badge(card.word)} {html.escape(card.cell.short)}</h3>")
        out.append(f"<p class='note'>Reproduce: <code>{html.escape(card.command)}</code></p>")
        if card.reasons:
            out.append("<ul class='reasons'>" + "".join(f"<li>{html_text(r)}</li>" for r in card.reasons) + "</ul>")
        for t in card_tables(card, v):
            out.append(t.to_html().replace("<h3>", "<h4>", 1).replace("</h3>", "</h4>", 1))
        out.append("</div>")
    plan = plan_table(v)
    if plan is not None:
        out.append(plan.to_html().replace("<table>", "<table class='wrap'>", 1))
    return "\n".join(out)

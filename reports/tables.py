"""Tables of a report: the ``Table`` that renders as Markdown or HTML, the number formats, and one table
per section of ``reports.analysis.Analysis`` (cells, accuracy, paired deltas, A/A control, fidelity,
serving, capacity).
"""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass
from typing import Optional

from kvbench.reports.analysis import Analysis
from kvbench.reports.gate.discriminative import delta_blind
from kvbench.reports.load import CellData, kv_text
from kvbench.reports.item_records import accuracy_suites, error_counts
from kvbench.suites import primary_metric

__all__ = ["Table", "html_text", "fmt_pct", "fmt_pp", "fmt_p", "fmt_num", "fmt_errors"]


# ------------------------------------------------------------------------------ formatting


def fmt_pct(x: Optional[float], digits: int = 1) -> str:
    return "—" if x is None or math.isnan(x) else f"{100 * x:.{digits}f}%"


def fmt_pp(x: Optional[float], digits: int = 1) -> str:
    if x is None or math.isnan(x):
        return "—"
    if math.isinf(x):
        return "−∞" if x < 0 else "+∞"
    v = round(100 * x, digits) + 0.0  # no "−0.0"
    return f"{v:+.{digits}f} pp".replace("-", "−")


def fmt_p(p: Optional[float]) -> str:
    if p is None or math.isnan(p):
        return "—"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def fmt_num(x, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.{digits}f}"


_CODE_SPAN = re.compile(r"`([^`]+)`")


def html_text(s: str) -> str:
    """``s`` escaped for HTML, with markdown's `code` spans as <code> elements (never literal backticks)."""
    return _CODE_SPAN.sub(r"<code>\1</code>", html.escape(s))


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""

    def to_markdown(self) -> str:
        def esc(s: str) -> str:
            return str(s).replace("|", "\\|").replace("\n", " ")

        out = [f"### {self.title}", ""]
        if not self.rows:
            out += ["_No data._", ""]
        else:
            out.append("| " + " | ".join(esc(c) for c in self.columns) + " |")
            out.append("|" + "|".join("---" for _ in self.columns) + "|")
            out += ["| " + " | ".join(esc(v) for v in row) + " |" for row in self.rows]
            out.append("")
        if self.note:
            out += [self.note, ""]
        return "\n".join(out)

    def to_html(self) -> str:
        out = [f"<h3>{html.escape(self.title)}</h3>"]
        if not self.rows:
            out.append("<p class='empty'>No data.</p>")
        else:
            out.append("<table><thead><tr>" + "".join(f"<th>{html_text(c)}</th>" for c in self.columns) + "</tr></thead><tbody>")
            for row in self.rows:
                cls = " class='fail'" if any(str(v) == "FAIL" for v in row) else ""
                out.append(f"<tr{cls}>" + "".join(f"<td>{html_text(str(v))}</td>" for v in row) + "</tr>")
            out.append("</tbody></table>")
        if self.note:
            out.append(f"<p class='note'>{html_text(self.note)}</p>")
        return "\n".join(out)


# ------------------------------------------------------------------------------ tables


def series_label(cell: CellData) -> str:
    """A cell's short label without its concurrency: the name of its format series in tables and plots."""
    c = cell.concurrency
    return cell.short.replace(f" c={c}", "") if c is not None else cell.short


def cells_table(a: Analysis) -> Table:
    rows = []
    for c in a.cells:
        cfg = c.config
        rows.append([c.short, c.key, str(cfg.get("model", "")), str(cfg.get("target", "")),
                     f"{cfg.get('prefill_backend', '')}/{cfg.get('decode_backend', '')}", kv_text(cfg),
                     str(cfg.get("kv_scales", "")), str(cfg.get("concurrency", "")), str(c.status or "missing"),
                     fmt_num(len(c.items)), fmt_num(len(c.requests)), (c.error or "")[:120]])
    columns = ["cell", "key", "model", "target", "prefill/decode", "kv", "scales", "conc.", "status",
               "items", "requests", "error"]
    devices = [((c.summary or {}).get("target") or {}).get("devices") for c in a.cells]
    if any(d is not None for d in devices):  # servers given GPUs (kvbench sweep --parallel / --devices)
        columns.insert(4, "devices")
        for row, d in zip(rows, devices):
            row.insert(4, ",".join(str(x) for x in d) if d is not None else "—")
    return Table("Cells", columns, rows)


def fmt_errors(n_errors: int, rate: Optional[float]) -> str:
    """Failed requests as "count (rate)", e.g. "2 (1.6%)"; "0" when none."""
    return f"{n_errors:,} ({fmt_pct(rate)})" if n_errors else "0"


def accuracy_table(a: Analysis) -> Table:
    conf = f"{100 * a.confidence:g}%"
    rows = []
    order = {s: i for i, s in enumerate(dict.fromkeys(r.suite for r in a.accuracy))}
    for r in sorted(a.accuracy, key=lambda r: (order[r.suite], r.metric != primary_metric(r.suite), r.metric)):
        e = r.est
        rows.append([r.suite, r.metric, r.cell.short, fmt_num(e.n), str(e.k), fmt_pct(e.mean),
                     f"[{fmt_pct(max(0.0, e.lo))}, {fmt_pct(min(1.0, e.hi))}]", e.method,
                     fmt_pct(r.pass_at_k) if r.pass_at_k is not None else "—", fmt_pct(r.invalid_rate), fmt_pct(r.truncation_rate),
                     fmt_errors(r.n_errors, r.error_rate)])
    # a suite whose every request failed has no accuracy: listed with its errors
    shown = {(id(r.cell), r.suite) for r in a.accuracy}
    for cell in a.cells:
        if not cell.done:
            continue
        for suite in accuracy_suites(cell):
            n_err, n_all = error_counts(cell, suite)
            if (id(cell), suite) not in shown and n_err and n_err == n_all:
                rows.append([suite, primary_metric(suite), cell.short, "0", "—", "—", "—", "—", "—", "—", "—",
                             fmt_errors(n_err, 1.0)])
    return Table("Accuracy", ["suite", "metric", "cell", "questions", "K", "accuracy", f"{conf} CI", "interval",
                              "pass@K", "invalid", "truncated", "errors"], rows,
                 note="Accuracy, its interval and the invalid and truncated rates are over answered items: failed "
                      "requests (timeouts, HTTP errors, dropped streams) are no answer and are counted apart, in "
                      "errors (count and share of all the suite's requests in the cell); pass@K leaves out questions "
                      "with a failed sample. "
                      "Wilson interval when every question was asked once, t-interval over per-question means for K>1. "
                      "The first metric of each suite is its primary one: `correct`, except `ruler` (the mean fraction "
                      "of expected strings found; its `correct` is every string found).")


def delta_table(a: Analysis) -> Table:
    conf = f"{100 * a.confidence:g}%"
    rows = []
    with_errors = any(r.n_error_pairs for r in a.deltas)
    for r in a.deltas:
        d = r.d
        disc = f"{d.base_only}/{d.cand_only}" if d.base_only >= 0 else "—"
        row = [r.suite, r.cell.short, r.base.short, fmt_num(d.n_pairs), fmt_pct(d.base_mean), fmt_pct(d.cand_mean),
               delta_blind(d.base_mean, d.cand_mean) or fmt_pp(d.delta), f"[{fmt_pp(d.ci_lo)}, {fmt_pp(d.ci_hi)}]",
               f"{fmt_p(d.p_value)} ({d.p_method})",
               fmt_p(r.p_holm), fmt_num(d.correlation, 2) if d.correlation is not None else "—", disc]
        if with_errors:
            row.append(fmt_num(r.n_error_pairs))
        rows.append(row)
    columns = ["suite", "cell", "baseline", "pairs", "baseline acc.", "cell acc.", "Δ", f"{conf} CI", "p", "p (Holm)",
               "corr.", "lost/gained"] + (["excluded (errors)"] if with_errors else [])
    note = ("Pairs share (item, repeat). CI: Newcombe's paired score interval for 0/1 scores with K=1 (it keeps "
            "a width when every pair agrees), else a paired bootstrap over questions (seeded). p: exact McNemar for K=1, "
            "paired t-test over per-question means for K>1; Holm-corrected across the comparisons of this report. "
            "lost/gained: items the baseline got right and the cell wrong, and the reverse. A metric whose baseline "
            "scores 0%, or where both cells score 100%, cannot show a loss: its Δ reads \"not discriminative\" "
            "(the verdict above applies the margins and the A/A control).")
    if with_errors:
        note += (" excluded (errors): (item, repeat) pairs left out because the request failed in the cell or in the "
                 "baseline (a failed request is not a wrong answer).")
    return Table("Paired deltas against the baseline", columns, rows, note=note)


def aa_table(a: Analysis) -> Table:
    conf = f"{100 * a.confidence:g}%"
    rows = []
    for r in a.aa:
        d = r.d
        disc = f"{d.base_only}/{d.cand_only}" if d.base_only >= 0 else "—"
        rows.append([r.suite, r.cell.short, r.base.short, fmt_num(d.n_pairs), fmt_pp(d.delta),
                     f"[{fmt_pp(d.ci_lo)}, {fmt_pp(d.ci_hi)}]", f"{fmt_p(d.p_value)} ({d.p_method})", disc,
                     fmt_pct(r.output_agreement)])
    return Table("A/A controls (a cell run twice): measured nondeterminism", ["suite", "control", "original", "pairs", "Δ",
                 f"{conf} CI", "p", "lost/gained", "identical outputs"], rows,
                 note="Each control reruns a cell (the baseline, or a candidate) in a fresh engine under different batching; "
                      "any difference here comes from nondeterminism of the stack itself (batching, kernels, sampling, "
                      "a quantized cache rounding a last-bit difference into another token). Deltas of the same size "
                      "are not attributable to the KV format.")


def _g(x: float) -> str:
    return "—" if x is None or math.isnan(x) else f"{x:.4g}"


def fidelity_table(a: Analysis) -> Table:
    rows = []
    for f in a.fidelity:
        dppl = (f.ppl_cand / f.ppl_ref - 1.0) if f.ppl_ref and not math.isnan(f.ppl_ref) else math.nan
        rows.append([f.cell.short, fmt_num(f.n_texts), fmt_num(f.n_tokens), f"{f.kl_mean:.4g}", _g(f.kl_p99),
                     f"{f.kl_max:.4g}", fmt_pct(f.top1_agree, 2), fmt_num(f.ppl_ref, 3), fmt_num(f.ppl_cand, 3),
                     fmt_pp(dppl, 2).replace(" pp", "%"), fmt_num(f.first_divergence_median, 0),
                     fmt_num(f.first_divergence_min, 0)])
    return Table("Fidelity against the reference cell (teacher-forced)", ["cell", "texts", "tokens", "KL mean", "KL p99",
                 "KL max", "top-1 agree", "ppl ref", "ppl cell", "Δppl", "first div. median", "first div. min"], rows,
                 note="KL(reference ‖ cell) per token in nats. KL mean, KL p99, top-1 agreement and perplexities are "
                      "pooled over tokens (KL p99 from the cell's summary.json; — when it has none). First divergence: token index where the greedy "
                      "continuation first differs from the reference's (the greedy window length when it never does).")


def _running_limit(cap: dict):
    """The server's admission limit on running requests (sglang max_running_requests, vLLM max_num_seqs)."""
    for k in ("max_running_requests", "max_num_seqs"):
        if cap.get(k) is not None:
            return cap[k]
    return None


def capacity_table(a: Analysis) -> Table:
    server = any(str(cap.get("source", "")).startswith("server") for _, cap, _ in a.capacity)
    rows = []
    for cell, cap, ratio in a.capacity:
        kv_bytes = cap.get("kv_bytes")
        row = [series_label(cell), kv_text(cell.config, cap), fmt_num(cap.get("bytes_per_token"), 0),
               fmt_num(cap.get("tokens")), f"{kv_bytes / 2**30:.3f}" if kv_bytes else "—",
               fmt_num(cap.get("context_len")), fmt_num(cap.get("max_concurrency")),
               f"{ratio:.2f}×" if ratio else "—"]
        if server:
            row[7:7] = [fmt_num(_running_limit(cap)), str(cap.get("source") or "engine")]
        rows.append(row)
    header = ["series", "kv", "bytes/token", "tokens", "KV GiB", "context", "max concurrency", "tokens vs baseline"]
    note = ("Bytes per token include block and tensor scales; with per-layer formats (skip = layers kept in bf16) "
            "they sum every layer in its own format.")
    if server:
        header[7:7] = ["running limit", "source"]
        note = ("Embedded cells: the engine's own plan; bytes per token include block and tensor scales. Server cells: "
                "the KV pool the server printed at start-up (bytes per token from its pool size, which it rounds) and its "
                "/metrics; the running limit is its admission limit (sglang max_running_requests, vLLM max_num_seqs), "
                "which caps concurrency before the KV pool does when it is smaller than max concurrency.")
    return Table("KV capacity by format", header, rows, note=note)

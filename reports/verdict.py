"""The ship decision on one page: a verdict card per candidate cell (cell vs the baseline), at the top of the
report.  ``build_verdicts`` runs the gate (``reports.gate.run_gate``) with the run's own thresholds, so each
card's word is the word ``kvbench gate RUN --candidate SELECTOR`` returns, and the report's overall word is
what ``kvbench gate RUN`` returns (the exit codes in ``reports.gate``).

A card puts next to each other: per accuracy suite the candidate / baseline recovery ratio with a paired
bootstrap interval, the non-inferiority result at the configured margin and the A/A control's difference
(the noise floor); long-context AUC recovery; fidelity KL (and the A/A control's KL); capacity (planned KV
tokens, and the measured largest number of running requests with an empty queue); per concurrency the
request / output throughput and goodput gain and the TTFT / TPOT / ITL p50 / p90 / p99 changes.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from kvbench.reports.stats import paired as stats
from kvbench.reports.analysis import Analysis, FidelityRow
from kvbench.reports.gate.discriminative import errored, scores
from kvbench.reports.gate.check import (Check, GateError, GateResult, GateThresholds, merge_gate_config, run_gate)
from kvbench.reports.load import CellData, RunData, selector_text
from kvbench.suites import primary_metric
from kvbench.reports.long_context import RecoveryRow
from kvbench.reports.capacity import load_request_sizes, planned_at_request
from kvbench.reports.render.plots import series_key

__all__ = ["Ratio", "SuiteLine", "ServingLine", "Capacity", "Verdict", "Verdicts", "build_verdicts", "paired_ratio", "verdict_records",
           "cell_selector", "LATENCY_KEYS"]

LATENCY_KEYS = [(m, q) for m in ("ttft", "tpot", "itl") for q in ("median", "p90", "p99")]


@dataclass(frozen=True)
class Ratio:
    """candidate / baseline with a two-sided interval; ``value`` None when the baseline is 0."""

    value: Optional[float]
    lo: Optional[float] = None
    hi: Optional[float] = None


def paired_ratio(base: dict, cand: dict, confidence: float, n_boot: int = 10_000, seed: int = 0) -> Ratio:
    """mean(cand) / mean(base) over shared (item, repeat) keys; the interval resamples questions (the repeats
    of a question stay together), as the paired deltas do."""
    keys = sorted(set(base) & set(cand), key=lambda k: (str(k[0]), k[1]))
    if not keys:
        return Ratio(None)
    bq = stats.group_by_question({k: base[k] for k in keys})
    cq = stats.group_by_question({k: cand[k] for k in keys})
    items = sorted(bq, key=str)
    b = np.array([np.mean(bq[i]) for i in items])
    c = np.array([np.mean(cq[i]) for i in items])
    if b.mean() <= 0:
        return Ratio(None)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(items), size=(n_boot, len(items)))
    bb, cb = b[idx].mean(axis=1), c[idx].mean(axis=1)
    ok = bb > 0
    r = cb[ok] / bb[ok]
    a = 1.0 - confidence
    lo, hi = (float(v) for v in np.quantile(r, [a / 2, 1 - a / 2])) if r.size else (None, None)
    return Ratio(float(c.mean() / b.mean()), lo, hi)


@dataclass
class SuiteLine:
    check: Check  # the gate's accuracy check (status, bound, threshold, noise)
    recovery: Ratio


@dataclass
class ServingLine:
    concurrency: int
    base: dict  # reports.analysis serving dicts (reports.serving)
    cand: dict

    def ratio(self, key: str) -> Optional[float]:
        b, c = self.base.get(key), self.cand.get(key)
        if not isinstance(b, (int, float)) or not isinstance(c, (int, float)) or not b or math.isnan(b) or math.isnan(c):
            return None
        return c / b

    def change(self, key: str) -> Optional[float]:
        """Relative change (c − b)/b: a latency going from 10 ms to 12 ms is +0.2."""
        r = self.ratio(key)
        return None if r is None else r - 1.0

    def ratio_range(self, key: str) -> Optional[tuple[float, float]]:
        """Lowest and highest candidate-repeat / baseline-repeat ratio; None with one load repeat per cell
        (``reports.serving_spread``)."""
        from kvbench.reports.serving_spread import ratio_range

        return ratio_range(self.base, self.cand, key)

    def warnings(self) -> list[str]:
        """A ratio within the run-to-run spread, an SLO the baseline does not meet (the loaded-machine warning
        covers every line of a card at once: ``reports.serving_spread.machine_warning``)."""
        from kvbench.reports.serving_spread import slo_unmet, spread_warning

        n = self.concurrency
        unmet = slo_unmet(self.base, self.cand) if self.cand.get("request_goodput") is not None else None
        out = [spread_warning(n, self.base, self.cand),
               f"serving: goodput at c={n}: {unmet}; no goodput ratio is shown" if unmet else None]
        return [w for w in out if w]


@dataclass
class Capacity:
    base_tokens: Optional[int] = None
    cand_tokens: Optional[int] = None
    base_max_concurrency: Optional[int] = None  # planned at the configured context
    cand_max_concurrency: Optional[int] = None
    base_running: Optional[float] = None  # measured: most running requests with an empty queue (server /metrics)
    cand_running: Optional[float] = None
    base_tested: Optional[int] = None  # the highest concurrency the series was loaded at: a measured value equal
    cand_tested: Optional[int] = None  # to it is a lower bound (the server may hold more)
    context_len: Optional[int] = None  # the context the planned max concurrency is counted at
    request_tokens: Optional[int] = None  # prompt + output tokens of the load test's requests
    base_at_request: Optional[int] = None  # planned concurrent requests of that size (the measured one's peer)
    cand_at_request: Optional[int] = None

    @staticmethod
    def _r(c, b) -> Optional[float]:
        return c / b if isinstance(c, (int, float)) and isinstance(b, (int, float)) and b else None

    @property
    def token_ratio(self) -> Optional[float]:
        return self._r(self.cand_tokens, self.base_tokens)

    @property
    def running_ratio(self) -> Optional[float]:
        return self._r(self.cand_running, self.base_running)


@dataclass
class Verdict:
    cell: CellData
    word: str
    selector: str
    command: str  # the gate command whose exit code this word is
    suites: list[SuiteLine] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)  # every check of the candidate (rates, errors, KL too)
    long_context: list[RecoveryRow] = field(default_factory=list)
    fidelity: Optional[FidelityRow] = None
    capacity: Capacity = field(default_factory=Capacity)
    serving: list[ServingLine] = field(default_factory=list)

    @property
    def reasons(self) -> list[str]:
        from kvbench.reports.gate.output import check_name

        def name(c: Check) -> str:
            if c.kind == "accuracy":
                return c.suite if c.metric in ("correct", primary_metric(c.suite)) else f"{c.suite}:{c.metric}"
            named = check_name(c)
            return named if named.startswith(c.suite) else f"{c.suite} {named}"  # "fidelity KL", not "fidelity fidelity KL"

        # every reason a check gives: why it did not pass, or a pass that needs saying (full marks on items
        # another candidate lost on)
        return [f"{name(c)}: {c.reason}" for c in self.checks if c.gated and c.reason]


@dataclass
class Verdicts:
    baseline: Optional[CellData]
    word: Optional[str]  # None when the gate could not run (``error``)
    exit_code: Optional[int]
    command: str
    thresholds: GateThresholds
    cards: list[Verdict] = field(default_factory=list)
    aa: Optional[CellData] = None
    base_fidelity: Optional[FidelityRow] = None
    aa_fidelity: Optional[FidelityRow] = None
    error: Optional[str] = None  # why there is no verdict (exit 2 of the gate)
    result: Optional[GateResult] = None


def _selector_view(cfg: dict) -> dict:
    """A cell config with its KV entry's options beside the top-level keys (``none`` where one is not set)."""
    from kvbench.core import kv_option_names

    out = {k: v for k, v in cfg.items() if k != "options"}
    opts = cfg.get("options") or {}
    out.update({k: ("none" if opts.get(k) is None else str(opts[k]).lower() if isinstance(opts[k], bool) else opts[k])
                for k in kv_option_names()})
    return out


def cell_selector(cell: CellData, cells: list[CellData]) -> str:
    """A ``key=value,...`` selector that picks ``cell`` alone among ``cells`` (A/A controls aside); the KV
    entry's options (``kv_dtype_skip_layers=1,2``, ``quantize_query=decode``) where they tell cells apart."""
    mine = _selector_view(cell.config)
    keys = [k for k in ("kv_dtype", "kv_scales", "prefill_backend", "decode_backend", "model", "target", "concurrency")
            if k in mine]
    keys += sorted(k for k in mine if k not in keys and not isinstance(mine[k], (dict, list)) and k != "aa_control")
    others = [_selector_view(c.config) for c in cells if c is not cell and not c.aa_control]
    chosen: list[str] = []
    for k in keys:
        if not any(all(str(o.get(j)) == str(mine.get(j)) for j in chosen) for o in others):
            break
        if any(str(o.get(k)) != str(mine.get(k)) for o in others if all(str(o.get(j)) == str(mine.get(j)) for j in chosen)):
            chosen.append(k)
    return ",".join(f"{k}={mine[k]}" for k in chosen) or ",".join(f"{k}={mine[k]}" for k in keys[:1])


def _gate_command(run: RunData, baseline: Optional[str], candidate: Optional[str]) -> str:
    cmd = ["kvbench", "gate", str(run.path)]
    if baseline:
        cmd += ["--baseline", baseline]
    if candidate:
        cmd += ["--candidate", candidate]
    return shlex.join(cmd)


def _series_cells(a: Analysis, cell: CellData) -> dict[int, dict]:
    return {c.concurrency or 0: s for c, s in a.serving
            if c.run == cell.run and not c.aa_control and c.series_config == cell.series_config}


def _capacity(a: Analysis, base: CellData, cand: CellData) -> Capacity:
    out = Capacity()
    for c, cap, _ in a.capacity:
        if c.run != cand.run:
            continue
        size = load_request_sizes(a).get(series_key(c))
        at_request = planned_at_request(cap, *size) if size else None
        if c.series_config == base.series_config:
            out.base_tokens, out.base_max_concurrency = cap.get("tokens"), cap.get("max_concurrency")
            out.base_at_request = at_request
        if c.series_config == cand.series_config:
            out.cand_tokens, out.cand_max_concurrency = cap.get("tokens"), cap.get("max_concurrency")
            out.cand_at_request, out.context_len = at_request, cap.get("context_len")
            out.request_tokens = size[0] if size else None

    def measured(cell: CellData) -> Optional[float]:
        vals = [s.get("max_running_without_queueing") for s in _series_cells(a, cell).values()]
        vals = [v for v in vals if isinstance(v, (int, float))]
        return max(vals) if vals else None

    out.base_running, out.cand_running = measured(base), measured(cand)
    out.base_tested = max(_series_cells(a, base), default=None)
    out.cand_tested = max(_series_cells(a, cand), default=None)
    return out


def _fidelity(a: Analysis, cell: Optional[CellData]) -> Optional[FidelityRow]:
    return next((f for f in a.fidelity if f.cell is cell), None) if cell is not None else None


def build_verdicts(run: RunData, a: Analysis, baseline_selector: Optional[str] = None,
                   thresholds: Optional[GateThresholds] = None) -> Optional[Verdicts]:
    """The verdict cards of a report; None when the run has no baseline with item records."""
    base = a.baseline
    if base is None:
        return None
    try:
        t = thresholds or merge_gate_config(GateThresholds(), run.config.get("gate"))
    except GateError as e:
        return Verdicts(base, None, 2, _gate_command(run, baseline_selector, None), GateThresholds(), error=str(e))
    sel = baseline_selector or (selector_text(run.config["baseline"]) if run.config.get("baseline") else None)
    base_sel = sel or cell_selector(base, run.cells)
    command = _gate_command(run, baseline_selector if baseline_selector else (None if sel else base_sel), None)
    try:
        result = run_gate(run, base_sel, None, t)
    except GateError as e:
        return Verdicts(base, None, 2, command, t, error=str(e))
    out = Verdicts(base, result.word, result.exit_code, command, t, aa=result.aa, result=result,
                   base_fidelity=_fidelity(a, base), aa_fidelity=_fidelity(a, result.aa))
    base_serving = _series_cells(a, base)
    for cand in result.candidates:
        csel = cell_selector(cand, [c for c in run.done_cells if c.items])
        v = Verdict(cand, result.word_of(cand), csel,
                    _gate_command(run, baseline_selector if baseline_selector else (None if sel else base_sel), csel),
                    checks=result.checks_of(cand))
        for chk in v.checks:
            if chk.kind == "accuracy":
                if chk.metric == "auc":
                    rec = next((r for r in a.recovery if r.cell is cand and r.suite == chk.suite), None)
                    p = rec.paired if rec else None
                    ratio = Ratio(p.auc_ratio, *p.auc_ratio_ci) if p and p.auc_ratio is not None else Ratio(None)
                else:
                    drop = errored(base, cand, chk.suite)
                    ratio = paired_ratio(scores(base, chk.suite, chk.metric, drop), scores(cand, chk.suite, chk.metric, drop),
                                         t.confidence, t.n_boot, t.seed)
                v.suites.append(SuiteLine(chk, ratio))
        v.long_context = [r for r in a.recovery if r.cell is cand]
        v.fidelity = _fidelity(a, cand)
        v.capacity = _capacity(a, base, cand)
        cand_serving = _series_cells(a, cand)
        v.serving = [ServingLine(n, base_serving[n], cand_serving[n]) for n in sorted(set(base_serving) & set(cand_serving))]
        out.cards.append(v)
    return out


def verdict_records(v: Optional[Verdicts]) -> dict[str, list[dict]]:
    """The verdicts and the gate's checks as flat rows for the machine-readable tables (``reports.export``)."""
    if v is None:
        return {}
    from kvbench.reports.gate.output import check_json

    cards = []
    for card in v.cards:
        row = {"cell_key": card.cell.key, "cell": card.cell.short, "word": card.word, "selector": card.selector,
               "command": card.command, "overall_word": v.word, "overall_exit_code": v.exit_code,
               "baseline_key": v.baseline.key if v.baseline else None, "aa_key": v.aa.key if v.aa else None,
               "capacity_base_tokens": card.capacity.base_tokens, "capacity_cand_tokens": card.capacity.cand_tokens,
               "capacity_token_ratio": card.capacity.token_ratio,
               "max_running_without_queueing_base": card.capacity.base_running,
               "max_running_without_queueing_cand": card.capacity.cand_running,
               "max_running_ratio": card.capacity.running_ratio,
               "kl_mean": card.fidelity.kl_mean if card.fidelity else None,
               "reasons": "; ".join(card.reasons)}
        for line in card.suites:
            c = line.check
            name = c.suite if c.metric == "correct" else f"{c.suite}:{c.metric}"
            row[f"{name}:recovery"] = line.recovery.value
            row[f"{name}:recovery_lo"] = line.recovery.lo
            row[f"{name}:recovery_hi"] = line.recovery.hi
            row[f"{name}:status"] = c.status
        for s in card.serving:
            for key in ("request_throughput", "output_throughput", "request_goodput"):
                row[f"c{s.concurrency}:{key}_ratio"] = s.ratio(key)
                lo, hi = s.ratio_range(key) or (None, None)  # over the load repeats (None: one repeat)
                row[f"c{s.concurrency}:{key}_ratio_lo"], row[f"c{s.concurrency}:{key}_ratio_hi"] = lo, hi
            for m, q in LATENCY_KEYS:
                row[f"c{s.concurrency}:{q}_{m}_ms_change"] = s.change(f"{q}_{m}_ms")
        cards.append(row)
    checks = [check_json(c) for c in (v.result.checks if v.result else [])]
    return {"verdicts": cards, "gate_checks": checks}

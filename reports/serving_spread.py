"""Serving ratios with their run-to-run spread, and the warnings that go with the serving tables.

A cell's serving dict (``reports.serving.serving_summary``) holds the median of each metric over its load
repeats and ``spread[key] = {"min", "max"}``.  Here:

- a ratio is candidate median / baseline median; its range covers every pairing of a candidate repeat with a
  baseline repeat (candidate min / baseline max … candidate max / baseline min): the repeats of two cells
  are not paired in time, so no pairing is more right than another;
- the spread ±X% of a comparison is the largest of: the baseline's own run-to-run spread and the
  candidate's (largest distance of a repeat from the median, relative to the median), and how far the
  range reaches from the ratio towards 1.0;
- a ratio is not a measured difference when its point differs from 1.00× but X ≥ |ratio − 1| (then the
  range includes 1.0, or one cell's own repeats vary more than the two cells differ);
- goodput needs an SLO the baseline meets: when the baseline meets it on fewer than ``SLO_UNMET_SHARE`` of
  its requests, the goodput ratio is replaced by that statement;
- a load test ran on a loaded machine when other processes took more than ``OTHERS_CPU_LIMIT`` of the CPU
  during it (``/proc/stat``), or, where that was not measured, when the 1-minute load average before it
  exceeded the CPU count.  An endpoint target's server is not kvbench's own process: its CPU counts as
  "others", so no such warning is given for endpoint cells (their machine-load column says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from kvbench.reports.tables import Table, html_text

__all__ = ["WarnedTable", "repeats", "ratio", "ratio_range", "fmt_ratio", "spread_pct", "within_noise", "spread_warning",
           "single_repeat_warning", "slo_unmet", "goodput_text", "machine_text", "machine_loaded", "machine_warning", "THROUGHPUT_KEYS",
           "SLO_UNMET_SHARE", "OTHERS_CPU_LIMIT"]

THROUGHPUT_KEYS = (("output_throughput", "out tok/s"), ("request_throughput", "req/s"))
SLO_UNMET_SHARE = 0.10
OTHERS_CPU_LIMIT = 0.25
_SLO_P50 = {"ttft_ms": ("TTFT", "median_ttft_ms"), "tpot_ms": ("TPOT", "median_tpot_ms"), "e2el_ms": ("E2E", "median_e2el_ms")}


@dataclass
class WarnedTable(Table):
    """A table with warning lines shown between its rows and its note (a list marked ⚠ in both formats)."""

    warnings: list[str] = field(default_factory=list)

    def to_markdown(self) -> str:
        text = super().to_markdown()
        if not self.warnings:
            return text
        block = "\n".join(f"- ⚠ **{w}**" for w in self.warnings) + "\n"
        if self.note and text.rstrip().endswith(self.note):
            head = text.rstrip()[: -len(self.note)]
            return head + block + "\n" + self.note + "\n"
        return text + block

    def to_html(self) -> str:
        text = super().to_html()
        if not self.warnings:
            return text
        block = ("<ul class='warnings' style='color:#9a6700;font-weight:600'>"
                 + "".join(f"<li>⚠ {html_text(w)}</li>" for w in self.warnings) + "</ul>")
        note = f"<p class='note'>{html_text(self.note)}</p>" if self.note else ""
        if note and text.endswith(note):
            return text[: -len(note)] + block + "\n" + note
        return text + "\n" + block


def _num(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def repeats(s: dict) -> int:
    return int(s.get("repeats") or 1)


def _range(s: dict, key: str) -> Optional[tuple[float, float]]:
    sp = (s.get("spread") or {}).get(key) or {}
    lo, hi = _num(sp.get("min")), _num(sp.get("max"))
    if lo is None or hi is None:
        v = _num(s.get(key))
        return None if v is None else (v, v)
    return lo, hi


def ratio(base: dict, cand: dict, key: str) -> Optional[float]:
    b, c = _num(base.get(key)), _num(cand.get(key))
    return None if b is None or c is None or not b else c / b


def ratio_range(base: dict, cand: dict, key: str) -> Optional[tuple[float, float]]:
    """(lowest, highest) candidate-repeat / baseline-repeat ratio; None with one repeat on each side."""
    if repeats(base) < 2 and repeats(cand) < 2:
        return None
    b, c = _range(base, key), _range(cand, key)
    if b is None or c is None or b[0] <= 0:
        return None
    return c[0] / b[1], c[1] / b[0]


def fmt_ratio(base: dict, cand: dict, key: str) -> str:
    """``0.91× (0.85–0.97)``; ``0.91×`` without repeats; ``—`` without a ratio."""
    r = ratio(base, cand, key)
    if r is None:
        return "—"
    rng = ratio_range(base, cand, key)
    return f"{r:.2f}×" + (f" ({rng[0]:.2f}–{rng[1]:.2f})" if rng else "")


def _own_spread(s: dict, key: str) -> Optional[float]:
    v, rng = _num(s.get(key)), _range(s, key)
    if not v or rng is None or repeats(s) < 2:
        return None
    return max(rng[1] - v, v - rng[0]) / v


def spread_pct(base: dict, cand: dict, key: str) -> Optional[float]:
    """The comparison's run-to-run spread X (module docstring) as a fraction; None without repeats."""
    r, rng = ratio(base, cand, key), ratio_range(base, cand, key)
    if r is None or rng is None:
        return None
    toward_one = (rng[1] - r) if r < 1 else (r - rng[0])
    own = [x for x in (_own_spread(base, key), _own_spread(cand, key)) if x is not None]
    return max([toward_one, *own])


def within_noise(base: dict, cand: dict, key: str) -> bool:
    """The ratio's point differs from 1.00× but the spread is at least as large as the difference."""
    r, x = ratio(base, cand, key), spread_pct(base, cand, key)
    return r is not None and x is not None and round(r, 2) != 1.0 and x >= abs(r - 1.0)


def _pct(x: float) -> str:
    return f"{100 * x:+.0f}%".replace("-", "−")


def spread_warning(conc, base: dict, cand: dict, who: str = "") -> Optional[str]:
    """The warning for a comparison whose throughput ratios lie within the run-to-run spread (None otherwise)."""
    keys = [(k, name) for k, name in THROUGHPUT_KEYS if within_noise(base, cand, k)]
    if not keys:
        return None
    x = max(spread_pct(base, cand, k) for k, _ in keys)
    diffs = ", ".join(f"{name} {ratio(base, cand, k):.2f}× ({_pct(ratio(base, cand, k) - 1)})" for k, name in keys)
    return (f"serving: run-to-run spread (±{100 * x:.0f}%) exceeds the measured difference at c={conc}{who} "
            f"({diffs}); not a measured speed difference")


def single_repeat_warning(cells: Iterable[dict]) -> Optional[str]:
    """Said once when every cell ran its load test once."""
    cells = list(cells)
    if cells and all(repeats(s) < 2 for s in cells):
        return ("serving: each load test ran once (load.repeats: 1), so no run-to-run spread was measured and no "
                "serving ratio here can be told apart from noise; set load.repeats: 3 to measure it")
    return None


def _misses_slo(s: dict) -> bool:
    good, done = _num(s.get("good_requests")), _num(s.get("completed"))
    return bool(s.get("slo")) and good is not None and bool(done) and good / done < SLO_UNMET_SHARE


def slo_unmet(base: dict, cand: Optional[dict] = None) -> Optional[str]:
    """What the SLO asks against the baseline's medians, when the baseline meets it on (almost) none of its
    requests ("either" when the candidate does not meet it either, or is not given); None when the baseline
    meets it, or there is no SLO."""
    if not _misses_slo(base):
        return None
    slo, good, done = base["slo"], _num(base.get("good_requests")), _num(base.get("completed"))
    parts = [(name, float(limit), _num(base.get(p50))) for k, limit in sorted(slo.items()) if k in _SLO_P50
             for name, p50 in [_SLO_P50[k]]]
    missed = [p for p in parts if p[2] is not None and p[2] > p[1]] or parts
    vs = ", ".join(f"{name} target {limit:g} ms vs baseline p50 {'—' if v is None else f'{v:.0f}'} ms"
                   for name, limit, v in missed)
    either = " either" if cand is None or _misses_slo(cand) else ""
    return f"SLO not met by the baseline{either} ({int(good)} of {int(done)} requests): {vs}"


def goodput_text(base: dict, cand: dict) -> str:
    """The goodput cell of a comparison: the ratio with its range, or why there is none."""
    if cand.get("request_goodput") is None:
        return "—"
    if slo_unmet(base):
        return "n/a: SLO not met by the baseline" + (" either" if _misses_slo(cand) else "")
    return fmt_ratio(base, cand, "request_goodput")


def machine_text(s: dict) -> str:
    """``others 38% · load 5.4 on 2 CPUs``: the most CPU other processes took in any repeat, and the highest 1-minute load
    average around it over the CPU count; ``—`` when the load test recorded none."""
    m = s.get("machine_load") or {}
    if not m:
        return "—"
    parts = []
    if _num(m.get("others_cpu_share")) is not None:
        parts.append(f"others {100 * m['others_cpu_share']:.0f}%")
    loads = [x for x in (_num(m.get("loadavg_before_1m")), _num(m.get("loadavg_after_1m"))) if x is not None]
    if loads:
        cpus = _num(m.get("cpu_count"))
        parts.append(f"load {max(loads):.1f}" + (f" on {cpus:.0f} CPUs" if cpus else ""))
    if parts and m.get("others_include_server"):
        parts[0] += " (incl. the endpoint's server)"
    return " · ".join(parts) or "—"


def machine_loaded(s: dict) -> bool:
    m = s.get("machine_load") or {}
    if m.get("others_include_server"):  # an endpoint target: its server's CPU is in "others" and in the load average
        return False
    others, cpus, before = _num(m.get("others_cpu_share")), _num(m.get("cpu_count")), _num(m.get("loadavg_before_1m"))
    if others is not None:
        return others > OTHERS_CPU_LIMIT
    return before is not None and cpus is not None and before > cpus


def machine_warning(labelled: Iterable[tuple[str, dict]]) -> Optional[str]:
    """One warning naming every load test (label, serving dict) that ran on a machine loaded by others."""
    loaded = [(label, s["machine_load"]) for label, s in labelled if machine_loaded(s)]
    if not loaded:
        return None
    others = [_num(m.get("others_cpu_share")) for _, m in loaded]
    others = [x for x in others if x is not None]
    loads = [x for _, m in loaded for x in (_num(m.get("loadavg_before_1m")), _num(m.get("loadavg_after_1m")))
             if x is not None]
    cpus = max((_num(m.get("cpu_count")) or 0 for _, m in loaded), default=0)
    what = ([f"they took up to {100 * max(others):.0f}% of the CPU"] if others else []) + \
        ([f"1-minute load average up to {max(loads):.1f} on {cpus:.0f} CPUs"] if loads else [])
    names = ", ".join(label for label, _ in loaded)
    return (f"serving: the machine was loaded by other processes during the load test{'s' if len(loaded) > 1 else ''} "
            f"of {names} ({'; '.join(what)}): those serving figures measure the machine as much as the format")

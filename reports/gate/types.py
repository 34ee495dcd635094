"""The gate's vocabulary (``reports/gate/check.py`` computes the checks): the thresholds and how a config
``gate:`` section overlays them, one ``Check`` per gated quantity, the ``GateResult`` of a run, and the
words and exit codes (the first word that applies wins: FAIL, NOT DISCRIMINATIVE, INCONCLUSIVE, PASS).
``reports.gate`` re-exports every name here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from kvbench.reports.stats import paired as stats
from kvbench.reports.gate.discriminative import LOWER_LIMIT_KINDS, Noise
from kvbench.reports.load import CellData

__all__ = ["GateError", "GateThresholds", "Check", "GateResult", "merge_gate_config", "EXIT_PASS", "EXIT_FAIL",
           "EXIT_ERROR", "EXIT_INCONCLUSIVE", "EXIT_NOT_DISCRIMINATIVE", "PASS", "FAIL", "INCONCLUSIVE",
           "NOT_DISCRIMINATIVE", "WORD_EXIT", "worst_word", "DEFAULT_MAX_DROP", "DEFAULT_MAX_RATE_INCREASE",
           "DEFAULT_MAX_ERROR_RATE", "DEFAULT_MAX_KL_MEAN", "DEFAULT_MAX_PPL_RATIO", "FIDELITY_KINDS", "FIDELITY_LIMITS"]

EXIT_PASS, EXIT_FAIL, EXIT_ERROR, EXIT_INCONCLUSIVE, EXIT_NOT_DISCRIMINATIVE = 0, 1, 2, 3, 4
PASS, FAIL, INCONCLUSIVE, NOT_DISCRIMINATIVE = "PASS", "FAIL", "INCONCLUSIVE", "NOT DISCRIMINATIVE"
WORD_EXIT = {PASS: EXIT_PASS, FAIL: EXIT_FAIL, INCONCLUSIVE: EXIT_INCONCLUSIVE, NOT_DISCRIMINATIVE: EXIT_NOT_DISCRIMINATIVE}
_WORD_ORDER = (FAIL, NOT_DISCRIMINATIVE, INCONCLUSIVE, PASS)  # the first that applies wins
_STATUS_WORD = {"fail": FAIL, "not discriminative": NOT_DISCRIMINATIVE, "inconclusive": INCONCLUSIVE, "pass": PASS}
DEFAULT_MAX_DROP = 0.05
DEFAULT_MAX_RATE_INCREASE = 0.05
DEFAULT_MAX_ERROR_RATE = 0.01
FIDELITY_KINDS = ("fidelity KL", "perplexity ratio", "top-1 agreement")
# Fidelity limits (docs/verdict.md "Default limits"): +2% perplexity is the "near-lossless" bar of KV-cache
# quantization work; the KL limit is the same bar in KL terms (on text the reference model itself would write,
# the expected rise in log-perplexity equals the KL, and log(1.02) = 0.0198).
DEFAULT_MAX_PPL_RATIO = 1.02
DEFAULT_MAX_KL_MEAN = 0.02
FIDELITY_LIMITS = ("max_kl_mean", "max_ppl_ratio", "min_top1_agreement")


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
    max_kl_mean: Optional[float] = DEFAULT_MAX_KL_MEAN  # None: reported, not gated (docs/verdict.md: the defaults)
    max_ppl_ratio: Optional[float] = DEFAULT_MAX_PPL_RATIO
    min_top1_agreement: Optional[float] = None
    fidelity_required: bool = False  # a fidelity limit was set explicitly: a candidate without fidelity records is an error
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
                        ("max_error_rate", self.max_error_rate), ("max_kl_mean", self.max_kl_mean),
                        ("max_ppl_ratio", self.max_ppl_ratio), ("min_top1_agreement", self.min_top1_agreement)]:
            if v is not None and (not isinstance(v, (int, float)) or math.isnan(v) or v < 0):
                raise GateError(f"{name} must be a number >= 0, got {v!r}")
        for name, flag, v in (("max_invalid_rate_increase", "--max-invalid-increase", self.max_invalid_rate_increase),
                              ("max_truncation_rate_increase", "--max-truncation-increase", self.max_truncation_rate_increase),
                              ("max_error_rate", "--max-error-rate", self.max_error_rate)):
            if v is not None and v > 1:
                raise GateError(f"{name} ({flag}) must be a fraction in [0, 1] (0.05 = 5 points), got {v!r}")
        if self.max_ppl_ratio is not None and self.max_ppl_ratio < 1:
            raise GateError(f"max_ppl_ratio is a ratio candidate / reference perplexity (1.02 = +2%), got {self.max_ppl_ratio!r}")
        if self.min_top1_agreement is not None and self.min_top1_agreement > 1:
            raise GateError(f"min_top1_agreement is a fraction in [0, 1] (0.9 = 90%), got {self.min_top1_agreement!r}")
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
    for k in ("confidence", "max_invalid_rate_increase", "max_truncation_rate_increase", "max_error_rate"):
        if gate.get(k) is not None:
            setattr(t, k, float(gate[k]))
    for k in FIDELITY_LIMITS:  # a number sets the limit (and requires fidelity records), false turns it off
        v = gate.get(k)
        if v is False or v == "off":
            setattr(t, k, None)
        elif v is not None:
            setattr(t, k, float(v))
            t.fidelity_required = True
    if gate.get("metrics"):
        t.metrics = [str(m) for m in gate["metrics"]]
    return t.validate()


@dataclass
class Check:
    candidate: CellData
    kind: str  # "accuracy" | "invalid rate" | "truncation rate" | "error rate" | one of FIDELITY_KINDS
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
    noises: list = field(default_factory=list)  # the A/A controls' Δs on this metric (baseline's, candidate's)
    status: str = ""  # "pass" | "fail" | "inconclusive" | "not discriminative" | "info" (set by ``classify``)
    reason: str = ""  # why the status is what it is, in words (not discriminative, error rate)
    floor_cause: str = ""  # accuracy and rates: what in the baseline's own records explains a floor, and the fix
    loss_shown_by: Optional[str] = None  # another candidate that provably lost on these items (reports/gate/check.py)

    @property
    def noise(self) -> Optional[Noise]:
        """The noise floor of this comparison: the larger A/A difference of the two cells' controls (either
        cell's own rerun moving the metric by that much is enough to make a difference that size noise)."""
        return max(self.noises, key=lambda n: abs(n.delta), default=None)

    @noise.setter
    def noise(self, value: Optional[Noise]) -> None:
        self.noises = [] if value is None else [value]

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
            if self.kind == "accuracy" or self.kind in LOWER_LIMIT_KINDS:
                return self.far_bound >= self.threshold
            return self.far_bound <= self.threshold
        if self.kind in FIDELITY_KINDS:
            return self.cand_value >= self.threshold if self.kind in LOWER_LIMIT_KINDS else self.cand_value <= self.threshold
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
    aa: Optional[CellData] = None  # the baseline's A/A control cell
    cand_aa: dict = field(default_factory=dict)  # candidate key -> its own A/A control cell, where the run has one

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

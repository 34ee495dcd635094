"""Suite protocol: items → requests → extraction and scoring → per-item records (docs/design.md §8, §10).

A generation suite is a small class: ``load_items`` (from ``--data-dir`` or the hub), ``build`` (a
``GenRequest``, completion or chat), ``score`` (extracted answer, primary ``correct``, named scores).
``suites/runner.py`` runs it against any ``Client`` concurrently and turns results into records.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from kvbench.core import GenRequest, GenResult, SamplingParams
from kvbench.core import check_record
from kvbench.core import REQUEST_KEYS, apply_request, describe_request, effective_options


class SuiteError(RuntimeError):
    """A suite cannot run (bad options, no data, every request failed); the message says why."""


class SuiteInputError(SuiteError):
    """Bad user input found only once the target is known (e.g. a length beyond its context); a usage error."""


@dataclass
class SuiteOptions:
    limit: Optional[int] = None  # first N items (in dataset order)
    repeats: int = 1  # K samples per item
    data_dir: Optional[str] = None
    concurrency: int = 8
    seed: int = 0  # base of the per-(item, repeat) seeds
    max_tokens: Optional[int] = None  # override the protocol's generation budget
    temperature: Optional[float] = None  # override the protocol's temperature
    progress: bool = True
    extra: dict = field(default_factory=dict)  # suite-specific knobs (e.g. fidelity reference)
    # request options (core/request_options.py: reasoning_effort, top_p, top_k, extra_body; a max_tokens or
    # temperature given here moves to the fields above), applied over the protocol's defaults
    request: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit <= 0:
            raise SuiteError(f"--limit must be positive, got {self.limit}")
        if self.repeats <= 0:
            raise SuiteError(f"--repeats must be positive, got {self.repeats}")
        if self.concurrency <= 0:
            raise SuiteError(f"--concurrency must be positive, got {self.concurrency}")
        self.request = dict(self.request or {})
        for key in ("max_tokens", "temperature"):
            value = self.request.pop(key, None)
            if value is None:
                continue
            if getattr(self, key) is not None and getattr(self, key) != value:
                raise SuiteError(f"{key} given twice ({getattr(self, key)} and request {key} {value})")
            setattr(self, key, value)
        unknown = [k for k in self.request if k not in REQUEST_KEYS]
        if unknown:
            raise SuiteError(f"unknown request option {unknown[0]!r}; allowed: {', '.join(REQUEST_KEYS)}")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise SuiteError(f"max_tokens must be positive, got {self.max_tokens}")


@dataclass
class Item:
    item_id: str
    target: str
    data: dict[str, Any]


@dataclass
class Scored:
    extracted: Optional[str]
    correct: Optional[bool]
    invalid: bool  # no answer could be extracted
    scores: dict[str, float]


@dataclass
class SuiteResult:
    suite: str
    records: list[dict]
    summary: dict
    source: str = ""  # where the data came from
    by_suite: Optional[dict[str, dict]] = None  # several record suites (lm-eval task groups)

    def summaries(self) -> dict[str, dict]:
        """Summary per record ``suite`` value (one entry except for lm-eval task groups)."""
        return self.by_suite if self.by_suite is not None else {self.suite: self.summary}


def item_seed(base: int, suite: str, item_id: str, repeat: int) -> int:
    """Seed of one (item, repeat): the same in every cell, independent of scheduling order."""
    digest = hashlib.sha256(f"{base}:{suite}:{item_id}:{repeat}".encode()).hexdigest()
    return int(digest[:8], 16) & 0x7FFFFFFF


def request_text(req: GenRequest) -> str:
    """The exact prompt as hashed into ``prompt_hash`` (chat messages as canonical JSON)."""
    if req.prompt is not None:
        return req.prompt
    return json.dumps(req.messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


class GenerationTask(ABC):
    """One generation suite.  Subclasses set ``name`` and implement the four methods."""

    name: str = ""
    default_params = SamplingParams(max_tokens=256, temperature=0.0)
    applies_limit: bool = False  # True: load_items applies --limit itself (the runner does not cut the list)

    @abstractmethod
    def load_items(self, opts: SuiteOptions) -> tuple[list[Item], str]:
        """(items in dataset order, data source description)."""

    def prepare(self, item: Item, repeat: int, seed: int) -> Item:
        """The item as seen by one repeat (e.g. GPQA's shuffled choices and target letter)."""
        return item

    @abstractmethod
    def build(self, item: Item, repeat: int, params: SamplingParams) -> GenRequest: ...

    @abstractmethod
    def score(self, item: Item, output: str) -> Scored: ...

    @abstractmethod
    def protocol(self, opts: SuiteOptions) -> str:
        """The pinned protocol string stored in every record."""

    def base_params(self, opts: SuiteOptions) -> SamplingParams:
        """The protocol's default sampling (a suite whose ``prompt_style`` changes them overrides this)."""
        return self.default_params

    def params(self, opts: SuiteOptions, seed: int) -> SamplingParams:
        """The protocol's defaults, then ``max_tokens`` / ``temperature`` and the request options of ``opts``."""
        p = replace(self.base_params(opts), seed=seed)
        if opts.max_tokens is not None:
            p = replace(p, max_tokens=opts.max_tokens)
        if opts.temperature is not None:
            p = replace(p, temperature=opts.temperature)
        return apply_request(p, opts.request)

    def record_fields(self, item: Item) -> dict:
        """Suite-specific top-level fields added to each record of ``item`` (the prepared item)."""
        return {}

    def extra_summary(self, records: list[dict], opts: SuiteOptions) -> dict:
        """Suite-specific aggregate metrics (pass@k ...) added to the summary."""
        return {}

    def describe_params(self, opts: SuiteOptions) -> str:
        p = self.params(opts, 0)
        samp = "greedy" if p.temperature == 0 else f"t{p.temperature:g}-p{p.top_p:g}" + (f"-k{p.top_k}" if p.top_k else "")
        return f"{samp}:max{p.max_tokens}{describe_request(p)}"


# A client over N data-parallel replicas (harness/replica_client.py) says so with ``replica_count``; the
# suites keep ``concurrency`` requests in flight per replica and name the replica in each record.
def replica_width(client) -> int:
    """How many replicas the client spreads requests over (1 for any other client)."""
    return max(1, int(getattr(client, "replica_count", 1) or 1))


def pinned(client):
    """A context in which the calling thread's requests go to one replica (a no-op for other clients)."""
    pin = getattr(client, "pinned", None)
    return pin() if callable(pin) else nullcontext()


def served_by(client) -> Optional[str]:
    """The replica that served the calling thread's last request (None for a client of one server)."""
    fn = getattr(client, "served_by", None)
    return fn() if callable(fn) else None


def is_error_record(rec: dict) -> bool:
    """Whether a record is a failed request (not an answer): it has an ``error`` message, or (records written
    before the ``error`` field) its finish_reason is ``error``."""
    return bool(rec.get("error")) or rec.get("finish_reason") == "error"


def make_record(
    suite: str,
    item: Item,
    repeat: int,
    seed: Optional[int],
    req: GenRequest,
    result: Optional[GenResult],
    scored: Optional[Scored],
    protocol: str,
    prompt_hash_fn,
    error: Optional[str] = None,
    error_kind: Optional[str] = None,
    retries: Optional[int] = None,
) -> dict:
    """One item record.  A failed request (``error`` set, or ``result`` None or with finish_reason ``error``)
    is no answer: ``correct`` and ``invalid`` are None, ``scores`` is empty, finish_reason is ``error`` and
    ``error`` / ``error_kind`` say what happened; an answered record has ``error`` and ``error_kind`` None.
    ``request_options`` is what the request was sent with (core/request_options.py), ``reasoning`` the
    reasoning text the server returned apart from the answer (never scored; None when none), ``retries`` the
    connection retries made (``retries`` given, else the result's)."""
    r = result
    failed = error is not None or r is None or r.finish_reason == "error"
    if failed:
        error = error or (r.error if r is not None else None) or "request failed"
        error_kind = error_kind or (getattr(r, "error_kind", None) if r is not None else None) or "other"
    elif scored is None:
        raise ValueError("make_record needs the scored answer of a successful request")
    return check_record({
        "suite": suite,
        "item_id": item.item_id,
        "repeat": repeat,
        "seed": seed,
        "prompt_hash": prompt_hash_fn(request_text(req)),
        "raw_output": (r.text or "") if r is not None else "",
        "extracted": None if failed else scored.extracted,
        "target": item.target,
        "correct": None if failed else scored.correct,
        "invalid": None if failed else scored.invalid,
        "finish_reason": "error" if failed else r.finish_reason,
        "prompt_tokens": int(r.prompt_tokens) if r is not None else 0,
        "output_tokens": int(r.output_tokens) if r is not None else 0,
        "latency_s": float(r.latency_s) if r is not None else 0.0,
        "scores": {} if failed else {k: float(v) for k, v in scored.scores.items()},
        "protocol": protocol,
        "error": error if failed else None,
        "error_kind": error_kind if failed else None,
        "request_options": effective_options(req),
        "reasoning": (getattr(r, "reasoning", None) or None) if r is not None else None,
        "retries": int(retries if retries is not None else (getattr(r, "retries", 0) or 0) if r is not None else 0),
    })


def _mean(values: list) -> Optional[float]:
    return sum(values) / len(values) if values else None


def summarize_records(records: list[dict]) -> dict:
    """Per-suite summary.  Failed requests (``is_error_record``) are counted apart, never as wrong answers:
    ``accuracy`` (mean of ``correct``), the mean of every score and the rates of invalid answers,
    truncations (finish_reason = length) and empty outputs are over the answered records only (None when
    none answered); ``n`` counts every record, ``answered`` the others, ``errors`` the failed ones,
    ``error_rate`` = errors / n and ``error_kinds`` = {kind: count}."""
    n = len(records)
    answered = [r for r in records if not is_error_record(r)]
    failed = [r for r in records if is_error_record(r)]
    kinds: dict[str, int] = {}
    for r in failed:
        kind = r.get("error_kind") or "other"
        kinds[kind] = kinds.get(kind, 0) + 1
    out: dict[str, Any] = {}
    judged = [r["correct"] for r in answered if r.get("correct") is not None]
    if judged:
        out["accuracy"] = sum(bool(c) for c in judged) / len(judged)
    keys: list[str] = []
    for r in answered:
        keys += [k for k in (r.get("scores") or {}) if k not in keys]
    for k in keys:
        vals = [r["scores"][k] for r in answered if k in (r.get("scores") or {}) and r["scores"][k] is not None]
        if vals:
            out[k] = sum(vals) / len(vals)
    out["n"] = n
    out["answered"] = len(answered)
    out["errors"] = len(failed)
    out["error_rate"] = len(failed) / n if n else None
    out["error_kinds"] = kinds
    out["invalid_rate"] = _mean([bool(r.get("invalid")) for r in answered])
    out["truncation_rate"] = _mean([r.get("finish_reason") == "length" for r in answered])
    out["empty_rate"] = _mean([not (r.get("raw_output") or "").strip() for r in answered])
    return out

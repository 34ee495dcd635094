"""The embedded engine's public interface (what the server, the harness and tests program against).

``kvbench.runtime.engine.Engine`` implements ``EngineProtocol``.  Requests are token ids; the engine's
``tokenizer`` turns text and chat messages into ids.  One background thread (``start()``) runs the
continuous-batching step loop; ``generate``/``score`` are blocking helpers that work with or without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Protocol, Sequence

from kvbench.core import SamplingParams

__all__ = [
    "SamplingParams",
    "StreamDelta",
    "RequestOutput",
    "EngineStats",
    "CapacityReport",
    "TokenizerProtocol",
    "EngineProtocol",
]


@dataclass
class StreamDelta:
    """New output of one request since the previous delta."""

    request_id: str
    token_ids: list[int]
    text: str  # decoded text delta (stop strings already cut)
    finish_reason: Optional[str] = None  # None while running; "stop" | "length" | "abort" | "error"
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[dict[int, float]]] = None
    error: Optional[str] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: Optional[list[float]] = None
    top_logprobs: Optional[list[dict[int, float]]] = None
    arrival_time: float = 0.0  # time.monotonic()
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_preemptions: int = 0


STEP_KINDS = ("prefill", "mixed", "decode")  # prefill steps, prefill steps carrying decode rows, decode steps


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    pages_used: int = 0
    pages_total: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0  # totals since start
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    # Triton compiles since the engine serves (each stalled the running requests); None where not watched (CPU)
    kernel_compiles: Optional[int] = None
    kernel_compile_s: Optional[float] = None
    # where the step loop's time went, per step kind (STEP_KINDS): steps run, wall seconds from scheduling to the
    # sampled tokens handed out (host work and the device's, which the read-back of the tokens waits for),
    # tokens forwarded; the time outside them is the loop waiting for work
    step_counts: dict = field(default_factory=dict)
    step_seconds: dict = field(default_factory=dict)
    step_tokens: dict = field(default_factory=dict)

    def count_step(self, kind: str, seconds: float, tokens: int) -> None:
        self.step_counts[kind] = self.step_counts.get(kind, 0) + 1
        self.step_seconds[kind] = self.step_seconds.get(kind, 0.0) + seconds
        self.step_tokens[kind] = self.step_tokens.get(kind, 0) + tokens

    @property
    def kv_usage(self) -> float:
        return self.pages_used / self.pages_total if self.pages_total else 0.0


@dataclass
class CapacityReport:
    kv_dtype: str
    page_size: int
    num_pages: int
    tokens: int
    bytes_per_token: float
    kv_bytes: int
    context_len: int
    max_concurrency: int
    extra: dict = field(default_factory=dict)

    def log_line(self) -> str:
        gib = self.kv_bytes / 2**30
        return (
            f"KV cache: {self.tokens} tokens ({self.extra.get('kv_layers') or self.kv_dtype}, {gib:.3f} GiB), "
            f"max concurrency {self.max_concurrency} at context {self.context_len}"
        )


class TokenizerProtocol(Protocol):
    eos_token_ids: Sequence[int]
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


class EngineProtocol(Protocol):
    model_id: str
    tokenizer: TokenizerProtocol
    max_model_len: int
    capacity: CapacityReport

    def start(self) -> None:
        """Start the background step loop (idempotent)."""

    def shutdown(self) -> None: ...

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: Optional[str] = None,
        on_delta: Optional[Callable[[StreamDelta], None]] = None,
    ) -> str:
        """Queue a request; ``on_delta`` is called from the engine thread for every new chunk and once
        with ``finish_reason`` set.  Raises ValueError (clear message) for prompts longer than the context,
        empty prompts, or max_tokens that cannot fit."""

    def add_score_request(self, request, request_id: Optional[str] = None,
                          on_delta: Optional[Callable[[StreamDelta], None]] = None) -> str:
        """Queue a teacher-forced scoring request (``kvbench.runtime.scoring.TokenScoreRequest``): a request
        kind of its own, whose rows are the continuation's log-probs.  Raises ValueError as ``add_request``
        does, and for a bad mode, an empty continuation or one that does not fit."""

    def abort(self, request_id: str) -> None:
        """Abort a queued or running request and free its pages (no-op when already finished)."""

    def stream(self, prompt_token_ids: list[int], params: SamplingParams) -> Iterator[StreamDelta]: ...

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Blocking batch generation through the scheduler (outputs in input order)."""

    def score(
        self, context_ids: list[int], continuation_ids: list[int], top_k: int = 0, full_distribution: bool = False,
        mode: str = "prefill", gather_ids=None,
    ):
        """Teacher-forced scoring -> kvbench.core.client.ScoreResult (continuation logprobs, greedy flags,
        optional top-k and full log-softmax rows, or with ``gather_ids`` ([T, k] ids) only the log-probs at
        those ids), computed through the paged cache in the configured format."""

    def stats(self) -> EngineStats: ...

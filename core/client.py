"""The one interface between a caller and a model: a ``Client`` and the request / result types.

A client is either the embedded engine in-process (``harness/engine_client.py``) or any
OpenAI-compatible server (``harness/openai_client.py``).  Suites, the fidelity task and the sweep runner
talk only to this protocol, so a cell never cares where its tokens come from.  The engine takes
``SamplingParams`` from here too (it is the vocabulary both sides share).

A client may also offer ``tokenizer()`` (optional, not part of the protocol): the target's tokenizer as a
``suites.prompt_tokenizer.PromptTokenizer``, for suites that build prompts of a given token length (ruler).

All calls are synchronous and thread-safe; callers run many at once from a thread pool (the embedded
engine batches concurrent calls through its continuous-batching scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Protocol, Sequence, runtime_checkable


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: Optional[int] = None  # number of top logprobs per generated token, None = off
    reasoning_effort: Optional[str] = None  # low | medium | high (chat requests; core/request_options.py)
    extra_body: Optional[dict] = None  # merged verbatim into an HTTP request's JSON body (HTTP targets only)


@dataclass
class GenRequest:
    """Exactly one of ``prompt`` (completion API, raw text) or ``messages`` (chat API) is set."""

    prompt: Optional[str] = None
    messages: Optional[list[dict]] = None
    params: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("GenRequest needs exactly one of prompt or messages")


# How a request failed (records' ``error_kind``): no answer in time, an HTTP status other than 200, no
# connection (refused, reset before a response), a response or stream cut off or malformed mid-way, else other.
ERROR_KINDS = ("timeout", "http", "connection", "stream", "other")


class RequestFailed(ConnectionError, RuntimeError):
    """One request failed before it produced a result; ``error_kind`` says how (one of ``ERROR_KINDS``).

    A ``ConnectionError`` (and a ``RuntimeError``) so that callers which let a failed request or an
    unreachable server stop them keep doing so."""

    def __init__(self, message: str, error_kind: str = "other", retries: int = 0):
        super().__init__(message)
        self.error_kind = error_kind if error_kind in ERROR_KINDS else "other"
        self.retries = int(retries)  # connection retries made before giving up


class TargetGone(RuntimeError):
    """The target can serve no request any more (every replica of a data-parallel target is out of rotation,
    harness/replica_client.py).  Unlike a failed request it is never recorded as one item's error: a suite
    stops, and so does its cell (recorded failed; ``--resume`` redoes it)."""


def classify_error(exc: BaseException) -> str:
    """The ``ERROR_KINDS`` entry of an exception raised by a client's ``generate``: its own ``error_kind``
    when it carries one, else by type (timeouts, httpx's transport and protocol errors, connection errors,
    undecodable JSON), else ``other``."""
    kind = getattr(exc, "error_kind", None)
    if kind in ERROR_KINDS:
        return kind
    names = {c.__name__ for c in type(exc).__mro__}
    if isinstance(exc, TimeoutError) or "TimeoutException" in names:
        return "timeout"
    if names & {"RemoteProtocolError", "ReadError", "DecodingError", "JSONDecodeError", "IncompleteRead"}:
        return "stream"
    if isinstance(exc, ConnectionError) or names & {"TransportError", "NetworkError"}:
        return "connection"
    if "HTTPStatusError" in names:
        return "http"
    return "other"


@dataclass
class GenResult:
    text: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int
    output_tokens: int
    latency_s: float
    ttft_s: Optional[float] = None
    token_ids: Optional[list[int]] = None
    logprobs: Optional[list[float]] = None  # logprob of each generated token, when asked for
    error: Optional[str] = None
    error_kind: str = "other"  # with finish_reason "error": one of ERROR_KINDS (read only for failed requests)
    reasoning: Optional[str] = None  # reasoning text the server returned apart from the answer (never scored)
    retries: int = 0  # connection retries before this result


@dataclass
class ScoreRequest:
    """Teacher-forced scoring: log-probs of ``continuation`` given ``context`` (raw text, no template)."""

    context: str
    continuation: str
    top_k: int = 0  # also return the top-k next-token distribution at each continuation position
    full_distribution: bool = False  # in-process clients may return full log-softmax rows
    # With full_distribution, what suffices instead of full [T, V] rows (an in-process client then keeps none):
    # the top ``full_top_k`` ids and log-probs per position (in top_ids / top_logprobs, wider than the API's 20),
    # and with ``gather_ids`` ([T, k] ids per position) the log-probs at those ids (``gathered_logprobs``).
    # Clients that do not know these fields return full rows as before.
    full_top_k: int = 0
    gather_ids: Optional[object] = None


@dataclass
class ScoreResult:
    token_ids: list[int]  # continuation token ids
    logprobs: list[float]  # log p(token_i | prefix) for each continuation token
    greedy: list[bool]  # whether each token was the argmax
    top_ids: Optional[list[list[int]]] = None
    top_logprobs: Optional[list[list[float]]] = None
    full_logprobs: Optional[object] = None  # torch.Tensor [n, vocab] float32 when asked and available
    gathered_logprobs: Optional[object] = None  # [n, k] log-probs at ScoreRequest.gather_ids, when asked

    @property
    def total_logprob(self) -> float:
        return float(sum(self.logprobs))

    @property
    def is_greedy(self) -> bool:
        return all(self.greedy)


@runtime_checkable
class Client(Protocol):
    model_id: str

    def generate(self, request: GenRequest) -> GenResult: ...

    def stream(self, request: GenRequest) -> Iterator[str]: ...

    def score(self, request: ScoreRequest) -> ScoreResult: ...

    def info(self) -> dict:
        """Target description for provenance: model, kv format, backends, capacity where known."""
        ...

    def close(self) -> None: ...

"""``EngineClient``: the ``Client`` protocol (core/client.py) over the embedded engine, in-process.

Completion requests tokenize the raw prompt (with the tokenizer's special tokens, e.g. BOS); chat
requests render the tokenizer's chat template.  Scoring tokenizes context and continuation separately
(context with special tokens, continuation without) so the continuation's token ids are exactly its own;
a request for full rows that says a top-k (``full_top_k``) or gathered ids (``gather_ids``) suffice gets
those, taken in the engine as rows are computed, and no [T, V] rows.
Thread-safe: the engine's step loop batches concurrent calls.

Request options (harness/request_options.py): ``reasoning_effort`` of a chat request becomes the chat
template's ``reasoning_effort`` variable, and only where the template uses one (e.g. gpt-oss's); ``extra_body``
has no meaning in-process (there is no request body).  ``check_request`` refuses both cases with a
``RequestOptionsError`` naming the option, before any request runs.
"""

from __future__ import annotations

import inspect
import time
from typing import Iterator, Optional

from kvbench.core import GenRequest, GenResult, ScoreRequest, ScoreResult
from kvbench.harness.request_options import RequestOptionsError
from kvbench.runtime import EngineConfig

__all__ = ["EngineClient", "sharing_client"]


class EngineClient:
    def __init__(self, config: Optional[EngineConfig] = None, engine=None):
        if engine is None:
            from kvbench.runtime import Engine

            engine = Engine(config or EngineConfig())
        self.engine = engine
        self.model_id: str = engine.model_id
        self.engine.start()

    # -------------------------------------------------------------------------------- helpers
    def check_request(self, request: GenRequest) -> None:
        """Raise ``RequestOptionsError`` for request options the embedded engine cannot honour."""
        p = request.params
        if p.extra_body:
            raise RequestOptionsError("extra_body applies to server and endpoint targets only (the embedded engine "
                                      f"has no HTTP request body); got keys {sorted(p.extra_body)}")
        if p.reasoning_effort and request.messages is not None:
            tok = self.engine.tokenizer
            template = getattr(tok, "chat_template", None)
            if not template or "reasoning_effort" not in str(template):
                raise RequestOptionsError(f"reasoning_effort {p.reasoning_effort!r}: the chat template of "
                                          f"{self.model_id} has no reasoning_effort variable")
            if not _takes_template_vars(tok):
                raise RequestOptionsError(f"reasoning_effort {p.reasoning_effort!r}: this engine's tokenizer "
                                          "renders no template variables")

    def _prompt_ids(self, req: GenRequest) -> list[int]:
        tok = self.engine.tokenizer
        if req.params.extra_body or req.params.reasoning_effort:
            self.check_request(req)
        if req.messages is not None:
            effort = req.params.reasoning_effort
            if effort:  # a template variable, as servers pass it for gpt-oss's template
                return list(tok.encode_chat(req.messages, add_generation_prompt=True, reasoning_effort=effort))
            return list(tok.encode_chat(req.messages, add_generation_prompt=True))
        return list(tok.encode(req.prompt, add_special_tokens=True))

    # ---------------------------------------------------------------------------------- Client
    def generate(self, request: GenRequest) -> GenResult:
        t0 = time.monotonic()
        ids = self._prompt_ids(request)
        try:
            (out,) = self.engine.generate([ids], request.params)
        except ValueError as e:
            return GenResult("", "error", len(ids), 0, time.monotonic() - t0, error=str(e))
        end = out.finish_time or time.monotonic()
        return GenResult(
            text=out.text,
            finish_reason=out.finish_reason,
            prompt_tokens=len(ids),
            output_tokens=len(out.token_ids),
            latency_s=end - t0,
            ttft_s=(out.first_token_time - t0) if out.first_token_time else None,
            token_ids=list(out.token_ids),
            logprobs=out.logprobs if request.params.logprobs is not None else None,
            error=None if out.finish_reason != "error" else "engine error",
        )

    def stream(self, request: GenRequest) -> Iterator[str]:
        ids = self._prompt_ids(request)
        for delta in self.engine.stream(ids, request.params):
            if delta.error:
                raise RuntimeError(delta.error)
            if delta.text:
                yield delta.text

    def score(self, request: ScoreRequest) -> ScoreResult:
        tok = self.engine.tokenizer
        ctx = list(tok.encode(request.context, add_special_tokens=True))
        cont = list(tok.encode(request.continuation, add_special_tokens=False))
        if not ctx:
            bos = getattr(tok, "bos_token_id", None)
            if bos is None:
                raise ValueError("score needs a non-empty context (the tokenizer has no BOS token to stand in)")
            ctx = [bos]
        from kvbench.runtime import MAX_SCORE_LOGPROBS

        gather = getattr(request, "gather_ids", None)
        full_top_k = int(getattr(request, "full_top_k", 0) or 0)
        if request.full_distribution and (full_top_k or gather is not None) and full_top_k <= MAX_SCORE_LOGPROBS:
            # what the caller needs from the full rows is taken in the engine, row by row: no [T, V] tensor
            k = max(request.top_k, full_top_k, 1)
            try:
                k = min(k, self.engine.parts.loaded.config.vocab_size)
            except AttributeError:  # an engine without a loaded model's config: k as asked
                pass
            return self.engine.score(ctx, cont, top_k=k, gather_ids=gather)
        return self.engine.score(ctx, cont, top_k=request.top_k, full_distribution=request.full_distribution)

    def tokenizer(self):
        """The engine's own tokenizer as a ``harness.prompt_tokenizer.PromptTokenizer``; its ``prompt_ids``
        is exactly what ``generate`` sends."""
        from kvbench.suites import HFPromptTokenizer

        return HFPromptTokenizer(self.engine.tokenizer, f"engine:{self.model_id}", prompt_ids=self._prompt_ids)

    def info(self) -> dict:
        return {"type": "embedded", **self.engine.info()}

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sharing_client(config: EngineConfig, other) -> EngineClient:
    """An ``EngineClient`` of ``config`` that reuses the model ``other`` (an open ``EngineClient``) has loaded
    when both would load the same weights (same model, seed, device and compute dtype): a fidelity reference
    next to its candidate then holds one copy of the weights, not two.  Otherwise it loads its own."""
    engine = getattr(other, "engine", None)
    loaded = getattr(getattr(engine, "parts", None), "loaded", None)
    if loaded is None or not _same_weights(config, getattr(engine, "config", None)):
        return EngineClient(config)
    from kvbench.runtime import Engine

    return EngineClient(engine=Engine(config, loaded=loaded))


def _same_weights(a: EngineConfig, b: Optional[EngineConfig]) -> bool:
    if not isinstance(b, EngineConfig) or a.model != b.model or a.seed != b.seed:
        return False
    from kvbench.runtime import engine_device, engine_dtype

    da, db = engine_device(a), engine_device(b)
    return da == db and engine_dtype(a, da) == engine_dtype(b, db)


def _takes_template_vars(tok) -> bool:
    """Whether ``tok.encode_chat`` passes keyword variables to its chat template."""
    try:
        params = inspect.signature(tok.encode_chat).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD or p.name == "reasoning_effort" for p in params)

"""``EngineClient``: the ``Client`` protocol (harness/client.py) over the embedded engine, in-process.

Completion requests tokenize the raw prompt (with the tokenizer's special tokens, e.g. BOS); chat
requests render the tokenizer's chat template.  Scoring tokenizes context and continuation separately
(context with special tokens, continuation without) so the continuation's token ids are exactly its own.
Thread-safe: the engine's step loop batches concurrent calls.
"""

from __future__ import annotations

import time
from typing import Iterator, Optional

from kvbench.harness.client import GenRequest, GenResult, ScoreRequest, ScoreResult
from kvbench.runtime.config import EngineConfig

__all__ = ["EngineClient"]


class EngineClient:
    def __init__(self, config: Optional[EngineConfig] = None, engine=None):
        if engine is None:
            from kvbench.runtime.engine import Engine

            engine = Engine(config or EngineConfig())
        self.engine = engine
        self.model_id: str = engine.model_id
        self.engine.start()

    # -------------------------------------------------------------------------------- helpers
    def _prompt_ids(self, req: GenRequest) -> list[int]:
        tok = self.engine.tokenizer
        if req.messages is not None:
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
        return self.engine.score(ctx, cont, top_k=request.top_k, full_distribution=request.full_distribution)

    def tokenizer(self):
        """The engine's own tokenizer as a ``harness.prompt_tokenizer.PromptTokenizer``; its ``prompt_ids``
        is exactly what ``generate`` sends."""
        from kvbench.harness.prompt_tokenizer import HFPromptTokenizer

        return HFPromptTokenizer(self.engine.tokenizer, f"engine:{self.model_id}", prompt_ids=self._prompt_ids)

    def info(self) -> dict:
        return {"type": "embedded", **self.engine.info()}

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

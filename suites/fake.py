"""A deterministic in-memory ``Client`` for tests of suites, stores and reports (no model, no torch).

Text is tokenized one character per token over a fixed 101-symbol alphabet.  The "model" is a bigram
table of random logits (``seed``) plus an optional perturbation (``noise``, ``noise_seed``) standing in for
a quantized KV cache, so fidelity metrics have known, controllable answers.  ``responder`` scripts the
text that ``generate`` returns (otherwise the bigram model decodes greedily or by seeded sampling).
"""

from __future__ import annotations

import string
import threading
from typing import Callable, Iterator, Optional

import numpy as np

from kvbench.core import GenRequest, GenResult, ScoreRequest, ScoreResult

ALPHABET = string.printable + "\x00"  # 100 printable symbols + an "unknown" symbol
VOCAB = len(ALPHABET)
_INDEX = {c: i for i, c in enumerate(ALPHABET)}


def tokenize(text: str) -> list[int]:
    return [_INDEX.get(c, VOCAB - 1) for c in text]


def detokenize(ids: list[int]) -> str:
    return "".join(ALPHABET[i] for i in ids)


class FakeClient:
    def __init__(
        self,
        seed: int = 0,
        noise: float = 0.0,
        noise_seed: int = 1,
        temperature_scale: float = 4.0,
        responder: Optional[Callable[[GenRequest], str]] = None,
        full_distribution: bool = True,
        model_id: str = "fake-bigram",
    ):
        rng = np.random.default_rng(seed)
        self.table = rng.standard_normal((VOCAB, VOCAB)) * temperature_scale
        if noise:
            self.table = self.table + np.random.default_rng(noise_seed).standard_normal((VOCAB, VOCAB)) * noise
        self.responder = responder
        self.full_distribution = full_distribution
        self.model_id = model_id
        self.calls = 0
        self._lock = threading.Lock()
        self.closed = False

    # -- the "model"
    def logprobs(self, prev: int) -> np.ndarray:
        row = self.table[prev]
        return row - (np.log(np.exp(row - row.max()).sum()) + row.max())

    # -- Client protocol
    def generate(self, request: GenRequest) -> GenResult:
        with self._lock:
            self.calls += 1
        prompt = request.prompt if request.prompt is not None else "\n".join(m["content"] for m in request.messages or [])
        p = request.params
        if self.responder is not None:
            text = self.responder(request)
            ids = tokenize(text)[: p.max_tokens]
            text = detokenize(ids)
        else:
            rng = np.random.default_rng(p.seed)
            prev, ids = (tokenize(prompt) or [0])[-1], []
            for _ in range(p.max_tokens):
                lp = self.logprobs(prev)
                prev = int(np.argmax(lp)) if p.temperature == 0 else int(rng.choice(VOCAB, p=np.exp(lp / p.temperature) / np.exp(lp / p.temperature).sum()))
                ids.append(prev)
            text = detokenize(ids)
        finish = "length" if len(ids) >= p.max_tokens else "stop"
        for s in p.stop:
            if s and s in text:
                text, finish = text[: text.index(s)], "stop"
                ids = tokenize(text)
        return GenResult(text, finish, len(tokenize(prompt)), len(ids), 0.001, 0.0005, token_ids=ids)

    def stream(self, request: GenRequest) -> Iterator[str]:
        yield self.generate(request).text

    def score(self, request: ScoreRequest) -> ScoreResult:
        ctx, cont = tokenize(request.context), tokenize(request.continuation)
        if not cont:
            raise ValueError("empty continuation")
        seq = (ctx or [0]) + cont
        start = len(seq) - len(cont)
        rows = np.stack([self.logprobs(seq[i - 1]) for i in range(start, len(seq))])
        lps = [float(rows[t, tok]) for t, tok in enumerate(cont)]
        greedy = [int(np.argmax(rows[t])) == tok for t, tok in enumerate(cont)]
        top_ids = top_lp = None
        if request.top_k:
            k = min(request.top_k, VOCAB)
            order = np.argsort(-rows, axis=-1, kind="stable")[:, :k]
            top_ids = order.tolist()
            top_lp = np.take_along_axis(rows, order, axis=-1).tolist()
        full = rows.astype(np.float32) if (request.full_distribution and self.full_distribution) else None
        return ScoreResult(cont, lps, greedy, top_ids, top_lp, full)

    def info(self) -> dict:
        return {"model": self.model_id, "kind": "fake"}

    def close(self) -> None:
        self.closed = True

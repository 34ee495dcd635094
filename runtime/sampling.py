"""Token sampling for a batch of rows with per-request parameters.

Greedy when ``temperature == 0``; otherwise temperature, then top-k, then top-p (nucleus) filtering and a
draw from the request's own ``torch.Generator`` (seeded per request, so a seed reproduces its tokens
regardless of what else is in the batch).  ``min_tokens`` masks EOS / stop ids until reached.
Log-probs are those of the model's raw distribution (log-softmax of the logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvbench.core import SamplingParams
from kvbench.runtime.attention.base import to_device

__all__ = ["DeviceSample", "SampleRow", "SampleOutput", "sample", "sample_on_device", "validate_params"]


MAX_REQUEST_LOGPROBS = 20  # per generated token, as the OpenAI API allows
MAX_SCORE_LOGPROBS = 1024  # teacher-forced scoring (fidelity) may ask for a wider top-k


def validate_params(p: SamplingParams, max_logprobs: int = MAX_REQUEST_LOGPROBS) -> None:
    if p.max_tokens is None or int(p.max_tokens) < 1:
        raise ValueError(f"max_tokens must be >= 1, got {p.max_tokens}")
    if p.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {p.top_k}")
    if p.min_tokens < 0 or p.min_tokens > p.max_tokens:
        raise ValueError(f"min_tokens must be in [0, max_tokens], got {p.min_tokens}")
    if p.logprobs is not None and not 0 <= p.logprobs <= max_logprobs:
        raise ValueError(f"logprobs must be in [0, {max_logprobs}], got {p.logprobs}")


@dataclass
class SampleRow:
    params: SamplingParams
    generator: Optional[torch.Generator]  # None for greedy
    banned: Sequence[int] = ()  # ids masked for this step (EOS/stop ids before min_tokens)
    forced: Optional[int] = None  # teacher forcing: take this token, report its logprob


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]  # logprob of each chosen token
    top_ids: list[Optional[list[int]]]
    top_logprobs: list[Optional[list[float]]]
    greedy: list[bool]  # chosen token == argmax of the raw distribution
    logp: "torch.Tensor | None" = None  # [N, V] log-softmax of the raw logits


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = logits / max(p.temperature, 1e-6)
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sx, si = torch.sort(x, descending=True)
        probs = torch.softmax(sx, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = cum - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, si, drop), float("-inf"))
    return x


@dataclass
class DeviceSample:
    """``sample_on_device``'s result, still on the device: ``packed`` ``[N, 3]`` float64 (each row's token, its
    log-prob, 1.0 where it is the argmax; float64 holds every id and float32 log-prob exactly), ``tokens`` ``[N]``
    (the next step's fed ids), the top log-probs per distinct ``top_n`` as (row indices, ``[M, 2k]``: the ids then
    their log-probs), and the log-softmax ``logp``.  ``host`` is what ``fetch`` reads: the same tensors, or their
    pinned host copies once ``to_host`` queued them."""

    packed: torch.Tensor
    tokens: torch.Tensor
    tops: list
    logp: torch.Tensor
    host: Optional[list] = None

    def to_host(self) -> None:
        """Queue the copies to pinned host memory (a CUDA device); ``fetch`` after the stream passed them."""
        self.host = []
        for t in [self.packed] + [v for _, v in self.tops]:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            self.host.append(h)

    def fetch(self) -> SampleOutput:
        """The tokens and log-probs as lists (waits for the device unless ``to_host``'s copies are done)."""
        host = self.host or [self.packed] + [v for _, v in self.tops]
        rows = host[0].tolist()
        n = len(rows)
        out = SampleOutput([int(r[0]) for r in rows], [r[1] for r in rows], [None] * n, [None] * n,
                           [r[2] == 1.0 for r in rows], self.logp)
        for (idx, _), h in zip(self.tops, host[1:]):
            for i, r in zip(idx, h.tolist()):
                k = len(r) // 2
                out.top_ids[i], out.top_logprobs[i] = [int(x) for x in r[:k]], r[k:]
        return out


def sample_on_device(logits: torch.Tensor, rows: Sequence[SampleRow], top_n: Sequence[int] = ()) -> DeviceSample:
    """Sample ``rows`` of ``logits`` (float32 ``[N, V]``) without the host waiting for the device: the argmax of
    every row with its log-prob; rows that draw (temperature > 0), mask ids (``banned``) or are forced are
    handled one by one, on the device (a draw uses the row's own generator there, as ``sample`` always did), and
    then the chosen tokens' log-probs come in one gather; one top-k per distinct ``top_n``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best, best_at = logp.max(dim=-1)
    special = [(i, r) for i, r in enumerate(rows) if r.forced is not None or r.banned or r.params.temperature != 0]
    toks, lp = best_at, best
    if special:
        toks = best_at.clone()
        for i, r in special:
            if r.forced is not None:
                toks[i] = int(r.forced)
                continue
            row = logits[i].float()
            if r.banned:
                row = row.index_fill(0, to_device(list(r.banned), torch.int64, row.device), float("-inf"))
            if r.params.temperature == 0:
                toks[i] = row.argmax()
            else:
                toks[i] = torch.multinomial(torch.softmax(_filter(row, r.params), dim=-1), 1, generator=r.generator)[0]
        lp = logp.gather(1, toks[:, None]).squeeze(1)
    packed = torch.stack((toks.double(), lp.double(), (toks == best_at).double()), dim=1)
    by_n: dict[int, list[int]] = {}
    for i in range(len(rows)):
        k = top_n[i] if i < len(top_n) else 0
        if k:
            by_n.setdefault(k, []).append(i)
    tops = []
    for k, idx in by_n.items():
        sel = logp if len(idx) == len(rows) else logp[to_device(idx, torch.int64, logp.device)]
        v, ids = torch.topk(sel, k, dim=-1)
        tops.append((idx, torch.cat((ids.double(), v.double()), dim=1)))
    return DeviceSample(packed, toks, tops, logp)


def sample(logits: torch.Tensor, rows: Sequence[SampleRow], top_n: Sequence[int] = ()) -> SampleOutput:
    """``logits`` float32 ``[N, V]``; ``top_n[i]`` = how many top logprobs row i wants (0 = none).  The host waits
    for the device once per call (``sample_on_device``, then one copy of every row's token and log-prob, and one
    per distinct ``top_n``)."""
    if not len(rows):
        return SampleOutput([], [], [], [], [], torch.log_softmax(logits.float(), dim=-1))
    return sample_on_device(logits, rows, top_n).fetch()

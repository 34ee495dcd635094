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

__all__ = ["SampleRow", "SampleOutput", "sample", "validate_params"]


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


def sample(logits: torch.Tensor, rows: Sequence[SampleRow], top_n: Sequence[int] = ()) -> SampleOutput:
    """``logits`` float32 ``[N, V]``; ``top_n[i]`` = how many top logprobs row i wants (0 = none).

    The host waits on the device a fixed number of times per call, not once per row: the argmax of every row
    with its log-prob (all a step of greedy rows needs), then, where a row took another token, the chosen tokens'
    log-probs in one gather, then one top-k per distinct ``top_n``.  Only rows that
    draw (temperature > 0) or mask ids (``banned``) are handled one by one."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best, best_at = logp.max(dim=-1)
    # one copy to the host for both (float64 holds every id and every float32 log-prob exactly)
    host = torch.stack((best_at.double(), best.double())).tolist() if logp.shape[0] else [[], []]
    argmax, best_lp = [int(a) for a in host[0]], host[1]
    n = len(rows)
    toks = list(argmax)
    for i, r in enumerate(rows):
        if r.forced is not None:
            toks[i] = int(r.forced)
        elif r.banned or r.params.temperature != 0:
            row = logits[i].float()
            if r.banned:
                row = row.clone()
                row[list(r.banned)] = float("-inf")
            if r.params.temperature == 0:
                toks[i] = int(row.argmax())
            else:
                probs = torch.softmax(_filter(row, r.params), dim=-1)
                toks[i] = int(torch.multinomial(probs, 1, generator=r.generator))
    out = SampleOutput(toks, [], [None] * n, [None] * n, [t == a for t, a in zip(toks, argmax)], logp)
    if all(out.greedy):  # every row took its argmax (greedy rows, and draws that landed there): no gather
        out.logprobs = list(best_lp)
    elif n:
        chosen = torch.tensor(toks, dtype=torch.int64).to(logp.device, non_blocking=True)
        out.logprobs = logp.gather(1, chosen[:, None]).squeeze(1).tolist()
    by_n: dict[int, list[int]] = {}
    for i in range(n):
        k = top_n[i] if i < len(top_n) else 0
        if k:
            by_n.setdefault(k, []).append(i)
    for k, idx in by_n.items():
        sel = logp if len(idx) == n else logp[torch.tensor(idx, dtype=torch.int64).to(logp.device)]
        v, ids = torch.topk(sel, k, dim=-1)
        for i, vi, ii in zip(idx, v.tolist(), ids.tolist()):
            out.top_logprobs[i], out.top_ids[i] = vi, ii
    return out

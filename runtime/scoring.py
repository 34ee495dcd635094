"""Teacher-forced scoring as a request kind of the engine (``Engine.add_score_request`` / ``Engine.score``).

A ``TokenScoreRequest`` asks for the log-probs of ``continuation_ids`` after ``context_ids`` (token ids; the
text-level ``kvbench.core.client.ScoreRequest`` is what clients send).  The engine turns it into a
``Sequence`` of kind ``SeqKind.SCORE_PREFILL`` (``mode="prefill"``: the continuation rides in the prompt
after ``score_from`` and runs as prefill chunks with decode semantics) or ``SeqKind.SCORE_DECODE``
(``mode="decode"``: one decode step per continuation token), with a ``ScoreState`` holding the forced
tokens and what the request keeps of each scored row (full log-softmax rows, or the values at gather ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from kvbench.core import SamplingParams, ScoreResult
from kvbench.runtime.scheduler import SeqKind

if TYPE_CHECKING:
    from kvbench.runtime.engine_api import RequestOutput
    from kvbench.runtime.scheduler import Sequence as Seq

__all__ = ["SCORE_MODES", "TokenScoreRequest", "ScoreState", "score_result"]

SCORE_MODES = ("prefill", "decode")


@dataclass(frozen=True)
class TokenScoreRequest:
    """Teacher-forced log-probs of ``continuation_ids`` after ``context_ids`` (see ``Engine.score``).
    ``top_k`` (up to ``MAX_SCORE_LOGPROBS``) is taken per row as rows are sampled; ``full_distribution`` keeps
    every row's log-softmax ([T, V] float32); ``gather_ids`` ([T, k] ids) keeps only the log-probs at those
    ids; ``mode``: one of ``SCORE_MODES``."""

    context_ids: Sequence[int]
    continuation_ids: Sequence[int]
    top_k: int = 0
    full_distribution: bool = False
    mode: str = "prefill"
    gather_ids: Any = None

    @property
    def kind(self) -> SeqKind:
        return SeqKind.SCORE_PREFILL if self.mode == "prefill" else SeqKind.SCORE_DECODE

    def check(self, max_model_len: int) -> None:
        """ValueError for a mode, continuation or length the engine cannot score (the prompt's own checks
        are the engine's)."""
        if self.mode not in SCORE_MODES:
            raise ValueError(f"score mode must be one of {', '.join(SCORE_MODES)}, got {self.mode!r}")
        if not self.continuation_ids:
            raise ValueError("score needs a non-empty continuation")
        if len(self.context_ids) + len(self.continuation_ids) - 1 > max_model_len:
            raise ValueError(f"context + continuation exceed the context length {max_model_len}")

    def sampling_params(self) -> SamplingParams:
        """Greedy, one row per continuation token, the top-k asked for."""
        return SamplingParams(max_tokens=len(self.continuation_ids), temperature=0.0, ignore_eos=True,
                              logprobs=self.top_k or None)

    def state(self, vocab: int) -> "ScoreState":
        """The per-sequence scoring state (row buffers allocated up front)."""
        forced = list(self.continuation_ids)
        st = ScoreState(forced)
        if self.full_distribution:
            st.full_rows = torch.empty(len(forced), vocab, dtype=torch.float32)
        if self.gather_ids is not None:
            st.gather = gather_index(self.gather_ids, len(forced), vocab)
            st.gathered = torch.empty(st.gather.shape, dtype=torch.float32)
        return st


@dataclass
class ScoreState:
    """A scoring sequence's forced tokens and the rows it keeps (filled row by row as they are scored)."""

    forced: list[int]
    full_rows: Optional[torch.Tensor] = None  # [T, V] float32 log-softmax rows, when asked
    gather: Optional[torch.Tensor] = None  # [T, k] int64 ids whose log-probs to keep
    gathered: Optional[torch.Tensor] = None  # [T, k] float32 log-probs at ``gather``

    def row_index(self, seq: "Seq", position: int) -> int:
        """The continuation token that the sampled row at ``position`` of ``seq`` predicts."""
        if seq.kind is SeqKind.SCORE_PREFILL:  # the row at position p predicts token p - score_from + 1
            return position - seq.score_from + 1
        return len(seq.output_ids)

    def keep_row(self, t: int, logp_row: torch.Tensor) -> None:
        """Row ``t``'s full log-softmax and/or its values at the gather ids, copied out (a view would keep the
        whole [rows, V] chunk it came from alive)."""
        if self.full_rows is not None:
            self.full_rows[t].copy_(logp_row)
        if self.gather is not None:
            self.gathered[t] = logp_row.index_select(0, self.gather[t].to(logp_row.device)).float().cpu()


def gather_index(ids, rows: int, vocab: int) -> torch.Tensor:
    """``ids`` ([T, k] token ids per scored position) as a CPU int64 tensor, checked against the request."""
    t = torch.as_tensor(ids, dtype=torch.int64)
    if t.dim() != 2 or t.shape[0] != rows:
        raise ValueError(f"gather_ids must be [{rows}, k] (one row per continuation token), got {list(t.shape)}")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise ValueError(f"gather_ids must be in [0, {vocab})")
    return t


def score_result(req: TokenScoreRequest, out: "RequestOutput", seq: "Seq") -> ScoreResult:
    """The ``ScoreResult`` of a finished scoring sequence (RuntimeError when it did not finish normally)."""
    if out.finish_reason not in ("length", "stop"):
        raise RuntimeError(f"scoring failed: {out.finish_reason}")
    st, sc = seq.state, seq.scoring
    return ScoreResult(
        token_ids=list(req.continuation_ids),
        logprobs=list(out.logprobs or []),
        greedy=list(st["greedy"]),
        top_ids=st["top_ids"] if req.top_k else None,
        top_logprobs=st["top_lps"] if req.top_k else None,
        full_logprobs=sc.full_rows if req.full_distribution else None,
        gathered_logprobs=sc.gathered if req.gather_ids is not None else None,
    )

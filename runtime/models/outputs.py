"""Per-request output bookkeeping: appending sampled tokens, stop ids / stop strings / length checks,
incremental detokenization with stop-string hold-back, stream deltas and the final RequestOutput.

Scoring sequences (``Sequence.scoring``, ``runtime/scoring.py``) report their forced tokens; those of kind
``SeqKind.SCORE_PREFILL`` keep their continuation inside the prompt after ``score_from`` (the scheduler feeds
it), so their scored tokens are recorded with ``record_scored`` and never appended to ``output_ids``;
``request_output`` reports them as the context plus the scored tokens."""

from __future__ import annotations

from typing import Optional

from kvbench.runtime.engine_api import RequestOutput, StreamDelta
from kvbench.runtime.scheduler import SeqKind, Sequence
from kvbench.core import IncrementalDetokenizer

__all__ = ["OutputProcessor"]


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos = set(int(i) for i in getattr(tokenizer, "eos_token_ids", []) or [])
        getattr(tokenizer, "byte_pieces", None)  # built once here (~0.1 s), not on the first token

    def init(self, seq: Sequence) -> None:
        p = seq.params
        st = seq.state
        st["detok"] = IncrementalDetokenizer(self.tokenizer, seq.prompt_ids[-6:])
        st["stops"] = [s for s in (p.stop or ()) if s]
        st["holdback"] = max((len(s) for s in st["stops"]), default=1) - 1
        st["emitted"] = 0
        st["text"] = None  # final text once finished
        st["logprobs"], st["top_ids"], st["top_lps"], st["greedy"] = [], [], [], []

    def _find_stop(self, seq: Sequence, text: str) -> Optional[int]:
        st = seq.state
        start = max(0, st["emitted"] - st["holdback"] - 1)
        hits = [i for i in (text.find(s, start) for s in st["stops"]) if i >= 0]
        return min(hits) if hits else None

    def append(self, seq: Sequence, tok: int, lp: float, top_ids, top_lps, greedy: bool) -> tuple[Optional[str], StreamDelta]:
        """``record`` then ``emit``: one sampled token, its finish reason (or None) and its stream delta."""
        return self.emit(seq, tok, lp, top_ids, top_lps, self.record(seq, tok, lp, top_ids, top_lps, greedy))

    def record(self, seq: Sequence, tok: int, lp: float, top_ids, top_lps, greedy: bool) -> Optional[str]:
        """Append a sampled token and its log-probs; the reason it ends the sequence, decided by token ids and
        counts alone: "stop" (a stop id or EOS once ``min_tokens`` are out), "length" (``max_tokens`` or the
        context; a scoring sequence once its continuation is through), else None.  Stop strings need the text:
        ``emit`` finds them."""
        p, st = seq.params, seq.state
        seq.output_ids.append(tok)
        st["logprobs"].append(lp)
        st["top_ids"].append(top_ids)
        st["top_lps"].append(top_lps)
        st["greedy"].append(greedy)
        n = len(seq.output_ids)
        if seq.scoring is not None:
            return "length" if n >= len(seq.scoring.forced) else None
        if n >= p.min_tokens and (tok in self.eos and not p.ignore_eos or tok in p.stop_token_ids):
            return "stop"
        return "length" if n >= st["max_new"] else None

    def emit(self, seq: Sequence, tok: int, lp: float, top_ids, top_lps, reason: Optional[str]) -> tuple[Optional[str], StreamDelta]:
        """The text side of a token ``record`` kept (``reason`` is what it returned): detokenization, stop strings
        (which may end the sequence: "stop") and the stream delta.  Returns the final reason and the delta."""
        p, st = seq.params, seq.state
        detok: IncrementalDetokenizer = st["detok"]
        if seq.scoring is not None:
            return reason, self._delta(seq, tok, lp, top_ids, top_lps, "")
        if reason == "stop":  # a stop id: its own text is not part of the output
            final = detok.text + detok.flush()
        else:
            detok.add(tok)
            final = None
            if reason == "length":
                detok.flush()
            # like stop ids, stop strings only count once min_tokens are out
            cut = self._find_stop(seq, detok.text) if st["stops"] and len(seq.output_ids) >= p.min_tokens else None
            if cut is not None:
                reason, final = "stop", detok.text[:cut]
            elif reason is not None:
                final = detok.text
        if reason is not None:
            upto = final
            st["text"] = final
        else:
            upto = detok.text[: len(detok.text) - st["holdback"]] if st["holdback"] else detok.text
        text = upto[st["emitted"]:] if len(upto) > st["emitted"] else ""
        st["emitted"] = max(st["emitted"], len(upto))
        return reason, self._delta(seq, tok, lp, top_ids, top_lps, text)

    def record_scored(self, seq: Sequence, tok: int, lp: float, top_ids, top_lps, greedy: bool) -> Optional[str]:
        """One teacher-forced row of a prefill-scored sequence; "length" once every continuation token is
        scored."""
        st = seq.state
        st["logprobs"].append(lp)
        st["top_ids"].append(top_ids)
        st["top_lps"].append(top_lps)
        st["greedy"].append(greedy)
        return "length" if len(st["logprobs"]) >= len(seq.scoring.forced) else None

    def _delta(self, seq: Sequence, tok, lp, top_ids, top_lps, text: str) -> StreamDelta:
        want = seq.params.logprobs is not None
        return StreamDelta(
            request_id=seq.request_id,
            token_ids=[tok],
            text=text,
            logprobs=[lp] if want else None,
            top_logprobs=[dict(zip(top_ids or [], top_lps or []))] if want else None,
        )

    def final_delta(self, seq: Sequence, reason: str, last: Optional[StreamDelta], error: Optional[str]) -> StreamDelta:
        st = seq.state
        if st.get("text") is None:
            st["text"] = st["detok"].text[: st["emitted"]]
        d = last or StreamDelta(request_id=seq.request_id, token_ids=[], text="")
        d.finish_reason = reason
        d.error = error
        return d

    def request_output(self, seq: Sequence, d: StreamDelta) -> RequestOutput:
        st = seq.state
        want = seq.params.logprobs is not None or seq.scoring is not None
        tops = None
        if seq.params.logprobs:
            tops = [dict(zip(i or [], v or [])) for i, v in zip(st["top_ids"], st["top_lps"])]
        if seq.kind is SeqKind.SCORE_PREFILL:  # the continuation rides in the prompt; report it as the output
            prompt, toks = seq.prompt_ids[: seq.score_from], seq.scoring.forced[: len(st["logprobs"])]
        else:
            prompt, toks = seq.prompt_ids, seq.output_ids
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=list(prompt),
            token_ids=list(toks),
            text=st.get("text") or "",
            finish_reason=d.finish_reason or "error",
            logprobs=list(st["logprobs"]) if want else None,
            top_logprobs=tops,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
            num_preemptions=seq.num_preemptions,
        )

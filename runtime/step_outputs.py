"""What the engine's step thread does with a step's sampled rows (``Engine.step``).

**Steps launched ahead** (``EngineConfig.overlap_schedule``, on by default; ``launch`` / ``resolve``).  A step whose
sampled rows are all plain greedy rows (temperature 0, no log-prob list, ``min_tokens`` out, not scoring) is
sampled on the device and left in flight: its tokens go to ``runner.fed`` on the device and, by an asynchronous
copy, to the host.  Each row's sequence gets a placeholder ``-(j + 1)`` (its row ``j``) as its last token, unless
this row is its last by length, so the scheduler plans the next step with the right counts, and that step's inputs
take the placeholder rows' ids from ``fed`` (``StepInputs.feed``; CUDA graphs gather them, ``runtime/graphs.py``).
So the next step is scheduled and launched before the host waits for this one's tokens: the device runs step N+1
while the host records step N.  Every other step is sampled at once (``sample``), as before.  A stop id is then
seen one step late: the sequence was scheduled into the step in flight, whose row for it is dropped.  The device
writes that row's K/V into pages the sequence just freed, before any later step can use them (one stream).

Recording a step's rows is in two parts:

1. **At once**, when the step's tokens reach the host: each row's token, log-prob and top log-probs are recorded on
   its sequence (``OutputProcessor.record``), and a sequence that ended by a stop id, ``max_tokens`` or the
   context leaves the scheduler (its pages are freed, it is not scheduled again).  This is all the next step's
   scheduling needs.
2. **Deferred** to the next step, after that step's device work is launched: detokenization, stop strings, the
   stream deltas and the ``on_delta`` callbacks (``OutputProcessor.emit``), so the host does them while the
   device computes instead of between two steps.  A stop *string* is only found here, so its sequence may have
   been scheduled into the step in flight: that row's token is dropped (the sequence is finished when it is
   sampled), which costs one wasted row and changes no output.  When there is no next step, the deferred rows are
   emitted before the step thread waits.

Scoring rows (``Sequence.scoring``) are handled at once in full: their forced tokens decide nothing the stream
shows, and their row bookkeeping (``ScoreState.row_index``) counts the rows already recorded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from kvbench.runtime.sampling import SampleRow, sample
from kvbench.runtime.scheduler import SeqKind, SeqStatus, Sequence as Seq

if TYPE_CHECKING:
    from kvbench.runtime.engine import Engine

__all__ = ["StepOutputs"]

log = logging.getLogger("kvbench.runtime")


@dataclass
class InFlight:
    """A step whose greedy tokens are on their way to the host: each sampled row's sequence, and the host copy of
    ``[token, log-prob]`` per row (float64, exact for both) with the event that marks it done."""

    seqs: list
    host: torch.Tensor
    event: Optional["torch.cuda.Event"]
    step: tuple  # (kind, launch time, tokens) for the step-time counters (``StepOutputs.done``)
    ended: Optional[float] = None  # a device that computes as it is called (CPU): when the step's work ended


def _plain(seq: Seq) -> bool:
    """A row whose token is its argmax and that asks for nothing but that token's log-prob."""
    p = seq.params
    return seq.scoring is None and p.temperature == 0 and not p.logprobs and len(seq.output_ids) >= p.min_tokens


class StepOutputs:
    """The sampled rows of an engine's steps: recorded at once, emitted one step later (module doc)."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.pending: list[tuple] = []  # (seq, token, logprob, top ids, top logprobs, reason) not yet emitted
        self.inflight: Optional[InFlight] = None  # a step launched ahead, its tokens not yet on the host
        self.last_done = 0.0  # perf_counter() when the last step was done (``done``)

    def done(self, kind: str, launched: float, tokens: int, ended: Optional[float] = None) -> None:
        """Count a step in the engine's step-time counters when its tokens are on the host: its time is from its
        launch, or from the step before it being done if that was later (steps launched ahead overlap), to now —
        so under load the times add up to the wall time the device was busy, each step's to about its device time.
        A step that samples no row (a prompt's middle chunk) is done once launched; its device time falls to the
        step done after it.  ``ended``: when the step's work ended, where that is known before it is recorded (a CPU
        step ends before the next one starts)."""
        now = time.perf_counter() if ended is None else ended
        self.engine._stats.count_step(kind, now - max(launched, self.last_done), tokens)
        self.last_done = now

    def sample(self, batch, out, a: int, b: int) -> None:
        """Sample (or, for scoring, force) rows ``a:b`` of a step's output and record them on their sequences."""
        e = self.engine
        logits = e.runner.model.logits(out.hidden[a:b])
        rows, top_n = [], []
        for j in range(a, b):
            seq = batch.seqs[out.seq_idx[j]]
            p, sc, st = seq.params, seq.scoring, seq.state
            if sc is None and len(seq.output_ids) >= p.min_tokens:
                row = st.get("row")
                if row is None:  # the same row every step once min_tokens are out
                    row = st["row"] = SampleRow(p, st.get("generator"))
                rows.append(row)
            else:
                banned = ()
                if sc is None:
                    banned = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(e.tokenizer.eos_token_ids))
                tok = None if sc is None else sc.forced[sc.row_index(seq, out.positions[j])]
                rows.append(SampleRow(p, st.get("generator"), banned, tok))
            top_n.append(p.logprobs or 0)
        res = sample(logits, rows, top_n)
        now = time.monotonic()
        stats, outp, pending = e._stats, e.out, self.pending
        for jj, j in enumerate(range(a, b)):
            seq = batch.seqs[out.seq_idx[j]]
            if seq.status == SeqStatus.FINISHED:
                continue  # ended after this step was scheduled (a stop string, an abort): the row is dropped
            if seq.first_token_time is None:
                seq.first_token_time = now
            sc = seq.scoring
            if sc is not None:
                self._scored(seq, sc, res, jj, out.positions[j])
                continue
            stats.generation_tokens += 1
            tok, lp, ti, tl = res.token_ids[jj], res.logprobs[jj], res.top_ids[jj], res.top_logprobs[jj]
            reason = outp.record(seq, tok, lp, ti, tl, res.greedy[jj])
            if reason is not None:
                e.scheduler.finish(seq, reason)  # scheduled no more; its final delta goes out with the rest
            pending.append((seq, tok, lp, ti, tl, reason))

    def launch(self, batch, out, logit_rows: int, step: tuple) -> bool:
        """Sample a step whose rows are all plain greedy rows on the device and leave it in flight: its tokens go to
        ``runner.fed`` (the next step's fed rows read them) and, by an asynchronous copy, to the host; each row's
        sequence gets the placeholder ``-(j + 1)`` as its last token (unless this row is its last by length), so the
        scheduler can plan the next step.  False (nothing done) when the step does not qualify: ``sample`` it."""
        e = self.engine
        fed, n = e.runner.fed, len(out.seq_idx)
        if fed is None or not e.config.overlap_schedule or n > fed.shape[0]:
            return False
        seqs = [batch.seqs[i] for i in out.seq_idx]
        if not all(map(_plain, seqs)):
            return False
        host = torch.empty((n, 2), dtype=torch.float64, pin_memory=fed.is_cuda)
        for a in range(0, n, logit_rows):
            b = min(n, a + logit_rows)
            logp = torch.log_softmax(e.runner.model.logits(out.hidden[a:b]).float(), dim=-1)
            best, best_at = logp.max(dim=-1)
            fed[a:b].copy_(best_at)
            host[a:b].copy_(torch.stack((best_at.double(), best.double()), dim=1), non_blocking=True)
        event = None
        if fed.is_cuda:
            event = torch.cuda.Event()
            event.record()
        for j, seq in enumerate(seqs):
            if seq.status != SeqStatus.FINISHED and len(seq.output_ids) + 1 < seq.state["max_new"]:
                seq.output_ids.append(-(j + 1))
        self.inflight = InFlight(seqs, host, event, step, None if event is not None else time.perf_counter())
        return True

    def resolve(self) -> None:
        """Wait for the step in flight (if any) and record its rows as ``sample`` does."""
        f, self.inflight = self.inflight, None
        if f is None:
            return
        if f.event is not None:
            f.event.synchronize()
        vals = f.host.tolist()
        now = time.monotonic()
        e = self.engine
        stats, outp, pending = e._stats, e.out, self.pending
        for seq, (tok, lp) in zip(f.seqs, vals):
            if seq.status == SeqStatus.FINISHED:
                continue  # ended meanwhile (a stop string, an abort): the row is dropped, its placeholder gone
            ids = seq.output_ids
            if ids and ids[-1] < 0:
                ids.pop()
            if seq.first_token_time is None:
                seq.first_token_time = now
            stats.generation_tokens += 1
            tok = int(tok)
            reason = outp.record(seq, tok, lp, None, None, True)
            if reason is not None:
                e.scheduler.finish(seq, reason)
            pending.append((seq, tok, lp, None, None, reason))
        self.done(*f.step, ended=f.ended)

    def _scored(self, seq: Seq, sc, res, jj: int, position: int) -> None:
        e = self.engine
        t = len(seq.state["logprobs"])
        if seq.kind is SeqKind.SCORE_PREFILL and sc.row_index(seq, position) < t:
            return  # recomputed after a preemption: this row was scored before
        sc.keep_row(t, res.logp[jj])
        e._stats.generation_tokens += 1
        args = (seq, res.token_ids[jj], res.logprobs[jj], res.top_ids[jj], res.top_logprobs[jj], res.greedy[jj])
        if seq.kind is SeqKind.SCORE_PREFILL:
            reason = e.out.record_scored(*args)
            if reason is not None:
                e._finish(seq, reason)
            return
        reason, delta = e.out.append(*args)
        if reason is not None:
            e._finish(seq, reason, last=delta)
        elif seq.on_delta is not None and delta is not None:
            seq.on_delta(delta)

    def emit(self) -> None:
        """The deferred part of the rows recorded so far: text, stop strings, deltas, final outputs."""
        if not self.pending:
            return
        e = self.engine
        items, self.pending = self.pending, []
        for k, (seq, tok, lp, ti, tl, reason) in enumerate(items):
            if seq.state.get("closed"):
                continue  # aborted or failed after its row was recorded: its final delta is out
            try:
                reason, delta = e.out.emit(seq, tok, lp, ti, tl, reason)
                if reason is not None:
                    e._finish(seq, reason, last=delta)
                elif seq.on_delta is not None:
                    seq.on_delta(delta)
            except BaseException:
                self.pending = items[k + 1:] + self.pending  # the rest is not lost: failed or emitted later
                raise

    def fail(self, error: str) -> None:
        """End every sequence with a recorded row not yet emitted with ``error`` (the step thread failed)."""
        items, self.pending = self.pending, []
        for seq, *_ in items:
            if not seq.state.get("closed"):
                self.engine._finish(seq, "error", error=error)

"""What the engine's step thread does with a step's sampled rows (``Engine.step``).

**Steps launched ahead** (``EngineConfig.overlap_schedule``, on by default; ``launch`` / ``resolve``).  A step without
scoring rows is sampled on the device (``sampling.sample_on_device``: argmax, draws with each request's own
generator, banned ids, top log-probs) and left in flight: its tokens go to ``runner.fed`` on the device and, by
asynchronous copies, to the host.  Each row's sequence gets a placeholder ``-(j + 1)`` (its row ``j``) as its last token, unless
this row is its last by length, so the scheduler plans the next step with the right counts, and that step's inputs
take the placeholder rows' ids from ``fed`` (``StepInputs.feed``; CUDA graphs gather them, ``runtime/graphs.py``).
So the next step is scheduled and launched before the host waits for this one's tokens: the device runs step N+1
while the host records step N.  A step with scoring rows is sampled at once (``sample``).  A stop id is then
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

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from kvbench.runtime.sampling import SampleRow, sample, sample_on_device
from kvbench.runtime.scheduler import SeqKind, SeqStatus, Sequence as Seq

if TYPE_CHECKING:
    from kvbench.runtime.engine import Engine

__all__ = ["StepOutputs"]


@dataclass
class InFlight:
    """A step whose tokens are on their way to the host: its sampled rows' sequences, and per chunk of rows the
    ``DeviceSample`` whose host copies are queued, with the event that marks them done."""

    seqs: list
    chunks: list  # DeviceSample per chunk of rows, in row order
    event: Optional["torch.cuda.Event"]
    step: tuple  # (kind, launch time, tokens) for the step-time counters (``StepOutputs.done``)
    ended: Optional[float] = None  # a device that computes as it is called (CPU): when the step's work ended


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

    def _rows(self, batch, out, a: int, b: int) -> tuple[list, list]:
        """Rows ``a:b``'s ``SampleRow`` (banned ids while ``min_tokens`` are not out, forced tokens of scoring rows)
        and how many top log-probs each wants."""
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
                    banned = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(self.engine.tokenizer.eos_token_ids))
                tok = None if sc is None else sc.forced[sc.row_index(seq, out.positions[j])]
                rows.append(SampleRow(p, st.get("generator"), banned, tok))
            top_n.append(p.logprobs or 0)
        return rows, top_n

    def sample(self, batch, out, a: int, b: int) -> None:
        """Sample (or, for scoring, force) rows ``a:b`` of a step's output and record them on their sequences."""
        res = sample(self.engine.runner.model.logits(out.hidden[a:b]), *self._rows(batch, out, a, b))
        now = time.monotonic()
        for jj, j in enumerate(range(a, b)):
            seq = batch.seqs[out.seq_idx[j]]
            if seq.status == SeqStatus.FINISHED:
                continue  # ended after this step was scheduled (a stop string, an abort): the row is dropped
            if seq.scoring is not None:
                if seq.first_token_time is None:
                    seq.first_token_time = now
                self._scored(seq, seq.scoring, res, jj, out.positions[j])
            else:
                self._record(seq, res, jj, now)

    def _record(self, seq: Seq, res, jj: int, now: float) -> None:
        """Record a generation row's token on its sequence (part 1 of the module doc)."""
        e = self.engine
        if seq.first_token_time is None:
            seq.first_token_time = now
        e._stats.generation_tokens += 1
        tok, lp, ti, tl = res.token_ids[jj], res.logprobs[jj], res.top_ids[jj], res.top_logprobs[jj]
        reason = e.out.record(seq, tok, lp, ti, tl, res.greedy[jj])
        if reason is not None:
            e.scheduler.finish(seq, reason)  # scheduled no more; its final delta goes out with the rest
        self.pending.append((seq, tok, lp, ti, tl, reason))

    def launch(self, batch, out, logit_rows: int, step: tuple) -> bool:
        """Sample a step without scoring rows on the device and leave it in flight: its tokens go to ``runner.fed``
        (the next step's fed rows read them) and, by asynchronous copies, to the host; each row's sequence gets the
        placeholder ``-(j + 1)`` as its last token (unless this row is its last by length), so the scheduler can plan
        the next step.  False (nothing done) when the step does not qualify: ``sample`` it."""
        e = self.engine
        fed, n = e.runner.fed, len(out.seq_idx)
        if fed is None or not e.config.overlap_schedule or n > fed.shape[0]:
            return False
        seqs = [batch.seqs[i] for i in out.seq_idx]
        if any(s.scoring is not None for s in seqs):
            return False
        chunks = []
        for a in range(0, n, logit_rows):
            b = min(n, a + logit_rows)
            ds = sample_on_device(e.runner.model.logits(out.hidden[a:b]), *self._rows(batch, out, a, b))
            fed[a:b].copy_(ds.tokens)
            if fed.is_cuda:
                ds.to_host()
            chunks.append(ds)
        event = None
        if fed.is_cuda:
            event = torch.cuda.Event()
            event.record()
        for j, seq in enumerate(seqs):
            if seq.status != SeqStatus.FINISHED and len(seq.output_ids) + 1 < seq.state["max_new"]:
                seq.output_ids.append(-(j + 1))
        self.inflight = InFlight(seqs, chunks, event, step, None if event is not None else time.perf_counter())
        return True

    def resolve(self) -> None:
        """Wait for the step in flight (if any) and record its rows as ``sample`` does."""
        f, self.inflight = self.inflight, None
        if f is None:
            return
        if f.event is not None:
            f.event.synchronize()
        now = time.monotonic()
        j = 0
        for ds in f.chunks:
            res = ds.fetch()
            for jj in range(len(res.token_ids)):
                seq = f.seqs[j + jj]
                if seq.status == SeqStatus.FINISHED:
                    continue  # ended meanwhile (a stop string, an abort): the row is dropped, its placeholder gone
                ids = seq.output_ids
                if ids and ids[-1] < 0:
                    ids.pop()
                self._record(seq, res, jj, now)
            j += len(res.token_ids)
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

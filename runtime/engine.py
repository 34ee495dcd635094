"""The embedded engine (``engine_api.EngineProtocol``): model + paged KV cache + attention backend +
continuous-batching scheduler, driven by one background step thread.

Requests are token ids.  ``generate``/``stream``/``score`` are blocking helpers over ``add_request``.
A request fits when the cache can hold it: prompt + generated tokens - 1 <= ``max_model_len`` (the last
sampled token is never fed back), so a prompt of exactly ``max_model_len`` tokens gets one token.

Scoring is teacher-forced through the same cache and backends as generation.  ``mode="prefill"`` (the
default): the context is prefilled as any prompt (new tokens in compute precision), then the continuation
runs as prefill/extend chunks in which its tokens attend to their own K/V after the format's
quantize -> dequantize round trip -- exactly what token-by-token decode reads from the cache -- and every
continuation row's logits are kept.  ``mode="decode"``: each continuation token is fed as its own decode
step (the reference the prefill mode is tested against; one step per token, so slow on long texts).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Callable, Iterator, Optional, Sequence

import torch

from kvbench.core.client import SamplingParams, ScoreResult
from kvbench.runtime.config import EngineConfig
from kvbench.runtime.engine_api import CapacityReport, EngineStats, RequestOutput, StreamDelta
from kvbench.runtime.models.engine_setup import build_engine_parts
from kvbench.runtime.models.outputs import OutputProcessor
from kvbench.runtime.sampling import MAX_REQUEST_LOGPROBS, MAX_SCORE_LOGPROBS, SampleRow, sample, validate_params
from kvbench.runtime.scheduler import Scheduler, SeqStatus, Sequence as Seq

__all__ = ["Engine", "SCORE_MODES", "LOGIT_ROWS"]

SCORE_MODES = ("prefill", "decode")
LOGIT_ROWS = 256  # sampled rows are turned into logits this many at a time (a scored 8k chunk: 8k x vocab)

log = logging.getLogger("kvbench.runtime")


class Engine:
    def __init__(self, config: Optional[EngineConfig] = None, loaded=None, scales=None):
        """``loaded``: an already loaded ``LoadedModel`` to share between engines (else ``config.model`` loads);
        ``scales``: KV scales to use instead of the config's policy (``KVScales``, e.g. another engine's)."""
        self.config = config or EngineConfig()
        parts = build_engine_parts(self.config, loaded, scales)
        self.parts = parts
        self.device = parts.device
        self.model_id = self.config.served_model_name or parts.loaded.model_id
        self.tokenizer = parts.loaded.tokenizer
        self.max_model_len = parts.max_model_len
        self.capacity: CapacityReport = parts.capacity
        self.cache = parts.cache
        self.runner = parts.runner
        self.scales = parts.scales
        self.scheduler = Scheduler(self.cache.allocator, self.cache.page_size, self.config.max_running, self.config.max_num_batched_tokens)
        self.out = OutputProcessor(self.tokenizer)
        self._inbox: list = []
        self._inbox_lock = threading.Lock()
        self._wake = threading.Condition(self._inbox_lock)
        self._seqs: dict[str, Seq] = {}
        self._ids = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._stats = EngineStats(pages_total=self.cache.num_pages)
        self._base_gen = torch.Generator(device=self.device).manual_seed(self.config.seed)
        log.info(self.capacity.log_line())

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        with self._inbox_lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="kvbench-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self._inbox and not self.scheduler.has_work():
                    self._wake.wait(timeout=0.5)
                if self._stop:
                    break
            try:
                self.step()
            except Exception as e:  # fail every live request, keep the engine usable
                log.exception("engine step failed")
                for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._finish(seq, "error", error=f"{type(e).__name__}: {e}")

    # -------------------------------------------------------------------------------- requests
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: Optional[str] = None,
        on_delta: Optional[Callable[[StreamDelta], None]] = None,
        _forced: Optional[list[int]] = None,
        _full_rows: bool = False,
        _score_prefill: bool = False,
        _gather=None,
    ) -> str:
        """``_forced``: teacher-forced continuation (scoring); with ``_score_prefill`` it is fed as
        prefill chunks with decode semantics (``Sequence.score_from``) instead of one decode step per token.
        ``_full_rows``: keep every scored row's log-softmax (one [T, V] float32 tensor, filled row by row);
        ``_gather``: [T, k] token ids per scored position whose log-probs to keep (a [T, k] tensor)."""
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        if _score_prefill and not _forced:
            raise ValueError("prefill scoring needs a non-empty continuation")
        validate_params(params, MAX_SCORE_LOGPROBS if _forced is not None else MAX_REQUEST_LOGPROBS)
        vocab = self.parts.loaded.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context is {self.max_model_len} (max_model_len)")
        rid = request_id or f"req-{next(self._ids)}"
        if _score_prefill:
            forced = [int(t) for t in _forced]
            if min(forced) < 0 or max(forced) >= vocab:
                raise ValueError(f"continuation token ids must be in [0, {vocab})")
            if len(ids) + len(forced) - 1 > self.max_model_len:
                raise ValueError(f"context + continuation exceed the context length {self.max_model_len}")
            seq = Seq(rid, ids + forced[:-1], params, on_delta=on_delta)
            seq.score_from = len(ids)
        else:
            seq = Seq(rid, ids, params, on_delta=on_delta)
        # the cache holds prompt + generated - 1 tokens (the last sampled token is never fed back)
        seq.state["max_new"] = min(int(params.max_tokens), self.max_model_len - len(ids) + 1)
        if _forced is not None:
            seq.state["forced"] = list(_forced)
            seq.state["full_rows"] = torch.empty(len(_forced), vocab, dtype=torch.float32) if _full_rows else None
            if _gather is not None:
                seq.state["gather"] = _gather_index(_gather, len(_forced), vocab)
                seq.state["gathered"] = torch.empty(seq.state["gather"].shape, dtype=torch.float32)
        if params.temperature > 0:
            g = torch.Generator(device=self.device)
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._base_gen))
            seq.state["generator"] = g.manual_seed(int(seed))
        self.out.init(seq)
        with self._wake:
            if rid in self._seqs:
                raise ValueError(f"duplicate request id {rid!r}")
            self._seqs[rid] = seq
            self._inbox.append(("add", seq))
            self._wake.notify_all()
        return rid

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._inbox.append(("abort", request_id))
            self._wake.notify_all()

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            items, self._inbox = self._inbox, []
        for kind, x in items:
            if kind == "add":
                self.scheduler.add(x)
            else:
                seq = self._seqs.get(x)
                if seq is not None and seq.status != SeqStatus.FINISHED:
                    self._finish(seq, "abort")

    # ------------------------------------------------------------------------------------ step
    def step(self) -> int:
        """Run one scheduler step; returns the number of tokens forwarded (0 = idle)."""
        self._drain_inbox()
        batch = self.scheduler.schedule()
        if batch is None:
            return 0
        out = self.runner.run_rows(batch)
        for seq, q in zip(batch.seqs, batch.q_lens):
            seq.num_cached += q
            if batch.phase == "prefill":
                self._stats.prompt_tokens += q
        if out is None:
            return batch.num_tokens
        n = len(out.seq_idx)
        for a in range(0, n, LOGIT_ROWS):
            self._sample_rows(batch, out, a, min(n, a + LOGIT_ROWS))
        return batch.num_tokens

    def _sample_rows(self, batch, out, a: int, b: int) -> None:
        """Sample (or, for scoring, force) rows ``a:b`` of a step's output and hand them to the requests."""
        logits = self.runner.model.logits(out.hidden[a:b])
        rows, top_n = [], []
        for j in range(a, b):
            seq = batch.seqs[out.seq_idx[j]]
            p = seq.params
            forced = seq.state.get("forced")
            banned = ()
            if forced is None and len(seq.output_ids) < p.min_tokens:
                banned = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(self.tokenizer.eos_token_ids))
            if seq.score_from is not None:  # the row at position p predicts continuation token p - score_from + 1
                tok = forced[out.positions[j] - seq.score_from + 1]
            else:
                tok = forced[len(seq.output_ids)] if forced else None
            rows.append(SampleRow(p, seq.state.get("generator"), banned, tok))
            top_n.append(p.logprobs or 0)
        res = sample(logits, rows, top_n)
        now = time.monotonic()
        for jj, j in enumerate(range(a, b)):
            seq = batch.seqs[out.seq_idx[j]]
            if seq.status == SeqStatus.FINISHED:
                continue
            st = seq.state
            if seq.score_from is not None and out.positions[j] - seq.score_from + 1 < len(st["logprobs"]):
                continue  # recomputed after a preemption: this row was scored before
            if st.get("forced") is not None:
                self._keep_rows(st, res.logp[jj])
            if seq.first_token_time is None:
                seq.first_token_time = now
            self._stats.generation_tokens += 1
            if seq.score_from is not None:
                reason = self.out.record_scored(seq, res.token_ids[jj], res.logprobs[jj], res.top_ids[jj], res.top_logprobs[jj], res.greedy[jj])
                if reason is not None:
                    self._finish(seq, reason)
                continue
            reason, delta = self.out.append(seq, res.token_ids[jj], res.logprobs[jj], res.top_ids[jj], res.top_logprobs[jj], res.greedy[jj])
            if reason is not None:
                self._finish(seq, reason, last=delta)
            elif seq.on_delta is not None and delta is not None:
                seq.on_delta(delta)

    @staticmethod
    def _keep_rows(st: dict, logp_row: torch.Tensor) -> None:
        """A scored row's full log-softmax and/or its values at the gather ids, copied out (a view would keep
        the whole [rows, V] chunk it came from alive).  Row ``t`` is the one about to be recorded."""
        t = len(st["logprobs"])
        if st.get("full_rows") is not None:
            st["full_rows"][t].copy_(logp_row)
        if st.get("gather") is not None:
            st["gathered"][t] = logp_row.index_select(0, st["gather"][t].to(logp_row.device)).float().cpu()

    def _finish(self, seq: Seq, reason: str, last: Optional[StreamDelta] = None, error: Optional[str] = None) -> None:
        self.scheduler.finish(seq, reason)
        with self._inbox_lock:
            self._seqs.pop(seq.request_id, None)
        if reason == "abort":
            self._stats.requests_aborted += 1
        else:
            self._stats.requests_finished += 1
        delta = self.out.final_delta(seq, reason, last, error)
        if seq.on_delta is not None:
            try:
                seq.on_delta(delta)
            except Exception:
                log.exception("on_delta callback failed for %s", seq.request_id)

    # ----------------------------------------------------------------------------- blocking API
    def _run_blocking(self, prompts, params_list, forced=None, full_rows=False, score_prefill=False, gather=None) -> list[RequestOutput]:
        self.start()
        done = [threading.Event() for _ in prompts]
        outs: list[Optional[RequestOutput]] = [None] * len(prompts)
        seqs: list[Seq] = []

        def cb(k):
            def f(d: StreamDelta) -> None:
                if d.finish_reason is not None:
                    outs[k] = self.out.request_output(seqs[k], d)
                    done[k].set()
            return f

        rids = []
        try:
            for k, (ids, p) in enumerate(zip(prompts, params_list)):
                rid = self.add_request(ids, p, on_delta=cb(k), _forced=forced[k] if forced else None, _full_rows=full_rows,
                                       _score_prefill=score_prefill, _gather=gather[k] if gather else None)
                seqs.append(self._seqs_snapshot(rid))
                rids.append(rid)
            for ev in done:
                ev.wait()
        except BaseException:
            for rid in rids:
                self.abort(rid)
            raise
        return outs, seqs  # type: ignore[return-value]

    def _seqs_snapshot(self, rid: str) -> Seq:
        with self._inbox_lock:
            return self._seqs[rid]

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("give one SamplingParams or one per prompt")
        return self._run_blocking(list(prompts), plist)[0]

    def stream(self, prompt_token_ids: list[int], params: SamplingParams) -> Iterator[StreamDelta]:
        self.start()
        q: "queue.Queue[StreamDelta]" = queue.Queue()
        rid = self.add_request(prompt_token_ids, params, on_delta=q.put)
        finished = False
        try:
            while not finished:
                d = q.get()
                finished = d.finish_reason is not None
                yield d
        finally:
            if not finished:
                self.abort(rid)

    def score(self, context_ids: list[int], continuation_ids: list[int], top_k: int = 0, full_distribution: bool = False,
              mode: str = "prefill", gather_ids=None) -> ScoreResult:
        """Teacher-forced log-probs of ``continuation_ids`` after ``context_ids`` (see the module doc for
        ``mode``; both modes give the same numbers up to float rounding).  ``top_k`` (up to
        ``MAX_SCORE_LOGPROBS``) is taken per row as rows are sampled; ``full_distribution`` keeps every row's
        log-softmax ([T, V] float32: 2.4 GB for 4k tokens of a 150k vocabulary); ``gather_ids`` ([T, k] ids)
        keeps only the log-probs at those ids (``gathered_logprobs``, [T, k])."""
        if mode not in SCORE_MODES:
            raise ValueError(f"score mode must be one of {', '.join(SCORE_MODES)}, got {mode!r}")
        if not continuation_ids:
            raise ValueError("score needs a non-empty continuation")
        if len(context_ids) + len(continuation_ids) - 1 > self.max_model_len:
            raise ValueError(f"context + continuation exceed the context length {self.max_model_len}")
        p = SamplingParams(max_tokens=len(continuation_ids), temperature=0.0, ignore_eos=True, logprobs=top_k or None)
        (out,), (seq,) = self._run_blocking([list(context_ids)], [p], forced=[list(continuation_ids)], full_rows=full_distribution,
                                            score_prefill=mode == "prefill",
                                            gather=[gather_ids] if gather_ids is not None else None)
        if out.finish_reason not in ("length", "stop"):
            raise RuntimeError(f"scoring failed: {out.finish_reason}")
        st = seq.state
        return ScoreResult(
            token_ids=list(continuation_ids),
            logprobs=list(out.logprobs or []),
            greedy=list(st["greedy"]),
            top_ids=st["top_ids"] if top_k else None,
            top_logprobs=st["top_lps"] if top_k else None,
            full_logprobs=st["full_rows"] if full_distribution else None,
            gathered_logprobs=st.get("gathered") if gather_ids is not None else None,
        )

    # ---------------------------------------------------------------------------------- counters
    def stats(self) -> EngineStats:
        s = self._stats
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self._inbox),
            pages_used=self.cache.allocator.num_used,
            pages_total=self.cache.num_pages,
            preemptions=self.scheduler.num_preemptions,
            prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
            requests_finished=s.requests_finished,
            requests_aborted=s.requests_aborted,
        )

    def info(self) -> dict:
        c = self.config
        return {
            "model": self.model_id,
            "model_source": self.parts.loaded.source,
            "kv_dtype": c.kv_dtype,
            "kv_scales": self.scales.summary(),
            "prefill_backend": c.prefill_backend,
            "decode_backend": c.decode_backend,
            "fused_append": c.fused_append,
            "quantize_query": c.quantize_query,
            "q_scale": self.parts.q_scales.summary() if self.parts.q_scales is not None else None,
            "device": str(self.device),
            "dtype": str(self.parts.dtype).replace("torch.", ""),
            "cuda_graphs": self.runner.graphs is not None,
            "max_model_len": self.max_model_len,
            "capacity": {**self.capacity.__dict__},
        }


def _gather_index(ids, rows: int, vocab: int) -> torch.Tensor:
    """``ids`` ([T, k] token ids per scored position) as a CPU int64 tensor, checked against the request."""
    t = torch.as_tensor(ids, dtype=torch.int64)
    if t.dim() != 2 or t.shape[0] != rows:
        raise ValueError(f"gather_ids must be [{rows}, k] (one row per continuation token), got {list(t.shape)}")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise ValueError(f"gather_ids must be in [0, {vocab})")
    return t

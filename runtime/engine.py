"""The embedded engine (``engine_api.EngineProtocol``): model + paged KV cache + attention backend +
continuous-batching scheduler, driven by one background step thread.

Requests are token ids.  ``generate``/``stream``/``score`` are blocking helpers over ``add_request``.
Scoring is teacher-forced through the same cache and backends as generation: the context is prefilled,
then each continuation token is fed as a decode step, so every score sees the KV format exactly as
generation does.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Callable, Iterator, Optional, Sequence

import torch

from kvbench.harness.client import SamplingParams, ScoreResult
from kvbench.runtime.config import EngineConfig
from kvbench.runtime.engine_api import CapacityReport, EngineStats, RequestOutput, StreamDelta
from kvbench.runtime.models.engine_setup import build_engine_parts
from kvbench.runtime.models.outputs import OutputProcessor
from kvbench.runtime.sampling import MAX_REQUEST_LOGPROBS, MAX_SCORE_LOGPROBS, SampleRow, sample, validate_params
from kvbench.runtime.scheduler import Scheduler, Sequence as Seq

__all__ = ["Engine"]

log = logging.getLogger("kvbench.runtime")


class Engine:
    def __init__(self, config: Optional[EngineConfig] = None, loaded=None):
        """``loaded``: an already loaded ``LoadedModel`` to share between engines (else ``config.model`` loads)."""
        self.config = config or EngineConfig()
        parts = build_engine_parts(self.config, loaded)
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
    ) -> str:
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        validate_params(params, MAX_SCORE_LOGPROBS if _forced is not None else MAX_REQUEST_LOGPROBS)
        vocab = self.parts.loaded.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context is {self.max_model_len} (max_model_len)")
        rid = request_id or f"req-{next(self._ids)}"
        seq = Seq(rid, ids, params, on_delta=on_delta)
        seq.state["max_new"] = min(int(params.max_tokens), self.max_model_len - len(ids))
        if _forced is not None:
            seq.state["forced"] = list(_forced)
            seq.state["full_rows"] = [] if _full_rows else None
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
                if seq is not None and seq.status != "finished":
                    self._finish(seq, "abort")

    # ------------------------------------------------------------------------------------ step
    def step(self) -> int:
        """Run one scheduler step; returns the number of tokens forwarded (0 = idle)."""
        self._drain_inbox()
        batch = self.scheduler.schedule()
        if batch is None:
            return 0
        logits, idx = self.runner.run(batch)
        for seq, q in zip(batch.seqs, batch.q_lens):
            seq.num_cached += q
            if batch.phase == "prefill":
                self._stats.prompt_tokens += q
        if logits is None:
            return batch.num_tokens
        rows, top_n = [], []
        for i in idx:
            seq = batch.seqs[i]
            p = seq.params
            forced = seq.state.get("forced")
            banned = ()
            if forced is None and len(seq.output_ids) < p.min_tokens:
                banned = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(self.tokenizer.eos_token_ids))
            rows.append(SampleRow(p, seq.state.get("generator"), banned, forced[len(seq.output_ids)] if forced else None))
            top_n.append(p.logprobs or 0)
        res = sample(logits, rows, top_n)
        now = time.monotonic()
        for j, i in enumerate(idx):
            seq = batch.seqs[i]
            if seq.status == "finished":
                continue
            if seq.state.get("full_rows") is not None:
                seq.state["full_rows"].append(res.logp[j].cpu())
            if seq.first_token_time is None:
                seq.first_token_time = now
            self._stats.generation_tokens += 1
            reason, delta = self.out.append(seq, res.token_ids[j], res.logprobs[j], res.top_ids[j], res.top_logprobs[j], res.greedy[j])
            if reason is not None:
                self._finish(seq, reason, last=delta)
            elif seq.on_delta is not None and delta is not None:
                seq.on_delta(delta)
        return batch.num_tokens

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
    def _run_blocking(self, prompts, params_list, forced=None, full_rows=False) -> list[RequestOutput]:
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
                rid = self.add_request(ids, p, on_delta=cb(k), _forced=forced[k] if forced else None, _full_rows=full_rows)
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

    def score(self, context_ids: list[int], continuation_ids: list[int], top_k: int = 0, full_distribution: bool = False) -> ScoreResult:
        if not continuation_ids:
            raise ValueError("score needs a non-empty continuation")
        if len(context_ids) + len(continuation_ids) > self.max_model_len:
            raise ValueError(f"context + continuation exceed the context length {self.max_model_len}")
        p = SamplingParams(max_tokens=len(continuation_ids), temperature=0.0, ignore_eos=True, logprobs=top_k or None)
        (out,), (seq,) = self._run_blocking([list(context_ids)], [p], forced=[list(continuation_ids)], full_rows=full_distribution)
        if out.finish_reason not in ("length", "stop"):
            raise RuntimeError(f"scoring failed: {out.finish_reason}")
        st = seq.state
        full = torch.stack(st["full_rows"]) if full_distribution else None
        return ScoreResult(
            token_ids=list(continuation_ids),
            logprobs=list(out.logprobs or []),
            greedy=list(st["greedy"]),
            top_ids=st["top_ids"] if top_k else None,
            top_logprobs=st["top_lps"] if top_k else None,
            full_logprobs=full,
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
            "device": str(self.device),
            "dtype": str(self.parts.dtype).replace("torch.", ""),
            "cuda_graphs": self.runner.graphs is not None,
            "max_model_len": self.max_model_len,
            "capacity": {**self.capacity.__dict__},
        }

"""The embedded engine (``engine_api.EngineProtocol``): model + paged KV cache + attention backend +
continuous-batching scheduler, driven by one background step thread.

Requests are token ids.  ``generate``/``stream`` are blocking helpers over ``add_request``, ``score`` one over
``add_score_request`` (a ``TokenScoreRequest``: scoring is a request kind of its own, ``runtime/scoring.py``).
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

import functools
import itertools
import logging
import queue
import threading
import time
from typing import Callable, Iterator, Optional, Sequence

import torch

from kvbench.core import SamplingParams, ScoreResult
from kvbench.runtime.compile_watch import install_compile_watch
from kvbench.runtime.config import EngineConfig
from kvbench.runtime.engine_api import CapacityReport, EngineStats, RequestOutput, StreamDelta
from kvbench.runtime.gemm_library import apply as apply_gemm_library
from kvbench.runtime.models.engine_setup import build_engine_parts, engine_device
from kvbench.runtime.models.outputs import OutputProcessor
from kvbench.runtime.sampling import MAX_REQUEST_LOGPROBS, MAX_SCORE_LOGPROBS, validate_params
from kvbench.runtime.scheduler import Scheduler, SeqKind, SeqStatus, Sequence as Seq
from kvbench.runtime.scoring import SCORE_MODES, TokenScoreRequest, score_result
from kvbench.runtime.step_outputs import StepOutputs
from kvbench.runtime.warmup import prepare_to_serve

__all__ = ["Engine", "SCORE_MODES", "LOGIT_ROWS", "TokenScoreRequest"]

LOGIT_ROWS = 256  # sampled rows are turned into logits this many at a time (a scored 8k chunk: 8k x vocab)

log = logging.getLogger("kvbench.runtime")


class Engine:
    def __init__(self, config: Optional[EngineConfig] = None, loaded=None, scales=None):
        """``loaded``: an already loaded ``LoadedModel`` to share between engines (else ``config.model`` loads);
        ``scales``: KV scales to use instead of the config's policy (``KVScales``, e.g. another engine's)."""
        self.config = config or EngineConfig()
        device = engine_device(self.config)
        apply_gemm_library(self.config.gemm_library, device)  # also before each step
        # Triton compiles before the engine serves are expected; later ones are logged (compile_watch.py)
        self._compiles = install_compile_watch() if device.type == "cuda" else None
        self._compiles_base = (0, 0.0) if self._compiles is None else (self._compiles.after_warmup,
                                                                      self._compiles.after_warmup_s)
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
        groups = parts.cache.spec.groups
        self.scheduler = Scheduler(self.cache.allocator, self.cache.page_size, self.config.max_running,
                                   self.config.max_num_batched_tokens, window=parts.page_window,
                                   scratch_page=self.cache.scratch_page,
                                   group_windows=list(groups.windows) if groups else None, mixed=self.config.mixed_prefill)
        self.out = OutputProcessor(self.tokenizer)
        self.rows = StepOutputs(self)  # sampled rows: recorded at once, text and deltas one step later
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
        self.warmup_s: Optional[float] = None
        self._serving = False

    def prepare_to_serve(self) -> None:
        """Before the HTTP server takes requests: the kernel warm-up, then compiles count as stalls (once per
        engine; ``runtime/warmup.py``, ``prepare_to_serve``)."""
        prepare_to_serve(self)

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        with self._inbox_lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="kvbench-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        if self._compiles is not None:
            self._compiles.release(self)  # a compile no longer stalls this engine's requests
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
                while not self._stop and not self._inbox and not self.scheduler.has_work() and not self.rows.pending \
                        and self.rows.inflight is None:
                    self._wake.wait(timeout=0.5)
                if self._stop:
                    break
            try:
                self.step()
            except Exception as e:  # fail every live request, keep the engine usable
                log.exception("engine step failed")
                error = f"{type(e).__name__}: {e}"
                try:  # rows sampled before the failure still go out (a finished request keeps its answer)
                    self.rows.resolve()
                    self.rows.emit()
                except Exception:
                    self.rows.inflight = None
                    log.exception("emitting the recorded rows failed")
                self.rows.fail(error)
                for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._finish(seq, "error", error=error)

    # -------------------------------------------------------------------------------- requests
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: Optional[str] = None,
        on_delta: Optional[Callable[[StreamDelta], None]] = None,
    ) -> str:
        """Queue a generation request (see ``EngineProtocol.add_request``); returns its request id."""
        ids = self._checked_prompt(prompt_token_ids, params, MAX_REQUEST_LOGPROBS)
        seq = Seq(request_id or f"req-{next(self._ids)}", ids, params, on_delta=on_delta)
        return self._queue(seq, len(ids))

    def add_score_request(
        self,
        request: TokenScoreRequest,
        request_id: Optional[str] = None,
        on_delta: Optional[Callable[[StreamDelta], None]] = None,
    ) -> str:
        """Queue a teacher-forced scoring request (a sequence of kind ``SeqKind.SCORE_PREFILL`` or
        ``SCORE_DECODE``, ``runtime/scoring.py``); its rows are recorded in the sequence's ``scoring`` state
        and its output reports the continuation as the generated tokens.  Returns its request id."""
        request.check(self.max_model_len)
        params = request.sampling_params()
        ids = self._checked_prompt(request.context_ids, params, MAX_SCORE_LOGPROBS)
        vocab = self.parts.loaded.config.vocab_size
        rid = request_id or f"req-{next(self._ids)}"
        kind = request.kind
        if kind is SeqKind.SCORE_PREFILL:
            forced = [int(t) for t in request.continuation_ids]
            if min(forced) < 0 or max(forced) >= vocab:
                raise ValueError(f"continuation token ids must be in [0, {vocab})")
            if len(ids) + len(forced) - 1 > self.max_model_len:
                raise ValueError(f"context + continuation exceed the context length {self.max_model_len}")
            seq = Seq(rid, ids + forced[:-1], params, on_delta=on_delta, kind=kind)
            seq.score_from = len(ids)
        else:
            seq = Seq(rid, ids, params, on_delta=on_delta, kind=kind)
        seq.scoring = request.state(vocab)
        return self._queue(seq, len(ids))

    def _checked_prompt(self, prompt_token_ids, params: SamplingParams, max_logprobs: int) -> list[int]:
        """The prompt as ints; ValueError when it is empty, out of the vocabulary or longer than the context,
        or when ``params`` are invalid."""
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        validate_params(params, max_logprobs)
        vocab = self.parts.loaded.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context is {self.max_model_len} (max_model_len)")
        return ids

    def _queue(self, seq: Seq, prompt_len: int) -> str:
        """Give ``seq`` its per-request state and hand it to the step thread."""
        params, rid = seq.params, seq.request_id
        # the cache holds prompt + generated - 1 tokens (the last sampled token is never fed back)
        seq.state["max_new"] = min(int(params.max_tokens), self.max_model_len - prompt_len + 1)
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
        """Run one scheduler step; returns the number of tokens forwarded (0 = idle).  The step is launched before
        the last one's tokens are recorded when that one is in flight (``runtime/step_outputs.py``)."""
        self._drain_inbox()
        t0 = time.perf_counter()
        apply_gemm_library(self.config.gemm_library, self.device)
        batch = self.scheduler.schedule()
        if batch is None and self.rows.inflight is not None:
            self.rows.resolve()  # its rows may end sequences (and free pages for waiting ones)
            batch = self.scheduler.schedule()
        if batch is None:
            self.rows.emit()
            return 0
        out = self.runner.run_rows(batch)
        for k, (seq, q) in enumerate(zip(batch.seqs, batch.q_lens)):
            seq.num_cached += q
            if batch.phase == "prefill" and k >= batch.decode_rows:
                self._stats.prompt_tokens += q
        self.rows.resolve()  # the last step's tokens, while the device runs this one
        self.rows.emit()  # and their text and deltas
        step = ("decode" if batch.phase == "decode" else "mixed" if batch.decode_rows else "prefill", t0, batch.num_tokens)
        if out is None or not self.rows.launch(batch, out, LOGIT_ROWS, step):
            n = 0 if out is None else len(out.seq_idx)
            for a in range(0, n, LOGIT_ROWS):
                self.rows.sample(batch, out, a, min(n, a + LOGIT_ROWS))
            self.rows.done(*step)
        return batch.num_tokens

    def _finish(self, seq: Seq, reason: str, last: Optional[StreamDelta] = None, error: Optional[str] = None) -> None:
        self.scheduler.finish(seq, reason)
        seq.finish_reason = reason  # a stop string found after "length" ended it (step_outputs.py)
        seq.state["closed"] = True
        ids = seq.output_ids
        while ids and ids[-1] < 0:  # the placeholder of a row in flight (step_outputs.py): never an output
            ids.pop()
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
    def _run_blocking(self, submits: list[Callable[..., str]]) -> tuple[list[RequestOutput], list[Seq]]:
        """Queue each request (``submit(on_delta=...)`` returns its id) and wait until every one finished."""
        self.start()
        done = [threading.Event() for _ in submits]
        outs: list[Optional[RequestOutput]] = [None] * len(submits)
        seqs: list[Seq] = []

        def cb(k):
            def f(d: StreamDelta) -> None:
                if d.finish_reason is not None:
                    outs[k] = self.out.request_output(seqs[k], d)
                    done[k].set()
            return f

        rids = []
        try:
            for k, submit in enumerate(submits):
                rid = submit(on_delta=cb(k))
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
        return self._run_blocking([functools.partial(self.add_request, ids, p) for ids, p in zip(prompts, plist)])[0]

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
        return self.run_score(TokenScoreRequest(list(context_ids), list(continuation_ids), top_k, full_distribution,
                                                mode, gather_ids))

    def run_score(self, request: TokenScoreRequest) -> ScoreResult:
        """Score ``request`` through the scheduler and wait for its ``ScoreResult``."""
        request.check(self.max_model_len)
        (out,), (seq,) = self._run_blocking([functools.partial(self.add_score_request, request)])
        return score_result(request, out, seq)

    # ---------------------------------------------------------------------------------- counters
    def stats(self) -> EngineStats:
        s, w = self._stats, self._compiles
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
            kernel_compiles=None if w is None else w.after_warmup - self._compiles_base[0],
            kernel_compile_s=None if w is None else w.after_warmup_s - self._compiles_base[1],
            step_counts=dict(s.step_counts), step_seconds=dict(s.step_seconds), step_tokens=dict(s.step_tokens),
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
            "warmup_s": None if self.warmup_s is None else round(self.warmup_s, 2),
            "compiles_after_warmup": None if self._compiles is None else self.stats().kernel_compiles,
            "max_model_len": self.max_model_len,
            "capacity": {**self.capacity.__dict__},
        }


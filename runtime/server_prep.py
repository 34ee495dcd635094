"""Request preparation for the embedded server (``runtime/server.py``): parsing, validation, tokenization and
chat templating of a request body, off the event loop, in two lanes by body size.

The guarantee: no request waits on another request's preparation for more than 100 ms.  How:

* Small bodies (at most ``SMALL_BODY_BYTES``, 64 KiB: what ordinary requests are) are prepared on
  ``PREP_THREADS`` threads of their own; a bigger body never takes one of them, so a small request never
  queues behind a big one.  Each small job is short (a 64 KiB body parses in well under a millisecond and
  tokenizes in tens of milliseconds, in the Rust tokenizer, which releases the GIL).
* Bigger bodies are prepared in ``processes`` worker processes (``kvbench serve`` runs
  ``DEFAULT_PREP_PROCESSES``) at a lower CPU priority (nice +10).  Their work then shares no GIL with the
  server: parsing a 7 MB body holds the GIL for ~55 ms in one call (~450 ms for a 7 MB list of token ids),
  checking its strings once more ~85 ms, turning millions of token ids into Python integers hundreds of
  milliseconds -- each call a stall for the event loop and for every small request if it ran in the
  server's process.  The body goes to the worker as bytes; what comes back is the parsed request (its
  prompts fit the context) or the error.  With ``processes=0`` (``create_app``'s default, for tests and
  embedding) the big lane is ``BIG_THREADS`` threads in the server's process: small requests still never
  queue behind big ones, but they share the GIL with them.
* Work on an oversized prompt is bounded: the tokenizer's ``min_token_count`` (a byte count, milliseconds
  per MB) turns away a prompt that certainly cannot fit before it is tokenized, and one that passes is
  tokenized without making Python integers of its ids unless it fits (``encode_capped``).

The workers start in the background when the app starts; a worker that dies (killed, out of memory) fails
the requests it held with a 503 and the pool is replaced; a worker whose server is gone (killed before it
could shut the pool down) ends itself within a second.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import pickle
import threading
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from kvbench.runtime.server_protocol import (
    ApiError,
    detokenize_reply,
    parse_body,
    parse_chat,
    parse_completion,
    tokenize_reply,
)

__all__ = ["SMALL_BODY_BYTES", "DEFAULT_PREP_PROCESSES", "PrepLanes", "PrepSpec", "prepare"]

SMALL_BODY_BYTES = 64 * 2**10  # bodies up to this size are prepared on the small lane
PREP_THREADS = 4  # threads of the small lane (also decoding for echo and logprobs)
BIG_THREADS = 2  # threads of the big lane when it has no worker processes
DEFAULT_PREP_PROCESSES = 2  # worker processes of the big lane in ``kvbench serve``
WORKER_NICE = 10  # the big lane's workers yield the CPU to the server's own threads

log = logging.getLogger("kvbench.server")


@dataclass(frozen=True)
class PrepSpec:
    """What preparing a request needs (pickled once for each worker process)."""

    tok: Any
    model_id: str
    max_len: int


def prepare(spec: PrepSpec, kind: str, raw: bytes) -> Any:
    """One request body, prepared: a ``ParsedRequest`` (``kind`` "completion" or "chat") or the JSON reply
    (bytes; "tokenize", "detokenize").  Raises ``ApiError`` for bad input."""
    body = parse_body(raw, spec.model_id)
    if kind == "completion":
        return parse_completion(body, spec.tok, spec.max_len)
    if kind == "chat":
        return parse_chat(body, spec.tok, spec.max_len)
    if kind == "tokenize":
        return tokenize_reply(body, spec.tok, spec.max_len)
    if kind == "detokenize":
        return detokenize_reply(body, spec.tok)
    raise ValueError(f"unknown request kind {kind!r}")


# -- the worker processes: each holds the spec it was started with (set once, by its initializer)
_worker_spec: Optional[PrepSpec] = None


def _init_worker(spec_bytes: bytes, nice: int) -> None:
    global _worker_spec
    try:
        os.nice(nice)
    except OSError:  # not allowed here: run at the server's priority
        pass
    _worker_spec = pickle.loads(spec_bytes)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="kvbench-prep-parent",
                     daemon=True).start()


def _exit_with_parent(parent: int, every_s: float = 0.5) -> None:
    """End this worker once the server that started it is gone (killed: it could not shut the pool down).
    A worker waits on a queue whose writing end it holds itself, so it would never see the server go."""
    while True:
        time.sleep(every_s)
        if os.getppid() != parent:
            os._exit(0)


def _prepare_in_worker(kind: str, raw: bytes) -> Any:
    assert _worker_spec is not None, "request-preparation worker without a spec"
    return prepare(_worker_spec, kind, raw)


def _worker_pid() -> int:
    return os.getpid()


@dataclass
class PrepLanes:
    """The small lane (threads) and the big lane (worker processes, or threads) of request preparation."""

    spec: PrepSpec
    processes: int = 0
    small: ThreadPoolExecutor = field(init=False)
    big: Executor = field(init=False)
    ready: threading.Event = field(init=False, default_factory=threading.Event)
    _spec_bytes: Optional[bytes] = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.processes < 0:
            raise ValueError(f"prep processes must be >= 0, got {self.processes}")
        self.small = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="kvbench-prep")
        warm = getattr(self.spec.tok, "min_token_count", None)
        if warm is not None:
            warm("")  # the bound's tables are made here, before serving (and pickled with the tokenizer)
        if self.processes:
            try:
                self._spec_bytes = pickle.dumps(self.spec)
            except Exception as e:  # noqa: BLE001 - e.g. a tokenizer holding a lock: threads it is
                log.warning("request preparation stays in-process (the tokenizer cannot be pickled: %s)", e)
        self.big = self._new_big_lane()

    @property
    def uses_processes(self) -> bool:
        return self._spec_bytes is not None

    def _new_big_lane(self) -> Executor:
        if self._spec_bytes is None:
            self.ready.set()
            return ThreadPoolExecutor(BIG_THREADS, thread_name_prefix="kvbench-prep-big")
        import multiprocessing

        return ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=(self._spec_bytes, WORKER_NICE))

    def start(self) -> None:
        """Start the worker processes in the background (``ready`` is set once all of them answer)."""
        if self.uses_processes:
            threading.Thread(target=self._warm, args=(self.big,), name="kvbench-prep-start", daemon=True).start()

    def _warm(self, pool: Executor) -> None:
        try:  # one task per worker at once: the pool starts them all
            futures = [pool.submit(_worker_pid) for _ in range(self.processes)]
            for f in futures:
                f.result()
        except Exception as e:  # noqa: BLE001 - shut down meanwhile, or a worker failed: requests will say
            log.warning("request-preparation workers did not start: %s", e)
        self.ready.set()

    async def off_loop(self, fn: Callable, *args) -> Any:
        """``fn(*args)`` on the small lane (short CPU work: decoding, rendering)."""
        return await asyncio.get_running_loop().run_in_executor(self.small, functools.partial(fn, *args))

    async def prepare(self, kind: str, raw: bytes) -> Any:
        """The body ``raw`` prepared (see ``prepare``) on the lane its size calls for."""
        if len(raw) <= SMALL_BODY_BYTES:
            return await self.off_loop(prepare, self.spec, kind, raw)
        loop = asyncio.get_running_loop()
        if not self.uses_processes:
            return await loop.run_in_executor(self.big, functools.partial(prepare, self.spec, kind, raw))
        pool = self.big
        try:
            return await loop.run_in_executor(pool, _prepare_in_worker, kind, bytes(raw))
        except BrokenProcessPool:
            if self.big is pool:  # the first to see it replaces the pool
                self.big = self._new_big_lane()
                pool.shutdown(wait=False, cancel_futures=True)
            raise ApiError(503, "the worker preparing this request died (out of memory?); try again",
                           "server_error") from None

    def shutdown(self) -> None:
        self.small.shutdown(wait=False, cancel_futures=True)
        self.big.shutdown(wait=False, cancel_futures=True)

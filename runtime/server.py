"""OpenAI-compatible HTTP server over the embedded engine (docs/design.md §7).

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming and not, ``usage``,
``logprobs``, ``echo``, ``stop``, ``seed``, ``n``; extensions ``ignore_eos``, ``min_tokens``, ``top_k``,
``stop_token_ids``, ``return_tokens_as_token_ids``), ``/health``, ``/metrics`` (Prometheus text) and the
tokenizer routes ``/tokenizer_info``, ``/tokenize``, ``/detokenize`` (what lm-eval's remote tokenizer uses).

Every request is one job of one or more engine requests (several prompts, or ``n`` > 1), run by
``runtime/server_jobs.py`` (engine deltas to JSON or SSE; a job that ends early aborts its unfinished
engine requests, which frees their pages).  Bad input gets a 4xx with an OpenAI-style error body.
This module holds the app: its routes and error handlers.

Long prompts cannot stall the server, and no request waits on another request's tokenization or validation
for more than 100 ms.  A request body is read as a stream and turned away with a 413 as soon as it passes
``max_body_bytes`` (at once when its Content-Length says so; ``runtime/server_body.py``), so an oversized
body is never held in memory.  JSON parsing, validation, tokenization and chat templating run off the event
loop in two lanes by body size (``runtime/server_prep.py``): bodies up to 64 KiB on threads of their own, so
a small request never queues behind a big one; bigger bodies in worker processes (``prep_processes``;
``kvbench serve`` starts 2) at a lower CPU priority, so their GIL-bound parts (parsing a 7 MB body holds the
GIL for ~55 ms in one call) do not stall the server either.  The work on an oversized prompt is bounded: a
prompt that certainly cannot fit the context (the tokenizer's ``min_token_count``: per byte, 1 / the
longest token holding that byte) gets its 400 before it is tokenized, in milliseconds per MB, and one that
passes the bound is counted in the Rust tokenizer without making Python integers of its ids unless it fits.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvbench.runtime.server_body import (  # noqa: F401 - re-exported for importers of this module
    BODY_BYTES_PER_TOKEN,
    MIN_MAX_BODY_BYTES,
    _too_large,
    default_max_body_bytes,
    read_body,
)
from kvbench.runtime.server_jobs import (  # noqa: F401 - re-exported for importers of this module
    _DISCONNECT_POLL_S,
    Job,
    JobContext,
    _Choice,
    echo_logprobs,
    run_job,
)
from kvbench.runtime.server_prep import DEFAULT_PREP_PROCESSES, SMALL_BODY_BYTES, PrepLanes, PrepSpec  # noqa: F401
from kvbench.runtime.server_protocol import (  # noqa: F401 - re-exported for importers of this module
    ApiError,
    ParsedRequest,
    parse_body,
    parse_chat,
    parse_completion,
    prometheus_text,
    render_logprobs,
    sse_event,
)


def create_app(engine, own_engine: bool = False, max_body_bytes: Optional[int] = None, prep_processes: int = 0):
    """A FastAPI app serving ``engine`` (an ``EngineProtocol``); starts its step loop on start-up.
    ``max_body_bytes``: the request-body cap (None: ``default_max_body_bytes(engine.max_model_len)``).
    ``prep_processes``: worker processes that prepare bodies over 64 KiB (0: threads of this process; see
    ``runtime/server_prep.py``); ``app.state.prep`` is the ``PrepLanes``."""
    tok = engine.tokenizer
    model_id = engine.model_id
    max_len = engine.max_model_len
    limit = int(max_body_bytes) if max_body_bytes is not None else default_max_body_bytes(max_len)
    if limit < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    lanes = PrepLanes(PrepSpec(tok, model_id, max_len), processes=prep_processes)
    app = FastAPI(title="kvbench", lifespan=_lifespan(engine, lanes, own_engine), docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.prep = lanes
    _add_error_handlers(app)
    _add_info_routes(app, engine, tok, model_id)

    async def prepared(request: Request, kind: str):
        """The body read under the cap, then prepared (``server_prep.prepare``) off the event loop."""
        return await lanes.prepare(kind, await read_body(request, limit))

    _add_request_routes(app, JobContext(engine, tok, model_id, lanes.off_loop), prepared)
    return app


def _lifespan(engine, lanes: PrepLanes, own_engine: bool):
    """Start the preparation lanes and the engine's step loop with the app; stop them (and the engine when the
    app owns it) when it shuts down."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        prev_switch, switch = sys.getswitchinterval(), gil_switch_s()
        if switch is not None:
            sys.setswitchinterval(switch)
        prepare = getattr(engine, "prepare_to_serve", None)
        if prepare is not None:  # the kernel warm-up (runtime/warmup.py) before the first request
            await asyncio.to_thread(prepare)
        lanes.start()
        engine.start()
        try:
            yield
        finally:
            lanes.shutdown()
            if own_engine:
                engine.shutdown()
            sys.setswitchinterval(prev_switch)

    return lifespan


GIL_SWITCH_MS = 0.5


def gil_switch_s() -> Optional[float]:
    """The interpreter's thread switch interval while the server runs: how long the event loop's thread (HTTP,
    the token streams) may keep the GIL once the engine's step thread, back from the device, waits for it.
    Python's 5 ms default let a busy loop delay a step by up to that; on an H200 at 64 streams of a Llama-3-8B
    shape, 0.5 ms cut the max inter-token gap from 208-226 to 82-92 ms and TPOT by 4% (docs/performance.md).
    ``KVBENCH_GIL_SWITCH_MS``: milliseconds, or ``off`` for Python's default; None: leave it."""
    raw = os.environ.get("KVBENCH_GIL_SWITCH_MS", "").strip().lower()
    if raw in ("off", "default", "none"):
        return None
    try:
        ms = float(raw) if raw else GIL_SWITCH_MS
    except ValueError:
        raise ValueError(f"KVBENCH_GIL_SWITCH_MS must be milliseconds or off, got {raw!r}") from None
    if not ms > 0:
        raise ValueError(f"KVBENCH_GIL_SWITCH_MS must be positive, got {raw!r}")
    return ms / 1000


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _add_error_handlers(app: FastAPI) -> None:
    """OpenAI-style error bodies for API errors, HTTP errors (404, 405, ...) and anything unexpected (500)."""

    @app.exception_handler(ApiError)
    async def _api_error(_req, e: ApiError):
        return _error(e)

    @app.exception_handler(Exception)
    async def _internal_error(_req, e: Exception):
        return _error(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, e: StarletteHTTPException):
        return _error(ApiError(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error"))


def _add_info_routes(app: FastAPI, engine, tok, model_id: str) -> None:
    """``/health``, ``/v1/models``, ``/metrics`` and ``/tokenizer_info``: answered on the event loop."""

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_id, "object": "model", "created": 0, "owned_by": "kvbench", "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine.stats(), model_id), media_type="text/plain; version=0.0.4")

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        eos = list(tok.eos_token_ids)
        return {
            "eos_token": tok.decode([eos[0]], skip_special_tokens=False) if eos else None,
            "eos_token_ids": eos,
            "bos_token": getattr(tok, "bos_token", None),
            "pad_token": getattr(tok, "pad_token", None),
            "vocab_size": tok.vocab_size,
            "model_max_length": engine.max_model_len,
            "chat_template": getattr(tok, "chat_template", None),
        }


def _add_request_routes(app: FastAPI, ctx: JobContext, prepared) -> None:
    """The routes whose bodies are prepared off the event loop: ``/tokenize``, ``/detokenize`` and the
    completion routes (each a job, ``runtime/server_jobs.py``)."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return Response(await prepared(request, "tokenize"), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return Response(await prepared(request, "detokenize"), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run_job(ctx, request, await prepared(request, "completion"), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run_job(ctx, request, await prepared(request, "chat"), chat=True)


def build_engine(config: Any):
    """The embedded engine for an ``EngineConfig``."""
    from kvbench.runtime.engine import Engine

    return Engine(config)


def run_server(engine_config: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
               max_body_bytes: Optional[int] = None, prep_processes: int = DEFAULT_PREP_PROCESSES) -> None:
    """Build the engine, log its KV capacity and serve until interrupted (bodies over 64 KiB are prepared
    in ``prep_processes`` worker processes)."""
    import uvicorn

    engine = build_engine(engine_config)
    cap = getattr(engine, "capacity", None)
    if cap is not None:
        print(cap.log_line(), flush=True)
    cfg = getattr(engine, "config", None)
    if cfg is not None and getattr(cfg, "max_running", None):  # the admission limit (harness/server_capacity.py reads it)
        print(f"scheduler: max running {cfg.max_running}, max batched tokens {cfg.max_num_batched_tokens}", flush=True)
    app = create_app(engine, own_engine=True, max_body_bytes=max_body_bytes, prep_processes=prep_processes)
    limit = max_body_bytes if max_body_bytes is not None else default_max_body_bytes(engine.max_model_len)
    print(f"kvbench serving {engine.model_id} on http://{host}:{port}/v1 (request bodies up to {limit / 2**20:.1f} MiB)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)

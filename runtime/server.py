"""OpenAI-compatible HTTP server over the embedded engine (DESIGN §7).

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming and not, ``usage``,
``logprobs``, ``echo``, ``stop``, ``seed``, ``n``; extensions ``ignore_eos``, ``min_tokens``, ``top_k``,
``stop_token_ids``, ``return_tokens_as_token_ids``), ``/health``, ``/metrics`` (Prometheus text) and the
tokenizer routes ``/tokenizer_info``, ``/tokenize``, ``/detokenize`` (what lm-eval's remote tokenizer uses).

Every request is one job of one or more engine requests (several prompts, or ``n`` > 1); the engine's
``on_delta`` callbacks arrive on the engine thread and are handed to the event loop with
``call_soon_threadsafe``.  When a job ends early (client gone, error, cancellation) its unfinished engine
requests are aborted, which frees their pages.  Bad input gets a 4xx with an OpenAI-style error body.

Long prompts cannot stall the server: a request body is read as a stream and turned away with a 413 as
soon as it passes ``max_body_bytes`` (at once when its Content-Length says so), so an oversized body is
never held in memory; JSON parsing, validation, tokenization and chat templating run on a small thread
pool, not on the event loop (the tokenizer releases the GIL while it works), so ``/health`` and other
streams keep answering meanwhile; and a prompt that certainly cannot fit the context (the tokenizer's
``min_token_count`` bound) gets its 400 before it is tokenized at all.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvbench.runtime.engine_api import SamplingParams, StreamDelta
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

_DISCONNECT_POLL_S = 0.5
_PREP_THREADS = 4  # threads that parse and tokenize requests off the event loop
MIN_MAX_BODY_BYTES = 8 * 2**20
BODY_BYTES_PER_TOKEN = 64


def default_max_body_bytes(max_model_len: int) -> int:
    """The default request-body cap: 64 bytes per token of context, at least 8 MiB.  A full-context prompt
    of ordinary text is ~4-6 bytes per token as JSON (as a token-id list, ~7), so this leaves room for
    non-ASCII text escaped as ``\\uXXXX`` and for batches of prompts, while a body that size still parses
    in tens of milliseconds.  ``kvbench serve --max-body-mb`` sets another."""
    return max(MIN_MAX_BODY_BYTES, BODY_BYTES_PER_TOKEN * int(max_model_len))


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than this server's limit of {limit} bytes ({limit / 2**20:.1f} MiB; "
                    "kvbench serve --max-body-mb sets it)", code="request_too_large")


async def read_body(request: Request, limit: int) -> bytearray:
    """The request body, read as a stream and given up (413) as soon as it passes ``limit`` bytes; a
    Content-Length over the limit is refused before any of the body is read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise _too_large(limit)
    return buf


class Job:
    """The engine requests behind one HTTP request, with one event queue fed from the engine thread."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.index: dict[str, int] = {}
        self.open: set[str] = set()
        self._checked = time.monotonic()

    def _push(self, delta: StreamDelta) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, delta)
        except RuntimeError:  # loop closed during shutdown
            pass

    def submit(self, base_id: str, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        try:
            for i, (ids, p) in enumerate(zip(prompts, params)):
                rid = f"{base_id}-{i}"
                self.index[rid] = i
                self.open.add(rid)
                self.engine.add_request(ids, p, request_id=rid, on_delta=self._push)
        except ValueError as e:
            self.abort()
            raise ApiError(400, str(e)) from None
        except BaseException:
            self.abort()  # requests already queued must not run on without a reader
            raise

    async def next(self, request=None) -> StreamDelta:
        """The next delta; while waiting, checks every ``_DISCONNECT_POLL_S`` whether ``request``'s client left."""
        while True:
            if request is None:
                delta = await self.queue.get()
            else:
                now = time.monotonic()
                if now - self._checked >= _DISCONNECT_POLL_S:
                    self._checked = now
                    if await request.is_disconnected():
                        raise ApiError(499, "client disconnected")
                try:
                    delta = await asyncio.wait_for(self.queue.get(), _DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    continue
            if delta.finish_reason is not None:
                self.open.discard(delta.request_id)
            return delta

    @property
    def done(self) -> bool:
        return not self.open

    def abort(self) -> None:
        for rid in list(self.open):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - aborting a finished request is a no-op
                pass
        self.open.clear()


class _Choice:
    def __init__(self, index: int):
        self.index, self.text, self.n_tokens = index, "", 0
        self.finish_reason: Optional[str] = None
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[Optional[dict]] = []


def create_app(engine, own_engine: bool = False, max_body_bytes: Optional[int] = None):
    """A FastAPI app serving ``engine`` (an ``EngineProtocol``); starts its step loop on start-up.
    ``max_body_bytes``: the request-body cap (None: ``default_max_body_bytes(engine.max_model_len)``)."""
    from contextlib import asynccontextmanager

    tok = engine.tokenizer
    model_id = engine.model_id
    max_len = engine.max_model_len
    limit = int(max_body_bytes) if max_body_bytes is not None else default_max_body_bytes(max_len)
    if limit < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    prep = ThreadPoolExecutor(_PREP_THREADS, thread_name_prefix="kvbench-prep")

    async def off_loop(fn: Callable, *args):
        """``fn(*args)`` on the request-preparation threads (parsing, tokenizing, rendering)."""
        return await asyncio.get_running_loop().run_in_executor(prep, functools.partial(fn, *args))

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            prep.shutdown(wait=False, cancel_futures=True)
            if own_engine:
                engine.shutdown()

    app = FastAPI(title="kvbench", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ApiError)
    async def _api_error(_req, e: ApiError):
        return error(e)

    @app.exception_handler(Exception)
    async def _internal_error(_req, e: Exception):
        return error(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, e: StarletteHTTPException):
        return error(ApiError(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error"))

    async def parsed(request: Request, parse: Callable[[dict], Any]):
        """The body read under the cap, then ``parse(body_dict)``, all of the CPU work off the event loop."""
        raw = await read_body(request, limit)
        return await off_loop(lambda: parse(parse_body(raw, model_id)))

    def json_response(obj: dict) -> Response:
        return Response(json.dumps(obj, ensure_ascii=False).encode(), media_type="application/json")

    def token_str(i: int, as_ids: bool) -> str:
        return f"token_id:{i}" if as_ids else tok.decode([i], skip_special_tokens=False)

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

    def _tokenize(body: dict) -> Response:
        text, special = body.get("prompt"), body.get("add_special_tokens", True)
        if not isinstance(text, str) or not isinstance(special, bool):
            raise ApiError(400, "/tokenize needs 'prompt' (string) and optional 'add_special_tokens' (bool)", param="prompt")
        ids = tok.encode(text, add_special_tokens=special)
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": max_len})

    def _detokenize(body: dict) -> Response:
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < tok.vocab_size for i in ids):
            raise ApiError(400, f"/detokenize needs 'tokens': a list of token ids in [0, {tok.vocab_size})", param="tokens")
        return json_response({"prompt": tok.decode(ids, skip_special_tokens=False)})

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await parsed(request, _tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await parsed(request, _detokenize)

    async def echo_logprobs(ids: list[int], top_k: int, as_ids: bool) -> tuple[list, list, list]:
        """Prompt tokens' logprobs (first is None) by teacher-forced scoring through the cache."""
        strs = await off_loop(lambda: [token_str(i, as_ids) for i in ids])
        if len(ids) < 2:
            return strs, [None] * len(ids), [None] * len(ids)
        try:
            res = await asyncio.to_thread(engine.score, ids[:1], ids[1:], max(top_k, 1))
        except NotImplementedError as e:
            raise ApiError(400, f"echo with logprobs is not supported by this engine: {e}") from None
        tops: list[Optional[dict]] = [None]
        for j, lp in enumerate(res.logprobs):
            top = {}
            if res.top_ids is not None and top_k > 0:
                for t, v in zip(res.top_ids[j][:top_k], res.top_logprobs[j][:top_k]):
                    s = token_str(int(t), as_ids)
                    top[s] = max(float(v), top.get(s, -float("inf")))
            if res.greedy[j]:  # the chosen token is the argmax: its own value is the top value
                top[strs[j + 1]] = max(float(lp), top.get(strs[j + 1], -float("inf")))
            tops.append(top)
        return strs, [None] + [float(x) for x in res.logprobs], tops

    async def run_job(request: Request, req: ParsedRequest, chat: bool):
        base = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        prompts = [ids for ids in req.prompts for _ in range(req.n)]
        params = [req.params_for(k) for _ in req.prompts for k in range(req.n)]
        choices = [_Choice(i) for i in range(len(prompts))]
        prompt_tokens = sum(len(ids) for ids in req.prompts)
        echo_lp: dict[int, tuple] = {}
        if req.echo:
            for c in choices:
                p = c.index // req.n
                c.text = req.texts[p] if req.texts and req.texts[p] is not None else await off_loop(
                    functools.partial(tok.decode, skip_special_tokens=False), prompts[c.index])
                if req.logprobs is not None and p not in echo_lp:
                    echo_lp[p] = await echo_logprobs(prompts[c.index], req.logprobs, req.as_ids)
        tstr = lambda i: token_str(i, req.as_ids)  # noqa: E731

        def lp_block(c: _Choice, ids, lps, tops, with_echo: bool, offset: int = 0):
            if req.logprobs is None:
                return None
            pre = echo_lp.get(c.index // req.n) if with_echo else None
            return render_logprobs(chat, ids, lps, tops, req.logprobs, tstr, pre, offset)

        def usage() -> dict:
            done = sum(c.n_tokens for c in choices)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}

        def chunk(c: _Choice, text: str, lp, finish: Optional[str], first: bool = False) -> str:
            if chat:
                delta = ({"role": "assistant", "content": text} if first else ({"content": text} if text else {}))
                ch = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                ch = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}
            return sse_event({"id": base, "object": obj + ".chunk" if chat else obj, "created": created, "model": model_id, "choices": [ch]})

        job = Job(engine, asyncio.get_running_loop())
        if req.max_tokens > 0:
            job.submit(base, prompts, params)
        else:  # echo only
            for c in choices:
                c.finish_reason = "length"

        if req.stream:
            async def sse():
                try:
                    for c in choices:
                        if chat or req.echo:
                            yield chunk(c, c.text, lp_block(c, [], [], [], True) if req.echo else None, c.finish_reason, first=True)
                    while not job.done:
                        d = await job.next()
                        c = choices[job.index[d.request_id]]
                        if d.finish_reason == "error" or d.error:
                            yield sse_event(ApiError(500, d.error or "engine error", "server_error").body())
                            break
                        c.n_tokens += len(d.token_ids)
                        fr = d.finish_reason if d.finish_reason in ("stop", "length") else None
                        if d.text or d.token_ids or fr:
                            lp = lp_block(c, d.token_ids, d.logprobs or [], d.top_logprobs or [], False, len(c.text))
                            c.text += d.text  # streamed so far (text_offset of the next chunk)
                            yield chunk(c, d.text, lp, fr)
                    if req.include_usage:
                        yield sse_event({"id": base, "object": obj + ".chunk" if chat else obj, "created": created, "model": model_id, "choices": [], "usage": usage()})
                    yield "data: [DONE]\n\n"
                finally:
                    job.abort()

            return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        try:
            while not job.done:
                d = await job.next(request)
                if d.finish_reason == "error" or d.error:
                    raise ApiError(500, d.error or "engine error", "server_error")
                c = choices[job.index[d.request_id]]
                c.text += d.text
                c.n_tokens += len(d.token_ids)
                c.tokens.extend(d.token_ids)
                c.logprobs.extend(d.logprobs or [])
                c.top.extend(d.top_logprobs or [])
                if d.finish_reason is not None:
                    c.finish_reason = d.finish_reason
        finally:
            job.abort()
        out = []
        for c in choices:
            lp = lp_block(c, c.tokens, c.logprobs, c.top, req.echo)
            if chat:
                out.append({"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                out.append({"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        return {"id": base, "object": obj, "created": created, "model": model_id, "choices": out, "usage": usage()}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parsed(request, lambda body: parse_completion(body, tok, max_len))
        return await run_job(request, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parsed(request, lambda body: parse_chat(body, tok, max_len))
        return await run_job(request, req, chat=True)

    return app


def build_engine(config: Any):
    """The embedded engine for an ``EngineConfig``."""
    from kvbench.runtime.engine import Engine

    return Engine(config)


def run_server(engine_config: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
               max_body_bytes: Optional[int] = None) -> None:
    """Build the engine, log its KV capacity and serve until interrupted."""
    import uvicorn

    engine = build_engine(engine_config)
    cap = getattr(engine, "capacity", None)
    if cap is not None:
        print(cap.log_line(), flush=True)
    app = create_app(engine, own_engine=True, max_body_bytes=max_body_bytes)
    limit = max_body_bytes if max_body_bytes is not None else default_max_body_bytes(engine.max_model_len)
    print(f"kvbench serving {engine.model_id} on http://{host}:{port}/v1 (request bodies up to {limit / 2**20:.1f} MiB)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)

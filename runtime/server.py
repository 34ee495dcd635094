"""OpenAI-compatible HTTP server over the embedded engine (DESIGN §7).

Routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming and not, ``usage``,
``logprobs``, ``echo``, ``stop``, ``seed``, ``n``; extensions ``ignore_eos``, ``min_tokens``, ``top_k``,
``stop_token_ids``, ``return_tokens_as_token_ids``), ``/health``, ``/metrics`` (Prometheus text) and the
tokenizer routes ``/tokenizer_info``, ``/tokenize``, ``/detokenize`` (what lm-eval's remote tokenizer uses).

Every request is one job of one or more engine requests (several prompts, or ``n`` > 1); the engine's
``on_delta`` callbacks arrive on the engine thread and are handed to the event loop with
``call_soon_threadsafe``.  When a job ends early (client gone, error, cancellation) its unfinished engine
requests are aborted, which frees their pages.  Bad input gets a 4xx with an OpenAI-style error body.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvbench.runtime.engine_api import SamplingParams, StreamDelta

_DISCONNECT_POLL_S = 0.5
_MAX_N = 16
_MAX_LOGPROBS = 20
_ROLES = ("system", "user", "assistant", "tool", "developer")


# ----------------------------------------------------------------------------- protocol


class ApiError(Exception):
    """An error answered with an OpenAI-style body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code or self.status}}


def _is_int(v) -> bool:
    return type(v) is int


def _is_num(v) -> bool:
    return type(v) in (int, float)


def _get(body: dict, name: str, check, what: str, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if not check(v):
        raise ApiError(400, f"'{name}' must be {what}, got {json.dumps(v)[:80]}", param=name)
    return v


def _str_list(v) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


@dataclass
class ParsedRequest:
    prompts: list[list[int]]
    params: SamplingParams
    max_tokens: int
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: Optional[int] = None
    as_ids: bool = False
    texts: list = field(default_factory=list)  # the prompts as given, when given as text (for echo)

    def params_for(self, k: int) -> SamplingParams:
        seed = self.params.seed
        return replace(self.params, seed=None if seed is None else seed + k)


def _parse_prompt(prompt, tok) -> list[list[int]]:
    vocab = tok.vocab_size
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists", param="prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise ApiError(400, "'prompt' must not be empty", param="prompt")
            out.append(tok.encode(p, add_special_tokens=True))
        elif isinstance(p, list) and p and all(_is_int(t) and 0 <= t < vocab for t in p):
            out.append(list(p))
        else:
            raise ApiError(400, f"'prompt' entries must be non-empty strings or lists of token ids in [0, {vocab})", param="prompt")
    return out


def _message_text(m) -> str:
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
        raise ApiError(400, f"each message must be an object with 'role' in {list(_ROLES)}", param="messages")
    c = m.get("content")
    if isinstance(c, str):
        return c
    if c is None and m["role"] == "assistant":
        return ""
    if isinstance(c, list) and all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
        return "".join(x["text"] for x in c)
    raise ApiError(400, "message 'content' must be a string or a list of text parts", param="messages")


def _common(body: dict, prompt_lens: list[int], max_model_len: int, default_max_tokens: Optional[int], chat: bool) -> ParsedRequest:
    echo = bool(_get(body, "echo", lambda v: isinstance(v, bool), "a boolean", False)) if not chat else False
    longest = max(prompt_lens)
    if longest >= max_model_len:
        raise ApiError(400, f"prompt has {longest} tokens; this model's context is {max_model_len} tokens", param="prompt", code="context_length_exceeded")
    max_tokens = _get(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens", _is_int, "an integer")
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else max_model_len - longest
    if max_tokens < (0 if echo else 1):
        raise ApiError(400, f"'max_tokens' must be at least {0 if echo else 1}, got {max_tokens}", param="max_tokens")
    if longest + max_tokens > max_model_len:
        raise ApiError(400, f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the context of {max_model_len} tokens", param="max_tokens", code="context_length_exceeded")
    n = _get(body, "n", _is_int, "an integer", 1)
    if not 1 <= n <= _MAX_N:
        raise ApiError(400, f"'n' must be in [1, {_MAX_N}], got {n}", param="n")
    best_of = _get(body, "best_of", _is_int, "an integer")
    if best_of not in (None, n):
        raise ApiError(400, "'best_of' other than n is not supported", param="best_of")
    temperature = float(_get(body, "temperature", _is_num, "a number", 1.0 if chat else 1.0))
    if not 0.0 <= temperature <= 2.0:
        raise ApiError(400, f"'temperature' must be in [0, 2], got {temperature}", param="temperature")
    top_p = float(_get(body, "top_p", _is_num, "a number", 1.0))
    if not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = _get(body, "top_k", _is_int, "an integer", 0)
    if top_k < -1:
        raise ApiError(400, f"'top_k' must be >= -1 (-1 or 0 = off), got {top_k}", param="top_k")
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, _is_num, "a number", 0) != 0:
            raise ApiError(400, f"'{name}' is not supported (only 0)", param=name)
    if body.get("logit_bias"):
        raise ApiError(400, "'logit_bias' is not supported", param="logit_bias")
    if body.get("tools"):
        raise ApiError(400, "'tools' are not supported", param="tools")
    seed = _get(body, "seed", _is_int, "an integer")
    stop = _get(body, "stop", _str_list, "a string or a list of strings", [])
    stop = [stop] if isinstance(stop, str) else [s for s in stop if s]
    stop_ids = _get(body, "stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(x) for x in v), "a list of integers", [])
    ignore_eos = _get(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False)
    min_tokens = _get(body, "min_tokens", _is_int, "an integer", 0)
    if not 0 <= min_tokens <= max_tokens:
        raise ApiError(400, f"'min_tokens' must be in [0, max_tokens={max_tokens}], got {min_tokens}", param="min_tokens")
    if chat:
        want = _get(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
        top = _get(body, "top_logprobs", _is_int, "an integer", 0)
        if top and not want:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = top if want else None
    else:
        logprobs = _get(body, "logprobs", _is_int, "an integer")
    if logprobs is not None and not 0 <= logprobs <= _MAX_LOGPROBS:
        raise ApiError(400, f"logprobs must be in [0, {_MAX_LOGPROBS}], got {logprobs}", param="logprobs")
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    opts = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = bool(opts.get("include_usage", False))
    params = SamplingParams(
        max_tokens=max(max_tokens, 1), temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed,
        stop=tuple(stop), stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos, min_tokens=min_tokens, logprobs=logprobs,
    )
    as_ids = _get(body, "return_tokens_as_token_ids", lambda v: isinstance(v, bool), "a boolean", False)
    return ParsedRequest([], params, max_tokens, n, stream, include_usage, echo, logprobs, as_ids)


def parse_completion(body: dict, tok, max_model_len: int) -> ParsedRequest:
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", param="prompt")
    prompts = _parse_prompt(body["prompt"], tok)
    req = _common(body, [len(p) for p in prompts], max_model_len, 16, chat=False)
    req.prompts = prompts
    raw = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    req.texts = [p if isinstance(p, str) else None for p in raw] if len(raw) == len(prompts) else [None] * len(prompts)
    return req


def parse_chat(body: dict, tok, max_model_len: int) -> ParsedRequest:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    clean = [{"role": m["role"], "content": _message_text(m)} for m in msgs]
    try:
        text = tok.apply_chat_template(clean, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - template errors are the caller's input
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
    ids = tok.encode(text, add_special_tokens=False)
    req = _common(body, [len(ids)], max_model_len, None, chat=True)
    req.prompts = [ids]
    return req


def render_logprobs(chat: bool, ids, lps, tops, k: int, tstr, pre=None, offset: int = 0) -> dict:
    """OpenAI logprobs block (completions: tokens/token_logprobs/top_logprobs/text_offset; chat: content)."""
    strs = [tstr(i) for i in ids]
    top_dicts = []
    for j, i in enumerate(ids):
        d: dict = {}
        src = tops[j] if j < len(tops) and tops[j] else {}
        for t, v in sorted(src.items(), key=lambda kv: -kv[1])[: max(k, 0)]:
            s = tstr(int(t))
            d[s] = max(float(v), d.get(s, -math.inf))
        if j < len(lps) and strs[j] not in d and (k == 0 or not src):
            d[strs[j]] = float(lps[j])
        top_dicts.append(d)
    vals = [float(v) for v in lps[: len(ids)]]
    if chat:
        content = []
        for s, v, d in zip(strs, vals, top_dicts):
            tl = [{"token": t, "logprob": x, "bytes": list(t.encode())} for t, x in d.items()][: max(k, 0)]
            content.append({"token": s, "logprob": v, "bytes": list(s.encode()), "top_logprobs": tl})
        return {"content": content}
    tokens, token_lps, top_lps = list(pre[0]) if pre else [], list(pre[1]) if pre else [], list(pre[2]) if pre else []
    tokens += strs
    token_lps += vals
    top_lps += top_dicts
    offs, pos = [], offset
    for s in tokens:
        offs.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top_lps, "text_offset": offs}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def prometheus_text(stats, model_id: str) -> str:
    label = '{model_name="%s"}' % model_id.replace("\\", "\\\\").replace('"', '\\"')
    rows = [
        ("num_requests_running", "gauge", "Requests in the running batch", stats.running),
        ("num_requests_waiting", "gauge", "Requests waiting for admission", stats.waiting),
        ("kv_pages_used", "gauge", "KV cache pages in use", stats.pages_used),
        ("kv_pages_total", "gauge", "KV cache pages in the pool", stats.pages_total),
        ("kv_cache_usage_ratio", "gauge", "Fraction of KV pages in use", stats.kv_usage),
        ("preemptions_total", "counter", "Requests preempted (recomputed) since start", stats.preemptions),
        ("prompt_tokens_total", "counter", "Prompt tokens processed since start", stats.prompt_tokens),
        ("generation_tokens_total", "counter", "Tokens generated since start", stats.generation_tokens),
        ("requests_finished_total", "counter", "Requests finished since start", stats.requests_finished),
        ("requests_aborted_total", "counter", "Requests aborted since start", stats.requests_aborted),
    ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP kvbench_{name} {help_}", f"# TYPE kvbench_{name} {kind}", f"kvbench_{name}{label} {float(value)}"]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- serving




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


def create_app(engine, own_engine: bool = False):
    """A FastAPI app serving ``engine`` (an ``EngineProtocol``); starts its step loop on start-up."""
    from contextlib import asynccontextmanager

    tok = engine.tokenizer
    model_id = engine.model_id

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
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

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        name = body.get("model")
        if name is not None and name != model_id:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{model_id}`", "not_found_error", "model", "model_not_found")
        return body

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

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request)
        text, special = body.get("prompt"), body.get("add_special_tokens", True)
        if not isinstance(text, str) or not isinstance(special, bool):
            raise ApiError(400, "/tokenize needs 'prompt' (string) and optional 'add_special_tokens' (bool)", param="prompt")
        ids = tok.encode(text, add_special_tokens=special)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await body_of(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < tok.vocab_size for i in ids):
            raise ApiError(400, f"/detokenize needs 'tokens': a list of token ids in [0, {tok.vocab_size})", param="tokens")
        return {"prompt": tok.decode(ids, skip_special_tokens=False)}

    async def echo_logprobs(ids: list[int], top_k: int, as_ids: bool) -> tuple[list, list, list]:
        """Prompt tokens' logprobs (first is None) by teacher-forced scoring through the cache."""
        strs = [token_str(i, as_ids) for i in ids]
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
                c.text = req.texts[p] if req.texts and req.texts[p] is not None else tok.decode(prompts[c.index], skip_special_tokens=False)
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
            return _sse({"id": base, "object": obj + ".chunk" if chat else obj, "created": created, "model": model_id, "choices": [ch]})

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
                            yield _sse(ApiError(500, d.error or "engine error", "server_error").body())
                            break
                        c.n_tokens += len(d.token_ids)
                        fr = d.finish_reason if d.finish_reason in ("stop", "length") else None
                        if d.text or d.token_ids or fr:
                            lp = lp_block(c, d.token_ids, d.logprobs or [], d.top_logprobs or [], False, len(c.text))
                            c.text += d.text  # streamed so far (text_offset of the next chunk)
                            yield chunk(c, d.text, lp, fr)
                    if req.include_usage:
                        yield _sse({"id": base, "object": obj + ".chunk" if chat else obj, "created": created, "model": model_id, "choices": [], "usage": usage()})
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
        req = parse_completion(await body_of(request), tok, engine.max_model_len)
        return await run_job(request, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_chat(await body_of(request), tok, engine.max_model_len)
        return await run_job(request, req, chat=True)

    return app


def build_engine(config: Any):
    """The embedded engine for an ``EngineConfig``."""
    from kvbench.runtime.engine import Engine

    return Engine(config)


def run_server(engine_config: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    """Build the engine, log its KV capacity and serve until interrupted."""
    import uvicorn

    engine = build_engine(engine_config)
    cap = getattr(engine, "capacity", None)
    if cap is not None:
        print(cap.log_line(), flush=True)
    print(f"kvbench serving {engine.model_id} on http://{host}:{port}/v1", flush=True)
    uvicorn.run(create_app(engine, own_engine=True), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)

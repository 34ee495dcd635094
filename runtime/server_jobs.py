"""The completion job behind one HTTP request of the embedded server (``runtime/server.py``).

A ``Job`` is the engine requests of one HTTP request (several prompts, or ``n`` > 1) with one event queue:
the engine's ``on_delta`` callbacks arrive on the engine thread and are handed to the event loop with
``call_soon_threadsafe``.  ``run_job`` collects the deltas into choices and answers with one JSON body, or
streams them as server-sent events; when a job ends early (client gone, error, cancellation) its
unfinished engine requests are aborted, which frees their pages.  ``echo_logprobs`` scores an echoed
prompt by teacher forcing.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvbench.runtime.engine_api import SamplingParams, StreamDelta
from kvbench.runtime.server_protocol import ApiError, ParsedRequest, render_logprobs, sse_event

__all__ = ["Job", "JobContext", "echo_logprobs", "run_job"]

_DISCONNECT_POLL_S = 0.5


class _LoopInbox:
    """Deltas from the engine thread on their way to one event loop.  The engine hands over a token of every
    running request each step; waking the loop once per token (a write to its self-pipe each, under the GIL
    the engine thread needs for its next step) grew the step with the batch, so the deltas wait in one list
    and the loop is woken only when the list was empty (one wake-up per step, or fewer)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: list = []
        self._lock = threading.Lock()

    def put(self, queue: asyncio.Queue, delta: StreamDelta) -> None:
        with self._lock:
            self._items.append((queue, delta))
            if len(self._items) > 1:
                return  # a wake-up is already on its way
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, delta in items:
            queue.put_nowait(delta)


_INBOXES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopInbox]" = weakref.WeakKeyDictionary()


def _inbox(loop: asyncio.AbstractEventLoop) -> _LoopInbox:
    box = _INBOXES.get(loop)
    if box is None:
        box = _INBOXES.setdefault(loop, _LoopInbox(loop))
    return box


class Job:
    """The engine requests behind one HTTP request, with one event queue fed from the engine thread."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.index: dict[str, int] = {}
        self.open: set[str] = set()
        self._checked = time.monotonic()
        self._inbox = _inbox(loop)

    def _push(self, delta: StreamDelta) -> None:
        self._inbox.put(self.queue, delta)

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


@dataclass(frozen=True)
class JobContext:
    """What a completion job needs from the app: the engine, its tokenizer, the served model id and the
    coroutine that runs CPU work (decoding, rendering) on the request-preparation threads."""

    engine: Any
    tok: Any
    model_id: str
    off_loop: Callable[..., Awaitable[Any]]

    def token_str(self, i: int, as_ids: bool) -> str:
        return f"token_id:{i}" if as_ids else self.tok.decode([i], skip_special_tokens=False)


async def echo_logprobs(ctx: JobContext, ids: list[int], top_k: int, as_ids: bool) -> tuple[list, list, list]:
    """Prompt tokens' logprobs (first is None) by teacher-forced scoring through the cache."""
    engine, off_loop, token_str = ctx.engine, ctx.off_loop, ctx.token_str
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


class _Reply:
    """One job's response: its id, its choices (prompts x ``n``) with their engine requests, and the rendering
    of its deltas as JSON choices or SSE chunks."""

    def __init__(self, ctx: JobContext, req: ParsedRequest, chat: bool):
        self.ctx, self.req, self.chat = ctx, req, chat
        self.base = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.obj = "chat.completion" if chat else "text_completion"
        self.prompts = [ids for ids in req.prompts for _ in range(req.n)]
        self.params = [req.params_for(k) for _ in req.prompts for k in range(req.n)]
        self.choices = [_Choice(i) for i in range(len(self.prompts))]
        self.prompt_tokens = sum(len(ids) for ids in req.prompts)
        self.echo_lp: dict[int, tuple] = {}

    async def add_echo(self) -> None:
        """Each choice starts with its prompt's text, and with its logprobs when asked (scored once per prompt)."""
        req, ctx = self.req, self.ctx
        for c in self.choices:
            p = c.index // req.n
            c.text = req.texts[p] if req.texts and req.texts[p] is not None else await ctx.off_loop(
                functools.partial(ctx.tok.decode, skip_special_tokens=False), self.prompts[c.index])
            if req.logprobs is not None and p not in self.echo_lp:
                self.echo_lp[p] = await echo_logprobs(ctx, self.prompts[c.index], req.logprobs, req.as_ids)

    def tstr(self, i: int) -> str:
        return self.ctx.token_str(i, self.req.as_ids)

    def lp_block(self, c: _Choice, ids, lps, tops, with_echo: bool, offset: int = 0):
        req = self.req
        if req.logprobs is None:
            return None
        pre = self.echo_lp.get(c.index // req.n) if with_echo else None
        return render_logprobs(self.chat, ids, lps, tops, req.logprobs, self.tstr, pre, offset)

    def usage(self) -> dict:
        done = sum(c.n_tokens for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done, "total_tokens": self.prompt_tokens + done}

    def _event(self, choices: list, **extra) -> str:
        obj = self.obj + ".chunk" if self.chat else self.obj
        return sse_event({"id": self.base, "object": obj, "created": self.created, "model": self.ctx.model_id,
                          "choices": choices, **extra})

    def chunk(self, c: _Choice, text: str, lp, finish: Optional[str], first: bool = False) -> str:
        if self.chat:
            delta = ({"role": "assistant", "content": text} if first else ({"content": text} if text else {}))
            ch = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            ch = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}
        return self._event([ch])

    def usage_chunk(self) -> str:
        return self._event([], usage=self.usage())

    def body(self) -> dict:
        """The JSON response once every choice finished."""
        out = []
        for c in self.choices:
            lp = self.lp_block(c, c.tokens, c.logprobs, c.top, self.req.echo)
            if self.chat:
                out.append({"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                out.append({"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        return {"id": self.base, "object": self.obj, "created": self.created, "model": self.ctx.model_id, "choices": out,
                "usage": self.usage()}


async def _sse(job: Job, r: _Reply):
    """The SSE chunks of a streaming job (its engine requests are aborted when the stream ends early)."""
    req, chat, choices = r.req, r.chat, r.choices
    try:
        # the echoed prompt goes first; a chat role otherwise comes with the first token (as vLLM sends it),
        # so a client timing the first chunk times the first token
        role_due = set() if req.echo else {c.index for c in choices} if chat else set()
        for c in choices:
            if req.echo:
                yield r.chunk(c, c.text, r.lp_block(c, [], [], [], True), c.finish_reason, first=True)
        while not job.done:
            d = await job.next()
            c = choices[job.index[d.request_id]]
            if d.finish_reason == "error" or d.error:
                yield sse_event(ApiError(500, d.error or "engine error", "server_error").body())
                break
            c.n_tokens += len(d.token_ids)
            fr = d.finish_reason if d.finish_reason in ("stop", "length") else None
            if d.text or d.token_ids or fr:
                lp = r.lp_block(c, d.token_ids, d.logprobs or [], d.top_logprobs or [], False, len(c.text))
                c.text += d.text  # streamed so far (text_offset of the next chunk)
                yield r.chunk(c, d.text, lp, fr, first=c.index in role_due)
                role_due.discard(c.index)
        if req.include_usage:
            yield r.usage_chunk()
        yield "data: [DONE]\n\n"
    finally:
        job.abort()


async def _collect(job: Job, request: Request, choices: list[_Choice]) -> None:
    """Gather a non-streaming job's deltas into its choices (499 when the client leaves, 500 on an engine error)."""
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


async def run_job(ctx: JobContext, request: Request, req: ParsedRequest, chat: bool):
    """Run one parsed completion request: the response body (a dict), or a ``StreamingResponse`` of SSE chunks when it streams."""
    r = _Reply(ctx, req, chat)
    if req.echo:
        await r.add_echo()
    job = Job(ctx.engine, asyncio.get_running_loop())
    if req.max_tokens > 0:
        job.submit(r.base, r.prompts, r.params)
    else:  # echo only
        for c in r.choices:
            c.finish_reason = "length"
    if req.stream:
        return StreamingResponse(_sse(job, r), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    await _collect(job, request, r.choices)
    return r.body()

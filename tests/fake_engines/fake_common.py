"""What the fake SGLang and vLLM servers share: the model "config", a KV budget turned into token capacity,
an admission-limited scheduler (at most ``max_running`` requests generate, the rest wait, so queueing shows
on ``/metrics``), deterministic answer-bearing outputs, the OpenAI-compatible routes and their response
shapes, and the request log.  The engine-specific parts (flags, log lines, metric names, field names,
error shapes) come from an ``EngineStyle`` built by each fake.

Outputs are a pure function of the prompt:
* a chat prompt asking for ``\\boxed{}`` (AIME) answers ``\\boxed{N}`` with N from a ``ANSWER=N`` marker in
  the prompt (``\\boxed{0}`` without one);
* a multiple-choice chat prompt (GPQA: kvbench's ``Answer: X``, simple-evals' ``Answer: $LETTER``, the gpt-oss
  evals' "corresponding option") answers with the letter of the option line (``A) ...`` or ``(A) ...``)
  holding the word ``CORRECT`` (``A`` when none does);
* anything else gets filler words ``w0 w1 ...`` (8 of them, or ``max_tokens`` with ``ignore_eos``).
Every chat answer starts with reasoning (a reasoning model): with a reasoning parser in the engine's
reasoning field(s), one token per word; without one inlined in the content as one ``<think>...</think>``
token.  Its length follows ``reasoning_effort`` (low 2 words, medium 4, high 8).

Environment: ``FAKE_KV_BUDGET_MIB`` (KV memory per GPU at the default memory fraction, default 1024),
``FAKE_TOKEN_DELAY_S`` (per output token, default 0.004), ``FAKE_REQUEST_LOG`` (a JSONL file: one line per
POST with route and body, and per cache flush).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

KV_BYTES = {"auto": 2, "bf16": 2, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1,
            "fp8_ds_mla": 1, "int8": 1, "fp4_e2m1": 0.5}
EFFORT_WORDS = {"low": 2, "medium": 4, "high": 8}


def emit(line: str) -> None:
    print(line, flush=True)


def stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


@dataclass
class ModelInfo:
    path: str
    layers: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    max_len: int = 4096
    arch: str = "LlamaForCausalLM"

    def bytes_per_token(self, kv_dtype: str) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * KV_BYTES.get(kv_dtype, 2)


def load_model(path: str) -> Optional[ModelInfo]:
    """The model directory's config.json; None when the path is no directory with one."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    c = json.loads(cfg.read_text() or "{}")
    heads = int(c.get("num_attention_heads", 4))
    return ModelInfo(path, layers=int(c.get("num_hidden_layers", 4)), kv_heads=int(c.get("num_key_value_heads", heads // 2 or 1)),
                     head_dim=int(c.get("head_dim", c.get("hidden_size", heads * 64) // heads)),
                     max_len=int(c.get("max_position_embeddings", 4096)), arch=(c.get("architectures") or ["LlamaForCausalLM"])[0])


def kv_budget_bytes(fraction: float, default_fraction: float, tp: int) -> int:
    mib = float(os.environ.get("FAKE_KV_BUDGET_MIB", "1024"))
    return int(mib * 2**20 * tp * fraction / default_fraction)


def fake_args_line(engine: str, args, argv: list[str]) -> str:
    env = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "VLLM_ATTENTION_BACKEND", "VLLM_SERVER_DEV_MODE") if k in os.environ}
    return "FAKE_ARGS " + json.dumps({"engine": engine, "argv": argv, "args": vars(args), "env": env}, sort_keys=True)


# ------------------------------------------------------------------------------------------ scheduler
class Scheduler:
    """At most ``max_running`` requests generate at once; the others wait (FIFO)."""

    def __init__(self, max_running: int, capacity_tokens: int, token_delay_s: float):
        self.max_running, self.capacity = max_running, capacity_tokens
        self.token_delay_s = token_delay_s
        self.running = self.waiting = self.used_tokens = 0
        self.prompt_tokens_total = self.generation_tokens_total = self.finished = self.preemptions = 0
        self._sem: Optional[asyncio.Semaphore] = None

    async def generate(self, prompt_tokens: int, pieces: list[tuple[str, str]]):
        """Yield the pieces one token at a time once admitted."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_running)
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        held = prompt_tokens
        self.used_tokens += held
        self.prompt_tokens_total += prompt_tokens
        try:
            await asyncio.sleep(self.token_delay_s)  # prefill
            for p in pieces:
                await asyncio.sleep(self.token_delay_s)
                held += 1
                self.used_tokens += 1
                self.generation_tokens_total += 1
                yield p
            self.finished += 1
        finally:
            self.used_tokens -= held
            self.running -= 1
            self._sem.release()

    @property
    def usage(self) -> float:
        return min(1.0, self.used_tokens / self.capacity) if self.capacity else 0.0


# ------------------------------------------------------------------------------------------ outputs
def count_tokens(prompt) -> int:
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], list):
            return sum(len(p) for p in prompt)
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)
        return sum(len(str(p).split()) for p in prompt)
    return len(str(prompt).split())


def answer_of(text: str) -> Optional[str]:
    if "\\boxed{" in text:
        m = re.search(r"ANSWER=(\d+)", text)
        return f"The final answer is \\boxed{{{m.group(1) if m else 0}}}"
    if "Answer: X" in text or "Answer: $LETTER" in text or "corresponding option" in text:
        # kvbench's and simple-evals' "A) ..." option lines, the gpt-oss evals' "(A) ..."
        for letter, option in re.findall(r"^\(?([A-D])\) (.*)$", text, re.MULTILINE):
            if "CORRECT" in option:
                return f"Let me pick.\nAnswer: {letter}"
        return "Let me pick.\nAnswer: A"
    return None


def output_pieces(text: str, max_tokens: int, ignore_eos: bool, effort: Optional[str], reasoning_field: Optional[str],
                  chat: bool = True) -> tuple[list[tuple[str, str]], str]:
    """(pieces as (kind, text) with kind ``content`` | ``reasoning``, finish_reason).  The model reasons before
    every chat answer (it is a reasoning model); completions get no reasoning."""
    pieces: list[tuple[str, str]] = []
    answer = answer_of(text)
    if chat:
        words = ["Thinking", "about", "the", "question", "step", "by", "step", "carefully"][:EFFORT_WORDS.get(effort or "medium", 4)]
        if reasoning_field:
            pieces += [("reasoning", (" " if i else "") + w) for i, w in enumerate(words)]
        else:
            pieces += [("content", "<think>" + " ".join(words) + "</think>")]
    if answer is not None:
        toks = re.split(r"(?<=\s)", answer)
        pieces += [("content", t) for t in toks if t]
    else:
        n = max_tokens if ignore_eos else min(8, max_tokens)
        pieces += [("content", f" w{i}") for i in range(n)]
    if ignore_eos and len(pieces) < max_tokens:
        pieces += [("content", f" w{i}") for i in range(max_tokens - len(pieces))]
    if len(pieces) > max_tokens:
        return pieces[:max_tokens], "length"
    return pieces, "length" if ignore_eos else "stop"


def prompt_text(body: dict) -> str:
    if "messages" in body:
        parts = []
        for m in body.get("messages") or []:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, list):
                c = " ".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
            parts.append(str(c or ""))
        return "\n".join(parts)
    p = body.get("prompt")
    return p if isinstance(p, str) else ""


# ------------------------------------------------------------------------------------------ engine style
@dataclass
class EngineStyle:
    name: str  # sglang | vllm
    served_name: str
    model_path: str
    max_model_len: int
    reasoning_fields: tuple[str, ...]  # where reasoning text goes (empty: no reasoning parser)
    error_body: Callable[[str, str, int, Optional[str]], dict]
    metrics_text: Callable[["Scheduler"], str]
    owned_by: str
    metrics_enabled: bool = True
    flush_route: Optional[tuple[tuple[str, ...], str]] = None  # (methods, path)
    flush_enabled: bool = True
    tokenize: bool = False
    check_model_name: bool = False
    context_error: Callable[[int, int, int], str] = lambda limit, prompt, new: f"context length {limit} exceeded"
    context_param: Optional[str] = None  # the error's param (vLLM 0.26: "input_tokens")
    bad_json: Optional[Callable[[Exception], tuple]] = None  # (message, type, param) for an unparsable body
    flush_json: bool = False
    value_suffix: bool = False  # vLLM 0.26 ends a parameter error with "(parameter=NAME, value=VALUE)"  # the flush answers {"success": bool} (vLLM 0.26: false while requests hold blocks)
    extra_card: dict = field(default_factory=dict)


def request_log(route: str, body) -> None:
    path = os.environ.get("FAKE_REQUEST_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"route": route, "body": body, "pid": os.getpid()}) + "\n")


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": None}


def build_app(style: EngineStyle, sched: Scheduler):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    def error(message: str, typ: str = "BadRequestError", code: int = 400, param: Optional[str] = None):
        return JSONResponse(style.error_body(message, typ, code, param), status_code=code)

    async def health(_: Request):
        return Response(status_code=200)

    async def models(_: Request):
        card = {"id": style.served_name, "object": "model", "created": int(time.time()), "owned_by": style.owned_by,
                "root": style.model_path, "parent": None, "max_model_len": style.max_model_len, **style.extra_card}
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(_: Request):
        if not style.metrics_enabled:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return PlainTextResponse(style.metrics_text(sched), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def flush(_: Request):
        if not style.flush_enabled:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        request_log(style.flush_route[1], None)
        if style.name == "sglang":
            text = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                    "requests, the operation will not be performed.)\n")
            return PlainTextResponse(text, status_code=200 if sched.running + sched.waiting == 0 else 400)
        if style.flush_json:
            return JSONResponse({"success": sched.running + sched.waiting == 0})
        return Response(status_code=200)

    async def tokenize(request: Request):
        body = await request.json()
        text = prompt_text(body) if "messages" in body else str(body.get("prompt", ""))
        toks = [sum(map(ord, w)) % 32000 for w in text.split()]
        return JSONResponse({"count": len(toks), "max_model_len": style.max_model_len, "tokens": toks, "token_strs": None})

    async def complete(request: Request):
        chat = request.url.path.endswith("/chat/completions")
        try:
            body = await request.json()
        except ValueError as e:
            if style.bad_json is not None:
                msg, typ, param = style.bad_json(e)
                return error(msg, typ, 400, param)
            return error(f"invalid JSON body: {e}")
        request_log(request.url.path, body)
        if not isinstance(body, dict):
            return error("the request body must be a JSON object")
        if chat and not isinstance(body.get("messages"), list):
            return error("Field required: messages", param="messages")
        if not chat and body.get("prompt") in (None, "", []):
            return error("Field required: prompt", param="prompt")
        if style.check_model_name and body.get("model") not in (None, style.served_name):
            return error(f"The model `{body.get('model')}` does not exist.", "NotFoundError", 404, "model")
        effort = body.get("reasoning_effort")
        if effort is not None and effort not in EFFORT_WORDS:
            return error(f"reasoning_effort: Input should be 'low', 'medium' or 'high' (got {effort!r})", param="reasoning_effort")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        temperature = body.get("temperature")
        tail = (lambda name, v: f" (parameter={name}, value={v})") if style.value_suffix else (lambda name, v: "")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return error(f"max_tokens must be at least 1, got {max_tokens}.{tail('max_tokens', max_tokens)}", param="max_tokens")
        if temperature is not None and (not isinstance(temperature, (int, float)) or temperature < 0):
            return error(f"temperature must be non-negative, got {temperature}.{tail('temperature', temperature)}", param="temperature")
        text = prompt_text(body)
        n_prompt = count_tokens(text) if chat else count_tokens(body["prompt"])
        if n_prompt + max_tokens > style.max_model_len:
            return error(style.context_error(style.max_model_len, n_prompt, max_tokens), param=style.context_param)
        fields = style.reasoning_fields if chat else ()
        pieces, finish = output_pieces(text, max_tokens, bool(body.get("ignore_eos")), effort,
                                       fields[0] if fields else None, chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created, model = int(time.time()), body.get("model") or style.served_name
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            out: list[tuple[str, str]] = [p async for p in sched.generate(n_prompt, pieces)]
            content = "".join(t for k, t in out if k == "content")
            reasoning = "".join(t for k, t in out if k == "reasoning") or None
            if chat:
                msg = {"role": "assistant", "content": content, "tool_calls": []}
                for f in fields:
                    msg[f] = reasoning
                choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            else:
                choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                                 "usage": _usage(n_prompt, len(out))})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, usage=None) -> str:
            d = {"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": choices}
            if usage is not None:
                d["usage"] = usage
            return "data: " + json.dumps(d) + "\n\n"

        async def events():
            n = 0
            async for kind, piece in sched.generate(n_prompt, pieces):
                n += 1
                if chat and n == 1:  # the role comes with the first token, as the engines send it
                    yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
                last = n == len(pieces)
                if chat:
                    delta = {f: piece for f in fields} if kind == "reasoning" else {"content": piece}
                    yield chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish if last else None}])
                else:
                    yield chunk([{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish if last else None,
                                  "stop_reason": None}])
            if include_usage:
                yield chunk([], _usage(n_prompt, n))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [Route("/health", health, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              Route("/v1/chat/completions", complete, methods=["POST"]), Route("/v1/completions", complete, methods=["POST"])]
    if style.flush_route:
        routes.append(Route(style.flush_route[1], flush, methods=list(style.flush_route[0])))
    if style.tokenize:
        routes.append(Route("/tokenize", tokenize, methods=["POST"]))
    return Starlette(routes=routes)


def serve(app, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


def fail_model_path(lines: list[str]) -> None:
    """An engine that cannot load its model: the error on stderr, exit code 1, no server."""
    for ln in lines:
        print(ln, file=sys.stderr, flush=True)
    sys.exit(1)

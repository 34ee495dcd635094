"""Request parsing/validation and response rendering for the OpenAI-compatible server (docs/design.md §7).

``parse_body`` checks a raw body; ``parse_completion`` / ``parse_chat`` turn it into a ``ParsedRequest``
(or raise ``ApiError``, a 4xx with an OpenAI-style error body); ``render_logprobs``, ``sse_event`` and
``prometheus_text`` render what the routes in ``kvbench.runtime.server`` send back.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Optional

from kvbench.runtime.engine_api import STEP_KINDS, SamplingParams

MAX_N = 16
MAX_LOGPROBS = 20
ROLES = ("system", "user", "assistant", "tool", "developer")

class ApiError(Exception):
    """An error answered with an OpenAI-style body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code or self.status}}

    def __reduce__(self):  # pickled back from a request-preparation worker process
        return ApiError, (self.status, self.message, self.type, self.param, self.code)


def parse_body(raw: bytes, model_id: str) -> dict:
    """A request body as a JSON object; a ``model`` other than ``model_id`` is a 404."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if _may_hold_surrogates(raw):
        try:  # JSON may escape a lone UTF-16 surrogate ("\ud800"), which is no text a tokenizer can take
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "request body holds a string that is not valid Unicode (an unpaired surrogate escape)") from None
        except RecursionError:
            raise ApiError(400, "request body is not valid JSON: nested too deeply") from None
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise ApiError(400, f"'model' must be a string, got {json.dumps(name)[:80]}", param="model")
    if name is not None and name != model_id:
        raise ApiError(404, f"The model `{name}` does not exist; this server serves `{model_id}`", "not_found_error", "model", "model_not_found")
    return body


def _may_hold_surrogates(raw: bytes) -> bool:
    """Whether a parsed body may hold a UTF-16 surrogate: only a ``\\uD800``-``\\uDFFF`` escape or the bytes of
    a surrogate written as UTF-8 (ED A0-BF ..., which ``json.loads`` lets through) put one there.  Three byte
    searches instead of writing the whole body out again (86 ms for a 7 MB prompt)."""
    return b"\\ud" in raw or b"\\uD" in raw or b"\xed" in raw


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
        return replace(self.params, seed=None if seed is None else choice_seed(seed, k))


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit integer, as torch's generators take


def choice_seed(seed: int, k: int) -> int:
    """The seed of choice ``k`` of a request with ``seed``: the seed itself for the first choice, a splitmix64
    mix of (seed, k) for the others, so that choice 1 of seed s is not choice 0 of seed s + 1."""
    if k == 0:
        return seed
    x = (seed + k * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1  # in [0, 2^63)


def _context_error(n_tokens: int, max_model_len: int, param: str, at_least: bool = False) -> ApiError:
    has = f"at least {n_tokens} tokens" if at_least else f"{n_tokens} tokens"
    return ApiError(400, f"prompt has {has}; this model's context is {max_model_len} tokens", param=param,
                    code="context_length_exceeded")


def encode_within(tok, text: str, max_model_len: int, add_special_tokens: bool, param: str = "prompt") -> list[int]:
    """``tok.encode(text)``, unless the tokenizer's ``min_token_count`` (optional: a lower bound on the token
    count found without tokenizing) shows that ``text`` cannot fit the context: then a 400 at once, so a
    huge prompt costs a byte count, not a tokenization (time and memory grow with the text).  A tokenizer
    with ``encode_capped`` (optional) counts the tokens of a long text without turning them all into
    Python integers; one that is too long then gets its 400 here."""
    bound = getattr(tok, "min_token_count", None)
    least = bound(text) if bound is not None else 0
    if least >= max_model_len:
        raise _context_error(least, max_model_len, param, at_least=True)
    capped = getattr(tok, "encode_capped", None)
    if capped is None:
        return tok.encode(text, add_special_tokens=add_special_tokens)
    n, ids = capped(text, max_model_len - 1, add_special_tokens)
    if ids is None:
        raise _context_error(n, max_model_len, param)
    return ids


def _parse_prompt(prompt, tok, max_model_len: int) -> list[list[int]]:
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
            out.append(encode_within(tok, p, max_model_len, True))
        elif isinstance(p, list) and p and len(p) >= max_model_len:
            raise _context_error(len(p), max_model_len, "prompt")
        elif isinstance(p, list) and p and all(_is_int(t) and 0 <= t < vocab for t in p):
            out.append(list(p))
        else:
            raise ApiError(400, f"'prompt' entries must be non-empty strings or lists of token ids in [0, {vocab})", param="prompt")
    return out


def _message_text(m) -> str:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ApiError(400, f"each message must be an object with 'role' in {list(ROLES)}", param="messages")
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
        raise _context_error(longest, max_model_len, "messages" if chat else "prompt")
    # a null max_completion_tokens is "not given" (clients serialise unset fields as null): max_tokens then applies
    max_tokens = _get(body, "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens",
                      _is_int, "an integer")
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else max_model_len - longest
    if max_tokens < (0 if echo else 1):
        raise ApiError(400, f"'max_tokens' must be at least {0 if echo else 1}, got {max_tokens}", param="max_tokens")
    if longest + max_tokens > max_model_len:
        raise ApiError(400, f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the context of {max_model_len} tokens", param="max_tokens", code="context_length_exceeded")
    n = _get(body, "n", _is_int, "an integer", 1)
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"'n' must be in [1, {MAX_N}], got {n}", param="n")
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
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError(400, "'response_format' other than {\"type\": \"text\"} is not supported (no JSON mode)",
                       param="response_format")
    if not chat and body.get("suffix") not in (None, ""):
        raise ApiError(400, "'suffix' is not supported", param="suffix")
    seed = _get(body, "seed", lambda v: _is_int(v) and SEED_MIN <= v <= SEED_MAX, "an integer in [-2^63, 2^63)")
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
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="logprobs")
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    opts = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", None)
    if opts is not None and not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    include_usage = _get(opts or {}, "include_usage", lambda v: isinstance(v, bool), "a boolean", False)
    params = SamplingParams(
        max_tokens=max(max_tokens, 1), temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed,
        stop=tuple(stop), stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos, min_tokens=min_tokens, logprobs=logprobs,
    )
    as_ids = _get(body, "return_tokens_as_token_ids", lambda v: isinstance(v, bool), "a boolean", False)
    return ParsedRequest([], params, max_tokens, n, stream, include_usage, echo, logprobs, as_ids)


def parse_completion(body: dict, tok, max_model_len: int) -> ParsedRequest:
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", param="prompt")
    prompts = _parse_prompt(body["prompt"], tok, max_model_len)
    req = _common(body, [len(p) for p in prompts], max_model_len, 16, chat=False)
    req.prompts = prompts
    raw = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    req.texts = [p if isinstance(p, str) else None for p in raw] if len(raw) == len(prompts) else [None] * len(prompts)
    return req


def parse_chat(body: dict, tok, max_model_len: int) -> ParsedRequest:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    clean = []
    for m in msgs:
        text = _message_text(m)  # checks that m is a message object with a known role first
        clean.append({"role": m["role"], "content": text})
    try:
        text = tok.apply_chat_template(clean, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - template errors are the caller's input
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
    ids = encode_within(tok, text, max_model_len, False, param="messages")
    req = _common(body, [len(ids)], max_model_len, None, chat=True)
    req.prompts = [ids]
    return req


def tokenize_reply(body: dict, tok, max_model_len: int) -> bytes:
    """The JSON reply of ``/tokenize``: the prompt's token ids and their count."""
    text, special = body.get("prompt"), body.get("add_special_tokens", True)
    if not isinstance(text, str) or not isinstance(special, bool):
        raise ApiError(400, "/tokenize needs 'prompt' (string) and optional 'add_special_tokens' (bool)", param="prompt")
    ids = tok.encode(text, add_special_tokens=special)
    return json.dumps({"tokens": ids, "count": len(ids), "max_model_len": max_model_len}).encode()


def detokenize_reply(body: dict, tok) -> bytes:
    """The JSON reply of ``/detokenize``: the text of the given token ids."""
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < tok.vocab_size for i in ids):
        raise ApiError(400, f"/detokenize needs 'tokens': a list of token ids in [0, {tok.vocab_size})", param="tokens")
    return json.dumps({"prompt": tok.decode(ids, skip_special_tokens=False)}, ensure_ascii=False).encode()


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


def sse_event(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
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
        ("kernel_compiles_total", "counter", "Kernels compiled while serving (each stalled the running requests)",
         getattr(stats, "kernel_compiles", None)),
        ("kernel_compile_seconds_total", "counter", "Seconds spent compiling kernels while serving",
         getattr(stats, "kernel_compile_s", None)),
    ]
    for k in STEP_KINDS:  # where the step loop's time went
        if k in (getattr(stats, "step_counts", None) or {}):
            rows += [(f"engine_{k}_steps_total", "counter", f"Engine {k} steps run", stats.step_counts[k]),
                     (f"engine_{k}_step_seconds_total", "counter",
                      f"Wall seconds in {k} steps (launch, or the step before done, to sampled tokens on the host)", stats.step_seconds[k]),
                     (f"engine_{k}_step_tokens_total", "counter", f"Tokens forwarded in {k} steps",
                      stats.step_tokens[k])]
    out = []
    for name, kind, help_, value in rows:
        if value is None:  # not measured by this engine (kernel compiles on the CPU)
            continue
        out += [f"# HELP kvbench_{name} {help_}", f"# TYPE kvbench_{name} {kind}", f"kvbench_{name}{label} {float(value)}"]
    return "\n".join(out) + "\n"

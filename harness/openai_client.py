"""``OpenAIClient``: the ``Client`` protocol (core/client.py) over any OpenAI-compatible HTTP server.

``generate`` uses ``/v1/completions`` (raw prompt) or ``/v1/chat/completions`` (messages); ``stream``
yields text pieces from SSE; ``score`` teacher-forces a continuation through ``/v1/completions`` with
``echo`` + ``logprobs`` on token-id prompts (tokenized by the server's ``/tokenize``), as lm-eval's
``local-completions`` does.  A server without those features gets a clear ``NotImplementedError``.
HTTP errors of single requests come back as ``GenResult(finish_reason="error", error=..., error_kind="http")``;
a timeout, a lost connection or a response cut off raise ``RequestFailed`` (a ``ConnectionError`` carrying its
``error_kind``); an unreachable server raises ``ConnectionError``.  Thread-safe (one pooled ``httpx.Client``).

Requests (docs/external-engines.md, "Requests"): ``reasoning_effort`` (chat) and ``extra_body`` of the
``SamplingParams`` go into the JSON body; reasoning the server returns apart (``reasoning_content``, or
``reasoning`` in newer vLLM) is ``GenResult.reasoning``, never the answer text.  A request that gets no
response (connection refused, reset or closed before a response, connect timeout) is retried up to
``max_retries`` times with exponential backoff and jitter; an HTTP status (4xx, 429, 5xx), a timeout waiting for
the response and a response cut off are not retried.  ``GenResult.retries`` / ``RequestFailed.retries`` count
the retries.  The connection pool is unbounded by default (``max_connections``), so any number of requests
may be in flight.
"""

from __future__ import annotations

import json
import random
import time
from typing import Iterator, Optional

from kvbench.core import GenRequest, GenResult, RequestFailed, SamplingParams, ScoreRequest, ScoreResult


def _root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def _error_text(resp) -> str:
    try:
        err = resp.json().get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        msg = None
    return f"HTTP {resp.status_code}: {msg or resp.text[:300]}"


CONTROL_TIMEOUT_S = 60.0  # /v1/models: a control call, not a generation
BACKOFF_CAP_S = 30.0


def _reasoning_text(obj: dict) -> Optional[str]:
    """Reasoning a server returned apart from the answer: ``reasoning_content`` (sglang, vLLM) or
    ``reasoning`` (newer vLLM); None when neither is there."""
    for key in ("reasoning_content", "reasoning"):
        value = obj.get(key)
        if value:
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return None


def _read_failed(url: str, e: Exception, retries: int, mid_stream: bool) -> RequestFailed:
    """A response that broke off after its headers: ``timeout`` when httpx timed out, else ``stream``."""
    import httpx

    what = f"({type(e).__name__}: {e})"
    if isinstance(e, httpx.TimeoutException):
        return RequestFailed(f"{url}: timed out {'mid-stream' if mid_stream else 'reading the response'} {what}", "timeout",
                             retries)
    return RequestFailed(f"{url}: {'stream' if mid_stream else 'response'} cut off {what}", "stream", retries)


class OpenAIClient:
    def __init__(self, base_url: str, model: Optional[str] = None, api_key: Optional[str] = None, timeout: float = 600.0,
                 max_retries: int = 0, max_connections: Optional[int] = None, retry_backoff_s: float = 0.5):
        """``timeout``: seconds to wait for a response (a non-streamed generation: all of it; a stream: each
        event); ``max_retries``: retries of a request that got no response; ``max_connections``: the pool's
        bound (None: unbounded); ``retry_backoff_s``: the first backoff (doubling per retry, jittered, at most
        30 s)."""
        import httpx

        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.base_url = _root(base_url)
        self.timeout_s = float(timeout)
        self.max_retries = int(max_retries)
        self.retry_backoff_s = float(retry_backoff_s)
        self._sleep = time.sleep  # tests replace it
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers,
                                  timeout=httpx.Timeout(timeout, connect=min(timeout, CONTROL_TIMEOUT_S)),
                                  limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))
        self.model_id = model or self._first_model()

    # ------------------------------------------------------------------------------ plumbing
    def _request(self, method: str, path: str, **kw):
        import httpx

        try:
            return self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise ConnectionError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from None

    def _first_model(self) -> str:
        r = self._request("GET", "/v1/models", timeout=min(self.timeout_s, CONTROL_TIMEOUT_S))
        if r.status_code != 200:
            raise ConnectionError(f"{self.base_url}/v1/models: {_error_text(r)}")
        data = r.json().get("data") or []
        if not data:
            raise ValueError(f"{self.base_url}/v1/models lists no model")
        return str(data[0]["id"])

    def _payload(self, request: GenRequest, stream: bool) -> tuple[str, dict]:
        p: SamplingParams = request.params
        body: dict = {"model": self.model_id, "max_tokens": int(p.max_tokens), "temperature": float(p.temperature), "stream": stream}
        if p.top_p != 1.0:
            body["top_p"] = float(p.top_p)
        if p.top_k:
            body["top_k"] = int(p.top_k)  # extension (kvbench, vLLM, SGLang)
        if p.seed is not None:
            body["seed"] = int(p.seed)
        if p.stop:
            body["stop"] = list(p.stop)
        if p.stop_token_ids:
            body["stop_token_ids"] = list(p.stop_token_ids)
        if p.ignore_eos:
            body["ignore_eos"] = True
        if p.min_tokens:
            body["min_tokens"] = int(p.min_tokens)
        if request.messages is not None:
            path = "/v1/chat/completions"
            body["messages"] = request.messages
            if p.logprobs is not None:
                body["logprobs"] = True
                body["top_logprobs"] = int(p.logprobs)
            if p.reasoning_effort:
                body["reasoning_effort"] = p.reasoning_effort
        else:
            path = "/v1/completions"
            body["prompt"] = request.prompt
            if p.logprobs is not None:
                body["logprobs"] = int(p.logprobs)
        for key, value in (p.extra_body or {}).items():
            if key in body:
                raise ValueError(f"extra_body may not set {key!r}: kvbench sets it itself")
            body[key] = value
        return path, body

    # ------------------------------------------------------------------------------ Client
    def _backoff(self, attempt: int) -> float:
        """Seconds before retry ``attempt + 1``: exponential, capped, with jitter (half fixed, half random)."""
        d = min(BACKOFF_CAP_S, self.retry_backoff_s * (2 ** attempt))
        return d / 2 + random.uniform(0, d / 2)

    def _send(self, path: str, body: dict):
        """POST until a response's headers arrive: ``(response, retries, send time)`` with the body unread.
        No response (refused, reset, closed, connect timeout) is retried up to ``max_retries`` times; then, and
        for a timeout waiting for the response, ``RequestFailed`` (``connection`` / ``timeout``)."""
        import httpx

        url = f"{self.base_url}{path}"
        attempt = 0
        while True:
            t0 = time.perf_counter()
            try:
                return self._http.send(self._http.build_request("POST", path, json=body), stream=True), attempt, t0
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                    httpx.WriteError) as e:  # no response
                if attempt >= self.max_retries:
                    tries = f" after {attempt} retries" if attempt else ""
                    raise RequestFailed(f"{url}: no response{tries} ({type(e).__name__}: {e})", "connection", attempt) from None
            except httpx.TimeoutException as e:
                raise RequestFailed(f"{url}: timed out waiting for a response ({type(e).__name__}: {e})", "timeout",
                                    attempt) from None
            except httpx.TransportError as e:
                raise RequestFailed(f"{url}: {type(e).__name__}: {e}", "connection", attempt) from None
            self._sleep(self._backoff(attempt))
            attempt += 1

    def _post(self, path: str, body: dict):
        """POST and read the whole response: ``(response, retries, send time)``.  A failure raises
        ``RequestFailed`` with its kind: ``timeout``, ``connection`` (no response, after the retries),
        ``stream`` (the body broke off after the headers)."""
        import httpx

        url = f"{self.base_url}{path}"
        r, retries, t0 = self._send(path, body)
        try:
            r.read()
        except httpx.TransportError as e:  # timeouts included
            raise _read_failed(url, e, retries, mid_stream=False) from None
        finally:
            r.close()
        return r, retries, t0

    def generate(self, request: GenRequest) -> GenResult:
        """One completion.  A response with an HTTP error status or a malformed body is a ``GenResult`` with
        ``finish_reason="error"`` (``error_kind`` ``http`` / ``stream``); a timeout, a refused or reset
        connection and a body cut off mid-way raise ``RequestFailed`` (kinds ``timeout``, ``connection``,
        ``stream``)."""
        path, body = self._payload(request, stream=False)
        r, retries, t0 = self._post(path, body)
        latency = time.perf_counter() - t0
        if r.status_code != 200:
            return GenResult("", "error", 0, 0, latency, error=_error_text(r), error_kind="http", retries=retries)
        try:
            out = r.json()
            choice = out["choices"][0]
            usage = out.get("usage") or {}
            chat = request.messages is not None
            message = (choice.get("message") or {}) if chat else {}
            # the answer is the content alone; reasoning returned apart is kept apart (never scored)
            text = (message.get("content") or "") if chat else (choice.get("text") or "")
            logprobs = None
            lp = choice.get("logprobs")
            if request.params.logprobs is not None and lp:
                logprobs = [c["logprob"] for c in lp.get("content") or []] if chat else list(lp.get("token_logprobs") or [])
            return GenResult(
                text=text, finish_reason=choice.get("finish_reason") or "stop", prompt_tokens=int(usage.get("prompt_tokens", 0)),
                output_tokens=int(usage.get("completion_tokens", 0)), latency_s=latency, logprobs=logprobs,
                reasoning=_reasoning_text(message), retries=retries,
            )
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:  # ValueError: bad JSON
            return GenResult("", "error", 0, 0, latency, error=f"malformed response ({type(e).__name__}: {e}): {r.text[:200]}",
                             error_kind="stream", retries=retries)

    def stream(self, request: GenRequest) -> Iterator[str]:
        """Text pieces of one streamed completion (answer text only: reasoning deltas are not yielded).
        Raises ``RequestFailed``: ``http`` for an error status, ``timeout``, ``connection`` (after the
        retries), and ``stream`` when the stream breaks off, carries a malformed event or an error event, or
        ends without ``[DONE]`` and without a finish reason."""
        import httpx

        path, body = self._payload(request, stream=True)
        chat = request.messages is not None
        url = f"{self.base_url}{path}"
        finished = False
        r, retries, _ = self._send(path, body)
        try:
            if r.status_code != 200:
                try:
                    r.read()
                except httpx.TransportError as e:  # timeouts included
                    raise _read_failed(url, e, retries, mid_stream=False) from None
                raise RequestFailed(_error_text(r), "http", retries)
            try:
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        raise RequestFailed(f"{url}: malformed stream event: {data[:200]}", "stream") from None
                    if not isinstance(obj, dict):
                        raise RequestFailed(f"{url}: malformed stream event: {data[:200]}", "stream")
                    if obj.get("error"):
                        raise RequestFailed(f"{url}: error event mid-stream: {obj['error']}", "stream")
                    for choice in obj.get("choices") or ():
                        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                        if piece:
                            yield piece
                        finished = finished or bool(choice.get("finish_reason"))
            except httpx.TransportError as e:  # timeouts included
                raise _read_failed(url, e, retries, mid_stream=True) from None
        finally:
            r.close()
        if not finished:
            raise RequestFailed(f"{url}: stream ended without [DONE] or a finish reason", "stream", retries)

    def _tokenize(self, text: str, special: bool) -> list[int]:
        r = self._request("POST", "/tokenize", json={"prompt": text, "add_special_tokens": special})
        if r.status_code != 200:
            raise NotImplementedError(f"scoring over HTTP needs the server's /tokenize route ({_error_text(r)})")
        return list(r.json()["tokens"])

    def score(self, request: ScoreRequest) -> ScoreResult:
        ctx = self._tokenize(request.context, True)
        cont = self._tokenize(request.continuation, False)
        if not cont:
            raise ValueError("score needs a non-empty continuation")
        k = max(int(request.top_k), 1)
        body = {"model": self.model_id, "prompt": ctx + cont, "max_tokens": 1, "temperature": 0.0, "echo": True,
                "logprobs": k, "return_tokens_as_token_ids": True}
        r = self._request("POST", "/v1/completions", json=body)
        if r.status_code != 200:
            raise NotImplementedError(f"the server refused echo+logprobs scoring: {_error_text(r)}")
        lp = (r.json().get("choices") or [{}])[0].get("logprobs") or {}
        token_lps, tops = lp.get("token_logprobs"), lp.get("top_logprobs")
        n0 = len(ctx)
        if not token_lps or not tops or len(token_lps) < n0 + len(cont) or any(v is None for v in token_lps[n0 : n0 + len(cont)]):
            raise NotImplementedError("the server does not return prompt logprobs with echo=true")
        lps = [float(v) for v in token_lps[n0 : n0 + len(cont)]]
        top = tops[n0 : n0 + len(cont)]
        greedy = [bool(t) and v >= max(t.values()) for v, t in zip(lps, top)]
        top_ids = top_lps = None
        if request.top_k:
            try:
                rows = [sorted(((int(s.split(":", 1)[1]), float(v)) for s, v in t.items()), key=lambda x: -x[1]) for t in top]
                top_ids = [[i for i, _ in row][: request.top_k] for row in rows]
                top_lps = [[v for _, v in row][: request.top_k] for row in rows]
            except (ValueError, IndexError, AttributeError):
                top_ids = top_lps = None  # the server ignored return_tokens_as_token_ids
        return ScoreResult(token_ids=cont, logprobs=lps, greedy=greedy, top_ids=top_ids, top_logprobs=top_lps)

    def tokenizer(self):
        """The server's tokenizer through its ``/tokenize`` route (``harness.prompt_tokenizer``); raises
        ``PromptTokenizerError`` (saying to pass ``--tokenizer``) when the server has none."""
        from kvbench.suites import RemotePromptTokenizer

        if getattr(self, "_prompt_tokenizer", None) is None:
            auth = self._http.headers.get("Authorization", "")
            key = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
            self._prompt_tokenizer = RemotePromptTokenizer(self.base_url, key)
        return self._prompt_tokenizer

    def info(self) -> dict:
        info: dict = {"target": "openai", "base_url": self.base_url, "model": self.model_id,
                      "timeout_s": self.timeout_s, "max_retries": self.max_retries}
        r = self._request("GET", "/v1/models", timeout=min(self.timeout_s, CONTROL_TIMEOUT_S))
        if r.status_code == 200:
            for card in r.json().get("data") or []:
                if card.get("id") == self.model_id and card.get("max_model_len"):
                    info["max_model_len"] = card["max_model_len"]
        return info

    def close(self) -> None:
        tok = getattr(self, "_prompt_tokenizer", None)
        if tok is not None:
            tok.close()
        self._http.close()

"""Request options: how a suite's requests are sampled and what else their body carries.

A ``request`` mapping may sit on a suite (``suites[i].request``) and on a target (``targets[i].request``: the
defaults of every suite run on that target); ``kvbench eval`` takes the same as flags.  Keys:

    reasoning_effort  low | medium | high      chat requests only (the completion API has no such field)
    temperature       number >= 0
    top_p             number in (0, 1]
    top_k             integer >= 0 (0 = off)
    max_tokens        integer >= 1
    extra_body        mapping merged verbatim into the HTTP request's JSON body (HTTP targets only)

Precedence per key: suite request > target request > the suite protocol's defaults; ``extra_body`` merges key
by key (a suite's key replaces the target's).  ``extra_body`` may not name a key kvbench sets itself
(``OWN_BODY_KEYS``).  Embedded targets refuse ``extra_body`` (there is no request body) and render
``reasoning_effort`` as a chat-template variable (harness/engine_client.py).  No torch here.  The sweep
configuration parses and checks them in ``harness/request_options.py``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Optional

from kvbench.core.client import GenRequest, SamplingParams

__all__ = [
    "REQUEST_KEYS", "REASONING_EFFORTS", "DEFAULT_TIMEOUT_S", "DEFAULT_MAX_RETRIES", "OWN_BODY_KEYS",
    "RequestOptionsError", "merge_requests", "apply_request", "effective_options", "describe_request",
]

REQUEST_KEYS = ("reasoning_effort", "temperature", "top_p", "top_k", "max_tokens", "extra_body")
REASONING_EFFORTS = ("low", "medium", "high")
DEFAULT_TIMEOUT_S = 3600.0  # per request, for sweep targets (reasoning requests may run for hours)
DEFAULT_MAX_RETRIES = 3  # connection errors (refused, reset, no response), with exponential backoff

# JSON body keys kvbench sets itself -> what to use instead of naming them in extra_body
OWN_BODY_KEYS = {
    "model": "set by the target", "messages": "built by the suite", "prompt": "built by the suite",
    "stream": "set by the client", "stream_options": "set by the client", "n": "one choice per request",
    "max_tokens": "use request.max_tokens", "max_completion_tokens": "use request.max_tokens",
    "temperature": "use request.temperature", "top_p": "use request.top_p", "top_k": "use request.top_k",
    "reasoning_effort": "use request.reasoning_effort", "seed": "seeded per (item, repeat)",
    "stop": "set by the suite", "stop_token_ids": "set by the suite", "ignore_eos": "set by the suite",
    "min_tokens": "set by the suite", "logprobs": "set by the suite", "top_logprobs": "set by the suite",
    "echo": "set by the client",
}


class RequestOptionsError(ValueError):
    """Request options a target cannot honour (e.g. ``extra_body`` on the embedded engine)."""


def merge_requests(*layers: Optional[dict]) -> dict:
    """Merge request mappings, lowest precedence first (``merge_requests(target, suite)``): later layers
    replace earlier ones key by key; ``extra_body`` merges key by key."""
    out: dict = {}
    for layer in layers:
        for k, v in (layer or {}).items():
            if v is None:
                continue
            if k == "extra_body":
                out[k] = {**out.get(k, {}), **v}
            else:
                out[k] = v
    return out


def apply_request(params: SamplingParams, request: Optional[dict]) -> SamplingParams:
    """``params`` with the request options set (those given; the others keep the suite's defaults)."""
    if not request:
        return params
    unknown = [k for k in request if k not in REQUEST_KEYS]
    if unknown:
        raise RequestOptionsError(f"unknown request option {unknown[0]!r}; allowed: {', '.join(REQUEST_KEYS)}")
    changes = {k: v for k, v in request.items() if v is not None}
    if "extra_body" in changes:
        changes["extra_body"] = dict(changes["extra_body"]) or None
    return replace(params, **changes)


def effective_options(req: GenRequest) -> dict:
    """What a request was sent with (the records' ``request_options``): every ``REQUEST_KEYS`` entry, None
    where unset.  ``reasoning_effort`` is None for completion (raw prompt) requests: it is not sent there."""
    p = req.params
    return {
        "reasoning_effort": p.reasoning_effort if req.messages is not None else None,
        "temperature": float(p.temperature),
        "top_p": float(p.top_p),
        "top_k": int(p.top_k),
        "max_tokens": int(p.max_tokens),
        "extra_body": dict(p.extra_body) if p.extra_body else None,
    }


def describe_request(p: SamplingParams) -> str:
    """The protocol-string suffix of options beyond sampling: ``:effort-high``, ``:body-<hash>``."""
    out = f":effort-{p.reasoning_effort}" if p.reasoning_effort else ""
    if p.extra_body:
        import hashlib

        digest = hashlib.sha256(json.dumps(p.extra_body, sort_keys=True).encode()).hexdigest()[:8]
        out += f":body-{digest}"
    return out

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
``reasoning_effort`` as a chat-template variable (harness/engine_client.py).  No torch here.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Iterable, Optional

from kvbench.harness.client import GenRequest, SamplingParams
from kvbench.harness.config_checks import _check_keys, _fail, _int, _mapping, _num

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


def parse_request(value: Any, path: str) -> dict:
    """A validated ``request`` mapping (only the keys given; ``null`` values are left out).  Errors raise
    ``SweepConfigError`` naming the key path, e.g. ``suites[0].request.reasoning_effort``."""
    d = _mapping(value, path)
    _check_keys(d, REQUEST_KEYS, path)
    out: dict = {}
    for key in REQUEST_KEYS:
        v = d.get(key)
        if v is None:
            continue
        p = f"{path}.{key}"
        if key == "reasoning_effort":
            if v not in REASONING_EFFORTS:
                _fail(p, f"{v!r} is not allowed; choose one of: {', '.join(REASONING_EFFORTS)}")
            out[key] = v
        elif key == "temperature":
            out[key] = _num(v, p)
        elif key == "top_p":
            out[key] = _num(v, p)
            if not 0 < out[key] <= 1:
                _fail(p, f"expected a number in (0, 1], got {v!r}")
        elif key == "top_k":
            out[key] = _int(v, p, 0)
        elif key == "max_tokens":
            out[key] = _int(v, p, 1)
        else:
            out[key] = check_extra_body(v, p)
    return out


def check_extra_body(value: Any, path: str) -> dict:
    """``extra_body``: a mapping of JSON values whose keys kvbench does not set itself."""
    if not isinstance(value, dict):
        _fail(path, f"expected a mapping (merged into the request body), got {type(value).__name__} {value!r}")
    for k in value:
        if not isinstance(k, str) or not k:
            _fail(path, f"keys must be non-empty strings, got {k!r}")
        if k in OWN_BODY_KEYS:
            _fail(f"{path}.{k}", f"kvbench sets {k!r} itself ({OWN_BODY_KEYS[k]}); it may not be overridden here")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        _fail(path, f"not JSON-serializable ({e})")
    return dict(value)


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


# ----------------------------------------------------------------------------- sweep checks
def check_target_request(target_type: str, request: dict, path: str) -> None:
    """An embedded target has no request body: ``extra_body`` there is a configuration error."""
    if target_type == "embedded" and request.get("extra_body"):
        _fail(f"{path}.extra_body", "extra_body applies to server and endpoint targets only (the embedded engine "
                                    "has no HTTP request body); use reasoning_effort / sampling keys instead")


def check_embedded_suites(targets: Iterable, suites: Iterable) -> None:
    """A suite's ``extra_body`` cannot reach an embedded target of the same sweep."""
    embedded = [t.name for t in targets if getattr(t, "type", None) == "embedded"]
    if not embedded:
        return
    for i, s in enumerate(suites):
        if (getattr(s, "request", None) or {}).get("extra_body"):
            _fail(f"suites[{i}].request.extra_body", f"extra_body applies to server and endpoint targets only; "
                                                      f"target(s) {', '.join(embedded)} are embedded")


def suite_request(spec: Any, path: str, d: dict) -> dict:
    """A suite's request from its ``request`` mapping plus the older top-level ``max_tokens`` /
    ``temperature`` keys (setting one in both places is an error)."""
    request = parse_request(d.get("request"), f"{path}.request")
    for key in ("max_tokens", "temperature"):
        top = getattr(spec, key, None)
        if top is not None and key in request:
            _fail(f"{path}.request.{key}", f"also set as {path}.{key}; set it in one place")
    return request


PROMPT_STYLE_SUITES = ("gpqa_diamond", "aime24", "aime25")


def check_suite_params(name: str, params: dict, path: str) -> None:
    """The params of the suites that take ``prompt_style`` (gpqa_diamond, aime24, aime25)."""
    if name not in PROMPT_STYLE_SUITES:
        return
    _check_keys(params, ("prompt_style",), path)
    if "prompt_style" in params:
        styles = prompt_styles(name)
        if params["prompt_style"] not in styles:
            _fail(f"{path}.prompt_style", f"{params['prompt_style']!r} is not allowed; choose one of: {', '.join(styles)}")


def prompt_styles(suite: str) -> tuple[str, ...]:
    if suite == "gpqa_diamond":
        from kvbench.suites.gpqa import PROMPT_STYLES
    else:
        from kvbench.suites.aime import PROMPT_STYLES
    return tuple(PROMPT_STYLES)

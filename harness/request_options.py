"""Request options in the sweep configuration: parsing and checking ``request`` mappings (``suites[i].request``,
``targets[i].request``) and the suites' ``prompt_style`` params.  The vocabulary itself (keys, precedence,
``apply_request``, ``effective_options``) lives in ``kvbench.core.request_options`` and is re-exported here.
No torch here.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from kvbench.core import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_S, OWN_BODY_KEYS, REASONING_EFFORTS, REQUEST_KEYS, RequestOptionsError, apply_request, describe_request, effective_options, merge_requests
from kvbench.harness.config_checks import _check_keys, _fail, _int, _mapping, _num
from kvbench.suites import PROMPT_STYLE_SUITES, prompt_styles


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


def check_suite_params(name: str, params: dict, path: str) -> None:
    """The params of the suites that take ``prompt_style`` (gpqa_diamond, aime24, aime25)."""
    if name not in PROMPT_STYLE_SUITES:
        return
    _check_keys(params, ("prompt_style",), path)
    if "prompt_style" in params:
        styles = prompt_styles(name)
        if params["prompt_style"] not in styles:
            _fail(f"{path}.prompt_style", f"{params['prompt_style']!r} is not allowed; choose one of: {', '.join(styles)}")

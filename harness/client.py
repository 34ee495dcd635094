"""The one interface between the harness and a model: a ``Client`` (re-exported from ``kvbench.core.client``,
where the engine, the suites and the harness all take it from)."""

from __future__ import annotations

from kvbench.core.client import (  # noqa: F401
    ERROR_KINDS,
    Client,
    GenRequest,
    GenResult,
    RequestFailed,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
    classify_error,
)

"""Reading a request body of the embedded server under a size cap (``runtime/server.py``).

A body is read as a stream and turned away with a 413 as soon as it passes the cap (at once when its
Content-Length says so), so an oversized body is never held in memory.
"""

from __future__ import annotations

from fastapi import Request

from kvbench.runtime.server_protocol import ApiError

__all__ = ["MIN_MAX_BODY_BYTES", "BODY_BYTES_PER_TOKEN", "default_max_body_bytes", "read_body"]

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

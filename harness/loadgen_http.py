"""One streamed request against an OpenAI-compatible endpoint, timed with a monotonic clock.

Timing points (``time.perf_counter``, CLOCK_MONOTONIC on Linux): ``start`` just before the request is
written, one timestamp per SSE event that carries output text (the first gives TTFT, the rest ITL gaps),
``end`` when the stream closes.  JSON parsing happens after the timestamp is taken.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class StreamOutcome:
    request_id: str
    start: float  # perf_counter at send
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    usage: Optional[dict] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None


def build_payload(api: str, model: str, prompt, max_tokens: int, temperature: float, ignore_eos: bool) -> dict:
    payload: dict = {
        "model": model,
        "max_tokens": int(max_tokens),
        "temperature": float(temperature),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        payload["ignore_eos"] = True
    if api == "chat":
        if not isinstance(prompt, str):
            raise ValueError("the chat API needs text prompts")
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    return payload


def _piece(api: str, choice: dict) -> Optional[str]:
    if api == "chat":
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content")
    return choice.get("text")


async def stream_request(session, url: str, payload: dict, api: str, request_id: str) -> StreamOutcome:
    """POST ``payload`` with ``stream: true`` and time every output chunk; never raises for HTTP errors."""
    import aiohttp

    parts: list[str] = []
    out = StreamOutcome(request_id=request_id, start=time.perf_counter())
    try:
        async with session.post(url, json=payload, headers={"X-Request-Id": request_id}) as resp:
            if resp.status != 200:
                body = await resp.text()
                out.error = f"HTTP {resp.status}: {body[:500]}"
            else:
                async for raw in resp.content:
                    now = time.perf_counter()
                    if not raw.startswith(b"data:"):
                        continue
                    data = raw[5:].strip()
                    if data == b"[DONE]":
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        err = obj["error"]
                        out.error = str(err.get("message", err) if isinstance(err, dict) else err)
                        break
                    if obj.get("usage"):
                        out.usage = obj["usage"]
                    for choice in obj.get("choices") or ():
                        piece = _piece(api, choice)
                        if piece:
                            out.chunk_times.append(now)
                            parts.append(piece)
                        if choice.get("finish_reason"):
                            out.finish_reason = choice["finish_reason"]
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.end = time.perf_counter()
    out.text = "".join(parts)
    if out.error is None and not out.chunk_times and out.finish_reason is None:
        out.error = "stream ended without output or finish_reason"
    return out

"""What every target's session is made of (harness/targets.py opens them; harness/replica_targets.py opens
those of several replicas): ``TargetSession``, the HTTP ``Client`` of a server (``http_client``), the served
model id (``served_model_id``) and the prefix-cache flush (``flush_cache``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from kvbench.core import Client
from kvbench.harness.processes import TargetError, _get
from kvbench.harness.replica_set import replica_urls
from kvbench.harness.sweep.config import TargetSpec

__all__ = ["TargetSession", "http_client", "served_model_id", "flush_cache", "FLUSH_ATTEMPTS"]


def http_client(base_url: str, model_id: Optional[str], api_key: Optional[str] = None,
                spec: Optional[TargetSpec] = None) -> Client:
    """The OpenAI-compatible ``Client`` of an HTTP target, with the target's per-request ``timeout_s`` and
    ``max_retries`` (defaults 3600 s and 3 without a spec); its connection pool is unbounded."""
    from kvbench.harness.openai_client import OpenAIClient
    from kvbench.harness.request_options import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_S

    return OpenAIClient(base_url=base_url, model=model_id, api_key=api_key,
                        timeout=getattr(spec, "timeout_s", DEFAULT_TIMEOUT_S),
                        max_retries=getattr(spec, "max_retries", DEFAULT_MAX_RETRIES))


def served_model_id(base_url: str, timeout: float = 10.0) -> str:
    """The first model id listed by ``GET {base_url}/v1/models``."""
    r = _get(f"{base_url}/v1/models", timeout)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise TargetError(f"{base_url}/v1/models lists no model")
    return data[0]["id"]


def flush_cache(base_url: str, spec: Optional[str], api_key: Optional[str] = None) -> None:
    """Flush a server's prefix cache (``'POST /flush_cache'`` style spec; None = nothing to flush); a
    ``ReplicaURL``: every replica's."""
    if not spec:
        return
    if len(replica_urls(base_url)) > 1:
        for url in replica_urls(base_url):
            flush_cache(url, spec, api_key)
        return
    import httpx

    method, path = spec.split()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    delay = 0.25
    for attempt in range(FLUSH_ATTEMPTS):
        r = httpx.request(method, f"{base_url}{path}", headers=headers, timeout=60.0)
        if r.status_code >= 400:
            raise TargetError(f"{method} {base_url}{path} (prefix-cache flush) answered HTTP {r.status_code}: {r.text[:200]}")
        if _flush_succeeded(r):
            return
        if attempt + 1 < FLUSH_ATTEMPTS:
            time.sleep(delay)
            delay = min(delay * 2, 4.0)
    raise TargetError(f"{method} {base_url}{path} (prefix-cache flush) answered {r.text[:200]!r} {FLUSH_ATTEMPTS} times: "
                      "the server kept its prefix cache (vLLM refuses while blocks are held by running requests); "
                      "the next cell would reuse cached prefixes")


FLUSH_ATTEMPTS = 8  # vLLM's reset fails while requests still hold blocks (aborted streams are freed within a step or two)


def _flush_succeeded(r) -> bool:
    """A 2xx flush answer that does not say it failed: vLLM answers ``{"success": false}`` with HTTP 200 while
    blocks are held (vllm/entrypoints/serve/dev/cache/api_router.py); sglang answers plain text."""
    try:
        body = r.json()
    except ValueError:
        return True
    return not (isinstance(body, dict) and body.get("success") is False)


class TargetSession:
    """An open target.  ``client`` answers generate/score; ``base_url()`` is an OpenAI-compatible URL
    for the load generator; ``capacity()`` the KV capacity when the target knows it; ``flush()`` empties
    a prefix cache between cells; ``log_path`` the captured server log, if any."""

    def __init__(self, client: Client, model_id: str, url: Optional[str] = None,
                 capacity: Optional[Callable[[], Optional[dict]]] = None,
                 flush: Optional[Callable[[], None]] = None,
                 url_factory: Optional[Callable[[], str]] = None,
                 log_path: Optional[Path] = None, info: Optional[dict] = None):
        self.client = client
        self.model_id = model_id
        self._url = url
        self._url_factory = url_factory
        self._capacity = capacity
        self._flush = flush
        self.log_path = log_path
        self.info = info or {}

    def base_url(self) -> str:
        if self._url is None:
            if self._url_factory is None:
                raise TargetError("this target has no HTTP endpoint for the load test")
            self._url = self._url_factory()
        return self._url

    def capacity(self) -> Optional[dict]:
        return self._capacity() if self._capacity else None

    def flush(self) -> None:
        if self._flush:
            self._flush()

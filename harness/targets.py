"""Targets: where a cell's tokens come from.  Every target yields a ``Client`` (core/client.py).

* ``embedded``: the in-process engine, ``EngineClient(EngineConfig)``; for the load test an
  OpenAI-compatible server (runtime/server.py) is started in-process on a free loopback port.
* ``server``: an external server started from a launch template (placeholders and option flags:
  harness/launch/options.py), waited on until its health URL answers,
  its stdout/stderr captured to a log file, its whole process group killed afterwards (the process
  handling: harness/processes.py).
* ``endpoint``: an already-running OpenAI-compatible URL (nothing started, nothing killed); or several, the
  data-parallel replicas of one server configuration (``base_url`` a list; harness/replica_set.py): each
  health-checked and serving the same model, requests spread by ``ReplicaClient`` (harness/replica_client.py),
  the flush sent to every replica, the capacity summed, ``base_url()`` a ``ReplicaURL`` for the load test
  (harness/loadgen/replicas.py).

``open_target`` is a context manager; a session is opened once per cell group (all concurrency levels of
one engine configuration) and closed even when a cell fails.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from kvbench.core import Client
from kvbench.harness.processes import (  # noqa: F401 - re-exported for importers of this module
    _CAUSE_MARKS,
    _PRCTL,
    TargetError,
    _cause,
    _die_with_parent,
    _get,
    _start_time,
    _tail,
    free_port,
    kill_group,
    reap_stale,
    spawn_logged,
    wait_healthy,
)
from kvbench.harness.replica_set import replica_urls
from kvbench.harness.server_capacity import server_capacity
from kvbench.harness.sweep.config import TargetSpec

log = logging.getLogger(__name__)


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


# ------------------------------------------------------------------------------ embedded
def _capacity_dict(report) -> Optional[dict]:
    if report is None:
        return None
    d = asdict(report) if is_dataclass(report) else dict(report)
    extra = d.pop("extra", None) or {}
    # mixed per-layer formats: the record says which layers differ (bytes_per_token is already exact)
    d.update({k: extra[k] for k in ("kv_dtype_skip_layers", "kv_layer_dtypes", "layer_formats", "kv_layers")
              if extra.get(k) is not None})
    return d


@contextmanager
def _in_process_server(engine, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``engine`` over HTTP from a thread of this process (runtime/server.py's app under uvicorn)."""
    import uvicorn

    from kvbench.runtime import create_app

    port = free_port(host)
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="kvbench-cell-server", daemon=True)
    thread.start()
    url = f"http://{host}:{port}"
    try:
        wait_healthy(f"{url}/health", timeout_s=60.0)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def open_embedded(engine_kwargs: dict) -> Iterator[TargetSession]:
    from contextlib import ExitStack

    from kvbench.harness.engine_client import EngineClient
    from kvbench.runtime import EngineConfig

    client = EngineClient(EngineConfig(**engine_kwargs))
    engine = getattr(client, "engine", None)
    with ExitStack() as stack:
        def url_factory() -> str:
            if engine is None:
                raise TargetError("EngineClient exposes no engine to serve over HTTP")
            return stack.enter_context(_in_process_server(engine))

        def flush() -> None:
            for name in ("flush_cache", "reset_prefix_cache"):
                fn = getattr(engine, name, None)
                if callable(fn):
                    fn()
                    return

        try:
            described = client.info()
        except Exception as e:  # provenance only; never fails the cell
            described = {"info_error": f"{type(e).__name__}: {e}"}
        session = TargetSession(
            client, client.model_id, capacity=lambda: _capacity_dict(getattr(engine, "capacity", None)),
            flush=flush, url_factory=url_factory, info={"type": "embedded", "engine": engine_kwargs, "engine_info": described},
        )
        try:
            yield session
        finally:
            stack.close()
            client.close()


# -------------------------------------------------------------------------------- server
def render_launch(spec: TargetSpec, cell_config: dict, port: int, devices: Optional[list[int]] = None) -> str:
    """The launch command of a cell group (harness/launch/options.py: placeholders filled and shell-quoted,
    names mapped through ``kv_dtype_map`` / ``backend_map``, ``option_flags`` and extra arguments added).
    ``devices``: the GPU ids the server was given (``{devices}``; default: the target's ``devices``, else
    0..tp_size-1).  A template that cannot carry the cell raises ``TargetError`` (the config check refuses
    such cells before any launch)."""
    from kvbench.harness.launch.options import LaunchError, render_command

    try:
        return render_command(spec, cell_config, port, devices)
    except LaunchError as e:
        raise TargetError(str(e)) from None


def _render_launch(spec: TargetSpec, cell_config: dict, port: int, devices: Optional[list[int]]) -> str:
    """``render_launch`` with ``devices`` when it takes them (and any are assigned)."""
    import inspect

    if devices is not None and "devices" in inspect.signature(render_launch).parameters:
        return render_launch(spec, cell_config, port, devices=devices)
    return render_launch(spec, cell_config, port)


@contextmanager
def open_server(spec: TargetSpec, cell_config: dict, log_path: Path,
                devices: Optional[list[int]] = None) -> Iterator[TargetSession]:
    """Launch, health-wait and finally kill a server.  ``devices``: the GPU ids it may use (its
    ``CUDA_VISIBLE_DEVICES``, over the target's ``env``; ``{devices}`` in the template; recorded in the
    session's ``info``); None leaves the environment as it is."""
    port = spec.port or free_port(spec.host)
    cmd = _render_launch(spec, cell_config, port, devices)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **spec.env}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    url = f"http://{spec.host}:{port}"
    log_start = log_path.stat().st_size if log_path.exists() else 0  # this launch's part of the log
    proc, pid_file = spawn_logged(cmd, log_path, env)
    try:
        waited = wait_healthy(f"{url}{spec.health_path}", spec.health_timeout_s, proc, log_path)
        log.info("server %s healthy after %.1f s (pid %d)", url, waited, proc.pid)
        model_id = spec.model_id or served_model_id(url)
        client = http_client(url, model_id, spec.api_key, spec)
        session = TargetSession(
            client, model_id, url=url, flush=lambda: flush_cache(url, spec.flush_cache, spec.api_key),
            log_path=log_path, info={"type": "server", "launch": cmd, "pid": proc.pid, "url": url},
            capacity=lambda: server_capacity(log_path, url, getattr(spec, "engine_kind", None), cell_config.get("kv_dtype"),
                                             offset=log_start, api_key=spec.api_key),
        )
        if devices is not None:
            session.info["devices"] = list(devices)
        try:
            yield session
        finally:
            client.close()
    finally:
        kill_group(proc)
        pid_file.unlink(missing_ok=True)


# ------------------------------------------------------------------------------ endpoint
@contextmanager
def open_endpoint(spec: TargetSpec) -> Iterator[TargetSession]:
    if getattr(spec, "replicas", None):
        with _open_replicas(spec) as session:
            yield session
        return
    url = spec.base_url
    wait_healthy(f"{url}{spec.health_path}", min(spec.health_timeout_s, 60.0))
    model_id = spec.model_id or served_model_id(url)
    client = http_client(url, model_id, spec.api_key, spec)
    try:
        # no start-up log to read: what the server exports on /metrics (sglang, vLLM), else None
        capacity = lambda: server_capacity(None, url, engine_kind=getattr(spec, "engine_kind", None),  # noqa: E731
                                           api_key=spec.api_key)
        yield TargetSession(client, model_id, url=url, flush=lambda: flush_cache(url, spec.flush_cache, spec.api_key),
                            capacity=capacity, info={"type": "endpoint", "url": url})
    finally:
        client.close()


@contextmanager
def _open_replicas(spec: TargetSpec) -> Iterator[TargetSession]:
    """An endpoint target of several replicas: every one healthy (else a ``TargetError`` naming it) and
    serving the same model (``check_same_model``); one client per replica behind a ``ReplicaClient``."""
    from kvbench.harness.replica_client import ReplicaClient
    from kvbench.harness.replica_set import ReplicaURL, check_same_model, replica_capacity

    urls = list(spec.replicas)
    for url in urls:
        try:
            wait_healthy(f"{url}{spec.health_path}", min(spec.health_timeout_s, 60.0))
        except TargetError as e:
            raise TargetError(f"replica {url} of target {spec.name!r} is not up: {e}") from None
    try:
        model_id = check_same_model(urls, spec.model_id, spec.api_key)
    except (ValueError, ConnectionError) as e:
        raise TargetError(f"target {spec.name!r}: {e}") from None
    client = ReplicaClient([http_client(url, model_id, spec.api_key, spec) for url in urls])
    try:
        def capacity() -> Optional[dict]:
            return replica_capacity(urls, [server_capacity(None, u, engine_kind=getattr(spec, "engine_kind", None),
                                                           api_key=spec.api_key) for u in urls])

        yield TargetSession(client, model_id, url=ReplicaURL(urls, spec.replica_load), capacity=capacity,
                            flush=lambda: flush_cache(ReplicaURL(urls), spec.flush_cache, spec.api_key),
                            info={"type": "endpoint", "url": urls[0], "replicas": urls, "replica_load": spec.replica_load})
    finally:
        client.close()


def open_target(spec: TargetSpec, cell_config: dict, engine_kwargs: dict, log_path: Path,
                devices: Optional[list[int]] = None):
    """Open the target of a cell group (a context manager yielding a ``TargetSession``).  ``devices``
    (server targets only): the GPU ids its server may use (see ``open_server``)."""
    if spec.type == "embedded":
        return open_embedded(engine_kwargs)
    if spec.type == "server":
        return open_server(spec, cell_config, log_path, devices=devices)
    if spec.type == "endpoint":
        return open_endpoint(spec)
    raise TargetError(f"unknown target type {spec.type!r}")

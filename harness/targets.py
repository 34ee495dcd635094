"""Targets: where a cell's tokens come from.  Every target yields a ``Client`` (core/client.py).

* ``embedded``: the in-process engine, ``EngineClient(EngineConfig)``; for the load test an
  OpenAI-compatible server (runtime/server.py) is started in-process on a free loopback port.
* ``server``: an external server started from a launch template (placeholders and option flags:
  harness/launch/options.py), waited on until its health URL answers,
  its stdout/stderr captured to a log file, its whole process group killed afterwards (the process
  handling: harness/processes.py).
* ``endpoint``: an already-running OpenAI-compatible URL (nothing started, nothing killed).

A server target of ``replicas: N`` (N copies launched, each on its own port and devices) and an endpoint whose
``base_url`` lists several URLs are data-parallel replicas of one server configuration
(harness/replica_targets.py): requests spread and moved off a failing replica by ``ReplicaClient``
(harness/replica_client.py), the load test over every replica (harness/loadgen/replicas.py).

``open_target`` is a context manager; a session is opened once per cell group (all concurrency levels of
one engine configuration) and closed even when a cell fails.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Iterator, Optional

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
from kvbench.harness.server_capacity import server_capacity
from kvbench.harness.sweep.config import TargetSpec
from kvbench.harness.target_session import (  # noqa: F401 - re-exported for importers of this module
    FLUSH_ATTEMPTS,
    TargetSession,
    _flush_succeeded,
    flush_cache,
    http_client,
    served_model_id,
)

log = logging.getLogger(__name__)


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
    def run() -> None:
        try:
            server.run()
        except SystemExit:  # uvicorn exits its start-up failures (the app's lifespan raised; logged by it)
            pass

    thread = threading.Thread(target=run, name="kvbench-cell-server", daemon=True)
    thread.start()
    url = f"http://{host}:{port}"
    try:
        # a GPU engine warms up its kernels first; a start-up that fails ends the thread, and the wait with it
        wait_healthy(f"{url}/health", timeout_s=300.0, alive=thread.is_alive)
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
    session's ``info``); None leaves the environment as it is.  A target of ``replicas: N`` launches N copies
    (harness/replica_targets.py)."""
    if int(getattr(spec, "server_replicas", 1) or 1) > 1:
        from kvbench.harness.replica_targets import open_server_replicas

        with open_server_replicas(spec, cell_config, log_path, devices) as session:
            yield session
        return
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
        from kvbench.harness.replica_targets import open_endpoint_replicas

        with open_endpoint_replicas(spec) as session:
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

"""Targets of several data-parallel replicas of ONE server configuration (docs/scale-out.md "Data-parallel
replicas"): an endpoint whose ``base_url`` lists several URLs (``open_endpoint_replicas``), or a server target
of ``replicas: N`` that kvbench launches N times (``open_server_replicas``).

``open_server_replicas`` renders the target's launch once per replica, each with its own port (a free one, or
``port + i`` for a fixed ``port``) and its own ``tp_size`` devices (the group's devices in order; without any,
the visible GPUs; on a machine without GPUs, none), its own log (``logs/<key>.log``, then
``<key>.replica<i>.log``), starts them all, waits until every one answers its health URL, and kills every one's
process group when the session closes, when one of them fails to start, and on Ctrl-C.

Either way every replica must serve the same model (``check_same_model``), requests go through a
``ReplicaClient`` (least-loaded dispatch, failover, replicas taken out of rotation), and the session
(``ReplicaSession``) gives the load test the replicas still in rotation (``base_url()``: a ``ReplicaURL``),
flushes every replica in rotation (one that cannot be reached is taken out), sums their capacity
(``replica_capacity``), reports ``replica_health()`` for the cell's summary, and copies each replica's log
slice into the cell's ``server.log``.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from kvbench.core import TargetGone, atomic_write_text
from kvbench.harness.processes import TargetError, free_port, kill_group, spawn_logged, wait_healthy
from kvbench.harness.replica_client import ReplicaClient
from kvbench.harness.replica_set import ReplicaURL, check_same_model, replica_capacity
from kvbench.harness.server_capacity import server_capacity
from kvbench.harness.sweep.config import TargetSpec
from kvbench.harness.target_session import TargetSession, flush_cache, http_client

__all__ = ["ReplicaSession", "open_endpoint_replicas", "open_server_replicas", "replica_log_path"]

log = logging.getLogger(__name__)


class ReplicaSession(TargetSession):
    """An open target of several replicas (module docstring).  ``logs``: ``(url, log path)`` of each launched
    replica (none for an endpoint); ``capacity_of(url)``: one replica's capacity."""

    def __init__(self, client: ReplicaClient, model_id: str, spec: TargetSpec, info: dict, capacity_of,
                 logs: tuple = ()):
        super().__init__(client, model_id, info=info, log_path=Path(logs[0][1]) if logs else None)
        self.spec, self._capacity_of, self.logs = spec, capacity_of, tuple(logs)
        self._offsets = {str(path): 0 for _, path in self.logs}

    def _live(self) -> list[str]:
        live = self.client.live()
        if not live:
            raise TargetGone(self.client.gone_text())
        return live

    def base_url(self) -> str:
        """The replicas in rotation, as the load test takes them (``mode``: the target's ``replica_load``)."""
        return ReplicaURL(self._live(), self.spec.replica_load)

    def flush(self) -> None:
        """Every replica in rotation's prefix cache; one that cannot be reached is taken out of rotation."""
        import httpx

        if not self.spec.flush_cache:
            return
        for url in self._live():
            try:
                flush_cache(url, self.spec.flush_cache, self.spec.api_key)
            except (httpx.TransportError, ConnectionError) as e:
                self.client.take_out(url, f"prefix-cache flush failed: {type(e).__name__}: {e}")
        self._live()

    def capacity(self) -> Optional[dict]:
        live = self.client.live()
        return replica_capacity(live, [self._capacity_of(u) for u in live]) if live else None

    def replica_health(self) -> dict:
        return self.client.health()

    def copy_log(self, dest: Path) -> None:
        """Each replica's log written since the last copy, one after another under a line naming the replica."""
        parts = []
        for url, path in self.logs:
            path = Path(path)
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self._offsets[str(path)])
                data = f.read()
            self._offsets[str(path)] += len(data)
            parts.append(f"===== replica {url} ({path.name}) =====\n" + data.decode("utf-8", errors="replace"))
        if parts:
            atomic_write_text(dest, "".join(p if p.endswith("\n") else p + "\n" for p in parts))


def _replica_client(spec: TargetSpec, urls: list[str]) -> tuple[ReplicaClient, str]:
    """Every replica serving one model (else a ``TargetError`` naming the one that differs), behind one client."""
    try:
        model_id = check_same_model(urls, spec.model_id, spec.api_key)
    except (ValueError, ConnectionError) as e:
        raise TargetError(f"target {spec.name!r}: {e}") from None
    clients = [http_client(url, model_id, spec.api_key, spec) for url in urls]
    return ReplicaClient(clients, max_failures=spec.replica_max_failures), model_id


@contextmanager
def open_endpoint_replicas(spec: TargetSpec) -> Iterator[ReplicaSession]:
    """An endpoint target of several replicas: every one healthy (else a ``TargetError`` naming it) and serving
    the same model."""
    urls = list(spec.replicas)
    for url in urls:
        try:
            wait_healthy(f"{url}{spec.health_path}", min(spec.health_timeout_s, 60.0))
        except TargetError as e:
            raise TargetError(f"replica {url} of target {spec.name!r} is not up: {e}") from None
    client, model_id = _replica_client(spec, urls)
    try:
        def capacity_of(url: str) -> Optional[dict]:
            return server_capacity(None, url, engine_kind=getattr(spec, "engine_kind", None), api_key=spec.api_key)

        info = {"type": "endpoint", "url": urls[0], "replicas": client.replicas, "replica_load": spec.replica_load}
        yield ReplicaSession(client, model_id, spec, info, capacity_of)
    finally:
        client.close()


# ------------------------------------------------------------------------------ launched replicas
@dataclass
class _Launched:
    url: str
    cmd: str
    proc: object
    pid_file: Path
    log_path: Path
    log_start: int
    devices: Optional[list[int]]


def replica_log_path(log_path: Path, i: int) -> Path:
    """The log of replica ``i``: the group's log for the first, ``<stem>.replica<i><suffix>`` for the others."""
    log_path = Path(log_path)
    return log_path if i == 0 else log_path.with_name(f"{log_path.stem}.replica{i}{log_path.suffix}")


def _devices_of(spec: TargetSpec, devices: Optional[list[int]]) -> list[Optional[list[int]]]:
    """Each replica's devices: from the group's, else from the visible GPUs (a Ray task's), else none."""
    from kvbench.harness.config_checks import SweepConfigError
    from kvbench.harness.parallel import replica_devices, target_replicas, target_tp_size, visible_devices

    n, tp = target_replicas(spec), target_tp_size(spec)
    try:
        if devices is None:
            visible = visible_devices()
            devices = visible if visible else None
        return replica_devices(devices, n, tp)
    except SweepConfigError as e:
        raise TargetError(f"target {spec.name!r}: {e}") from None


def _launch(spec: TargetSpec, cell_config: dict, port: int, devices: Optional[list[int]], log_path: Path) -> _Launched:
    from kvbench.harness.launch.options import LaunchError, render_command

    try:
        cmd = render_command(spec, cell_config, port, devices)
    except LaunchError as e:
        raise TargetError(str(e)) from None
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **spec.env}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    start = log_path.stat().st_size if log_path.exists() else 0
    proc, pid_file = spawn_logged(cmd, log_path, env)
    return _Launched(f"http://{spec.host}:{port}", cmd, proc, pid_file, log_path, start, devices)


@contextmanager
def open_server_replicas(spec: TargetSpec, cell_config: dict, log_path: Path,
                         devices: Optional[list[int]] = None) -> Iterator[ReplicaSession]:
    """Launch the target's ``replicas`` copies, wait for all, and kill all at the end (module docstring)."""
    chunks = _devices_of(spec, devices)
    n = len(chunks)
    launched: list[_Launched] = []
    try:
        for i, devs in enumerate(chunks):
            port = spec.port + i if spec.port else free_port(spec.host)
            launched.append(_launch(spec, cell_config, port, devs, replica_log_path(log_path, i)))
        for i, one in enumerate(launched):
            try:
                waited = wait_healthy(f"{one.url}{spec.health_path}", spec.health_timeout_s, one.proc, one.log_path)
            except TargetError as e:
                raise TargetError(f"replica {i + 1} of {n} ({one.url}): {e}") from None
            log.info("replica %s healthy after %.1f s (pid %d)", one.url, waited, one.proc.pid)
        client, model_id = _replica_client(spec, [one.url for one in launched])
        by_url = dict(zip(client.replicas, launched))
        try:
            def capacity_of(url: str) -> Optional[dict]:
                one = by_url[url]
                return server_capacity(one.log_path, url, getattr(spec, "engine_kind", None), cell_config.get("kv_dtype"),
                                       offset=one.log_start, api_key=spec.api_key)

            info = {"type": "server", "launch": launched[0].cmd, "launches": [one.cmd for one in launched],
                    "pid": [one.proc.pid for one in launched], "url": client.replicas[0], "replicas": client.replicas,
                    "replica_load": spec.replica_load}
            if devices is not None or chunks[0] is not None:
                info["devices"] = [d for devs in chunks for d in (devs or [])]
                info["replica_devices"] = chunks
            yield ReplicaSession(client, model_id, spec, info, capacity_of,
                                 logs=tuple((u, one.log_path) for u, one in by_url.items()))
        finally:
            client.close()
    finally:
        for one in launched:
            kill_group(one.proc)
            one.pid_file.unlink(missing_ok=True)

"""``kvbench sweep --executor ray``: every cell group a Ray task, the run store written by the driver alone.

The driver (this module, inside ``run_sweep``) connects to a Ray cluster (``--address``; none: what ``ray.init()``
finds, else a Ray of its own on this machine), creates a ``CellSink`` actor and submits one task per cell group
(``ray_worker.run_group_task``) with the resources the group declares (``group_resources``): ``num_cpus``
(``--ray-cpus-per-group``, default 1) and ``num_gpus``: a server's ``tp_size`` (× its ``replicas``) and 1 for an
embedded engine on CUDA when the cluster has GPUs, 0 otherwise; plus the custom resources of ``--ray-resources``
(``{"name": amount}``, e.g. a label that the nodes of one GPU type were started with: ``ray start
--resources='{"h100": 8}'``), which pin every group to the nodes that have them. Ray sets ``CUDA_VISIBLE_DEVICES``
on the worker to the GPUs it gave the task, and a server the task launches inherits it. Groups that must not
overlap locally still do not (one endpoint URL, a server's fixed port); embedded groups run side by side, each in
its own worker process.

The driver's loop drains the sink: each cell a worker finished is written into the driver's run store with the
store's atomic writes (result files, then the status) and printed by the progress display. When a task ends
without reporting all its cells because its worker or node died, it is submitted again for the cells not yet
reported (up to ``--ray-retries`` times, default 1), after which those cells are recorded failed ("Ray worker
died: ..." / "Ray node died: ...") and the sweep goes on. A retry asks for the same resources (custom ones
included: a pinned group stays pinned), so it lands on a surviving node that has them; once a node of the cluster
has died, a group that no live node can take any more (its retry, or a task still waiting) is not left waiting for
one to join: its unfinished cells are recorded failed with the node-death reason. Ctrl-C (or SIGTERM) cancels the
running tasks (``ray.cancel``, force), keeps the cells already reported and raises again: ``--resume`` redoes
exactly the cells that are not done, whichever executor runs it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from dataclasses import dataclass, field
from typing import Iterator, Optional

from kvbench.core import STATUS_DONE, RunStore, atomic_write_text
from kvbench.core.plugins import PLUGINS_ENV
from kvbench.harness.matrix import Cell
from kvbench.harness.parallel import GroupPlan
from kvbench.harness.ray_resources import (check_reachable, death_reason, describe_task, first_line, fits, group_resources,
                                           parse_resources, plain)
from kvbench.harness.ray_worker import RESULT_FILES, CellSink, run_group_task
from kvbench.harness.runner import SweepOutcome, _record_failure
from kvbench.harness.sweep.config import SweepConfig, SweepConfigError
from kvbench.harness.sweep.display import SweepDisplay

log = logging.getLogger(__name__)

RAY_INSTALL = 'pip install "kvbench[ray]"'
EXECUTORS = ("local", "ray")


def import_ray():
    """The ``ray`` module, or a ``SweepConfigError`` that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise SweepConfigError(f"--executor ray needs Ray, which is not installed here ({e}); "
                               f"install it with: {RAY_INSTALL}") from None
    return ray


@dataclass
class RayOptions:
    """``--address``, ``--ray-retries``, ``--ray-cpus-per-group``, ``--ray-resources``."""

    address: Optional[str] = None  # None: ray.init()'s own search (RAY_ADDRESS, a local `ray start`, else a new Ray)
    retries: int = 1  # new attempts of a group whose worker or node died
    cpus_per_group: float = 1.0
    resources: dict = field(default_factory=dict)  # custom Ray resources every group's task asks for
    poll_s: float = 0.2  # how often the driver drains the sink
    nodes_poll_s: float = 1.0  # after a node died: how often the driver asks which nodes still live

    def __post_init__(self) -> None:
        if int(self.retries) != self.retries or self.retries < 0:
            raise SweepConfigError(f"--ray-retries must be a whole number >= 0, got {self.retries}")
        if not self.cpus_per_group > 0:
            raise SweepConfigError(f"--ray-cpus-per-group must be above 0, got {self.cpus_per_group}")
        self.resources = parse_resources(self.resources)


class RayDisplay(SweepDisplay):
    """The sweep display with one phase per running group (reported by the workers through the sink)."""

    def __init__(self, total: int, enabled: Optional[bool]):
        super().__init__(total, enabled)
        self.most_running = 1

    def group_phase(self, group: int, text: Optional[str]) -> None:
        with self._lock:
            if text is None:
                self._phases.pop(("ray", group), None)  # type: ignore[call-overload]
            else:
                self._phases[("ray", group)] = text  # type: ignore[index]
            self.most_running = max(self.most_running, len(self._phases))
            self.parallel = self.most_running  # the ETA spreads the remaining cells over this many groups
            if self.progress:
                self.describe_task()


@dataclass
class _Group:
    """One cell group on its way through Ray: the cells not yet reported, the tries so far."""

    index: int
    cells: list[Cell]
    resources: dict
    exclusive: tuple[str, ...]
    attempts: int = 0
    received: set = field(default_factory=set)
    node: Optional[str] = None  # the Ray node its current task started on (the worker tells the sink)


class RayExecutor:
    """``run_sweep(executor=RayExecutor(RayOptions(...)))``: the groups as Ray tasks (module docstring)."""

    name = "ray"

    def __init__(self, options: Optional[RayOptions] = None):
        self.options = options or RayOptions()
        self.ray = None
        self.cluster: dict = {}
        self.dead_nodes: dict[str, str] = {}  # node id -> how the driver learned that it died
        self._nodes_checked = 0.0

    # -- the connection
    @contextlib.contextmanager
    def connected(self) -> Iterator["RayExecutor"]:
        """Connected to the cluster while inside (disconnected afterwards when this call connected)."""
        ray = import_ray()
        self.ray = ray
        owns = not ray.is_initialized()
        if owns:
            where = self.options.address or "auto"
            check_reachable(self.options.address or os.environ.get("RAY_ADDRESS"))
            try:
                ray.init(address=self.options.address, logging_level=logging.WARNING, configure_logging=True)
            except Exception as e:  # ConnectionError, a bad address, ...
                raise SweepConfigError(f"--executor ray: cannot connect to the Ray cluster ({where}): "
                                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        try:
            self.cluster = self._cluster_info()
            yield self
        finally:
            if owns:
                ray.shutdown()

    def _cluster_info(self) -> dict:
        ray = self.ray
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        try:
            gcs = ray.get_runtime_context().gcs_address
        except Exception:  # Ray Client: the address given is what there is
            gcs = None
        return {"address": self.options.address or gcs, "gcs_address": gcs, "nodes": len(nodes),
                "node_ids": [n.get("NodeID") for n in nodes],
                "node_resources": [dict(n.get("Resources") or {}) for n in nodes],
                "gpus": float(ray.cluster_resources().get("GPU", 0))}

    def manifest_info(self) -> dict:
        """What the manifest's run entry records about where the cells ran."""
        return {"executor": "ray", "ray_address": self.cluster.get("address"), "ray_nodes": self.cluster.get("nodes"),
                "ray_retries": self.options.retries, "ray_cpus_per_group": self.options.cpus_per_group,
                **({"ray_resources": dict(self.options.resources)} if self.options.resources else {})}

    def display(self, total: int, enabled: Optional[bool]) -> RayDisplay:
        return RayDisplay(total, enabled)

    # -- the run
    def run_groups(self, sweep: SweepConfig, store: RunStore, plans: list[GroupPlan], work, opener,
                   display: RayDisplay, outcome: SweepOutcome) -> None:
        """Submit every group, drain the sink until all have ended; Ctrl-C cancels what still runs."""
        from kvbench.harness.targets import open_target

        ray = self.ray
        groups = [self._group(sweep, i, p) for i, p in enumerate(plans)]
        by_key = {c.key: (g, c) for g in groups for c in g.cells}
        sink = ray.remote(CellSink).options(num_cpus=0, **self._here()).remote()
        args = {"task": ray.remote(run_group_task), "sweep": ray.put(sweep), "work": ray.put(work),
                "opener": None if opener is open_target else opener, "plugins": os.environ.get(PLUGINS_ENV) or None,
                "cwd": os.getcwd()}
        queue, running = list(groups), {}
        self.dead_nodes = {}
        try:
            while queue or running:
                self._submit(queue, running, sink, args)
                ready = []
                if running:
                    ready, _ = ray.wait(list(running), num_returns=len(running), timeout=self.options.poll_s)
                self._drain(sink, store, display, outcome, by_key)
                for ref in ready:
                    self._ended(ref, running.pop(ref), store, display, outcome, queue)
                if self.dead_nodes:
                    self._drop_homeless(queue, running, store, display, outcome)
        except BaseException:
            self._cancel(running)
            with contextlib.suppress(Exception):  # cells reported before the stop are kept
                self._drain(sink, store, display, outcome, by_key)
            raise
        finally:
            with contextlib.suppress(Exception):
                ray.kill(sink)
        pos = {c.key: i for i, c in enumerate(outcome.selected)}
        outcome.done.sort(key=lambda k: pos.get(k, -1))
        outcome.failed.sort(key=lambda k: pos.get(k, -1))

    def _group(self, sweep: SweepConfig, index: int, plan: GroupPlan) -> _Group:
        res = group_resources(sweep, plan, self.options.cpus_per_group, self.cluster.get("gpus", 0),
                              self.options.resources)
        if not any(fits(res, n) for n in self.cluster.get("node_resources", [])):
            log.warning("cell group of %s asks Ray for %s, which no node of the cluster has now: it waits until one "
                        "joins", plan.cells[0].label, describe_task(res))
        exclusive = tuple(k for k in plan.exclusive if k != "embedded")  # embedded: a worker process each
        return _Group(index, list(plan.cells), res, exclusive)

    def _here(self) -> dict:
        """The sink lives on the head node (the cluster ends with it anyway), not on a node whose death would take
        every reported cell with it; when Ray does not say which node is the head, on the driver's node
        (preferred, not required).  The sink dies with the driver wherever it is."""
        try:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            head = [i for i, r in zip(self.cluster.get("node_ids", []), self.cluster.get("node_resources", []))
                    if "node:__internal_head__" in r]
            if len(head) == 1:
                return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=head[0], soft=False)}
            node = self.ray.get_runtime_context().get_node_id()
            return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=True)}
        except Exception:
            return {}

    def _submit(self, queue: list[_Group], running: dict, sink, args: dict) -> None:
        """Submit the queued groups whose exclusive resources (an endpoint, a fixed port) are free."""
        held = {k for g in running.values() for k in g.exclusive}
        for g in list(queue):
            if set(g.exclusive) & held:
                continue
            queue.remove(g)
            held.update(g.exclusive)
            task = args["task"].options(
                **g.resources, max_retries=0, retry_exceptions=False, name=f"kvbench-group-{g.cells[0].label}"[:120])
            ref = task.remote(args["sweep"], g.cells, sink, g.index, args["work"], args["opener"], args["plugins"],
                              args["cwd"])
            running[ref] = g

    def _drain(self, sink, store: RunStore, display: RayDisplay, outcome: SweepOutcome, by_key: dict) -> None:
        cells, phases, started = self.ray.get(sink.drain.remote())
        if started:
            groups = {g.index: g for g, _ in by_key.values()}
            for index, node in started.items():
                groups[index].node = node
        for key, payload in cells:
            group, cell = by_key[key]
            if key in group.received:
                continue
            group.received.add(key)
            write_cell(store, cell, payload)
            (outcome.done if payload.get("status") == STATUS_DONE else outcome.failed).append(key)
            display.finished(payload.get("line") or f"{payload.get('status')} {cell.label}", payload.get("seconds"))
        for index, text in phases.items():
            display.group_phase(index, text)

    def _ended(self, ref, group: _Group, store: RunStore, display: RayDisplay, outcome: SweepOutcome,
               queue: list[_Group]) -> None:
        """A task ended: its cells are all reported, or it is tried again, or its unreported cells fail."""
        ray_exc = self.ray.exceptions
        err, tb, retry = None, "", False
        try:
            self.ray.get(ref)
        except ray_exc.TaskCancelledError as e:
            err, tb = f"the cell group's Ray task was cancelled: {first_line(e)}", str(e)
        except ray_exc.RayTaskError as e:  # an exception outside every cell (e.g. the work did not unpickle)
            err, tb = f"the cell group's Ray task failed: {first_line(getattr(e, 'cause', None) or e)}", plain(str(e))
        except ray_exc.RayError as e:  # the worker or its node died (WorkerCrashedError, NodeDiedError, ...)
            err, tb, retry = death_reason(e), "".join(traceback.format_exception(e)), True
            if err.startswith("Ray node died"):  # its node, when the task said which ("?": it did not get to)
                self.dead_nodes[group.node or "?"] = err
        node, group.node = group.node, None
        group.cells = [c for c in group.cells if c.key not in group.received]
        if not group.cells:
            display.group_phase(group.index, None)
            return
        err = err or "the cell group's Ray task ended without reporting this cell"
        if retry and group.attempts < self.options.retries:
            live = self._live_nodes() if self.dead_nodes else None
            if live is not None and not any(fits(group.resources, r) for r in live.values()):
                err += f"; no live node of the cluster has what its retry would ask for ({describe_task(group.resources)})"
            else:
                group.attempts += 1
                log.warning("cell group of %s: %s%s; trying its %d unfinished cell(s) again (retry %d of %d)",
                            group.cells[0].label, err, f" (on node {node})" if node else "", len(group.cells),
                            group.attempts, self.options.retries)
                queue.insert(0, group)
                return
        self._fail(group, err, tb, store, display, outcome)

    def _fail(self, group: _Group, err: str, tb: str, store: RunStore, display: RayDisplay,
              outcome: SweepOutcome) -> None:
        """The group's cells not yet reported are recorded failed with ``err`` (a late report is ignored)."""
        display.group_phase(group.index, None)
        for cell in group.cells:
            group.received.add(cell.key)
            _record_failure(store, cell, err, tb, {})
            outcome.failed.append(cell.key)
            display.finished(f"[red]failed[/] {cell.label}: {err[:200]}")
        group.cells = []

    def _live_nodes(self) -> dict[str, dict]:
        """The nodes alive now (node id -> total resources), less those a task's NodeDiedError named dead (the
        GCS lists a node as dead only after its health checks failed, seconds later)."""
        live = {}
        for n in self.ray.nodes():
            if n.get("Alive") and n.get("NodeID") not in self.dead_nodes:
                live[n.get("NodeID")] = dict(n.get("Resources") or {})
        for node_id in self.cluster.get("node_ids", []):
            if node_id not in live and node_id not in self.dead_nodes:
                self.dead_nodes[node_id] = f"Ray node died: node {node_id} left the cluster"
        return live

    def _drop_homeless(self, queue: list[_Group], running: dict, store: RunStore, display: RayDisplay,
                       outcome: SweepOutcome) -> None:
        """Once a node died: the groups (waiting or submitted) that no live node can take any more are recorded
        failed with the node-death reason instead of waiting for a node to join (checked every
        ``nodes_poll_s``)."""
        import time

        now = time.monotonic()
        if now - self._nodes_checked < self.options.nodes_poll_s:
            return
        self._nodes_checked = now
        live = self._live_nodes()
        why = "; ".join(dict.fromkeys(self.dead_nodes.values()))
        for ref, g in list(running.items()) + [(None, g) for g in queue]:
            if any(fits(g.resources, r) for r in live.values()):
                continue
            if ref is None:
                queue.remove(g)
            else:
                running.pop(ref)
                with contextlib.suppress(Exception):
                    self.ray.cancel(ref, force=True)
            g.cells = [c for c in g.cells if c.key not in g.received]
            err = f"{why}; no live node of the cluster has what this cell group asks for ({describe_task(g.resources)})"
            log.warning("cell group of %s: %s", g.cells[0].label if g.cells else g.index, err)
            self._fail(g, err, "", store, display, outcome)

    def _cancel(self, running: dict) -> None:
        for ref in running:
            with contextlib.suppress(Exception):
                self.ray.cancel(ref, force=True)


def write_cell(store: RunStore, cell: Cell, payload: dict) -> None:
    """A cell a worker reported, into the driver's store: ``cell.json`` (status running), its result files (one
    it did not produce is removed: a redone cell starts clean), then its status."""
    store.init_cell(cell.key, cell.config, cell.label)
    d = store.cell_dir(cell.key)
    files = payload.get("files") or {}
    for name in RESULT_FILES:
        if name in files:
            atomic_write_text(d / name, files[name])
        else:
            (d / name).unlink(missing_ok=True)
    store.set_status(cell.key, payload["status"])

"""The Ray resources of a sweep's cell groups and the cluster checks of ``kvbench sweep --executor ray``
(``harness/ray_executor.py``): ``--ray-resources`` parsed, what a group's task asks of Ray (``group_resources``,
``describe_resources`` for ``--dry-run``), whether a node can ever run it (``fits``), whether an address takes a
connection, and the reason recorded when a worker or node dies."""

from __future__ import annotations

import re
import socket
from typing import Optional

from kvbench.harness.matrix import engine_options
from kvbench.harness.parallel import GroupPlan
from kvbench.harness.sweep.config import SweepConfig, SweepConfigError

# resources Ray itself names: num_cpus / num_gpus come from --ray-cpus-per-group and the target
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def parse_resources(value) -> dict:
    """``--ray-resources``: a JSON object (or a dict) of custom Ray resource names and amounts above 0, e.g.
    ``{"h100": 1}``; a ``SweepConfigError`` otherwise (CPUs and GPUs have their own settings)."""
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise SweepConfigError(f"--ray-resources: expected a JSON object such as '{{\"h100\": 1}}', got "
                                   f"{value!r} ({e.msg})") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SweepConfigError(f"--ray-resources: expected a JSON object of resource names and amounts, got {value!r}")
    out = {}
    for name, amount in value.items():
        if not isinstance(name, str) or not name.strip():
            raise SweepConfigError(f"--ray-resources: a resource name must be a non-empty string, got {name!r}")
        if name in _RAY_BUILTIN_RESOURCES:
            raise SweepConfigError(f"--ray-resources: {name} is not a custom resource (CPUs: --ray-cpus-per-group; "
                                   "GPUs follow the target)")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
            raise SweepConfigError(f"--ray-resources: the amount of {name} must be a number above 0, got {amount!r}")
        out[name] = amount
    return out


def group_resources(sweep: SweepConfig, plan: GroupPlan, cpus: float, cluster_gpus: float,
                    custom: Optional[dict] = None) -> dict:
    """The Ray resources of one cell group's task: ``num_cpus``, ``num_gpus`` and, when ``custom`` (the
    ``--ray-resources``) names any, ``resources`` (see the module docstring)."""
    spec = sweep.target(plan.target)
    gpus = 0
    if spec.type == "server" and cluster_gpus > 0:
        gpus = plan.tp_size * plan.replicas  # every replica its own tp_size GPUs
    elif spec.type == "embedded":
        device = engine_options(sweep, plan.cells[0]).get("device")
        if device is None:  # the engine's default: cuda when there is one
            gpus = 1 if cluster_gpus > 0 else 0
        elif str(device).startswith("cuda"):
            gpus = 1
    res = {"num_cpus": cpus, "num_gpus": gpus}
    if custom:
        res["resources"] = dict(custom)
    return res


def describe_resources(sweep: SweepConfig, plan: GroupPlan, cpus: float, custom: Optional[dict] = None) -> str:
    """``--dry-run``: what a group's task asks of a cluster with GPUs and of one without."""
    with_gpus = group_resources(sweep, plan, cpus, 1)["num_gpus"]
    without = group_resources(sweep, plan, cpus, 0)["num_gpus"]
    gpus = f"{with_gpus} GPU" if with_gpus == without else f"{with_gpus} GPU (0 on a cluster without GPUs)"
    extra = "".join(f", {amount:g} {name}" for name, amount in (custom or {}).items())
    return f"{cpus:g} CPU, {gpus}{extra}"


def fits(resources: dict, node_resources: dict) -> bool:
    """Whether a node whose total resources are ``node_resources`` can ever run a task that asks ``resources``."""
    want = {"CPU": resources.get("num_cpus", 0), "GPU": resources.get("num_gpus", 0), **resources.get("resources", {})}
    return all(node_resources.get(name, 0) >= amount for name, amount in want.items() if amount)


def check_reachable(address: Optional[str], timeout_s: float = 10.0) -> None:
    """A ``SweepConfigError`` when ``HOST:PORT`` (or ``ray://HOST:PORT``) takes no TCP connection: ``ray.init`` would
    retry for minutes.  Other forms (none, ``auto``, ``local``) are left to Ray."""
    m = re.fullmatch(r"(?:ray://)?\[?([^\]/]+?)\]?:(\d+)/?", (address or "").strip())
    if not m:
        return
    try:
        socket.create_connection((m.group(1), int(m.group(2))), timeout=timeout_s).close()
    except OSError as e:
        raise SweepConfigError(f"--executor ray: no Ray cluster answers at {address} ({e.strerror or e}); start one "
                               "(docs/scale-out.md) or fix --address") from None


def describe_task(resources: dict) -> str:
    """``1 CPU, 0 GPU, 1 h100``: what a task asks of Ray."""
    extra = "".join(f", {amount:g} {name}" for name, amount in resources.get("resources", {}).items())
    return f"{resources.get('num_cpus', 0):g} CPU, {resources.get('num_gpus', 0):g} GPU{extra}"


def plain(text: str) -> str:
    """``text`` without the terminal colour codes Ray puts in its error messages."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def first_line(e: BaseException) -> str:
    lines = [line.strip() for line in plain(str(e)).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def death_reason(e: BaseException) -> str:
    """``Ray worker died: ...`` / ``Ray node died: ...`` from the exception Ray raised for the task."""
    what = "node" if "Node" in type(e).__name__ else "worker"
    return f"Ray {what} died: {first_line(e)}"

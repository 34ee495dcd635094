"""Cell work for tests/test_sweep_ray.py that misbehaves once, on a Ray worker or in this process.

``HookWork`` is the real ``DefaultWork`` plus two planted faults, each armed until its marker file exists:

* ``exit_in`` (a cell key): the worker process dies (``os._exit``) in that cell's load test, the first time
  (the marker is written just before);
* ``sleep_in`` (a cell key): that cell's first suite sleeps ``sleep_s`` seconds, the first time;
* ``kill_node_in`` (a cell key): in that cell's load test, the first time, the whole Ray node the worker runs on
  dies: its raylet's process group (``ray start --block`` and everything it started; the worker itself is in
  a group of its own and dies with its raylet) gets SIGKILL.  Only a group listed in ``node_pgids`` (the
  nodes a test started for this) is killed; on any other node the hook raises instead.

Every suite and load call appends ``<cell key> <what> <pid> <Ray node id or ->`` to ``calls`` (a file), so a
test can tell which cells ran where and how often.  Imported as a plugin (``KVBENCH_PLUGINS=ray_sweep_hooks``) with
``$KVBENCH_TEST_HOOK`` holding the same settings as JSON, it makes ``DefaultWork`` itself a ``HookWork`` (for
a sweep run through the command line).  Workers import it by name: the test cluster's processes have this
directory on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Optional

from kvbench.harness import cell_work
from kvbench.harness.cell_work import DefaultWork

HOOK_ENV = "KVBENCH_TEST_HOOK"


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "-"
    except Exception:
        return "-"


class Hooks:
    def __init__(self, calls: str, exit_in: Optional[str] = None, sleep_in: Optional[str] = None,
                 sleep_s: float = 0.0, marker_dir: Optional[str] = None, kill_node_in: Optional[str] = None,
                 node_pgids: tuple = ()):
        self.calls, self.exit_in, self.sleep_in, self.sleep_s = calls, exit_in, sleep_in, sleep_s
        self.marker_dir = marker_dir or str(Path(calls).parent)
        self.kill_node_in, self.node_pgids = kill_node_in, tuple(node_pgids)

    def note(self, cell, what: str) -> None:
        with open(self.calls, "a") as f:
            f.write(f"{cell.key} {what} {os.getpid()} {_node_id()}\n")

    def kill_node(self) -> None:
        """SIGKILL to the process group of this worker's raylet (its parent), if it is one of ``node_pgids``."""
        pgid = os.getpgid(os.getppid())
        if pgid not in self.node_pgids:
            raise RuntimeError(f"kill_node_in: this worker's node (process group {pgid}) is not one of "
                               f"{self.node_pgids}")
        os.killpg(pgid, signal.SIGKILL)
        time.sleep(120)  # the raylet is gone: Ray ends this worker long before

    def once(self, name: str) -> bool:
        """True the first time ``name`` is asked for (across processes: a marker file)."""
        marker = Path(self.marker_dir) / f"{name}.marker"
        if marker.exists():
            return False
        marker.write_text(str(os.getpid()))
        return True


class HookWork(DefaultWork):
    def __init__(self, sweep, hooks: Hooks):
        super().__init__(sweep)
        self.hooks = hooks

    def suite(self, spec, client, cell, fidelity):
        self.hooks.note(cell, f"suite:{spec.name}")
        if cell.key == self.hooks.sleep_in and self.hooks.once(f"sleep-{cell.key}"):
            time.sleep(self.hooks.sleep_s)
        return super().suite(spec, client, cell, fidelity)

    def load(self, base_url, model_id, cell):
        self.hooks.note(cell, "load")
        if cell.key == self.hooks.exit_in and self.hooks.once(f"exit-{cell.key}"):
            os._exit(17)  # the worker dies mid-cell
        if cell.key == self.hooks.kill_node_in and self.hooks.once(f"kill-node-{cell.key}"):
            self.hooks.kill_node()  # its node dies mid-cell
        return super().load(base_url, model_id, cell)


def _install_from_env() -> None:
    """As a plugin: every ``DefaultWork`` made from now on carries the hooks of ``$KVBENCH_TEST_HOOK``."""
    raw = os.environ.get(HOOK_ENV)
    if not raw:
        return
    hooks = Hooks(**json.loads(raw))

    class EnvHookWork(HookWork):
        def __init__(self, sweep):
            super().__init__(sweep, hooks)

    cell_work.DefaultWork = EnvHookWork
    from kvbench.harness import ray_worker, runner

    runner.DefaultWork = ray_worker.DefaultWork = EnvHookWork


_install_from_env()

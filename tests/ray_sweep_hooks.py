"""Cell work for tests/test_sweep_ray.py that misbehaves once, on a Ray worker or in this process.

``HookWork`` is the real ``DefaultWork`` plus two planted faults, each armed until its marker file exists:

* ``exit_in`` (a cell key): the worker process dies (``os._exit``) in that cell's load test, the first time
  (the marker is written just before);
* ``sleep_in`` (a cell key): that cell's first suite sleeps ``sleep_s`` seconds, the first time.

Every suite and load call appends ``<cell key> <what>`` to ``calls`` (a file), so a test can tell which cells
ran where and how often.  Imported as a plugin (``KVBENCH_PLUGINS=ray_sweep_hooks``) with
``$KVBENCH_TEST_HOOK`` holding the same settings as JSON, it makes ``DefaultWork`` itself a ``HookWork`` (for
a sweep run through the command line).  Workers import it by name: the test cluster's processes have this
directory on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from kvbench.harness import cell_work
from kvbench.harness.cell_work import DefaultWork

HOOK_ENV = "KVBENCH_TEST_HOOK"


class Hooks:
    def __init__(self, calls: str, exit_in: Optional[str] = None, sleep_in: Optional[str] = None,
                 sleep_s: float = 0.0, marker_dir: Optional[str] = None):
        self.calls, self.exit_in, self.sleep_in, self.sleep_s = calls, exit_in, sleep_in, sleep_s
        self.marker_dir = marker_dir or str(Path(calls).parent)

    def note(self, cell, what: str) -> None:
        with open(self.calls, "a") as f:
            f.write(f"{cell.key} {what} {os.getpid()}\n")

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

"""Peak resident memory (RSS) of every cell of a sweep, and of the whole sweep (docs/performance.md "Memory").

    python docs/scripts/sweep_memory.py configs/default.yaml --data-dir ../shared/data
    python docs/scripts/sweep_memory.py docs/scripts/sweep_memory_1b.yaml --data-dir ../shared/data --json mem.json

The sweep runs in this process (``harness.runner.run_sweep``, progress off) into ``--out`` (default: a fresh
temporary directory).  Each cell has a measurement window: from the first thing it runs (for the first cell of
a cell group: from the target's start-up, so the window holds the model load) to the start of the next cell.
A window's peak is the kernel's own high-water mark (``VmHWM``, reset at every window start through
``/proc/self/clear_refs``), also sampled every ``--interval`` seconds as a fallback where that reset is not
allowed.  ``rss_start`` is the RSS when the window opened: at a group's first cell it shows what earlier groups
left behind.  Linux only (``/proc/self``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

GB = 1e9


class Window:
    """One measurement window (a plain class: docs scripts are loaded without a sys.modules entry)."""

    def __init__(self, label: str, rss_start: int):
        self.label, self.rss_start, self.peak, self.seconds = label, rss_start, 0, 0.0

    def to_dict(self) -> dict:
        return {"label": self.label, "rss_start": self.rss_start, "peak": self.peak, "seconds": self.seconds}


class Meter:
    """Measurement windows, one open at a time; a background thread samples RSS into the open one."""

    def __init__(self, interval: float):
        from kvbench.core.memory import reset_peak_rss, rss_bytes

        self.interval, self.windows, self._lock = interval, [], threading.Lock()
        self._stop = threading.Event()
        self._exact = reset_peak_rss()  # VmHWM can be reset: window peaks are exact, not sampled
        self._t0 = time.monotonic()
        self.windows.append(Window("start-up (imports, config)", rss_bytes()))
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        from kvbench.core.memory import rss_bytes

        while not self._stop.wait(self.interval):
            rss = rss_bytes()
            with self._lock:
                w = self.windows[-1]
                w.peak = max(w.peak, rss)

    def _close_current(self) -> None:
        from kvbench.core.memory import peak_rss_bytes, rss_bytes

        w = self.windows[-1]
        w.peak = max(w.peak, rss_bytes(), peak_rss_bytes() if self._exact else 0)
        now = time.monotonic()
        w.seconds, self._t0 = round(now - self._t0, 1), now

    def enter(self, label: str) -> None:
        """Close the open window (unless it is ``label``'s) and open one for ``label``."""
        from kvbench.core.memory import reset_peak_rss, rss_bytes

        with self._lock:
            if self.windows[-1].label == label:
                return
            self._close_current()
            if self._exact:
                reset_peak_rss()
            self.windows.append(Window(label, rss_bytes()))

    def finish(self) -> list[Window]:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            self._close_current()
        return self.windows


class MeteredWork:
    """A ``CellWork`` that opens the cell's window before each of its suites and its load test."""

    def __init__(self, work, meter: Meter):
        self.work, self.meter = work, meter

    def suite(self, spec, client, cell, fidelity):
        self.meter.enter(cell.label)
        return self.work.suite(spec, client, cell, fidelity)

    def load(self, base_url, model_id, cell):
        self.meter.enter(cell.label)
        return self.work.load(base_url, model_id, cell)


def metered_opener(meter: Meter, labels: dict[str, str]):
    """``open_target`` that opens the window of a group's first cell before the target starts (a fidelity
    reference target, ``reference-*.log``, stays in the window of the cell that asked for it)."""
    from kvbench.harness.targets import open_target

    @contextmanager
    def opener(spec, cell_config, engine_kwargs, log_path, **kw):
        stem = Path(log_path).stem
        if not stem.startswith("reference-"):
            meter.enter(labels.get(stem, stem))
        with open_target(spec, cell_config, engine_kwargs, log_path, **kw) as session:
            yield session

    return opener


def run(config: str, out: Optional[str], data_dir: Optional[str], interval: float) -> dict:
    from kvbench.core.memory import rss_bytes
    from kvbench.harness.cell_work import DefaultWork
    from kvbench.harness.matrix import expand
    from kvbench.harness.runner import run_sweep
    from kvbench.harness.sweep.config import load_config

    cfg = load_config(config)
    if data_dir is not None:
        cfg.data_dir = data_dir
    labels = {c.key: c.label for c in expand(cfg)}
    run_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="sweep-memory-")) / "run"
    meter = Meter(interval)
    t0 = time.monotonic()
    outcome = run_sweep(cfg, run_dir, progress=False, work=MeteredWork(DefaultWork(cfg), meter),
                        opener=metered_opener(meter, labels))
    meter.enter("after the sweep")
    windows = meter.finish()
    return {
        "config": config, "run_dir": str(run_dir), "wall_s": round(time.monotonic() - t0, 1),
        "done": len(outcome.done), "failed": len(outcome.failed), "exact_peaks": meter._exact,
        "cells": [w.to_dict() for w in windows], "peak": max(w.peak for w in windows), "rss_end": rss_bytes(),
        "python": platform.python_version(), "machine": platform.machine(), "cpus": __import__("os").cpu_count(),
    }


def print_table(res: dict) -> None:
    print(f"{'window':60s} {'peak RSS GB':>11s} {'RSS at start GB':>15s} {'s':>7s}")
    for w in res["cells"]:
        print(f"{w['label'][:60]:60s} {w['peak'] / GB:11.2f} {w['rss_start'] / GB:15.2f} {w['seconds']:7.1f}")
    print(f"sweep peak RSS: {res['peak'] / GB:.2f} GB ({'VmHWM per window' if res['exact_peaks'] else 'sampled'}); "
          f"{res['done']} cells done, {res['failed']} failed, {res['wall_s']:.0f} s wall; run dir {res['run_dir']}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="sweep YAML file")
    ap.add_argument("--out", help="run directory (must not exist; default: a new temporary directory)")
    ap.add_argument("--data-dir", help="dataset directory (overrides the config's data_dir)")
    ap.add_argument("--interval", type=float, default=0.05, help="RSS sampling interval in seconds (default 0.05)")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    res = run(args.config, args.out, args.data_dir, args.interval)
    print_table(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0 if not res["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Resume after a real crash: a sweep subprocess is killed with SIGKILL in the middle of a cell, then
``resume=True`` finishes the run without redoing the cells that were done."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kvbench.harness.matrix import expand
from kvbench.core.store import RunStore
from kvbench.harness.sweep.config import parse_config

RAW = {
    "name": "crash",
    "axes": {"kv": ["bf16", "fp8_e4m3", "fp8_e5m2"], "concurrency": [1, 2]},
    "suites": [{"name": "gsm8k_chat", "limit": 2}],
    "load": {"num_prompts": 2},
}

SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from contextlib import contextmanager
    from kvbench.harness.runner import run_sweep
    from kvbench.harness.sweep.config import parse_config
    from kvbench.harness.targets import TargetSession

    raw, out, events, resume = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"

    def note(line):
        with open(events, "a") as f:
            f.write(line + "\\n")

    class Client:
        model_id = "fake"
        def close(self):
            pass

    @contextmanager
    def opener(spec, cfg, engine_kwargs, log_path):
        yield TargetSession(Client(), "fake", url="http://fake")

    class Work:
        def suite(self, spec, client, cell, fidelity):
            note("suite " + cell.key)
            return [{"suite": spec.name, "item_id": "0", "repeat": 0, "correct": True}], {"accuracy": 1.0, "n": 1}

        def load(self, base_url, model_id, cell):
            note("start " + cell.key)
            time.sleep(0.4)
            note("end " + cell.key)
            return {"completed": 2}, [{"request_id": "r0", "success": True}]

    run_sweep(parse_config(raw), out, resume=resume, work=Work(), opener=opener, progress=False)
    """
)


def events(path: Path) -> list[tuple[str, str]]:
    return [tuple(line.split()) for line in path.read_text().splitlines()] if path.exists() else []


def test_kill_9_then_resume(tmp_path):
    script = tmp_path / "sweep_script.py"
    script.write_text(SCRIPT)
    out, ev = tmp_path / "run", tmp_path / "events.txt"
    cells = expand(parse_config(RAW))
    st = RunStore(out)
    cmd = [sys.executable, str(script), json.dumps(RAW), str(out), str(ev)]
    proc = subprocess.Popen(cmd + ["0"])
    try:
        deadline = time.monotonic() + 60
        # wait until two cells are done and a third has started
        while time.monotonic() < deadline:
            done = [c.key for c in cells if st.status(c.key) == "done"]
            started = [k for e, k in events(ev) if e == "start"]
            if len(done) >= 2 and len(started) > len(done):
                break
            assert proc.poll() is None, "the sweep ended before it could be killed"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    done_before = {c.key for c in cells if st.status(c.key) == "done"}
    interrupted = [c.key for c in cells if st.status(c.key) == "running"]
    assert 2 <= len(done_before) < len(cells) and len(interrupted) == 1
    n_before = len(events(ev))
    # what a write killed between its temporary file and the rename leaves behind: the resume removes it
    stale = st.root / "cells" / interrupted[0] / ".summary.json.k1ll3d0x.tmp"
    stale.write_text("{half")
    keep = st.root / "cells" / interrupted[0] / "notes.tmp"  # not the store's pattern: left alone
    keep.write_text("x")

    subprocess.run(cmd + ["1"], check=True, timeout=60)
    assert not stale.exists() and keep.exists()
    second = events(ev)[n_before:]
    redone = {k for e, k in second if e in ("start", "suite")}  # the A/A control (on by default) runs suites only
    assert redone == {c.key for c in cells} - done_before  # unfinished and never-started cells, nothing else
    assert interrupted[0] in redone
    assert all(st.status(c.key) == "done" for c in cells)
    for c in cells:
        assert st.read_json(c.key, "summary")["error"] is None
        assert len(st.read_requests(c.key)) == (0 if c.config.get("aa_control") else 1)
    runs = st.manifest()["runs"]
    assert [r["resume"] for r in runs] == [False, True] and "finished" not in runs[0] and runs[1]["skipped"] == len(done_before)

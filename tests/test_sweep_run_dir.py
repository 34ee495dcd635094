"""The run directory on --resume: one sweep at a time (RUN/.lock), a corrupt manifest is one error line, and
the resume check refuses exactly what would reuse a finished cell made with other settings (gate,
description, a new KV format or a respelled --data-dir are fine).  Fake target and work, no model."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import textwrap
import threading
from contextlib import contextmanager

import pytest
import yaml
from typer.testing import CliRunner

from kvbench.harness import runner as runner_mod
from kvbench.harness.cli import app
from kvbench.harness.matrix import expand
from kvbench.harness.runner import RunInUseError, RunLock, run_sweep
from kvbench.core.store import RunStore
from kvbench.harness.sweep.config import SweepConfigError, parse_config
from kvbench.harness.targets import TargetSession

RAW = {
    "name": "rd",
    "description": "first",
    "engine": {"device": "cpu", "kv_budget_gb": 0.25},
    "axes": {"kv": ["bf16", "fp8_e4m3"], "concurrency": [1, 2]},
    "suites": [{"name": "gsm8k_chat", "limit": 2}],
    "load": {"num_prompts": 2},
    "baseline": {"kv_dtype": "bf16"},
    "gate": {"max_drop": 0.05},
    "aa_control": False,  # run-directory mechanics; the A/A control has tests of its own (test_sweep_runner)
}


def cfg(data_dir=None, **over):
    raw = copy.deepcopy(RAW)
    for path, value in over.items():
        *parents, last = path.split("__")
        d = raw
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = value
    c = parse_config(raw)
    c.data_dir = data_dir
    return c


class Fake:
    """Opener + CellWork; ``block`` makes the load test wait (a sweep that is still running)."""

    def __init__(self, fail=lambda cell: False, block: threading.Event | None = None):
        self.ran, self.fail, self.block = [], fail, block
        self.started = threading.Event()

    @contextmanager
    def opener(self, spec, cell_config, engine_kwargs, log_path):
        class Client:
            model_id = "fake"

            def close(self):
                pass

        yield TargetSession(Client(), "fake", url="http://fake")

    def suite(self, spec, client, cell, fidelity):
        return [{"suite": spec.name, "item_id": "0", "repeat": 0, "correct": True}], {"accuracy": 1.0, "n": 1}

    def load(self, base_url, model_id, cell):
        self.ran.append(cell.key)
        self.started.set()
        if self.block is not None:
            assert self.block.wait(30)
        if self.fail(cell):
            raise RuntimeError("planted")
        return {"completed": 1}, [{"request_id": "r", "success": True}]


def sweep(c, out, resume=False, fake=None, **kw):
    fake = fake or Fake()
    return run_sweep(c, out, resume=resume, work=fake, opener=fake.opener, progress=False, **kw), fake


# ------------------------------------------------------------------------------------------ lock
def test_second_sweep_on_a_running_run_is_refused_before_it_touches_anything(tmp_path, monkeypatch):
    reaped = []
    monkeypatch.setattr(runner_mod, "reap_stale", lambda logs: reaped.append(logs) or [])
    out, gate = tmp_path / "run", threading.Event()
    first = Fake(block=gate)
    errors = []

    def run_first():
        try:
            sweep(cfg(), out, fake=first)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=run_first)
    t.start()
    try:
        assert first.started.wait(30)
        manifest_before = (out / "manifest.json").read_bytes()
        second = Fake()
        with pytest.raises(RunInUseError, match=rf"is in use by another sweep \(pid {os.getpid()}\)"):
            sweep(cfg(), out, resume=True, fake=second)
        assert second.ran == [] and len(reaped) == 1  # the second sweep reaped nothing and ran nothing
        assert (out / "manifest.json").read_bytes() == manifest_before
        # the command line says it in one line, exit 2
        c = tmp_path / "c.yaml"
        c.write_text(yaml.safe_dump(RAW))
        r = CliRunner().invoke(app, ["sweep", str(c), "--out", str(out), "--resume"])
        assert r.exit_code == 2 and f"is in use by another sweep (pid {os.getpid()})" in r.output
    finally:
        gate.set()
        t.join(30)
    assert not errors
    out2, _ = sweep(cfg(), out, resume=True)  # released when the first sweep ended
    assert len(out2.skipped) == 4


def test_lock_is_released_when_the_sweep_raises(tmp_path):
    sweep(cfg(), tmp_path / "run")
    with pytest.raises(SweepConfigError, match="already holds a run"):
        sweep(cfg(), tmp_path / "run")

    class Boom(Fake):
        def load(self, base_url, model_id, cell):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sweep(cfg(), tmp_path / "run2", fake=Boom())
    with RunLock(tmp_path / "run"), RunLock(tmp_path / "run2"):  # both free again
        pass


def test_lock_dies_with_its_process(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from kvbench.harness.runner import RunLock
        RunLock({str(tmp_path / 'run')!r}).acquire()
        print("locked", flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(RunInUseError, match=f"pid {p.pid}"):
            RunLock(tmp_path / "run").acquire()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
    RunLock(tmp_path / "run").acquire().release()


# ------------------------------------------------------------------------------------ manifest
def test_corrupt_manifest_is_one_error_line(tmp_path):
    out = tmp_path / "run"
    sweep(cfg(), out)
    (out / "manifest.json").write_text('{"config": {')
    with pytest.raises(SweepConfigError, match=r"manifest.json is not valid JSON \("):
        sweep(cfg(), out, resume=True)
    c = tmp_path / "c.yaml"
    c.write_text(yaml.safe_dump(RAW))
    r = CliRunner().invoke(app, ["sweep", str(c), "--out", str(out), "--resume"])
    assert r.exit_code == 2, r.output
    assert f"kvbench sweep: error: {out}/manifest.json is not valid JSON (" in r.output and "Traceback" not in r.output
    (out / "manifest.json").write_text("[1, 2]")
    with pytest.raises(SweepConfigError, match="not a kvbench sweep manifest"):
        sweep(cfg(), out, resume=True)


# --------------------------------------------------------------------------------- resume rules
def test_report_only_changes_resume_and_update_the_manifest(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    out = tmp_path / "run"
    first, _ = sweep(cfg(str(data)), out)
    c2 = cfg(str(data) + "/", description="second", gate={"max_drop": 0.1, "confidence": 0.9}, name="renamed")
    second, fake = sweep(c2, out, resume=True)
    assert fake.ran == [] and sorted(second.skipped) == sorted(first.done)
    m = RunStore(out).manifest()
    assert m["config"]["gate"]["max_drop"] == 0.1 and m["config"]["description"] == "second"


def test_new_kv_format_runs_only_the_new_cells(tmp_path):
    out = tmp_path / "run"
    first, _ = sweep(cfg(), out)
    c2 = cfg(axes={"kv": ["bf16", "fp8_e4m3", "nvfp4"], "concurrency": [1, 2]})
    second, fake = sweep(c2, out, resume=True)
    new = {c.key for c in expand(c2) if c.config["kv_dtype"] == "nvfp4"}
    assert set(fake.ran) == new and set(second.done) == new and sorted(second.skipped) == sorted(first.done)
    assert [c["key"] for c in RunStore(out).manifest()["cells"]] == [c.key for c in expand(c2)]


@pytest.mark.parametrize("over,needles", [
    ({"engine": {"device": "cpu", "kv_budget_gb": 0.5}}, ["differs in: engine", "engine.kv_budget_gb: was 0.25, now 0.5"]),
    ({"suites": [{"name": "gsm8k_chat", "limit": 3}]}, ["differs in: suites", "suites[0].limit: was 2, now 3"]),
    ({"load": {"num_prompts": 4}}, ["differs in: load", "load.num_prompts"]),
    ({"seed": 1}, ["differs in: seed"]),
    ({"slo": {"ttft_ms": 100}}, ["differs in: slo"]),
    ({"accuracy_concurrency": 2}, ["differs in: accuracy_concurrency", "accuracy suites"]),
    ({"axes": {"kv": ["bf16"], "concurrency": [1, 2]}}, ["differs in: kv", "not in the new matrix", "fp8_e4m3/unit"]),
    ({"targets": [{"name": "embedded", "type": "embedded", "engine": {"max_running": 4}}]},
     ["differs in: targets", "target embedded.engine.max_running"]),
])
def test_changes_that_would_reuse_finished_cells_are_refused(tmp_path, over, needles):
    out = tmp_path / "run"
    sweep(cfg(), out)
    before = (out / "manifest.json").read_bytes()
    with pytest.raises(SweepConfigError) as e:
        sweep(cfg(**over), out, resume=True)
    for needle in needles + ["was made with a different config", "or use a new --out directory"]:
        assert needle in str(e.value), str(e.value)
    assert (out / "manifest.json").read_bytes() == before


def test_other_data_dir_is_refused_with_the_original(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    sweep(cfg(str(a)), tmp_path / "run")
    with pytest.raises(SweepConfigError, match=rf"differs in: data_dir.*pass the original --data-dir {a}"):
        sweep(cfg(str(b)), tmp_path / "run", resume=True)
    with pytest.raises(SweepConfigError, match="differs in: data_dir"):
        sweep(cfg(None), tmp_path / "run", resume=True)


def test_settings_may_change_while_no_cell_is_finished(tmp_path):
    out = tmp_path / "run"
    first, _ = sweep(cfg(), out, fake=Fake(fail=lambda cell: True))
    assert len(first.failed) == 4 and not first.done
    c2 = cfg(engine={"device": "cpu", "kv_budget_gb": 0.5})
    second, fake = sweep(c2, out, resume=True)
    assert len(second.done) == 4 and RunStore(out).manifest()["config"]["engine"]["kv_budget_gb"] == 0.5
    # now cells are done: the engine is fixed again
    with pytest.raises(SweepConfigError, match="differs in: engine"):
        sweep(cfg(), out, resume=True)


def test_done_cell_the_manifest_does_not_know_is_not_reused(tmp_path):
    out = tmp_path / "run"
    sweep(cfg(), out, only="kv_dtype=bf16")
    c2 = cfg(axes={"kv": ["bf16", "fp8_e4m3", "nvfp4"], "concurrency": [1, 2]})
    stray = next(c for c in expand(c2) if c.config["kv_dtype"] == "nvfp4")
    st = RunStore(out)
    st.init_cell(stray.key, stray.config, stray.label)
    st.set_status(stray.key, "done")
    with pytest.raises(SweepConfigError, match="finished cells the manifest does not describe"):
        sweep(c2, out, resume=True)

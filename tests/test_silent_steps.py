"""No silent long step: model loading and KV-scale calibration say so on stderr, `kvbench serve` fails at once
on a busy port, the sweep shows an ETA, times cells with their target's start-up, and ends with the command
to type next (``--resume`` after an interrupt, ``report`` / ``gate`` after a finished run)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch
import yaml
from typer.testing import CliRunner

from kvbench.harness import runner as runner_mod
from kvbench.harness.cli import app
from kvbench.core.store import RunStore
from kvbench.harness.sweep.display import SweepDisplay, eta_seconds, format_eta
from kvbench.harness.sweep.hints import resume_command
from kvbench.harness.targets import TargetSession
from kvbench.runtime import step_notes
from kvbench.runtime.models.loader import load_model

TINY = "synthetic:llama-3-8b,layers=3,hidden=64,heads=2,kv_heads=1,head_dim=32,intermediate_size=128,vocab=300"


@pytest.fixture(autouse=True)
def _notes_on(monkeypatch):
    monkeypatch.delenv(step_notes.QUIET_ENV, raising=False)


# --- model loading and calibration ---------------------------------------------------------------------------

def test_loading_a_model_says_so(capsys):
    loaded = load_model(TINY)
    err = capsys.readouterr().err
    assert err.startswith(f"loading {TINY} (synthetic weights)…\n")  # said before the work, not only after
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(rf"loading {re.escape(TINY)} \(synthetic weights\)… building 3 layers… done in (\d+\.\d) s; "
                     r"(\d+\.\d)M params on cpu", last)
    assert m, err
    assert float(m.group(1)) == pytest.approx(loaded.load_seconds, abs=0.11)
    assert float(m.group(2)) == pytest.approx(loaded.config.num_params() / 1e6, abs=0.06)


def test_gguf_loading_names_the_dequantizing_step(tmp_path, monkeypatch):
    from kvbench.runtime.models import gguf_loader

    parts: list[str] = []
    monkeypatch.setattr(gguf_loader, "load_gguf", lambda path, dtype: (_ for _ in ()).throw(RuntimeError("stop")))
    monkeypatch.setattr("kvbench.runtime.default_model.cache_dir", lambda: tmp_path)
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="stop"):
        gguf_loader.load_gguf_cached(f, on_part=parts.append)
    assert parts == ["dequantizing"]  # nothing cached yet: the slow path is named before it runs


def test_failed_load_says_failed(capsys, monkeypatch):
    from kvbench.runtime.models import loader

    monkeypatch.setattr(loader, "_build", lambda *a: (_ for _ in ()).throw(MemoryError("out of memory")))
    with pytest.raises(MemoryError):
        load_model(TINY)
    assert re.fullmatch(r"loading .*… building 3 layers… failed after \d+\.\d s",
                        capsys.readouterr().err.splitlines()[-1])
    s = step_notes.Step("loading x")
    s.part("dequantizing")
    s.fail()
    assert capsys.readouterr().err.splitlines()[-1].startswith("loading x… dequantizing… failed after ")


def test_quiet_silences_notes(capsys, monkeypatch):
    with step_notes.quiet():
        load_model(TINY)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(step_notes.QUIET_ENV, "1")
    step_notes.note("hello")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(step_notes.QUIET_ENV, "0")
    step_notes.note("hello")
    assert capsys.readouterr().err == "hello\n"


def test_calibration_says_so_with_amax_per_layer_group(capsys):
    from kvbench.runtime.attention.base import build_rope_cache
    from kvbench.runtime.models.calibration import calibrate_scales

    with step_notes.quiet():
        loaded = load_model(TINY)
    cfg = loaded.config
    rope = build_rope_cache(cfg.rope_dim, 256, cfg.rope_theta, cfg.rope_scaling, cfg.rope_style, torch.device("cpu"))
    scales = calibrate_scales(loaded.model, loaded.tokenizer, rope, "fp8_e4m3", 2, False, "cpu")
    err = capsys.readouterr().err
    tokens = scales.details["calibration_tokens"]
    first, last = err.strip().splitlines()[0], err.strip().splitlines()[-1]
    assert first == f"calibrating fp8_e4m3 KV scales on {tokens} tokens (2 prompts, 3 layers)…"
    m = re.fullmatch(r"calibrating .*… done in \d+\.\d s; (.*)", last)
    assert m, err
    groups = m.group(1).split(", ")
    assert [g.split(" amax")[0] for g in groups] == ["layer 0", "layer 1", "layer 2"]
    k_found = [float(re.search(r"K (\S+)", g).group(1)) for g in groups]
    assert max(k_found) == pytest.approx(scales.details["k_amax_max"], rel=0.01)


def test_amax_groups_of_many_layers():
    from kvbench.runtime.scales import AmaxObserver

    obs = AmaxObserver(30, 2)
    obs.k_amax[:, 0] = torch.arange(30, dtype=torch.float32)
    obs.v_amax[:, 1] = 0.5
    text = obs.describe()
    assert text == ("layers 0–7 amax K 7 V 0.5, layers 8–15 amax K 15 V 0.5, "
                    "layers 16–23 amax K 23 V 0.5, layers 24–29 amax K 29 V 0.5")


# --- kvbench serve: busy port ----------------------------------------------------------------------------------

def test_serve_on_a_busy_port_fails_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        # the default model would take seconds to load (and download): the check must come first
        res = subprocess.run([sys.executable, "-m", "kvbench.harness.cli", "serve", "--port", str(port)],
                             capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
    assert res.returncode == 2, res.stderr
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and f"port {port}" in err and "already in use" in err and "--port" in err
    assert "loading" not in err and "Traceback" not in err
    assert took < 5  # process start-up included; the check itself is a bind


def test_port_check_in_process_is_fast_and_lets_free_ports_pass():
    from kvbench.harness.commands.serve import check_port_free
    from kvbench.harness.errors import UserError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_port_free("127.0.0.1", port)
        assert time.monotonic() - t0 < 1
    check_port_free("127.0.0.1", port)  # free again
    check_port_free("127.0.0.1", 0)


# --- the sweep: ETA, start-up time, what to type next ----------------------------------------------------------

def test_eta_formatter():
    assert eta_seconds([], 3) is None and format_eta(None) == ""
    assert eta_seconds([10.0, 20.0], 0) is None
    assert eta_seconds([10.0, 20.0], 4) == 60.0
    assert eta_seconds([10.0, float("nan")], 4, parallel=2) == 20.0  # untimed cells left out
    assert eta_seconds([10.0], 1, parallel=4) == 10.0  # never faster than one cell
    assert format_eta(44.6) == "ETA 45s"
    assert format_eta(250) == "ETA 4m 10s"
    assert format_eta(7500) == "ETA 2h 05m"


def test_display_plain_lines_carry_count_and_eta(capsys):
    d = SweepDisplay(3, None)
    d.finished("[green]done[/]   a (10.0 s)", 10.0)
    d.finished("[green]done[/]   b (20.0 s)", 20.0)
    d.finished("[green]done[/]   c (30.0 s)", 30.0)
    assert capsys.readouterr().err.splitlines() == [
        "done   a (10.0 s)  [1/3, ETA 20s]", "done   b (20.0 s)  [2/3, ETA 15s]", "done   c (30.0 s)  [3/3]"]
    assert d.eta_text() == ""


def test_progress_bar_has_an_eta_column():
    d = SweepDisplay(4, True, parallel=2)
    with d:
        assert d.progress.tasks[0].fields["eta"] == ""
        d.finished("[green]done[/]   a (30.0 s)", 30.0)
        assert d.progress.tasks[0].fields["eta"] == "ETA 45s"  # 3 cells of 30 s, two at a time
        assert d.progress.tasks[0].completed == 1


def _write_config(tmp_path):
    raw = {"name": "fake", "axes": {"kv": [{"dtype": "bf16", "scales": "unit"}, {"dtype": "fp8_e4m3", "scales": "unit"}],
                                    "concurrency": [1]},
           "suites": [], "load": {"num_prompts": 1}, "aa_control": False}
    path = tmp_path / "fake.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


class FakeWork:
    def __init__(self, interrupt_on=None, startup_s=0.0):
        self.interrupt_on, self.startup_s = interrupt_on, startup_s

    @contextmanager
    def opener(self, spec, cell_config, engine_kwargs, log_path, **extra):
        time.sleep(self.startup_s)
        yield TargetSession(object(), "fake-model", url="http://fake", capacity=lambda: None, flush=lambda: None)

    def suite(self, spec, client, cell, fidelity):
        raise AssertionError("no suites configured")

    def load(self, base_url, model_id, cell):
        if cell.config["kv_dtype"] == self.interrupt_on:
            raise KeyboardInterrupt
        return {"output_throughput": 1.0}, [{"request_id": "r", "success": True}]


REAL_RUN_SWEEP = runner_mod.run_sweep


def _patch_runner(monkeypatch, work):
    real = REAL_RUN_SWEEP

    def fake_run_sweep(*args, **kw):
        return real(*args, work=work, opener=work.opener, **kw)

    monkeypatch.setattr(runner_mod, "run_sweep", fake_run_sweep)


def test_interrupted_sweep_prints_the_exact_resume_command(tmp_path, monkeypatch):
    cfg = _write_config(tmp_path)
    _patch_runner(monkeypatch, FakeWork(interrupt_on="fp8_e4m3"))
    out, data = tmp_path / "my run", tmp_path / "data"
    data.mkdir()
    r = CliRunner().invoke(app, ["sweep", str(cfg), "--out", str(out), "--only", "concurrency=1",
                                 "--data-dir", str(data), "--no-progress"])
    assert r.exit_code == 130, r.output
    expected = resume_command(str(cfg), out, only="concurrency=1", data_dir=str(data))
    assert f"  {expected}" in r.output.splitlines()
    assert f"'{out}' --resume --only concurrency=1 --data-dir {data}" in expected  # quoted: the path has a space
    assert "kvbench report" not in r.output
    # the printed command finishes the run
    _patch_runner(monkeypatch, FakeWork())
    import shlex

    argv = shlex.split(expected)[1:]
    r = CliRunner().invoke(app, [*argv, "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "1 cells done, 0 failed, 1 already done" in r.output


def test_finished_sweep_prints_report_and_gate_and_startup_time(tmp_path, monkeypatch):
    cfg = _write_config(tmp_path)
    _patch_runner(monkeypatch, FakeWork(startup_s=0.2))
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["sweep", str(cfg), "--out", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert f"kvbench report {out}" in r.output and f"kvbench gate {out}" in r.output
    assert "--resume" not in r.output
    store = RunStore(out)
    keys = [c["key"] for c in store.manifest()["cells"]]
    summaries = [store.read_json(k, "summary") for k in keys]
    startups = [s.get("startup_s") for s in summaries]
    assert all(s is not None and s >= 0.2 for s in startups)  # one target per kv format: each group's first cell
    m = re.search(r"done   \S+ .*\((\d+\.\d) s incl\. (\d+\.\d) s target start-up\)", r.output)
    assert m, r.output
    assert float(m.group(2)) >= 0.2 and float(m.group(1)) >= float(m.group(2))


def test_failed_cells_end_with_the_command_that_redoes_them(tmp_path, monkeypatch):
    cfg = _write_config(tmp_path)

    class Failing(FakeWork):
        def load(self, base_url, model_id, cell):
            if cell.config["kv_dtype"] == "fp8_e4m3":
                raise RuntimeError("planted")
            return super().load(base_url, model_id, cell)

    _patch_runner(monkeypatch, Failing())
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["sweep", str(cfg), "--out", str(out), "--parallel", "2", "--no-progress"])
    assert r.exit_code == 1, r.output
    assert f"  {resume_command(str(cfg), out, parallel=2)}" in r.output.splitlines()
    assert "--parallel 2" in r.output and "kvbench report" not in r.output


def test_sigterm_stops_like_ctrl_c():
    import os
    import signal

    from kvbench.harness.sweep.hints import SweepTerminated, sigterm_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SweepTerminated):
        with sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    assert signal.getsignal(signal.SIGTERM) == before


def test_sweep_lines_are_not_wrapped_off_a_terminal():
    """A sweep logged to a file keeps each cell's line whole (rich wraps at 80 columns off a terminal)."""
    import subprocess
    import sys

    line = ("fp8_e5m2/calibrate torch c=16 (81.6 s): ruler 0.611, gsm8k_chat 0.000, fidelity KL 3.80e-02, "
            "63.7 out tok/s")
    code = ("from kvbench.harness.sweep.display import SweepDisplay\n"
            "d = SweepDisplay(2, True)\n"
            "with d:\n"
            f"    d.finished('[green]done[/]   ' + {line!r}, seconds=1.0)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "COLUMNS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert f"done   {line}" in out.stderr.splitlines(), out.stderr

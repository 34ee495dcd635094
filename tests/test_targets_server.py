"""Targets: launch templates, health waits, log capture, process-group kill.  The slow test launches the
real ``kvbench serve`` (default model, CPU) through a launch template and drives it."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvbench.harness.sweep.config import SweepConfigError, TargetSpec, parse_config
from kvbench.harness.targets import TargetError, _start_time, kill_group, open_server, reap_stale, render_launch

CELL = {"model": "default", "target": "srv", "prefill_backend": "torch", "decode_backend": "torch",
        "kv_dtype": "fp8_e4m3", "kv_scales": "calibrate", "concurrency": 2}


def server_spec(launch: str, **kw):
    t = {"name": "srv", "type": "server", "launch": launch, **kw}
    return parse_config({"targets": [t]}).targets[0]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # zombies still count for killpg; look for live members
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def group_gone(pgid: int, timeout_s: float = 5.0) -> bool:
    """True once no live process is left in the group (a SIGKILLed child takes a moment to exit)."""
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_render_launch_maps_and_quotes():
    spec = server_spec("serve --m {model} --kv {kv_dtype} --p {prefill_backend} --d {decode_backend} --s {kv_scales} {host}:{port}",
                       kv_dtype_map={"fp8_e4m3": "fp8"}, backend_map={"torch": "TORCH_SDPA"})
    cmd = render_launch(spec, {**CELL, "model": "/models/my model"}, 8123)
    assert cmd == "serve --m '/models/my model' --kv fp8 --p TORCH_SDPA --d TORCH_SDPA --s calibrate 127.0.0.1:8123"
    with pytest.raises(SweepConfigError, match=r"targets\[0\].launch: unknown placeholder \{gpu\}.*\{kv_dtype\}"):
        server_spec("serve {gpu} {port}")  # the config refuses it (harness/launch/options.py)
    with pytest.raises(TargetError, match=r"unknown placeholder 'gpu'.*\{kv_dtype\}"):
        render_launch(TargetSpec(name="srv", type="server", launch="serve {gpu} {port}"), CELL, 1)


def test_server_that_exits_fails_fast_with_its_log(tmp_path):
    spec = server_spec("echo booting; echo 'bad flag --frobnicate' >&2; exit 3 # {port}", health_timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(TargetError, match=r"(?s)exited with code 3.*bad flag --frobnicate"):
        with open_server(spec, CELL, tmp_path / "s.log"):
            pass
    assert time.monotonic() - t0 < 10
    assert "booting" in (tmp_path / "s.log").read_text()


def test_first_line_of_a_failed_start_names_the_cause(tmp_path):
    """The sweep prints one line per failed cell: that line must say why, not only 'exited with code 1'."""
    spec = server_spec("echo 'loading weights'; echo 'OSError: /no/such/model is not a local folder' >&2; "
                       "echo 'shutting down'; exit 1 # {port}", health_timeout_s=30)
    with pytest.raises(TargetError) as e:
        with open_server(spec, CELL, tmp_path / "s.log"):
            pass
    first = str(e.value).splitlines()[0]
    assert "exited with code 1" in first and "OSError: /no/such/model is not a local folder" in first


def test_health_timeout_kills_the_group(tmp_path):
    pid_file = tmp_path / "pid"
    spec = server_spec(f"echo $$ > {pid_file}; sleep 600 & sleep 600 # {{port}}", health_timeout_s=1.0)
    with pytest.raises(TargetError, match=r"not healthy after 1 s"):
        with open_server(spec, CELL, tmp_path / "s.log"):
            pass
    pgid = int(pid_file.read_text())
    assert group_gone(pgid)


def test_kill_group_escalates_to_sigkill(tmp_path):
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"],
                            start_new_session=True, stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"up"
    t0 = time.monotonic()
    kill_group(proc, grace_s=0.5)
    assert proc.returncode == -signal.SIGKILL and time.monotonic() - t0 < 5
    assert group_gone(proc.pid)


def test_orphans_of_a_killed_sweep_are_reaped(tmp_path):
    """kill -9 of the sweep: the launched leader dies with it (PDEATHSIG); what is left of its process
    group is killed by the next sweep on that run directory (the pid file names it)."""
    import subprocess
    import textwrap

    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from kvbench.harness.sweep.config import parse_config
        from kvbench.harness.targets import open_server
        spec = parse_config({{"targets": [{{"name": "srv", "type": "server", "health_timeout_s": 600,
                 "launch": "sleep 600 & exec sleep 601 # {{port}}"}}]}}).targets[0]
        with open_server(spec, {CELL!r}, sys.argv[1]):
            pass
    """))
    logs = tmp_path / "logs"
    proc = subprocess.Popen([sys.executable, str(script), str(logs / "g.log")])
    pid_file = logs / "g.pid"
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    pgid = int(pid_file.read_text().split()[0])
    assert group_alive(pgid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while _start_time(pgid) is not None and time.monotonic() < deadline:  # the leader dies with its parent
        time.sleep(0.05)
    assert _start_time(pgid) is None
    assert group_alive(pgid)  # the stray child lives on, until the next sweep on the run reaps its group
    assert reap_stale(logs) == [pgid]
    assert group_gone(pgid) and not list(logs.glob("*.pid"))
    # a live process that reuses a recorded pid (another start time) is left alone
    keeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        (logs / "stale.pid").write_text(f"{keeper.pid} 12345\n")
        assert reap_stale(logs) == [] and keeper.poll() is None
        (logs / "k.pid").write_text(f"{keeper.pid} {_start_time(keeper.pid)}\n")
        assert reap_stale(logs) == [keeper.pid]
        keeper.wait(timeout=5)
        assert keeper.returncode == -signal.SIGKILL
    finally:
        if keeper.poll() is None:
            keeper.kill()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kvbench_serve_through_a_launch_template(tmp_path):
    """Start `kvbench serve` (with a stray child in its process group), wait for /health, drive it with
    generate and a small load test, then check the log was captured and the whole group is gone."""
    from kvbench.core.client import GenRequest, SamplingParams
    from kvbench.harness.loadgen.run import LoadConfig, run_load

    launch = (
        "sleep 600 & exec {python} -m kvbench.harness serve --model {model} --kv-dtype {kv_dtype} "
        "--kv-scales {kv_scales} --prefill-backend {prefill_backend} --decode-backend {decode_backend} "
        "--host {host} --port {port} --device cpu --kv-budget-gb 0.05 --max-model-len 512"
    )
    spec = server_spec(launch, health_timeout_s=240)
    log = tmp_path / "server.log"
    with open_server(spec, {**CELL, "kv_scales": "unit"}, log) as session:  # unit: no calibration pass
        pgid = session.info["pid"]
        assert group_alive(pgid)
        assert session.model_id  # from /v1/models
        res = session.client.generate(GenRequest(prompt="The capital of France is", params=SamplingParams(max_tokens=6)))
        assert res.finish_reason in ("stop", "length") and res.output_tokens >= 1 and res.error is None
        summary, records = run_load(session.base_url(), session.model_id,
                                    LoadConfig(num_prompts=3, max_concurrency=2, input_len=16, output_len=4, warmup=0, salt="t"))
        assert len(records) == 3 and all(r["success"] for r in records)
        assert summary["completed"] == 3
    assert group_gone(pgid)  # the server and the stray `sleep` are both gone
    text = log.read_text()
    assert "--kv-dtype fp8_e4m3" in text.splitlines()[0]  # the rendered command heads the log
    assert "KV cache:" in text  # the server's own start-up output was captured


def test_in_process_server_whose_start_fails_stops_the_wait_at_once():
    """A sweep's in-process server (a GPU engine warms up at its start): a start-up that raises ends the server
    thread, and the health wait fails then with a clear error, not after its 300 s."""
    from kvbench.harness.targets import _in_process_server
    from kvbench.runtime.engine_api import CapacityReport

    class Tok:
        eos_token_ids, vocab_size = [0], 10

    class Broken:
        model_id, tokenizer, max_model_len = "m", Tok(), 64
        capacity = CapacityReport("bf16", 16, 4, 64, 2.0, 128, 64, 1)

        def prepare_to_serve(self):
            raise RuntimeError("warm-up failed on purpose")

        def start(self):
            pass

        def shutdown(self):
            pass

    t0 = time.monotonic()
    with pytest.raises(TargetError, match="stopped before .* answered: its start-up failed"):
        with _in_process_server(Broken()):
            pass
    assert time.monotonic() - t0 < 30

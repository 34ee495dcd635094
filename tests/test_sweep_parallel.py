"""`kvbench sweep --parallel N --devices ...`: cell groups side by side on disjoint devices and ports.

Stand-in servers (a stdlib HTTP server written here) record their pid, port, CUDA_VISIBLE_DEVICES and
start/stop times; fake cell work (no model) makes the cells take a while so groups overlap."""

from __future__ import annotations

import json
import re
import shlex
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.harness.matrix import expand, groups
from kvbench.harness.parallel import GroupScheduler, parse_devices, plan_groups, simulate, visible_devices
from kvbench.harness.runner import run_sweep
from kvbench.core.store import RunStore
from kvbench.harness.sweep.config import SweepConfigError, parse_config
from kvbench.harness.targets import TargetSession, free_port

KVS = ("bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4")

SERVER = textwrap.dedent(
    """
    import http.server, json, os, signal, sys, time
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    port, events = int(args["--port"]), args["--events"]

    def note(kind):
        rec = {"event": kind, "pid": os.getpid(), "port": port, "kv": args.get("--kv"), "t": time.time(),
               "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}
        with open(events, "a") as f:
            f.write(json.dumps(rec) + "\\n")

    if args.get("--kv") == args.get("--fail-kv"):
        note("fail")
        sys.exit(3)
    note("start")

    def stop(*_):
        note("stop")
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "m"}]} if self.path.startswith("/v1/models") else
                              {"port": port, "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def server_sweep(tmp_path: Path, kv=KVS, conc=(1,), tp_size=1, fail_kv="none", **over):
    script = tmp_path / "stand_in_server.py"
    script.write_text(SERVER)
    events = tmp_path / "events.jsonl"
    launch = (f"exec {{python}} {shlex.quote(str(script))} --port {{port}} --kv {{kv_dtype}} "
              f"--events {shlex.quote(str(events))} --fail-kv {fail_kv}")
    raw = {"name": "par", "targets": [{"name": "srv", "type": "server", "launch": launch, "model_id": "m",
                                       "health_timeout_s": 30}],
           "axes": {"kv": list(kv), "concurrency": list(conc)}, "suites": [], "load": {"num_prompts": 1}, **over}
    cfg = parse_config(raw)
    cfg.targets[0].tp_size = tp_size  # the target key (set directly: works whether or not the parser knows it)
    return cfg, events


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def intervals(events: list[dict]) -> dict[int, dict]:
    """pid -> {start, stop, cvd, port, kv} of every stand-in server that came up."""
    out: dict[int, dict] = {}
    for e in events:
        if e["event"] == "start":
            out[e["pid"]] = {"start": e["t"], "stop": None, "cvd": e["cvd"], "port": e["port"], "kv": e["kv"]}
        elif e["event"] == "stop":
            out[e["pid"]]["stop"] = e["t"]
    return out


def max_overlap(spans: list[tuple[float, float]]) -> int:
    points = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda p: (p[0], p[1]))
    cur = best = 0
    for _, d in points:
        cur += d
        best = max(best, cur)
    return best


REQUEST = {"request_id": "r0", "success": True, "error": None, "prompt_tokens": 8, "output_tokens": 4, "start_s": 0.0,
           "ttft_s": 0.01, "latency_s": 0.05, "itl_s": [0.01, 0.01, 0.01], "tpot_s": 0.01}


class HttpWork:
    """Fake cell work: the load test asks the cell's own server who it is (its port and devices) and waits."""

    def __init__(self, hold_s=0.5, interrupt=None):
        self.hold_s, self.interrupt = hold_s, interrupt
        self.seen: dict[str, dict] = {}
        self.up_after: dict[str, bool] = {}  # whether the cell's server still answered when its work ended
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def suite(self, spec, client, cell, fidelity):
        return [], {}

    def load(self, base_url, model_id, cell):
        with self.lock:
            self.calls.append(cell.key)
        if self.interrupt and self.interrupt(cell):
            raise KeyboardInterrupt
        who = httpx.get(f"{base_url}/whoami", timeout=10).json()
        with self.lock:
            self.seen[cell.key] = who
        time.sleep(self.hold_s if not callable(self.hold_s) else self.hold_s(cell))
        try:
            up = httpx.get(f"{base_url}/whoami", timeout=5).status_code == 200
        except httpx.HTTPError:
            up = False
        with self.lock:
            self.up_after[cell.key] = up
        return {"output_throughput": 1.0}, [REQUEST]


def test_two_servers_at_once_on_disjoint_devices_and_ports(tmp_path):
    cfg, events = server_sweep(tmp_path, tp_size=2)
    work = HttpWork(hold_s=0.6)
    out = run_sweep(cfg, tmp_path / "run", work=work, progress=False, parallel=2, devices=[0, 1, 2, 3])
    cells = expand(cfg)
    assert out.ok and out.done == [c.key for c in cells]  # outcome in matrix order
    servers = intervals(read_events(events))
    assert len(servers) == 4 and all(s["stop"] is not None for s in servers.values())
    spans = [(s["start"], s["stop"]) for s in servers.values()]
    assert max_overlap(spans) == 2  # side by side, never more than two
    for a in servers.values():  # servers alive at the same time hold disjoint devices
        assert len(a["cvd"].split(",")) == 2 and set(a["cvd"].split(",")) <= {"0", "1", "2", "3"}
        for b in servers.values():
            if a is not b and a["start"] < b["stop"] and b["start"] < a["stop"]:
                assert not set(a["cvd"].split(",")) & set(b["cvd"].split(","))
    assert len({s["port"] for s in servers.values()}) == 4
    st = RunStore(tmp_path / "run")
    by_port = {s["port"]: s for s in servers.values()}
    for c in cells:  # each cell's summary names the devices its server really had
        target = st.read_json(c.key, "summary")["target"]
        port = int(target["url"].rsplit(":", 1)[1])
        assert by_port[port]["kv"] == c.config["kv_dtype"]
        assert ",".join(map(str, target["devices"])) == by_port[port]["cvd"] == work.seen[c.key]["cvd"]
        assert target["parallel"] == 2
    run = st.manifest()["runs"][-1]
    assert run["parallel"] == 2 and run["devices"] == [0, 1, 2, 3]
    assert {k: ",".join(map(str, v)) for k, v in run["cell_devices"].items()} == {
        c.key: work.seen[c.key]["cvd"] for c in cells}
    assert not any(alive(pid) for pid in servers)
    assert not list((tmp_path / "run" / "logs").glob("*.pid"))
    # the report lists the devices of every cell
    from kvbench.reports.analysis import analyze
    from kvbench.reports.load import assign_short_labels, load_run
    from kvbench.reports.tables import cells_table

    data = load_run(tmp_path / "run")
    assign_short_labels(data.cells)
    table = cells_table(analyze(data.cells, lambda c: None))
    col = table.columns.index("devices")
    assert sorted(row[col] for row in table.rows) == sorted(work.seen[c.key]["cvd"] for c in cells)


def test_a_server_that_fails_does_not_stop_the_others(tmp_path):
    cfg, events = server_sweep(tmp_path, conc=(1, 2), fail_kv="fp8_e5m2")
    out = run_sweep(cfg, tmp_path / "run", work=HttpWork(hold_s=0.2), progress=False, parallel=2, devices=[0, 1])
    bad = [c.key for c in expand(cfg) if c.config["kv_dtype"] == "fp8_e5m2"]
    assert sorted(out.failed) == sorted(bad) and len(out.done) == 6
    st = RunStore(tmp_path / "run")
    for key in bad:
        assert st.status(key) == "failed" and "failed to start" in st.read_json(key, "summary")["error"]
    assert [e["kv"] for e in read_events(events) if e["event"] == "fail"] == ["fp8_e5m2"]
    servers = intervals(read_events(events))
    assert len(servers) == 3 and not any(alive(pid) for pid in servers)


def test_interruption_kills_every_server_and_resume_redoes_exactly_the_unfinished_cells(tmp_path):
    cfg, events = server_sweep(tmp_path, conc=(1, 2))
    cells = expand(cfg)
    by = {(c.config["kv_dtype"], c.concurrency): c for c in cells}
    a2, b2 = by[("bf16", 2)], by[("fp8_e4m3", 2)]

    def interrupt(cell):  # group b's second cell is hit by Ctrl-C once group a's second cell is under way
        if cell.key == b2.key:
            deadline = time.monotonic() + 10
            while a2.key not in work.seen and time.monotonic() < deadline:
                time.sleep(0.01)
            return True
        return False

    work = HttpWork(hold_s=lambda c: 1.0 if c.key == a2.key else 0.05, interrupt=interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(cfg, tmp_path / "run", work=work, progress=False, parallel=2)
    servers = intervals(read_events(events))
    assert len(servers) == 2 and not any(alive(pid) for pid in servers)  # groups c and d never started
    assert work.up_after[a2.key] is False  # its server was killed at the interruption, under the running cell
    st = RunStore(tmp_path / "run")
    done = {c.key for c in cells if st.is_done(c.key)}
    assert done == {by[("bf16", 1)].key, by[("fp8_e4m3", 1)].key}
    assert st.status(a2.key) == "failed" and "stopped" in st.read_json(a2.key, "summary")["error"]
    assert st.status(b2.key) == "running"
    again = HttpWork(hold_s=0.05)
    out = run_sweep(cfg, tmp_path / "run", resume=True, work=again, progress=False, parallel=2)
    assert out.ok and sorted(out.skipped) == sorted(done)
    assert sorted(again.calls) == sorted(c.key for c in cells if c.key not in done)
    assert all(st.is_done(c.key) for c in cells)
    assert not any(alive(pid) for pid in intervals(read_events(events)))


# ------------------------------------------------------------------ in-process fakes (no processes)
class FakeClient:
    model_id = "m"

    def close(self):
        pass


class Recorder:
    """A fake opener counting targets open at once, and fake work that takes a little while."""

    def __init__(self, fail_kv=None, hold_s=0.1):
        self.lock = threading.Lock()
        self.live = self.max_live = 0
        self.opened: list[tuple] = []
        self.calls: list[tuple] = []
        self.fail_kv, self.hold_s = fail_kv, hold_s
        self.ref_opens = 0

    @contextmanager
    def opener(self, spec, cfg, engine_kwargs, log_path, **kw):
        if cfg["kv_dtype"] == self.fail_kv:
            raise RuntimeError("planted start failure")
        with self.lock:
            self.live += 1
            self.max_live = max(self.max_live, self.live)
            self.opened.append((cfg["target"], cfg["kv_dtype"], kw.get("devices")))
        try:
            yield TargetSession(FakeClient(), "m", url="http://fake", capacity=lambda: {"kv": cfg["kv_dtype"]})
        finally:
            with self.lock:
                self.live -= 1

    def suite(self, spec, client, cell, fidelity):
        with self.lock:
            self.calls.append(("suite", cell.key, spec.name))
        if spec.name == "fidelity":
            cached = fidelity.cache_dir / f"{fidelity.label.replace(':', '_')}.ref"
            if not cached.exists():
                ref = fidelity.make_client()
                with self.lock:
                    self.ref_opens += 1
                time.sleep(0.2)  # a slow reference pass: a second group would miss the cache meanwhile
                ref.close()
                cached.write_text("ref")
        return [{"suite": spec.name, "item_id": "0", "repeat": 0, "correct": True}], {"accuracy": 1.0, "n": 1}

    def load(self, base_url, model_id, cell):
        with self.lock:
            self.calls.append(("load", cell.key, cell.concurrency))
        time.sleep(self.hold_s)
        return {"output_throughput": float(cell.concurrency)}, [{"request_id": "r", "success": True}]


def fake_sweep(targets, kv=KVS, conc=(1, 2), suites=(), **over):
    raw = {"name": "fake", "targets": targets, "axes": {"kv": list(kv), "concurrency": list(conc)},
           "suites": [{"name": s, "limit": 1} for s in suites], "load": {"num_prompts": 1}, "aa_control": False,
           **over}
    return parse_config(raw)


SRV = {"name": "srv", "type": "server", "launch": "serve {port} --kv {kv_dtype}", "model_id": "m"}


def _strip(d):
    return {k: v for k, v in d.items() if k not in ("elapsed_s", "startup_s")}


def test_parallel_1_is_the_sweep_as_before(tmp_path):
    cfg = fake_sweep([SRV], suites=("gsm8k_chat",))
    outs, recs = [], []
    for name, kw in (("plain", {}), ("p1", {"parallel": 1})):
        r = Recorder(fail_kv="fp8_e5m2", hold_s=0)
        outs.append(run_sweep(cfg, tmp_path / name, work=r, opener=r.opener, progress=False, **kw))
        recs.append(r)
    assert recs[0].opened == recs[1].opened == [("srv", k, None) for k in KVS if k != "fp8_e5m2"]
    assert recs[0].calls == recs[1].calls and recs[0].max_live == 1
    assert (outs[0].done, outs[0].failed) == (outs[1].done, outs[1].failed)
    cells = expand(cfg)
    assert outs[0].done == [c.key for c in cells if c.config["kv_dtype"] != "fp8_e5m2"]
    for c in cells:
        a, b = (RunStore(tmp_path / n).read_json(c.key, "summary") for n in ("plain", "p1"))
        assert _strip(a) == _strip(b) and not {"devices", "parallel"} & set(a.get("target", {}))
    assert {"parallel", "devices", "cell_devices"}.isdisjoint(RunStore(tmp_path / "p1").manifest()["runs"][-1])


def test_parallel_1_with_devices_gives_each_server_its_devices(tmp_path):
    cfg = fake_sweep([SRV], kv=("bf16", "fp8_e4m3"))
    cfg.targets[0].tp_size = 2
    r = Recorder(hold_s=0)
    out = run_sweep(cfg, tmp_path / "run", work=r, opener=r.opener, progress=False, devices=[3, 1, 2])
    assert out.ok and r.opened == [("srv", "bf16", [3, 1]), ("srv", "fp8_e4m3", [3, 1])] and r.max_live == 1
    assert RunStore(tmp_path / "run").read_json(out.done[0], "summary")["target"]["devices"] == [3, 1]


def test_without_gpus_servers_run_side_by_side_on_ports_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible
    cfg = fake_sweep([SRV])
    r = Recorder(hold_s=0.15)
    out = run_sweep(cfg, tmp_path / "run", work=r, opener=r.opener, progress=None, parallel=3)
    assert out.ok and r.max_live == 3 and {d for _, _, d in r.opened} == {None}
    assert out.done == [c.key for c in expand(cfg)]
    lines = capsys.readouterr().err.splitlines()  # plain progress lines from several threads, one per cell, whole
    pattern = re.compile(r"done   (.+) \(\d+\.\d s(?: incl\. \d+\.\d s target start-up)?\): (\d)\.0 out tok/s"
                         r"  \[\d+/\d+(?:, ETA \S+(?: \S+)?)?\]")
    assert sorted(pattern.fullmatch(line).groups() for line in lines) == sorted(
        (c.label, str(c.concurrency)) for c in expand(cfg))


def test_endpoint_groups_on_one_url_run_one_at_a_time(tmp_path):
    ep = {"name": "ep", "type": "endpoint", "base_url": "http://127.0.0.1:9", "model_id": "m"}
    r = Recorder(hold_s=0.05)
    out = run_sweep(fake_sweep([ep], kv=KVS[:3]), tmp_path / "one", work=r, opener=r.opener, progress=False, parallel=3)
    assert out.ok and r.max_live == 1 and len(r.opened) == 3
    ep2 = {**ep, "name": "ep2", "base_url": "http://127.0.0.1:10"}
    r = Recorder(hold_s=0.1)
    out = run_sweep(fake_sweep([ep, ep2], kv=KVS[:2]), tmp_path / "two", work=r, opener=r.opener, progress=False,
                    parallel=3)
    assert out.ok and r.max_live == 2  # two endpoints: one group on each at a time


def test_embedded_groups_run_one_at_a_time_beside_servers(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    emb = {"name": "emb", "type": "embedded"}
    r = Recorder(hold_s=0.1)
    out = run_sweep(fake_sweep([emb], kv=KVS[:3]), tmp_path / "emb", work=r, opener=r.opener, progress=False,
                    parallel=3)
    assert out.ok and r.max_live == 1


def test_embedded_group_holds_this_process_device(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    cfg = fake_sweep([{"name": "emb", "type": "embedded"}, SRV], kv=("bf16",), conc=(1,))
    emb, srv = plan_groups(cfg, groups(expand(cfg)), parallel=2)
    assert (emb.allowed, emb.need, emb.exclusive) == ([2], 1, ("embedded",))
    assert (srv.allowed, srv.need) == ([2, 5], 1)
    assert simulate([emb, srv], 2) == [(0, [2]), (0, [5])]


def test_tp_size_beyond_the_pool_is_a_config_error_before_anything_starts(tmp_path, monkeypatch):
    cfg = fake_sweep([SRV])
    cfg.targets[0].tp_size = 4
    r = Recorder()
    with pytest.raises(SweepConfigError, match=r"target 'srv': tp_size 4 needs 4 devices per server, but --devices "
                                               r"\[0, 1\] hold only 2"):
        run_sweep(cfg, tmp_path / "run", work=r, opener=r.opener, progress=False, parallel=2, devices=[0, 1])
    assert not (tmp_path / "run").exists() and r.opened == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(SweepConfigError, match=r"but the visible GPUs \[0, 1, 2\] hold only 3"):
        run_sweep(cfg, tmp_path / "run", work=r, opener=r.opener, progress=False, parallel=2)
    cfg.targets[0].devices = [4]
    with pytest.raises(SweepConfigError, match=r"but its devices \[4\] holds only 1"):
        run_sweep(cfg, tmp_path / "run", work=r, opener=r.opener, progress=False)


def test_fidelity_reference_is_computed_once_across_parallel_groups(tmp_path):
    cfg = fake_sweep([SRV], kv=("fp8_e4m3", "fp8_e5m2", "nvfp4"), conc=(1,), suites=("fidelity",))
    r = Recorder(hold_s=0.05)
    out = run_sweep(cfg, tmp_path / "run", work=r, opener=r.opener, progress=False, parallel=3, devices=[0, 1, 2])
    assert out.ok and r.max_live >= 2
    assert r.ref_opens == 1  # the other groups waited for it and read the cache
    refs = [o for o in r.opened if o[1] == "bf16"]
    assert len(refs) == 1 and refs[0][2] is not None and len(refs[0][2]) == 1  # on its cell's own device
    assert refs[0][2] in [d for _, k, d in r.opened if k != "bf16"]


def test_scheduler_runs_at_most_n_and_releases_devices():
    from kvbench.harness.parallel import GroupPlan

    live, peak, lock, got = [0], [0], threading.Lock(), []

    def run_one(plan, devs):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            got.append(devs)
        time.sleep(0.05)
        with lock:
            live[0] -= 1

    plans = [GroupPlan(cells=[], target="t", kind="server", allowed=[0, 1, 2, 3, 4], need=2) for _ in range(6)]
    s = GroupScheduler(parallel=3)
    s.run(plans, run_one)
    assert peak[0] == 2 and s.max_running == 2  # five devices, two per server: two at once despite parallel 3
    assert len(got) == 6 and all(len(d) == 2 and set(d) <= {0, 1, 2, 3, 4} for d in got) and not s.pool.busy


def test_free_port_never_repeats():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200


def test_parse_and_visible_devices(monkeypatch):
    assert parse_devices("0, 1,3") == [0, 1, 3]
    for bad, msg in (("0,-1", "'-1' is not a device id"), ("a", "'a' is not a device id"), ("1,1", "listed twice"),
                     ("", "expected device ids")):
        with pytest.raises(SweepConfigError, match=msg):
            parse_devices(bad)
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "3,1"}) == [3, 1]
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == [0]  # CUDA stops at an invalid id
    assert visible_devices({"CUDA_VISIBLE_DEVICES": ""}) == []
    with pytest.raises(SweepConfigError, match="UUID"):
        visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-1234"})


# ------------------------------------------------------------------------------------- CLI
def _config(tmp_path: Path) -> Path:
    p = tmp_path / "sweep.yaml"
    p.write_text(textwrap.dedent("""\
        name: cli
        targets:
          - {name: srv, type: server, launch: "serve --port {port} --kv {kv_dtype}", model_id: m}
        axes: {kv: [bf16, fp8_e4m3, fp8_e5m2, nvfp4], concurrency: [1]}
        suites: []
        """))
    return p


def test_cli_flags_are_checked_and_dry_run_shows_the_device_plan(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    run = CliRunner().invoke
    for args, msg in ((["--parallel", "0"], "--parallel must be at least 1"),
                      (["--devices", "0,-1"], "'-1' is not a device id"),
                      (["--devices", "0,0"], "listed twice")):
        r = run(app, ["sweep", str(cfg), "--out", str(tmp_path / "run"), *args])
        assert r.exit_code == 2 and msg in r.output, r.output
    r = run(app, ["sweep", str(cfg), "--dry-run", "--parallel", "2", "--devices", "0,1,2,3", "--out", str(tmp_path / "r")])
    assert r.exit_code == 0, r.output
    plan = [line.strip() for line in r.output.splitlines() if line.startswith("  wave")]
    assert [p.split(":")[0] for p in plan] == ["wave 1", "wave 1", "wave 2", "wave 2"]
    assert [p.rsplit(": ", 1)[1] for p in plan] == ["devices 0", "devices 1", "devices 0", "devices 1"]
    assert r.output.strip().splitlines()[-1] == f"4 cells -> {tmp_path / 'r'}"
    r = run(app, ["sweep", str(cfg), "--dry-run", "--out", str(tmp_path / "r")])
    assert r.exit_code == 0 and "device plan" not in r.output  # no device options: the listing as before

    from kvbench.harness.sweep import config as sweep_config

    real = sweep_config.load_config

    def with_tp(path):
        c = real(path)
        c.targets[0].tp_size = 8
        return c

    monkeypatch.setattr(sweep_config, "load_config", with_tp)
    r = run(app, ["sweep", str(cfg), "--parallel", "2", "--devices", "0,1,2,3", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "tp_size 8 needs 8 devices per server" in r.output, r.output
    assert not (tmp_path / "x").exists()

"""``kvbench sweep --executor ray`` on a local two-node Ray cluster (CPU): the same cells and item records as a
local sweep, a worker that dies mid-cell (retried; with no retries its cell fails and the rest finishes), a
driver killed mid-sweep then resumed, Ctrl-C, a sweep pinned to the second node (``--ray-resources``), and, last,
whole nodes that die mid-cell (two extra nodes: the cell is retried on the other, then, with no node left that
has the resource, recorded failed with the node-death reason while the other group finishes).  The cluster (a
head and a second node, ``ray start --block`` in their own process groups) is started once for the module and
torn down by killing those process groups.

The flag handling (``--executor``, ``--address``, ``--ray-retries``, ``--ray-cpus-per-group``,
``--ray-resources``, the resume command, the error without Ray) is checked without a cluster."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kvbench.core import RunStore
from kvbench.harness.cli import app
from kvbench.harness.matrix import expand
from kvbench.harness.runner import run_sweep
from kvbench.harness.sweep.config import SweepConfigError, parse_config

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
BIN = Path(sys.executable).parent
MODEL = "synthetic:llama-3-8b,layers=2,hidden=64,heads=2,kv_heads=1,head_dim=32,intermediate_size=128,vocab=300"
# What may differ between a --executor ray sweep and a local sweep of the same config: wall-clock times and the
# figures made of them, and where the work ran (Ray node, the port of the cell's in-process server).  Everything
# else a cell writes (items, request records, summary, capacity, cell.json, status) must be identical.
ITEM_VOLATILE = ("latency_s",)  # items.jsonl: the request's wall-clock seconds
REQUEST_VOLATILE = ("start_s", "ttft_s", "tpot_s", "itl_s", "latency_s")  # requests.jsonl: load-test timings
SUMMARY_VOLATILE = ("elapsed_s", "startup_s")  # summary.json: the cell's and its engine's wall-clock seconds
TARGET_VOLATILE = ("ray_node",)  # summary.json target: node id, hostname, ip, GPU ids (ray only)
# summary.json load (and each of its per_repeat entries): the server URL (a free port per run), the timings and
# the throughputs, latency statistics (*_ms), peak concurrency and spread made of them, and the machine's load
LOAD_VOLATILE = ("base_url", "duration_s", "peak_concurrency", "client_lag_ms", "machine_load", "t0_monotonic",
                 "spread")
LOAD_VOLATILE_SUFFIXES = ("_ms", "_throughput")

# CI installs Ray (the test extra): there a missing Ray fails these tests instead of skipping them
needs_ray = pytest.mark.skipif(find_spec("ray") is None and not os.environ.get("CI"),
                               reason='Ray is not installed (pip install "kvbench[ray]")')


def raw_config(data_dir: Path) -> dict:
    """Two KV formats x two concurrencies of a tiny synthetic model: two cell groups of two cells each (the
    suites run in the concurrency-1 cell, the load test in both)."""
    return {
        "name": "ray", "model": MODEL,
        "engine": {"device": "cpu", "dtype": "float32", "kv_budget_gb": 0.01, "max_model_len": 512, "max_running": 4},
        "axes": {"kv": ["bf16", {"dtype": "fp8_e4m3", "scales": "unit"}], "concurrency": [1, 2]},
        "suites": [{"name": "gsm8k_chat", "limit": 2, "max_tokens": 6},
                   {"name": "fidelity", "limit": 2, "params": {"top_k": 8, "greedy_tokens": 4}}],
        "load": {"num_prompts": 2, "input_len": 12, "output_len": 3, "warmup": 0, "metrics_interval_s": 0},
        "baseline": {"kv_dtype": "bf16"}, "aa_control": False, "data_dir": str(data_dir),
    }


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("data")
    rows = [{"question": f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?",
             "answer": f"He has {i} + {i + 3} = {2 * i + 3} apples.\n#### {2 * i + 3}"} for i in range(6)]
    (d / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_node(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    """``ray start ... --block`` in a process group of its own (its pid); returns once it says the node runs.
    (One at a time: nodes that start at once in one temp dir can collide on their sockets.)"""
    with open(log, "w") as out:
        p = subprocess.Popen([str(BIN / "ray"), "start", *args, "--disable-usage-stats", "--block"], stdout=out,
                             stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 90
    while "Ray runtime started" not in log.read_text():
        if p.poll() is not None or time.monotonic() > deadline:
            _stop_node(p)
            raise RuntimeError(f"ray start {' '.join(args)} did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return p


def _stop_node(p: subprocess.Popen) -> None:
    """Its whole process group (the node's raylet, GCS, workers): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL too: the group's processes that outlive its leader
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(2 if sig == signal.SIGTERM else 10)
        except subprocess.TimeoutExpired:
            pass


# the Ray config of the test cluster's GCS (RAY_<name> on `ray start --head`): node death noticed in ~2 s
HEALTH_CHECK_ENV = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "2000",
                    "RAY_health_check_failure_threshold": "4"}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of two nodes: the head (2 CPUs) and a second node (1 CPU, resources ``node2`` and
    ``kvb_pool``: only the node-death test asks for the latter, and may kill that node), with
    a temporary directory of their own (sessions, logs, the address file; removed afterwards) and without
    token authentication (``RAY_AUTH_MODE=disabled``, here too); its processes have tests/ on PYTHONPATH (the
    work hooks).  The head's GCS declares a node dead after 4 failed health checks 0.5 s apart (Ray's defaults:
    5 checks 3 s apart, 15 s or more), for the node-death test.  This process stays connected (the in-process
    sweeps reuse the connection); yields ``(address, env, temp, [head, node2])`` (their ``ray start``
    processes): more nodes can join the same way."""
    import ray

    temp = Path(tempfile.mkdtemp(prefix="kvb-ray-"))  # short: Ray's socket paths live under it
    port = _free_port()
    auth = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **HEALTH_CHECK_ENV,
           "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)}
    address = f"127.0.0.1:{port}"
    nodes = []
    try:
        nodes.append(_start_node(["--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                                  f"--temp-dir={temp}"], temp / "head.log", env))
        nodes.append(_start_node([f"--address={address}", "--num-cpus=1",
                                  '--resources={"node2": 1, "kvb_pool": 1}',
                                  f"--temp-dir={temp}"], temp / "node2.log", env))
        ray.init(address=address, logging_level="WARNING")
        deadline = time.monotonic() + 60
        while sum(1 for n in ray.nodes() if n.get("Alive")) < 2:
            assert time.monotonic() < deadline, "the second Ray node never joined"
            time.sleep(0.2)
        yield address, env, temp, nodes
    finally:
        ray.shutdown()
        for p in reversed(nodes):
            _stop_node(p)
        shutil.rmtree(temp, ignore_errors=True)
        if auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = auth


@pytest.fixture(scope="module")
def cluster(ray_cluster) -> str:
    """The test cluster's address."""
    return ray_cluster[0]


def _executor(address: str, **kw):
    from kvbench.harness.ray_executor import RayExecutor, RayOptions

    return RayExecutor(RayOptions(address=address, **kw))


def _items(store: RunStore, key: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ITEM_VOLATILE} for r in store.read_items(key)]


def _requests(store: RunStore, key: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in REQUEST_VOLATILE} for r in store.read_requests(key)]


def _steady_load(load: dict) -> dict:
    out = {k: v for k, v in load.items() if k not in LOAD_VOLATILE and not k.endswith(LOAD_VOLATILE_SUFFIXES)}
    if "per_repeat" in out:
        out["per_repeat"] = [_steady_load(r) for r in out["per_repeat"]]
    return out


def _summary(store: RunStore, key: str) -> dict:
    s = {k: v for k, v in store.read_json(key, "summary").items() if k not in SUMMARY_VOLATILE}
    s["target"] = {k: v for k, v in s["target"].items() if k not in TARGET_VOLATILE}
    if s.get("load"):
        s["load"] = _steady_load(s["load"])
    return s


def test_the_comparison_leaves_out_only_the_listed_fields():
    """The filters of the ray-vs-local comparison drop what they list and keep everything else."""
    item = {"latency_s": 1.0, "raw_output": "x", "scores": {"kl": 0.1}, "replica": None}
    assert [k for k in item if k not in ITEM_VOLATILE] == ["raw_output", "scores", "replica"]
    load = {"base_url": "u", "completed": 2, "mean_ttft_ms": 1.0, "output_throughput": 3.0, "total_output_tokens": 6,
            "per_repeat": [{"duration_s": 1.0, "failed": 0}], "spread": {}, "server_metrics": {"available": False}}
    assert _steady_load(load) == {"completed": 2, "total_output_tokens": 6, "per_repeat": [{"failed": 0}],
                                  "server_metrics": {"available": False}}


def _calls(path: Path) -> list[tuple[str, str, str]]:
    return [tuple(line.split()) for line in path.read_text().splitlines()] if path.exists() else []


# ------------------------------------------------------------------------------ flags (no cluster; before it starts)
def _write(tmp_path, data_dir) -> Path:
    p = tmp_path / "ray.yaml"
    p.write_text(yaml.safe_dump(raw_config(data_dir)))
    return p


def test_ray_flags_need_the_ray_executor_and_exclude_parallel(tmp_path, data_dir):
    cfg = str(_write(tmp_path, data_dir))
    for extra, msg in ((["--address", "x:1"], "--address applies to --executor ray only"),
                       (["--ray-retries", "2", "--ray-cpus-per-group", "2"],
                        "--ray-retries, --ray-cpus-per-group apply to --executor ray only"),
                       (["--executor", "dask"], "--executor: expected one of local, ray, got 'dask'"),
                       (["--executor", "ray", "--parallel", "2"],
                        "--parallel and --devices are for the local executor"),
                       (["--executor", "ray", "--ray-retries", "-1", "--dry-run"],
                        "--ray-retries must be a whole number"),
                       (["--ray-resources", '{"h100": 1}'], "--ray-resources applies to --executor ray only"),
                       (["--executor", "ray", "--dry-run", "--ray-resources", "h100"],
                        "--ray-resources: expected a JSON object such as"),
                       (["--executor", "ray", "--dry-run", "--ray-resources", "[1]"],
                        "--ray-resources: expected a JSON object of resource names"),
                       (["--executor", "ray", "--dry-run", "--ray-resources", '{"GPU": 1}'],
                        "--ray-resources: GPU is not a custom resource"),
                       (["--executor", "ray", "--dry-run", "--ray-resources", '{"h100": 0}'],
                        "--ray-resources: the amount of h100 must be a number above 0, got 0")):
        r = CliRunner().invoke(app, ["sweep", cfg, "--out", str(tmp_path / "r"), *extra])
        assert r.exit_code == 2 and msg in r.output, r.output
    assert not (tmp_path / "r").exists()


def test_dry_run_lists_the_ray_tasks_without_connecting(tmp_path, data_dir):
    r = CliRunner().invoke(app, ["sweep", str(_write(tmp_path, data_dir)), "--dry-run", "--executor", "ray",
                                 "--address", "10.9.9.9:6379", "--ray-cpus-per-group", "2"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "executor ray (10.9.9.9:6379; --ray-retries 1): one task per cell group"
    assert sum(1 for line in lines if line.endswith("(2 cells, embedded target embedded): 2 CPU, 0 GPU")) == 2
    r = CliRunner().invoke(app, ["sweep", str(_write(tmp_path, data_dir)), "--dry-run", "--executor", "ray",
                                 "--ray-resources", '{"h100": 1, "rack_a": 0.5}'])
    assert r.exit_code == 0, r.output
    assert sum(1 for line in r.output.splitlines()
               if line.endswith("(2 cells, embedded target embedded): 1 CPU, 0 GPU, 1 h100, 0.5 rack_a")) == 2


def test_missing_ray_names_the_extra(tmp_path, data_dir, monkeypatch):
    from kvbench.harness.ray_executor import RayExecutor

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    r = CliRunner().invoke(app, ["sweep", str(_write(tmp_path, data_dir)), "--executor", "ray"])
    assert r.exit_code == 2 and 'pip install "kvbench[ray]"' in r.output, r.output
    with pytest.raises(SweepConfigError, match=r'pip install "kvbench\[ray\]"'):
        run_sweep(parse_config(raw_config(data_dir)), tmp_path / "r", executor=RayExecutor())
    assert not (tmp_path / "r").exists()


@needs_ray
def test_an_address_nobody_answers_stops_before_the_run_directory(tmp_path, data_dir):
    port = _free_port()  # closed again: nothing listens there
    r = CliRunner().invoke(app, ["sweep", str(_write(tmp_path, data_dir)), "--out", str(tmp_path / "r"),
                                 "--executor", "ray", "--address", f"127.0.0.1:{port}"])
    assert r.exit_code == 2, r.output
    assert f"--executor ray: no Ray cluster answers at 127.0.0.1:{port}" in r.output
    assert not (tmp_path / "r").exists()


def test_resume_command_keeps_the_ray_flags(tmp_path, data_dir, monkeypatch):
    from kvbench.harness import ray_executor, runner

    def interrupted(*args, **kw):
        assert kw["executor"].options.address == "h:6379" and kw["executor"].options.retries == 3
        assert kw["executor"].options.resources == {"h100": 1, "rack a": 2.5}
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_sweep", interrupted)
    monkeypatch.setattr(ray_executor, "import_ray", lambda: None)  # no Ray needed to get this far
    cfg = str(_write(tmp_path, data_dir))
    r = CliRunner().invoke(app, ["sweep", cfg, "--out", str(tmp_path / "r"), "--executor", "ray", "--address", "h:6379",
                                 "--ray-retries", "3", "--ray-cpus-per-group", "0.5",
                                 "--ray-resources", '{"h100": 1, "rack a": 2.5}'])
    assert r.exit_code == 130, r.output
    cmd = r.output.splitlines()[-1].strip()
    assert shlex.split(cmd)[4:] == [str(tmp_path / "r"), "--resume", "--executor", "ray", "--address", "h:6379",
                                    "--ray-retries", "3", "--ray-cpus-per-group", "0.5",
                                    "--ray-resources", '{"h100":1,"rack a":2.5}']


def test_ray_display_prints_each_cell_with_the_eta_over_the_running_groups(capsys):
    """The driver's plain progress (--no-progress): a line per cell as its worker reports it, with the count and an
    ETA spread over the most groups seen running at once (the workers report their phases through the sink)."""
    from kvbench.harness.ray_executor import RayDisplay

    d = RayDisplay(4, None)
    d.group_phase(0, "bf16 c=1: gsm8k_chat")
    d.group_phase(1, "fp8 c=1: load test")
    d.finished("[green]done[/]   bf16 c=1 (10.0 s)", 10.0)  # mean 10 s x 3 left / 2 groups
    d.group_phase(0, None)  # its group ended: the ETA still counts the 2 groups seen at once
    d.finished("[green]done[/]   fp8 c=1 (30.0 s)", 30.0)  # mean 20 s x 2 left / 2 groups
    d.finished("[red]failed[/] fp8 c=2: boom", None)  # untimed: the mean stays 20 s
    d.finished("[green]done[/]   bf16 c=2 (5.0 s)", 5.0)
    assert capsys.readouterr().err.splitlines() == [
        "done   bf16 c=1 (10.0 s)  [1/4, ETA 15s]", "done   fp8 c=1 (30.0 s)  [2/4, ETA 20s]",
        "failed fp8 c=2: boom  [3/4, ETA 20s]", "done   bf16 c=2 (5.0 s)  [4/4]"]


def test_group_resources_follow_the_target():
    from kvbench.harness.matrix import groups
    from kvbench.harness.parallel import plan_groups
    from kvbench.harness.ray_resources import group_resources

    raw = {"targets": [{"name": "srv", "type": "server", "tp_size": 2,
                        "launch": "serve --port {port} --tp {tp_size} --kv {kv_dtype}"},
                       {"name": "gpu", "type": "embedded", "engine": {"device": "cuda"}},
                       {"name": "cpu", "type": "embedded", "engine": {"device": "cpu"}},
                       {"name": "auto", "type": "embedded"},
                       {"name": "ep", "type": "endpoint", "base_url": "http://h:8000"}],
           "axes": {"kv": ["bf16"], "concurrency": [1]}, "aa_control": False}
    cfg = parse_config(raw)
    plans = {p.target: p for p in plan_groups(cfg, groups(expand(cfg)), 1)}
    want = {"srv": (2, 0), "gpu": (1, 1), "cpu": (0, 0), "auto": (1, 0), "ep": (0, 0)}  # (with GPUs, without)
    for name, (with_gpus, without) in want.items():
        assert group_resources(cfg, plans[name], 1.5, 8) == {"num_cpus": 1.5, "num_gpus": with_gpus}, name
        assert group_resources(cfg, plans[name], 1.5, 0)["num_gpus"] == without, name
    # --ray-resources: every group's task asks for them besides its CPUs and GPUs
    assert group_resources(cfg, plans["srv"], 1, 8, {"h100": 2}) == {"num_cpus": 1, "num_gpus": 2,
                                                                      "resources": {"h100": 2}}


def test_a_node_fits_a_task_only_with_every_resource_it_asks_for():
    from kvbench.harness.ray_resources import fits

    task = {"num_cpus": 1, "num_gpus": 0, "resources": {"kvb_pool": 1}}
    assert fits(task, {"CPU": 1, "kvb_pool": 1}) and fits(task, {"CPU": 4, "GPU": 8, "kvb_pool": 2})
    assert not fits(task, {"CPU": 8}) and not fits(task, {"CPU": 0.5, "kvb_pool": 1})
    assert not fits({"num_cpus": 1, "num_gpus": 1}, {"CPU": 8}) and fits({"num_cpus": 1, "num_gpus": 0}, {"CPU": 1})


# ------------------------------------------------------------------------------ on the cluster
@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(240)
def test_ray_sweep_writes_what_a_local_sweep_writes(cluster, data_dir, tmp_path, capsys):
    import torch

    cfg = parse_config(raw_config(data_dir))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the workers (one CPU each): the same float reductions
    try:
        local = run_sweep(cfg, tmp_path / "local", progress=False)
    finally:
        torch.set_num_threads(threads)
    capsys.readouterr()
    remote = run_sweep(cfg, tmp_path / "ray", progress=None, executor=_executor(cluster))
    assert local.ok and remote.ok, (local.failed, remote.failed)
    keys = [c.key for c in expand(cfg)]
    assert local.done == remote.done == keys
    # progress on the driver: one line per finished cell with its time, the count and the ETA (none after the last)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("done ")]
    assert len(lines) == 4 and all(sum(f"done   {c.label} (" in line for line in lines) == 1 for c in expand(cfg))
    assert all(re.search(rf"\[{i}/4, ETA \d+s\]$", lines[i - 1]) for i in (1, 2, 3)) and lines[3].endswith("[4/4]")
    lst, rst = RunStore(tmp_path / "local"), RunStore(tmp_path / "ray")
    assert [c.key for c in lst.cells()] == [c.key for c in rst.cells()]
    for key in keys:
        assert rst.status(key) == lst.status(key) == "done"
        assert (rst.cell_dir(key) / "cell.json").read_text() == (lst.cell_dir(key) / "cell.json").read_text()
        assert _items(rst, key) == _items(lst, key), key  # every item record, field for field
        assert _requests(rst, key) == _requests(lst, key) and len(rst.read_requests(key)) == 2, key
        assert _summary(rst, key) == _summary(lst, key), key  # suites' results, target, load counts, capacity
        assert rst.read_json(key, "capacity") == lst.read_json(key, "capacity")
        node = rst.read_json(key, "summary")["target"]["ray_node"]
        assert node["node_id"] and node["hostname"] and "ray_node" not in lst.read_json(key, "summary")["target"]
        assert (rst.cell_dir(key) / "server.log").exists() == (lst.cell_dir(key) / "server.log").exists()
    assert sum(1 for k in keys if lst.read_items(k)) == 2  # the two concurrency-1 cells ran the suites
    assert {r["suite"] for k in keys for r in lst.read_items(k)} == {"gsm8k_chat", "fidelity"}
    run = rst.manifest()["runs"][-1]
    assert run["executor"] == "ray" and run["ray_nodes"] == 2 and run["ray_address"].endswith(cluster.split(":")[1])
    assert run["done"] == 4 and "executor" not in lst.manifest()["runs"][-1]
    assert not list((tmp_path / "ray").glob("fidelity/*"))  # the references were computed on the workers

    # the local run resumed with the ray executor: the cell that is not done (fp8 c=1, with its suites) is redone
    # on the cluster, the others are kept, and it writes what the local run had written
    before = (_items(lst, keys[2]), _requests(lst, keys[2]), _summary(lst, keys[2]))
    lst.set_status(keys[2], "failed")
    again = run_sweep(cfg, tmp_path / "local", resume=True, progress=False, executor=_executor(cluster))
    assert again.done == [keys[2]] and again.skipped == [keys[0], keys[1], keys[3]]
    assert (_items(lst, keys[2]), _requests(lst, keys[2]), _summary(lst, keys[2])) == before
    assert "ray_node" in lst.read_json(keys[2], "summary")["target"]
    assert [r.get("executor") for r in lst.manifest()["runs"]] == [None, "ray"]


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(240)
def test_a_worker_that_dies_mid_cell_is_retried_and_only_its_unfinished_cells_rerun(cluster, data_dir, tmp_path):
    from ray_sweep_hooks import Hooks, HookWork

    cfg = parse_config(raw_config(data_dir))
    keys = [c.key for c in expand(cfg)]  # bf16 c1, bf16 c2, fp8 c1, fp8 c2
    calls = tmp_path / "calls.txt"
    work = HookWork(cfg, Hooks(str(calls), exit_in=keys[3]))  # the fp8 group's second cell, in its load test
    out = run_sweep(cfg, tmp_path / "run", progress=None, work=work, executor=_executor(cluster, retries=1))
    assert out.ok and out.done == keys, out.failed
    ran = _calls(calls)
    # fp8 c1 finished before the worker died: the retried task skipped it (one run of its suites and load)
    assert [c for c in ran if c[0] == keys[2]] and len({c[2] for c in ran if c[0] == keys[2]}) == 1
    assert sum(1 for c in ran if c[0] == keys[2] and c[1] == "load") == 1
    retried = [c for c in ran if c[0] == keys[3]]
    assert [c[1] for c in retried] == ["load", "load"] and retried[0][2] != retried[1][2]  # a new worker
    assert all(sum(1 for c in ran if c[0] == k and c[1] == "load") == 1 for k in keys[:2])
    st = RunStore(tmp_path / "run")
    assert all(st.status(k) == "done" for k in keys) and st.read_json(keys[3], "summary")["error"] is None


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(240)
def test_without_retries_the_cell_of_a_dead_worker_fails_and_resume_finishes_it_locally(cluster, data_dir, tmp_path):
    from ray_sweep_hooks import Hooks, HookWork

    cfg = parse_config(raw_config(data_dir))
    keys = [c.key for c in expand(cfg)]
    work = HookWork(cfg, Hooks(str(tmp_path / "calls.txt"), exit_in=keys[1]))  # the bf16 group's second cell
    out = run_sweep(cfg, tmp_path / "run", progress=None, work=work, executor=_executor(cluster, retries=0))
    assert out.failed == [keys[1]] and out.done == [keys[0], *keys[2:]]
    st = RunStore(tmp_path / "run")
    summary = st.read_json(keys[1], "summary")
    assert st.status(keys[1]) == "failed" and summary["error"].startswith("Ray worker died: WorkerCrashedError")
    assert "WorkerCrashedError" in (st.cell_dir(keys[1]) / "error.txt").read_text()
    # --resume with the local executor redoes exactly that cell (same store, same cell keys)
    again = run_sweep(cfg, tmp_path / "run", resume=True, progress=False)
    assert again.done == [keys[1]] and again.skipped == [keys[0], *keys[2:]]
    assert st.status(keys[1]) == "done" and "ray_node" not in st.read_json(keys[1], "summary")["target"]
    runs = st.manifest()["runs"]
    assert [r.get("executor") for r in runs] == ["ray", None] and runs[0]["failed"] == 1


class Driver:
    """``kvbench sweep CONFIG --executor ray --address ADDR`` as a subprocess whose fp8 group is held up (the first
    suite of its first cell sleeps, once: ``ray_sweep_hooks`` as a plugin), so that cells still run when the
    first one is written."""

    def __init__(self, tmp_path: Path, data_dir: Path, address: str):
        cfg_path = tmp_path / "ray.yaml"
        cfg_path.write_text(yaml.safe_dump(raw_config(data_dir)))
        self.keys = [c.key for c in expand(parse_config(raw_config(data_dir)))]
        self.calls, self.run, self.log = tmp_path / "calls.txt", tmp_path / "run", tmp_path / "driver.log"
        hook = {"calls": str(self.calls), "sleep_in": self.keys[2], "sleep_s": 120}
        # PYTHONPATH keeps what this process has: the driver imports the same kvbench as the cluster's workers
        self.env = {**os.environ, "KVBENCH_PLUGINS": "ray_sweep_hooks",
                    "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p),
                    "KVBENCH_TEST_HOOK": json.dumps(hook)}
        self.argv = [str(BIN / "kvbench"), "sweep", str(cfg_path), "--out", str(self.run), "--no-progress",
                     "--executor", "ray", "--address", address]
        self.store = RunStore(self.run)

    def start_until_a_cell_is_done(self) -> subprocess.Popen:
        with open(self.log, "w") as log:
            driver = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + 120
        try:
            while not any(self.store.is_done(k) for k in self.keys):
                assert driver.poll() is None and time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.05)
        except BaseException:
            driver.kill()
            raise
        return driver

    def sleeper_ends(self, timeout: float = 30) -> bool:
        """The worker process that sleeps in the fp8 group's first suite has ended."""
        pid = int(next(c[2] for c in _calls(self.calls) if c[0] == self.keys[2]))
        return _within(timeout, lambda: not _alive(pid))


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(240)
def test_a_killed_driver_is_resumed_with_the_ray_executor(cluster, data_dir, tmp_path):
    """The driver is killed (SIGKILL) once its first cell is written: its tasks end with it.  The rerun with
    ``--resume --executor ray`` finishes the rest and does not rerun the cells that were done."""
    d = Driver(tmp_path, data_dir, cluster)
    keys, st = d.keys, d.store
    driver = d.start_until_a_cell_is_done()
    driver.kill()  # no clean-up of any kind
    driver.wait(30)
    done = [k for k in keys if st.is_done(k)]
    assert done and keys[2] not in done and keys[3] not in done
    assert d.sleeper_ends()  # Ray ends the tasks of a driver that died
    stamps = {k: (st.cell_dir(k) / "summary.json").stat().st_mtime_ns for k in done}

    r = subprocess.run([*d.argv, "--resume"], capture_output=True, text=True, env=d.env, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{4 - len(done)} cells done, 0 failed, {len(done)} already done (skipped)" in r.stdout
    assert all(st.is_done(k) for k in keys)
    assert {k: (st.cell_dir(k) / "summary.json").stat().st_mtime_ns for k in done} == stamps
    ran = _calls(d.calls)
    assert all(sum(1 for c in ran if c[0] == k and c[1] == "load") == 1 for k in done)  # not rerun
    runs = st.manifest()["runs"]
    assert len(runs) == 2 and all(r["executor"] == "ray" and r["ray_nodes"] == 2 for r in runs)
    assert "finished" not in runs[0] and runs[1]["resume"] is True


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(240)
def test_ctrl_c_cancels_the_running_tasks_and_prints_the_resume_command(cluster, data_dir, tmp_path):
    d = Driver(tmp_path, data_dir, cluster)
    driver = d.start_until_a_cell_is_done()
    driver.send_signal(signal.SIGINT)
    assert driver.wait(60) == 130, d.log.read_text()
    assert d.sleeper_ends(timeout=10)  # cancelled (force), not left sleeping
    out = d.log.read_text().splitlines()
    i = out.index("resume it with:")
    cmd = shlex.split(out[i + 1])
    assert cmd[:2] == ["kvbench", "sweep"] and cmd[2:] == [*d.argv[2:5], "--resume", *d.argv[6:]]
    assert "--no-progress" not in cmd and [k for k in d.keys if d.store.is_done(k)]
    assert not any(d.store.is_done(k) for k in d.keys[2:])


# ------------------------------------------------------------------------------ placement and node death (last)
def small_config(data_dir: Path, kv: list) -> dict:
    """One concurrency-1 cell per KV format (a cell group each), one suite: the placement and node tests."""
    raw = raw_config(data_dir)
    raw["axes"] = {"kv": kv, "concurrency": [1]}
    raw["suites"] = raw["suites"][:1]
    return raw


def _node_ids(**where) -> set[str]:
    """The ids of the live nodes of the cluster whose resources hold every ``name=amount`` of ``where``."""
    import ray

    return {n["NodeID"] for n in ray.nodes()
            if n["Alive"] and all(n["Resources"].get(k, 0) >= v for k, v in where.items())}


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(240)
def test_ray_resources_pin_the_groups_to_the_nodes_that_have_them(cluster, data_dir, tmp_path):
    """``--ray-resources {"node2": 1}``: every group runs on the second node (not the head, where the driver and
    the cluster's other CPUs are), as its cells' summaries record."""
    import ray

    head = {n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]}
    node2 = _node_ids(node2=1)
    assert len(head) == 1 and len(node2) == 1 and head != node2
    cfg = parse_config(small_config(data_dir, ["bf16", {"dtype": "fp8_e4m3", "scales": "unit"}]))
    keys = [c.key for c in expand(cfg)]
    out = run_sweep(cfg, tmp_path / "run", progress=False,
                    executor=_executor(cluster, resources={"node2": 1}))
    assert out.done == keys, out.failed
    st = RunStore(tmp_path / "run")
    assert {st.read_json(k, "summary")["target"]["ray_node"]["node_id"] for k in keys} == node2
    assert st.manifest()["runs"][-1]["ray_resources"] == {"node2": 1}


@pytest.fixture
def pool_nodes(ray_cluster):
    """The two nodes of the test cluster with the custom resource ``kvb_pool`` (1 CPU each, not the head): the
    second node and one more started here, each in a process group of its own (its pid: what ``kill_node_in``
    may kill).  The test that uses them kills them both: it runs last in the module."""
    address, env, temp, nodes = ray_cluster
    head = _node_ids(**{"node:__internal_head__": 1})
    extra = _start_node([f"--address={address}", "--num-cpus=1", '--resources={"kvb_pool": 1}',
                         f"--temp-dir={temp}"], temp / "pool.log", env)
    try:
        deadline = time.monotonic() + 60
        while len(_node_ids(kvb_pool=1)) < 2:
            assert time.monotonic() < deadline, "the second kvb_pool node never joined"
            time.sleep(0.2)
        assert len(head) == 1 and not _node_ids(kvb_pool=1) & head
        yield [nodes[1], extra]
    finally:
        _stop_node(extra)


def _within(timeout: float, done) -> bool:
    """Whether ``done()`` becomes true within ``timeout`` seconds (polled every 0.2 s)."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_dead(node_id: str, timeout: float = 30) -> bool:
    return _within(timeout, lambda: node_id not in _node_ids())


@pytest.mark.slow
@needs_ray
@pytest.mark.timeout(240)
def test_a_node_that_dies_mid_cell_is_retried_on_another_then_failed_when_none_is_left(pool_nodes, cluster, data_dir,
                                                                                      tmp_path):
    """Every group asks for ``kvb_pool`` (two nodes have it).  The fp8 group's node dies (SIGKILL to its raylet's
    process group) in its cell's load test: the cell is retried on the other ``kvb_pool`` node and the sweep
    finishes.  A second sweep kills that node too: no live node has ``kvb_pool`` any more, so the fp8 cell is
    recorded failed with the node-death reason, while the bf16 group (run first on that node) is done."""
    from ray_sweep_hooks import Hooks, HookWork

    cfg = parse_config(small_config(data_dir, ["bf16", {"dtype": "fp8_e4m3", "scales": "unit"}]))
    keys = [c.key for c in expand(cfg)]  # bf16, fp8
    pool = _node_ids(kvb_pool=1)
    pgids = [p.pid for p in pool_nodes]
    # the sweeps' sink (an actor) must not sit on a node that dies: it is placed on the head

    # 1. the node dies, the cell is retried on the other one
    calls = tmp_path / "one" / "calls.txt"
    calls.parent.mkdir()
    work = HookWork(cfg, Hooks(str(calls), kill_node_in=keys[1], node_pgids=pgids))
    out = run_sweep(cfg, tmp_path / "one" / "run", progress=False, work=work,
                    executor=_executor(cluster, retries=1, resources={"kvb_pool": 1}))
    assert out.done == keys, [RunStore(tmp_path / "one" / "run").read_json(k, "summary")["error"] for k in out.failed]
    loads = [c for c in _calls(calls) if c[0] == keys[1] and c[1] == "load"]
    assert len(loads) == 2, loads  # the first attempt (its node killed) and the retry
    dead, survivor = loads[0][3], loads[1][3]
    assert {dead, survivor} == pool  # on each kvb_pool node once: the retry on the other one
    assert _wait_dead(dead) and survivor in _node_ids()
    assert sorted(p.poll() is None for p in pool_nodes) == [False, True]  # the dead node's processes are gone
    st = RunStore(tmp_path / "one" / "run")
    assert st.read_json(keys[1], "summary")["target"]["ray_node"]["node_id"] == survivor
    assert st.read_json(keys[1], "summary")["error"] is None
    assert st.read_json(keys[0], "summary")["target"]["ray_node"]["node_id"] in pool

    # 2. the last kvb_pool node dies: the retry has nowhere to go, the cell fails with the reason
    calls = tmp_path / "two" / "calls.txt"
    calls.parent.mkdir()
    work = HookWork(cfg, Hooks(str(calls), kill_node_in=keys[1], node_pgids=pgids))
    out = run_sweep(cfg, tmp_path / "two" / "run", progress=False, work=work,
                    executor=_executor(cluster, retries=1, resources={"kvb_pool": 1}))
    assert out.done == [keys[0]] and out.failed == [keys[1]]
    assert [c[3] for c in _calls(calls) if c[1] == "load"] == [survivor, survivor]  # bf16 first, then fp8
    st = RunStore(tmp_path / "two" / "run")
    error = st.read_json(keys[1], "summary")["error"]
    assert error.startswith("Ray node died: NodeDiedError: Task failed because the node it was running on is dead")
    assert survivor in error and "no live node of the cluster has what its retry would ask for (1 CPU, 0 GPU, " \
                                  "1 kvb_pool)" in error, error
    assert "NodeDiedError" in (st.cell_dir(keys[1]) / "error.txt").read_text()
    assert st.status(keys[0]) == "done" and st.status(keys[1]) == "failed"
    assert _wait_dead(survivor) and not _node_ids(kvb_pool=1)

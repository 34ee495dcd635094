"""Server targets of ``replicas: N`` (docs/scale-out.md "Data-parallel replicas"): the config key and its checks,
the device plan (N × tp_size devices per group, tp_size per replica), the scheduler's locks over every replica's
URL and fixed port, the Ray resources and the dry-run launches; then, with the fake SGLang server, a sweep that
launches two replicas on their own ports and devices, spreads the suite and the load test over both, sums their
capacity and stops both, and a replica that fails to start taking the other one down with it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from kvbench.harness.matrix import expand, groups
from kvbench.harness.parallel import exclusive_keys, plan_groups, replica_devices, simulate
from kvbench.harness.sweep.config import SweepConfigError, parse_config

sys.path.insert(0, str(Path(__file__).parent / "fake_engines"))
from conformance import FAKE_SGLANG, PYTHON, expected_tokens, fake_args, make_data, make_model  # noqa: E402

LAUNCH = (f"{PYTHON} {FAKE_SGLANG} --model-path {{model}} --kv-cache-dtype {{kv_dtype}} --tp-size {{tp_size}} "
          "--max-running-requests 4 --enable-metrics --host {host} --port {port}")


def _server(**kw) -> dict:
    return {"name": "srv", "type": "server", "launch": "serve --port {port} --tp {tp_size}", **kw}


def test_the_replicas_key_and_the_device_plan():
    cfg = parse_config({"targets": [_server(replicas=2, tp_size=2, replica_load="each")]})
    t = cfg.targets[0]
    assert (t.server_replicas, t.replicas, t.replica_load) == (2, None, "each")
    d = cfg.to_dict()["targets"][0]
    assert d["replicas"] == 2 and "server_replicas" not in d
    assert parse_config({"targets": [{k: v for k, v in d.items() if v is not None}]}).targets[0].server_replicas == 2
    assert "replicas" not in parse_config({"targets": [_server()]}).to_dict()["targets"][0]
    for target, where in [
        ({"name": "e", "type": "endpoint", "base_url": "http://a:1", "replicas": 2}, "lists its replicas under base_url"),
        ({"name": "m", "type": "embedded", "replicas": 2}, "applies to server targets only"),
        (_server(replicas=0), "targets[0].replicas: expected an integer >= 1"),
        (_server(replica_load="each"), "targets[0].replica_load: applies to"),
    ]:
        with pytest.raises(SweepConfigError) as e:
            parse_config({"targets": [target]})
        assert where in str(e.value)

    plans = plan_groups(cfg, groups(expand(cfg)), 1, [0, 1, 2, 3], visible=lambda: [])
    assert (plans[0].allowed, plans[0].need, plans[0].replicas) == ([0, 1, 2, 3], 4, 2)
    with pytest.raises(SweepConfigError, match=r"2 replicas × tp_size 2 need 4 devices, but --devices \[0, 1, 2\]"):
        plan_groups(cfg, groups(expand(cfg)), 1, [0, 1, 2], visible=lambda: [])
    # without --devices: the visible GPUs even at --parallel 1 (replicas never share a device); none on a CPU box
    assert plan_groups(cfg, groups(expand(cfg)), 1, None, visible=lambda: list(range(8)))[0].allowed == list(range(8))
    assert plan_groups(cfg, groups(expand(cfg)), 1, None, visible=lambda: [])[0].allowed is None
    assert replica_devices([4, 5, 6, 7], 2, 2) == [[4, 5], [6, 7]] and replica_devices(None, 3, 1) == [None] * 3

    from kvbench.harness.ray_resources import describe_resources, group_resources

    assert group_resources(cfg, plans[0], 1.0, 8)["num_gpus"] == 4
    assert describe_resources(cfg, plans[0], 1.0) == "1 CPU, 4 GPU (0 on a cluster without GPUs)"


def test_locks_cover_every_replica_url_and_port():
    fixed = parse_config({"targets": [_server(replicas=3, port=9000)]}).targets[0]
    assert exclusive_keys(fixed) == tuple(f"port:127.0.0.1:{p}" for p in (9000, 9001, 9002))
    cfg = parse_config({"targets": [
        {"name": "e1", "type": "endpoint", "base_url": ["http://a:1", "http://b:1"]},
        {"name": "e2", "type": "endpoint", "base_url": ["http://c:1", "http://B:1/v1"]},  # shares replica b
        {"name": "e3", "type": "endpoint", "base_url": "http://d:1"}]})
    assert exclusive_keys(cfg.targets[0]) == ("endpoint:http://a:1", "endpoint:http://b:1")
    plans = plan_groups(cfg, groups(expand(cfg)), 3)
    waves = [w for w, _ in simulate(plans, 3)]
    assert waves == [0, 1, 1]  # e2 waits for e1 (one server in common); e3 shares none


def test_dry_run_lists_each_replica_launch(tmp_path):
    from kvbench.harness.commands.sweep import _launch_listing

    cfg = parse_config({"targets": [_server(replicas=2, tp_size=2)], "axes": {"concurrency": [1]}})
    plans = plan_groups(cfg, groups(expand(cfg)), 1, [0, 1, 2, 3])
    lines = _launch_listing(cfg, plans, 1)
    assert "2 replicas" in lines[0]
    assert [ln for ln in lines if ln.startswith("  env")] == ["  env CUDA_VISIBLE_DEVICES=0,1", "  env CUDA_VISIBLE_DEVICES=2,3"]
    assert sum(ln.startswith("  $ serve --port") and "--tp 2" in ln for ln in lines) == 2


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(120)
def test_a_server_target_of_two_replicas_launches_spreads_and_stops_both(tmp_path):
    from kvbench.core.store import RunStore
    from kvbench.harness.runner import run_sweep

    cfg = parse_config({
        "name": "replicas", "model": str(make_model(tmp_path)), "aa_control": False,
        "data_dir": str(make_data(tmp_path)),
        "targets": [{"name": "sgl", "type": "server", "launch": LAUNCH, "replicas": 2, "health_timeout_s": 30,
                     "flush_cache": "POST /flush_cache", "max_retries": 0}],
        "axes": {"concurrency": [2]}, "suites": [{"name": "aime25", "max_tokens": 64}],
        "load": {"num_prompts": 4, "input_len": 16, "output_len": 8, "metrics_interval_s": 0, "warmup": 0},
    })
    outcome = run_sweep(cfg, tmp_path / "run", progress=False, devices=[0, 1])
    (cell,) = expand(cfg)
    store = RunStore(tmp_path / "run")
    summary = store.read_json(cell.key, "summary")
    assert outcome.ok, summary.get("error")
    target = summary["target"]
    urls = target["replicas"]
    assert len(urls) == 2 and len(set(urls)) == 2 and target["replica_devices"] == [[0], [1]]
    assert target["devices"] == [0, 1] and len(target["launches"]) == 2
    log = (store.cell_dir(cell.key) / "server.log").read_text()
    launched = fake_args(log)
    assert sorted(a["env"]["CUDA_VISIBLE_DEVICES"] for a in launched) == ["0", "1"]
    assert sorted(f"http://127.0.0.1:{a['args']['port']}" for a in launched) == sorted(urls)
    assert all(f"===== replica {u}" in log for u in urls)
    items = store.read_items(cell.key)
    assert len(items) == 3 and all(r["error"] is None for r in items) and {r["replica"] for r in items} == set(urls)
    load = summary["load"]
    assert (load["replicas"], load["completed"], load["concurrency_per_replica"]) == (2, 8, 2)
    assert {r["replica"] for r in store.read_requests(cell.key)} == set(urls)
    cap = store.read_json(cell.key, "capacity")
    assert cap["replica_count"] == 2 and cap["tokens"] == 2 * expected_tokens(2)
    assert summary["replica_health"]["out"] == [] and summary["replica_health"]["in_rotation"] == urls
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in target["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in target["pid"]) and not list((tmp_path / "run" / "logs").glob("*.pid"))


@pytest.mark.timeout(60)
def test_a_replica_that_fails_to_start_takes_the_others_down(tmp_path):
    from kvbench.harness.targets import TargetError, free_port, open_target

    port = free_port("127.0.0.1")
    launch = (f"if [ {{port}} = {port} ]; then exec {LAUNCH}; else echo 'replica boom' >&2; exit 3; fi")
    spec = parse_config({"targets": [{"name": "sgl", "type": "server", "launch": launch, "replicas": 2, "port": port,
                                      "health_timeout_s": 30}]}).targets[0]
    cell = {"model": str(make_model(tmp_path)), "target": "sgl", "prefill_backend": "default",
            "decode_backend": "default", "kv_dtype": "auto", "kv_scales": "unit", "concurrency": 1}
    with pytest.raises(TargetError, match=rf"(?s)replica 2 of 2 \(http://127.0.0.1:{port + 1}\): .*exited with code 3.*replica boom"):
        with open_target(spec, cell, {}, tmp_path / "logs" / "g.log"):
            pass
    assert "FAKE_ARGS" in (tmp_path / "logs" / "g.log").read_text()  # the first replica did start
    assert (tmp_path / "logs" / "g.replica1.log").exists() and not list((tmp_path / "logs").glob("*.pid"))
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)  # and was stopped

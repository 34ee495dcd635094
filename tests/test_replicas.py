"""Data-parallel replicas behind one endpoint target (``base_url: [URL1, URL2]``; docs/scale-out.md "Data-parallel
replicas"): the config spelling and its checks, the replica checks when the target opens (every replica up and
serving the same model), flush and capacity over every replica, least-loaded dispatch with the concurrency
bound per replica, and, with two ``kvbench serve`` processes of a tiny synthetic model, a sweep whose item
records show both replicas and equal a one-replica run, a load test aggregated over both (and one replica at a
time), a replica that fails mid-run (its requests served by the other, it taken out of rotation), a cell whose
replicas all fail (failed, then redone by --resume), and ``kvbench eval`` / ``kvbench load`` over two replicas."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from kvbench.core import GenRequest, SamplingParams
from kvbench.harness.replica_client import ReplicaClient
from kvbench.harness.replica_set import ReplicaURL, check_same_model, replica_capacity
from kvbench.harness.sweep.config import SweepConfigError, parse_config
from kvbench.harness.targets import TargetError, open_target



def _write_gsm8k(d: Path) -> Path:
    """Twelve made-up GSM8K test items in ``d`` (the replica tests need only questions the model can be asked)."""
    d.mkdir(parents=True, exist_ok=True)
    rows = [{"question": f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?",
             "answer": f"He has {i} + {i + 3} = {2 * i + 3} apples.\n#### {2 * i + 3}"} for i in range(12)]
    (d / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory) -> Path:
    return _write_gsm8k(tmp_path_factory.mktemp("gsm8k"))
MODEL = "synthetic:llama-3-8b,layers=2,hidden=256,heads=4,kv_heads=2,head_dim=64,intermediate_size=512,vocab=512"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeReplica:
    """A stdlib HTTP server in a thread: ``/health``, ``/v1/models`` (``model``, ``max_model_len``), ``/metrics`` (an
    SGLang KV pool of ``tokens``), ``POST /flush_cache`` (counted); a completion request is counted and its
    connection closed unanswered (a replica that fails once requests arrive), or with ``answer`` set a chat
    completion is answered ``The answer is 7.``"""

    def __init__(self, model: str = "tiny", max_model_len=None, tokens=None):
        self.model, self.max_model_len, self.tokens = model, max_model_len, tokens
        self.flushes = self.completions = 0
        self.answer = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, "ok", "text/plain")
                elif self.path == "/v1/models":
                    card = {"id": fake.model, "object": "model"}
                    if fake.max_model_len:
                        card["max_model_len"] = fake.max_model_len
                    self._send(200, json.dumps({"object": "list", "data": [card]}))
                elif self.path == "/metrics" and fake.tokens:
                    self._send(200, f"sglang:max_total_num_tokens {fake.tokens}\n", "text/plain")
                else:
                    self._send(404, "{}")

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/flush_cache":
                    fake.flushes += 1
                    self._send(200, "ok", "text/plain")
                elif fake.answer and self.path == "/v1/chat/completions":
                    fake.completions += 1
                    msg = {"role": "assistant", "content": "The answer is 7."}
                    self._send(200, json.dumps({"choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
                                                "usage": {"prompt_tokens": 5, "completion_tokens": 5}}))
                else:
                    fake.completions += 1
                    self.close_connection = True  # no answer: the replica failed

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes():
    made: list[FakeReplica] = []

    def make(**kw) -> FakeReplica:
        made.append(FakeReplica(**kw))
        return made[-1]

    yield make
    for f in made:
        f.close()


def _endpoint(base_url, **kw) -> dict:
    return {"targets": [{"name": "dp", "type": "endpoint", "base_url": base_url, **kw}]}


# ------------------------------------------------------------------------------ the config
def test_base_url_list_is_parsed_and_kept_in_the_manifest():
    cfg = parse_config(_endpoint(["http://node1:8000/", "http://node2:8000"], replica_load="each"))
    t = cfg.targets[0]
    assert (t.base_url, t.replicas, t.replica_load) == ("http://node1:8000", ["http://node1:8000", "http://node2:8000"], "each")
    d = cfg.to_dict()["targets"][0]
    assert d["base_url"] == ["http://node1:8000", "http://node2:8000"] and "replicas" not in d and d["replica_load"] == "each"
    again = parse_config({"targets": [{k: v for k, v in d.items() if v is not None}]}).targets[0]
    assert (again.base_url, again.replicas, again.replica_load) == (t.base_url, t.replicas, t.replica_load)
    # one URL (also as a one-item list): the target and its manifest form are what they were
    for one in ("http://node1:8000", ["http://node1:8000"]):
        single = parse_config(_endpoint(one))
        assert (single.targets[0].base_url, single.targets[0].replicas) == ("http://node1:8000", None)
        assert single.to_dict()["targets"][0]["base_url"] == "http://node1:8000"
        assert {"replicas", "replica_load"}.isdisjoint(single.to_dict()["targets"][0])


@pytest.mark.parametrize("target, where", [
    (_endpoint(["http://a:1", "http://A:1/"]), "targets[0].base_url[1]: http://A:1 is already listed"),
    (_endpoint(["http://a:1", "http://a:1/v1"]), "targets[0].base_url[1]"),
    (_endpoint(["http://a:1", "a:2"]), "targets[0].base_url[1]: expected an http(s) URL"),
    (_endpoint(["http://a:1", "http://"]), "targets[0].base_url[1]: expected an http(s) URL"),
    (_endpoint(["http://a:1", 7]), "targets[0].base_url[1]: expected a non-empty string"),
    (_endpoint([]), "targets[0].base_url: expected an http(s) URL or a list"),
    (_endpoint("http://a:1", replica_load="each"), "targets[0].replica_load"),
    (_endpoint(["http://a:1", "http://b:1"], replica_load="split"), "targets[0].replica_load: 'split' is not allowed"),
    ({"targets": [{"name": "s", "type": "server", "launch": "serve {port}", "base_url": ["http://a:1", "http://b:1"]}]},
     "targets[0].base_url: base_url applies to endpoint targets only"),
])
def test_bad_replica_lists_are_refused(target, where):
    with pytest.raises(SweepConfigError) as e:
        parse_config(target)
    assert where in str(e.value)


@pytest.mark.parametrize("target, where", [
    (_endpoint(["http://a:1", "http://b:1"], replica_max_failures=0), "targets[0].replica_max_failures: expected an integer >= 1"),
    (_endpoint(["http://a:1", "http://b:1"], replica_max_failures="3"), "targets[0].replica_max_failures: expected an integer"),
    (_endpoint("http://a:1", replica_max_failures=2), "targets[0].replica_max_failures: applies to an endpoint target whose base_url lists several"),
    ({"targets": [{"name": "s", "type": "server", "launch": "serve {port}", "replica_max_failures": 2}]},
     "targets[0].replica_max_failures: applies to"),
    ({"targets": [{"name": "e", "type": "embedded", "replica_max_failures": 2}]}, "targets[0].replica_max_failures: applies to"),
])
def test_bad_replica_max_failures_are_refused(target, where):
    with pytest.raises(SweepConfigError) as e:
        parse_config(target)
    assert where in str(e.value)


def test_replica_max_failures_is_kept_in_the_manifest_form():
    t = parse_config(_endpoint(["http://a:1", "http://b:1"], replica_max_failures=5)).targets[0]
    assert t.replica_max_failures == 5
    d = parse_config(_endpoint(["http://a:1", "http://b:1"], replica_max_failures=5)).to_dict()["targets"][0]
    again = parse_config({"targets": [{k: v for k, v in d.items() if v is not None}]}).targets[0]
    assert d["replica_max_failures"] == 5 and again.replica_max_failures == 5
    server = parse_config({"targets": [{"name": "s", "type": "server", "launch": "serve {port}", "replicas": 2,
                                        "replica_max_failures": 1}]}).targets[0]
    assert server.replica_max_failures == 1
    default = parse_config(_endpoint(["http://a:1", "http://b:1"]))
    assert default.targets[0].replica_max_failures == 3 and "replica_max_failures" not in default.to_dict()["targets"][0]


def test_env_variables_expand_in_each_replica(monkeypatch):
    monkeypatch.setenv("NODE2", "http://node2:8000")
    t = parse_config(_endpoint(["http://node1:8000", "${NODE2}", "${NODE3:-http://node3:8000}"])).targets[0]
    assert t.replicas == ["http://node1:8000", "http://node2:8000", "http://node3:8000"]


# ------------------------------------------------------------------------------ opening the target
def _open(cfg):
    return open_target(cfg.targets[0], {}, {}, Path("unused.log"))


def test_replicas_must_serve_the_same_model(fakes):
    a, b = fakes(model="m1"), fakes(model="m2")
    with pytest.raises(TargetError, match=re.escape(f"replica {b.url} serves 'm2' but replica {a.url} serves 'm1'")):
        with _open(parse_config(_endpoint([a.url, b.url], health_timeout_s=2))):
            pass
    with pytest.raises(TargetError, match=re.escape(f"replica {a.url} does not serve 'm2'")):
        with _open(parse_config(_endpoint([a.url, b.url], health_timeout_s=2, model_id="m2"))):
            pass
    c, d = fakes(model="m", max_model_len=4096), fakes(model="m", max_model_len=8192)
    with pytest.raises(ValueError, match=re.escape(f"replica {d.url} serves 'm' with max_model_len 8192")):
        check_same_model([c.url, d.url])
    assert check_same_model([a.url, fakes(model="m1").url]) == "m1"


def test_a_replica_down_at_the_start_is_an_error_naming_it(fakes):
    a, down = fakes(), f"http://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(TargetError, match=re.escape(f"replica {down} of target 'dp' is not up")):
        with _open(parse_config(_endpoint([a.url, down], health_timeout_s=0.5))):
            pass
    assert time.monotonic() - t0 < 10


def test_flush_and_capacity_cover_every_replica(fakes):
    a, b = fakes(tokens=1000), fakes(tokens=3000)
    cfg = parse_config(_endpoint([a.url, b.url], health_timeout_s=2, flush_cache="POST /flush_cache"))
    with _open(cfg) as session:
        assert session.model_id == "tiny" and session.info["replicas"] == [a.url, b.url]
        url = session.base_url()
        assert url == a.url and url.replicas == (a.url, b.url) and url.mode == "aggregate"
        session.flush()
        assert (a.flushes, b.flushes) == (1, 1)
        cap = session.capacity()
    assert cap["tokens"] == 4000 and cap["replica_count"] == 2
    assert [(r["url"], r["tokens"]) for r in cap["replicas"]] == [(a.url, 1000), (b.url, 3000)]
    from kvbench.harness.targets import flush_cache

    flush_cache(url, "POST /flush_cache")  # what the sweep calls between load repeats: every replica again
    assert (a.flushes, b.flushes) == (2, 2)
    assert replica_capacity(["u1", "u2"], [None, None]) is None
    partial = replica_capacity(["u1", "u2"], [{"tokens": 5, "page_size": 16}, None])
    assert "tokens" not in partial and partial["page_size"] == 16 and partial["replicas"][1]["capacity"] is None


# ------------------------------------------------------------------------------ dispatch
class _SlowClient:
    """A client that takes ``delay`` per request and counts what it holds at once."""

    def __init__(self, url: str, delay: float = 0.03):
        from kvbench.suites.fake import FakeClient

        self.inner, self.base_url, self.model_id, self.delay = FakeClient(), url, "fake-bigram", delay
        self.now = self.most = self.calls = 0
        self._lock = threading.Lock()

    def generate(self, request):
        with self._lock:
            self.now += 1
            self.calls += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(self.delay)
            return self.inner.generate(request)
        finally:
            with self._lock:
                self.now -= 1

    def close(self):
        pass


def test_suites_keep_the_concurrency_per_replica(gsm8k_dir):
    from kvbench.suites import SuiteOptions, run_suite

    a, b = _SlowClient("http://r0"), _SlowClient("http://r1")
    client = ReplicaClient([a, b])
    res = run_suite("gsm8k_chat", client, SuiteOptions(limit=12, concurrency=2, data_dir=str(gsm8k_dir), progress=False,
                                                        max_tokens=4))
    assert a.most == b.most == 2  # two in flight on each replica, never more
    assert a.calls + b.calls == 12 and a.calls >= 4 and b.calls >= 4
    served = [r["replica"] for r in res.records]
    assert served.count("http://r0") == a.calls and served.count("http://r1") == b.calls
    # a sequential caller alternates between the replicas
    seq = ReplicaClient([_SlowClient("http://r0", 0), _SlowClient("http://r1", 0)])
    order = []
    for _ in range(4):
        seq.generate(GenRequest(prompt="hi", params=SamplingParams(max_tokens=2)))
        order.append(seq.served_by())
    assert order == ["http://r0", "http://r1", "http://r0", "http://r1"]


def test_load_slots_bound_each_replica():
    import asyncio

    from kvbench.harness.loadgen.replicas import _Slots

    async def main():
        slots, most, now = _Slots(2, 2), [0, 0], [0, 0]

        async def one():
            i = await slots.acquire()
            now[i] += 1
            most[i] = max(most[i], now[i])
            await asyncio.sleep(0.01)
            now[i] -= 1
            slots.release(i)
            return i

        got = await asyncio.gather(*(one() for _ in range(12)))
        return most, got

    most, got = asyncio.run(main())
    assert most == [2, 2] and sorted(set(got)) == [0, 1]


# ------------------------------------------------------------------------------ two real replicas
@pytest.fixture(scope="module")
def servers():
    """Two ``kvbench serve`` processes of one configuration (same synthetic weights, --served-model-name tiny)."""
    procs, urls = [], []
    for _ in range(2):
        port = _free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvbench.harness.cli", "serve", "--model", MODEL, "--device", "cpu",
             "--kv-budget-gb", "0.01", "--max-model-len", "1024", "--port", str(port), "--served-model-name", "tiny"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 120
        for proc, url in zip(procs, urls):
            while True:
                assert proc.poll() is None, proc.stdout.read()
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.2)
        yield urls
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _sweep(base_url, out: Path, data_dir: Path, warmup: int = 1):
    from kvbench.core.store import RunStore
    from kvbench.harness.matrix import expand
    from kvbench.harness.runner import run_sweep

    cfg = parse_config({
        "name": "dp", "aa_control": False, "data_dir": str(data_dir),
        "targets": [{"name": "dp", "type": "endpoint", "base_url": base_url, "max_retries": 0, "timeout_s": 60,
                     "health_timeout_s": 10}],
        "axes": {"concurrency": [1]},
        "suites": [{"name": "gsm8k_chat", "limit": 6, "max_tokens": 6}],
        "load": {"num_prompts": 4, "input_len": 16, "output_len": 4, "warmup": warmup, "metrics_interval_s": 0.2},
    })
    outcome = run_sweep(cfg, out, progress=False)
    store = RunStore(out)
    (cell,) = expand(cfg)
    return outcome, store.read_items(cell.key), store.read_requests(cell.key), store.read_json(cell.key, "summary")


def _answers(items):
    return [(r["item_id"], r["prompt_hash"], r["raw_output"], r["output_tokens"]) for r in items]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sweep_over_two_replicas_equals_one_replica_and_survives_a_failing_one(servers, tmp_path, fakes, gsm8k_dir):
    a, b = servers
    done, items, reqs, summary = _sweep([a, b], tmp_path / "two", gsm8k_dir)
    assert done.ok, summary.get("error")
    assert {r["replica"] for r in items} == {a, b} and all(r["error"] is None for r in items)
    one_done, one_items, one_reqs, one_summary = _sweep(a, tmp_path / "one", gsm8k_dir)
    assert one_done.ok and all("replica" not in r for r in one_items + one_reqs)
    assert _answers(items) == _answers(one_items)  # greedy decoding: the same answers whichever replica served
    assert one_summary["load"].get("replicas") is None and "replicas" not in one_summary["target"]
    assert "replica_failover" not in one_summary["load"]

    load = summary["load"]
    assert (load["replicas"], load["replica_urls"], load["replica_load"], load["concurrency_per_replica"]) == (2, [a, b], "aggregate", 1)
    assert load["completed"] == 8 and load["num_prompts"] == 8 and load["max_concurrency"] == 2 and load["peak_concurrency"] <= 2
    assert {r["replica"] for r in reqs} == {a, b} and len(reqs) == 8
    assert [p["url"] for p in load["per_replica"]] == [a, b] and sum(p["completed"] for p in load["per_replica"]) == 8
    assert load["server_metrics"]["available"] and load["server_metrics"]["replicas_reporting"] == 2
    assert summary["target"]["replicas"] == [a, b]

    from kvbench.reports.compare import report_analysis
    from kvbench.reports.load import load_run
    from kvbench.reports.serving import serving_tables

    load_t, lat_t = serving_tables(report_analysis(load_run(tmp_path / "two"), n_boot=50))
    assert load_t.rows[0][1] == "1 × 2 replicas" and lat_t.rows[0][1] == "1 × 2 replicas"
    assert "replica" in load_t.note and "no failover: a request that fails on a replica is counted failed" in load_t.note
    assert load["replica_failover"] is False  # the load test states that it never moves a failed request

    # a replica that fails once requests arrive: each request it fails goes to the other replica, which serves
    # it (the record names it); after 3 failures in a row it is out of rotation, and the load test runs without it
    broken = fakes(model="tiny")
    done, items, reqs, summary = _sweep([a, broken.url], tmp_path / "broken", gsm8k_dir, warmup=0)
    assert done.ok, summary.get("error")
    assert broken.completions == 3 and len(items) == 6
    assert all(r["replica"] == a and r["error"] is None for r in items)
    assert _answers(items) == _answers(one_items)  # the same answers as a one-replica run
    assert summary["suites"]["gsm8k_chat"]["errors"] == 0
    health = summary["replica_health"]
    assert health["in_rotation"] == [a] and health["failovers"] == 3 and health["sent"][broken.url] == 3
    (out,) = health["out"]
    assert out["url"] == broken.url and "3 requests in a row failed with a connection error" in out["reason"]
    assert summary["load"]["replica_urls"] == [a] and summary["load"]["replicas"] == 1
    assert reqs and all(r["success"] and r["replica"] == a for r in reqs)
    load_t, _ = serving_tables(report_analysis(load_run(tmp_path / "broken"), n_boot=50))
    assert load_t.rows[0][1] == "1 × 1 replica"  # the report says the load test ran on what was left


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_load_each_replica_in_turn_and_a_down_replica(servers):
    from kvbench.harness.loadgen.replicas import run_replicas
    from kvbench.harness.loadgen.run import LoadConfig

    a, b = servers
    cfg = LoadConfig(num_prompts=3, max_concurrency=1, input_len=16, output_len=4, warmup=0, metrics_interval_s=0)
    summary, records = run_replicas(ReplicaURL([a, b], "each"), None, cfg)
    assert (summary["replicas"], summary["replica_load"], summary["model"]) == (2, "each", "tiny")
    assert summary["completed"] == 6 and summary["num_prompts"] == 3 and summary["max_concurrency"] == 1
    assert [r["replica"] for r in records] == [a] * 3 + [b] * 3
    first_end = max(r["start_s"] + r["latency_s"] for r in records[:3])
    assert min(r["start_s"] for r in records[3:]) >= first_end - 1e-6  # laid end to end
    assert [(p["url"], p["completed"]) for p in summary["per_replica"]] == [(a, 3), (b, 3)]
    down = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ConnectionError, match=re.escape(f"replica {down}")):
        run_replicas(ReplicaURL([a, down]), None, cfg)


def test_a_cell_whose_replicas_all_fail_fails_and_resume_redoes_it(tmp_path, fakes):
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "fake_engines"))
    from conformance import make_data

    from kvbench.core.store import RunStore
    from kvbench.harness.matrix import expand
    from kvbench.harness.runner import run_sweep

    a, b = fakes(model="tiny"), fakes(model="tiny")
    cfg = parse_config({
        "name": "gone", "aa_control": False, "data_dir": str(make_data(tmp_path)),
        "targets": [{"name": "dp", "type": "endpoint", "base_url": [a.url, b.url], "max_retries": 0, "timeout_s": 10,
                     "health_timeout_s": 5}],
        "axes": {"concurrency": [2]}, "suites": [{"name": "aime25", "max_tokens": 8}], "load": {"enabled": False},
    })
    (cell,) = expand(cfg)
    outcome = run_sweep(cfg, tmp_path / "run", progress=False)
    store = RunStore(tmp_path / "run")
    summary = store.read_json(cell.key, "summary")
    assert outcome.failed == [cell.key] and not store.is_done(cell.key)
    assert "TargetGone: every replica of the target is out of rotation" in summary["error"]
    assert a.url in summary["error"] and b.url in summary["error"]
    assert {o["url"] for o in summary["replica_health"]["out"]} == {a.url, b.url}
    assert a.completions <= 4 and b.completions <= 4  # taken out after 3 failures in a row (2 in flight each)

    a.answer = b.answer = True  # the replicas are back: --resume redoes the cell
    again = run_sweep(cfg, tmp_path / "run", resume=True, progress=False)
    assert again.done == [cell.key] and store.is_done(cell.key)
    items = store.read_items(cell.key)
    assert len(items) == 3 and all(r["error"] is None for r in items) and {r["replica"] for r in items} <= {a.url, b.url}
    assert store.read_json(cell.key, "summary")["replica_health"]["out"] == []


def _gone_config(tmp_path, a, b, **target) -> Path:
    import sys

    import yaml

    sys.path.insert(0, str(Path(__file__).parent / "fake_engines"))
    from conformance import make_data

    raw = {"name": "gone", "aa_control": False, "data_dir": str(make_data(tmp_path)),
           "targets": [{"name": "dp", "type": "endpoint", "base_url": [a.url, b.url], "max_retries": 0, "timeout_s": 10,
                        "health_timeout_s": 5, **target}],
           "axes": {"concurrency": [1]}, "suites": [{"name": "aime25", "max_tokens": 8}], "load": {"enabled": False}}
    path = tmp_path / "gone.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_replica_max_failures_takes_a_replica_out_sooner_and_the_sweep_flag_overrides_it(tmp_path, fakes):
    """``replica_max_failures: 5`` in the config, ``--replica-max-failures 1`` on the command line: the failing
    replica gets one request, then leaves the rotation; the manifest records the value that ran, and a resume
    without the flag (the config's 5) is not a changed config."""
    from typer.testing import CliRunner

    from kvbench.core.store import RunStore
    from kvbench.harness.cli import app

    a, b = fakes(model="tiny"), fakes(model="tiny")
    a.answer = True  # a answers, b closes every connection unanswered
    cfg = _gone_config(tmp_path, a, b, replica_max_failures=5)
    run = tmp_path / "run"
    r = CliRunner().invoke(app, ["sweep", str(cfg), "--out", str(run), "--no-progress", "--replica-max-failures", "1"])
    assert r.exit_code == 0, r.output
    store = RunStore(run)
    (cell,) = store.cells()
    health = store.read_json(cell.key, "summary")["replica_health"]
    assert b.completions == 1 and health["max_failures"] == 1 and health["in_rotation"] == [a.url]
    assert health["out"][0]["url"] == b.url and health["out"][0]["reason"].startswith("1 requests in a row failed")
    items = store.read_items(cell.key)
    assert len(items) == 3 and all(x["replica"] == a.url and x["error"] is None for x in items)
    assert store.manifest()["config"]["targets"][0]["replica_max_failures"] == 1
    again = CliRunner().invoke(app, ["sweep", str(cfg), "--out", str(run), "--no-progress", "--resume"])
    assert again.exit_code == 0 and "0 cells done, 0 failed, 1 already done (skipped)" in again.output, again.output

    # without the flag the config's value holds (b fails at most 3 requests here: it stays in rotation)
    r = CliRunner().invoke(app, ["sweep", str(cfg), "--out", str(tmp_path / "run5"), "--no-progress"])
    assert r.exit_code == 0, r.output
    store5 = RunStore(tmp_path / "run5")
    health = store5.read_json(store5.cells()[0].key, "summary")["replica_health"]
    assert health["max_failures"] == 5 and health["out"] == [] and health["in_rotation"] == [a.url, b.url]


def test_the_sweep_flag_refuses_a_count_below_one(tmp_path, fakes):
    from typer.testing import CliRunner

    from kvbench.harness.cli import app

    cfg = _gone_config(tmp_path, fakes(), fakes())
    r = CliRunner().invoke(app, ["sweep", str(cfg), "--out", str(tmp_path / "r"), "--replica-max-failures", "0"])
    assert r.exit_code == 2 and "--replica-max-failures must be a whole number >= 1, got 0" in r.output, r.output
    assert not (tmp_path / "r").exists()


def test_the_sweep_flag_needs_a_target_of_replicas_and_stays_in_the_resume_command(tmp_path, monkeypatch):
    import shlex

    import yaml
    from typer.testing import CliRunner

    from kvbench.harness import runner
    from kvbench.harness.cli import app

    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump({"targets": [{"name": "e", "type": "endpoint", "base_url": "http://127.0.0.1:9"}],
                                   "aa_control": False}))
    r = CliRunner().invoke(app, ["sweep", str(one), "--dry-run", "--replica-max-failures", "2"])
    assert r.exit_code == 2 and "--replica-max-failures applies to targets of several replicas" in r.output, r.output

    seen = {}

    def interrupted(cfg, *args, **kw):
        seen["value"] = cfg.targets[0].replica_max_failures
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_sweep", interrupted)
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump({"targets": [{"name": "e", "type": "endpoint",
                                                "base_url": ["http://127.0.0.1:9", "http://127.0.0.1:10"]}],
                                   "aa_control": False}))
    r = CliRunner().invoke(app, ["sweep", str(two), "--out", str(tmp_path / "r"), "--replica-max-failures", "7"])
    assert r.exit_code == 130 and seen["value"] == 7, r.output
    assert shlex.split(r.output.splitlines()[-1].strip())[4:] == [str(tmp_path / "r"), "--resume",
                                                                  "--replica-max-failures", "7"]


def test_eval_replica_max_failures(tmp_path, fakes):
    import sys

    from typer.testing import CliRunner

    from kvbench.harness.cli import app

    sys.path.insert(0, str(Path(__file__).parent / "fake_engines"))
    from conformance import make_data

    a, b = fakes(model="tiny"), fakes(model="tiny")
    a.answer = True
    base = ["eval", "--suite", "aime25", "--max-tokens", "8", "--data-dir", str(make_data(tmp_path)),
            "--concurrency", "1", "--max-retries", "0", "--no-progress"]
    for args, needle in (([ "--endpoint", a.url, "--replica-max-failures", "2"], "--replica-max-failures applies to several --endpoint URLs"),
                         (["--endpoint", f"{a.url},{b.url}", "--replica-max-failures", "0"], "--replica-max-failures must be a whole number >= 1")):
        r = CliRunner().invoke(app, [*base, *args])
        assert r.exit_code == 2 and needle in r.output, r.output
    assert a.completions == b.completions == 0
    r = CliRunner().invoke(app, [*base, "--endpoint", f"{a.url},{b.url}", "--replica-max-failures", "1",
                                 "--out", str(tmp_path / "e")])
    assert r.exit_code == 0, r.output
    summary = json.loads((tmp_path / "e" / "summary.json").read_text())
    health = summary["replica_health"]
    assert b.completions == 1 and health["max_failures"] == 1 and health["in_rotation"] == [a.url]
    assert health["out"][0]["reason"].startswith("1 requests in a row failed with a connection error")
    items = [json.loads(line) for line in (tmp_path / "e" / "items.jsonl").read_text().splitlines()]
    assert len(items) == 3 and all(x["replica"] == a.url and x["error"] is None for x in items)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_eval_and_load_commands_take_several_replicas(servers, tmp_path, gsm8k_dir):
    from typer.testing import CliRunner

    from kvbench.harness.cli import app

    a, b = servers
    r = CliRunner().invoke(app, ["eval", "--suite", "gsm8k_chat", "--limit", "4", "--max-tokens", "4", "--data-dir",
                                 str(gsm8k_dir), "--endpoint", a, "--endpoint", b, "--concurrency", "1", "--max-retries", "0",
                                 "--no-progress", "--out", str(tmp_path / "eval")])
    assert r.exit_code == 0, r.output
    items = [json.loads(line) for line in (tmp_path / "eval" / "items.jsonl").read_text().splitlines()]
    assert len(items) == 4 and {x["replica"] for x in items} == {a, b} and all(x["error"] is None for x in items)
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["endpoint"] == [a, b] and summary["target"]["replicas"] == [a, b]
    assert summary["replica_health"]["out"] == [] and sum(summary["replica_health"]["sent"].values()) == 4

    r = CliRunner().invoke(app, ["load", "--base-url", f"{a},{b}", "--max-concurrency", "1", "--num-prompts", "2",
                                 "--input-len", "16", "--output-len", "4", "--warmup", "0", "--metrics-interval", "0",
                                 "--replica-load", "each", "--no-progress", "--out", str(tmp_path / "load")])
    assert r.exit_code == 0, r.output
    assert "Replicas (concurrency is per replica):  2, each" in r.output
    assert re.search(r"Replica failover: +none \(a failed request counts as failed\)", r.output), r.output
    level = json.loads((tmp_path / "load" / "c1" / "summary.json").read_text())
    assert (level["replicas"], level["replica_load"], level["completed"], level["replica_urls"]) == (2, "each", 4, [a, b])
    assert level["replica_failover"] is False
    reqs = [json.loads(line) for line in (tmp_path / "load" / "c1" / "requests.jsonl").read_text().splitlines()]
    assert [x["replica"] for x in reqs] == [a, a, b, b]


@pytest.mark.parametrize("args, needle", [
    (["eval", "--endpoint", "http://127.0.0.1:9,http://127.0.0.1:9/v1"], "--endpoint[1]: http://127.0.0.1:9/v1 is already listed"),
    (["eval", "--endpoint", "http://127.0.0.1:9", "--endpoint", "node2:8000"], "--endpoint[1]: expected an http(s) URL"),
    (["load", "--base-url", "http://127.0.0.1:9", "--replica-load", "each"], "--replica-load each: applies to several"),
    (["load", "--base-url", "http://127.0.0.1:9,http://127.0.0.1:10", "--replica-load", "split"], "choose one of aggregate, each"),
])
def test_replica_flags_refuse_bad_input(args, needle):
    from typer.testing import CliRunner

    from kvbench.harness.cli import app

    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and needle in r.output, r.output


def test_eval_names_a_replica_that_is_down(fakes, tmp_path):
    from typer.testing import CliRunner

    from kvbench.harness.cli import app

    down = f"http://127.0.0.1:{_free_port()}"
    r = CliRunner().invoke(app, ["eval", "--suite", "gsm8k_chat", "--endpoint", f"{fakes().url},{down}", "--limit", "1"])
    assert r.exit_code == 2 and f"replica {down}: GET /v1/models failed" in r.output, r.output

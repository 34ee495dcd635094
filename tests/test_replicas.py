"""Data-parallel replicas behind one endpoint target (``base_url: [URL1, URL2]``; docs/scale-out.md "Data-parallel
replicas"): the config spelling and its checks, the replica checks when the target opens (every replica up and
serving the same model), flush and capacity over every replica, least-loaded dispatch with the concurrency
bound per replica, and, with two ``kvbench serve`` processes of a tiny synthetic model, a sweep whose item
records show both replicas and equal a one-replica run, a load test aggregated over both (and one replica at a
time), and a replica that fails mid-run (failed requests, not a crash)."""

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

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
MODEL = "synthetic:llama-3-8b,layers=2,hidden=256,heads=4,kv_heads=2,head_dim=64,intermediate_size=512,vocab=512"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeReplica:
    """A stdlib HTTP server in a thread: ``/health``, ``/v1/models`` (``model``, ``max_model_len``), ``/metrics`` (an
    SGLang KV pool of ``tokens``), ``POST /flush_cache`` (counted); a completion request is counted and its
    connection closed unanswered: a replica that fails once requests arrive."""

    def __init__(self, model: str = "tiny", max_model_len=None, tokens=None):
        self.model, self.max_model_len, self.tokens = model, max_model_len, tokens
        self.flushes = self.completions = 0
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


@pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists(), reason="shared data not present")
def test_suites_keep_the_concurrency_per_replica():
    from kvbench.suites import SuiteOptions, run_suite

    a, b = _SlowClient("http://r0"), _SlowClient("http://r1")
    client = ReplicaClient([a, b])
    res = run_suite("gsm8k_chat", client, SuiteOptions(limit=12, concurrency=2, data_dir=str(DATA), progress=False,
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


def _sweep(base_url, out: Path, warmup: int = 1):
    from kvbench.core.store import RunStore
    from kvbench.harness.matrix import expand
    from kvbench.harness.runner import run_sweep

    cfg = parse_config({
        "name": "dp", "aa_control": False, "data_dir": str(DATA),
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
@pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists(), reason="shared data not present")
def test_a_sweep_over_two_replicas_equals_one_replica_and_survives_a_failing_one(servers, tmp_path, fakes):
    a, b = servers
    done, items, reqs, summary = _sweep([a, b], tmp_path / "two")
    assert done.ok, summary.get("error")
    assert {r["replica"] for r in items} == {a, b} and all(r["error"] is None for r in items)
    one_done, one_items, one_reqs, one_summary = _sweep(a, tmp_path / "one")
    assert one_done.ok and all("replica" not in r for r in one_items + one_reqs)
    assert _answers(items) == _answers(one_items)  # greedy decoding: the same answers whichever replica served
    assert one_summary["load"].get("replicas") is None and "replicas" not in one_summary["target"]

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
    assert "replica" in load_t.note

    # a replica that fails once requests arrive: its requests fail (recorded, counted), the cell finishes
    broken = fakes(model="tiny")
    done, items, reqs, summary = _sweep([a, broken.url], tmp_path / "broken", warmup=0)
    assert done.ok, summary.get("error")
    bad = [r for r in items if r["replica"] == broken.url]
    good = [r for r in items if r["replica"] == a]
    assert bad and good and broken.completions > 0
    assert all(r["finish_reason"] == "error" and r["error_kind"] == "connection" for r in bad)
    assert all(r["error"] is None for r in good)
    expected = {r[0]: r for r in _answers(one_items)}
    assert all(expected[x[0]] == x for x in _answers(good))
    assert summary["suites"]["gsm8k_chat"]["errors"] == len(bad) and summary["suites"]["gsm8k_chat"]["error_kinds"] == {"connection": len(bad)}
    failed = [r for r in reqs if not r["success"]]
    assert failed and all(r["replica"] == broken.url and broken.url in r["error"] for r in failed)
    assert summary["load"]["failed"] == len(failed) and summary["load"]["completed"] == len(reqs) - len(failed)


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

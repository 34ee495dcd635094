"""Data-parallel replicas, the parts that need no server (docs/scale-out.md "Data-parallel replicas"): a request
a replica fails to answer is served by another and the record names that one; a replica that keeps failing is
taken out of rotation with the reason; when every replica is gone the suite stops (``TargetGone``); other
failures stay the request's own.  The lm-eval bridge and the fidelity suite keep their concurrency per replica,
each document / text on one replica, and their records name it; results equal a one-client run."""

from __future__ import annotations

import threading
import time

import pytest

from kvbench.core import GenRequest, RequestFailed, SamplingParams, TargetGone
from kvbench.harness.replica_client import ReplicaClient
from kvbench.suites.base import GenerationTask, Item, Scored, SuiteOptions
from kvbench.suites.fake import FakeClient


class Replica:
    """A ``FakeClient`` behind a base URL that counts what it holds at once; ``dead`` makes every request fail
    with ``fail_kind`` (``connection``: no response, as a replica that went away)."""

    def __init__(self, url: str, delay: float = 0.0, dead: bool = False, fail_kind: str = "connection",
                 die_after=None):
        self.inner, self.base_url, self.model_id = FakeClient(), url, "fake-bigram"
        self.delay, self.dead, self.fail_kind, self.die_after = delay, dead, fail_kind, die_after
        self.now = self.most = self.calls = 0
        self._lock = threading.Lock()

    def _run(self, fn):
        with self._lock:
            self.now += 1
            self.calls += 1
            self.most = max(self.most, self.now)
            if self.die_after is not None and self.calls > self.die_after:  # the replica went away mid-suite
                self.dead = True
            dead = self.dead  # as it was when the request arrived
        try:
            time.sleep(self.delay)
            if dead:
                raise RequestFailed(f"{self.base_url}/v1/completions: no response (ConnectError)", self.fail_kind)
            return fn()
        finally:
            with self._lock:
                self.now -= 1

    def generate(self, request):
        return self._run(lambda: self.inner.generate(request))

    def score(self, request):
        return self._run(lambda: self.inner.score(request))

    def stream(self, request):
        self._run(lambda: None)
        yield from self.inner.stream(request)

    def info(self):
        return {"base_url": self.base_url}

    def close(self):
        pass


REQ = GenRequest(prompt="hello", params=SamplingParams(max_tokens=3))


def test_a_failed_request_is_served_by_another_replica_and_a_failing_one_leaves_rotation():
    dead, good = Replica("http://r0", dead=True), Replica("http://r1")
    client = ReplicaClient([dead, good], max_failures=2)
    expected = FakeClient().generate(REQ).text
    for _ in range(4):
        assert client.generate(REQ).text == expected
        assert client.served_by() == "http://r1"  # the replica that finally served it
    assert dead.calls == 2 and good.calls == 4  # out of rotation after 2 failures in a row: no third try
    health = client.health()
    assert health["in_rotation"] == ["http://r1"] and health["failovers"] == 2
    (out,) = health["out"]
    assert out["url"] == "http://r0" and "2 requests in a row failed with a connection error" in out["reason"]
    assert "no response" in out["reason"] and client.live() == ["http://r1"]
    assert "".join(client.stream(REQ)) == expected and client.load()["http://r1"]["in_flight"] == 0
    # a success resets the count: failures that are not in a row never take a replica out
    flaky, other = Replica("http://f"), Replica("http://o")
    c2 = ReplicaClient([flaky, other], max_failures=2)
    for _ in range(3):
        flaky.dead = True
        c2.generate(REQ)
        flaky.dead = False
        c2.generate(REQ)
        c2.generate(REQ)
    assert c2.health()["out"] == [] and flaky.calls >= 4


def test_other_failures_are_not_moved_and_no_replica_left_is_target_gone():
    slow = Replica("http://t", dead=True, fail_kind="timeout")
    client = ReplicaClient([slow, Replica("http://u")], max_failures=1)
    with pytest.raises(RequestFailed):
        client.generate(REQ)  # a timeout is the request's own result: recorded, not sent again
    assert client.served_by() == "http://t" and client.health()["out"] == [] and client.failovers == 0
    gone = ReplicaClient([Replica("http://a", dead=True), Replica("http://b", dead=True)], max_failures=1)
    with pytest.raises(TargetGone, match=r"every replica of the target is out of rotation \(http://a: .*http://b: "):
        gone.generate(REQ)
    with pytest.raises(TargetGone):
        gone.score(None)
    # each replica tries a request once: with both failing but still in rotation, the request's error is raised
    both = ReplicaClient([Replica("http://c", dead=True), Replica("http://d", dead=True)], max_failures=5)
    with pytest.raises(RequestFailed):
        both.generate(REQ)
    assert both.health()["failovers"] == 1 and both.live() == ["http://c", "http://d"]


def test_pinned_requests_share_one_replica_and_move_together():
    a, b = Replica("http://a"), Replica("http://b")
    client = ReplicaClient([a, b])
    with client.pinned():
        first = client.served_by()
        client.generate(REQ)
        client.generate(REQ)
        assert client.served_by() == first and client.load()[first]["in_flight"] == 1  # one slot held throughout
    assert {a.calls, b.calls} == {0, 2}
    with client.pinned():
        victim = a if client.served_by() == "http://a" else b
        victim.dead, before = True, victim.calls
        client.generate(REQ)  # fails on the pinned replica: served by the other, the pin moves there
        client.generate(REQ)
        assert client.served_by() != victim.base_url
    assert victim.calls == before + 1 and client.failovers == 1
    assert client.load()["http://a"]["in_flight"] == client.load()["http://b"]["in_flight"] == 0


class _Echo(GenerationTask):
    name = "echo"

    def load_items(self, opts):
        return [Item(f"i{i}", "x", {"q": f"question {i}"}) for i in range(16)], "inline"

    def build(self, item, repeat, params):
        return GenRequest(prompt=item.data["q"], params=params)

    def score(self, item, output):
        return Scored(output, False, False, {})

    def protocol(self, opts):
        return "echo:v1"


def test_the_suite_runner_records_the_serving_replica_and_stops_when_none_is_left():
    from kvbench.suites.runner import run_generation

    dying, good = Replica("http://r0", delay=0.01, die_after=2), Replica("http://r1", delay=0.01)
    opts = SuiteOptions(concurrency=2, progress=False, max_tokens=3)
    client = ReplicaClient([dying, good])
    res = run_generation(_Echo(), client, opts)
    one = run_generation(_Echo(), FakeClient(), opts)
    assert [r["raw_output"] for r in res.records] == [r["raw_output"] for r in one.records]
    assert all(r["error"] is None for r in res.records) and res.summary["errors"] == 0
    # the two it answered before it went away name it; every other item names the replica that served it
    assert [r["replica"] for r in res.records].count("http://r0") == 2 and good.calls == 14
    assert 5 <= dying.calls <= 6 and client.health()["out"][0]["url"] == "http://r0"  # 3 failures: out
    with pytest.raises(TargetGone):
        run_generation(_Echo(), ReplicaClient([Replica("http://a", dead=True), Replica("http://b", dead=True)]), opts)


def test_lm_eval_bridge_keeps_concurrency_per_replica(tmp_path):
    import json

    import yaml

    from kvbench.suites.registry import RunContext, run_suite

    rows = [{"q": f"q{i}", "choices": ["cd", "ef", "gh"], "label": i % 3} for i in range(8)]
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tiny_mc.yaml").write_text(yaml.safe_dump({
        "task": "tiny_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{q}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    ctx = RunContext(lm_eval_include=str(tmp_path))
    a, b = Replica("http://a", delay=0.01), Replica("http://b", delay=0.01)
    res = run_suite("lm_eval:tiny_mc", ReplicaClient([a, b]), SuiteOptions(concurrency=2, progress=False), ctx)
    one = run_suite("lm_eval:tiny_mc", FakeClient(), SuiteOptions(concurrency=2, progress=False), ctx)
    assert [(r["item_id"], r["extracted"], r["correct"]) for r in res.records] == \
        [(r["item_id"], r["extracted"], r["correct"]) for r in one.records]
    assert a.most == b.most == 2 and a.calls + b.calls == 24  # 2 in flight per replica, 3 choices per document
    assert a.calls % 3 == 0 and b.calls % 3 == 0  # a document's requests on one replica
    assert {r["replica"] for r in res.records} == {"http://a", "http://b"}
    assert sum(r["replica"] == "http://a" for r in res.records) * 3 == a.calls


def test_fidelity_keeps_concurrency_per_replica_and_names_the_replica():
    from kvbench.suites.fidelity.ref import Text
    from kvbench.suites.fidelity.suite import FidelitySuite, Reference

    texts = [Text(f"t{i}", f"Question {i}: what is {i} + {i}?\nAnswer:", f" {2 * i} because {i} + {i} = {2 * i}.")
             for i in range(8)]

    def suite():
        return FidelitySuite(Reference("fake-ref", lambda: FakeClient()), None, top_k=8, greedy_tokens=6,
                             texts=lambda opts: texts)

    a, b = Replica("http://a", delay=0.02), Replica("http://b", delay=0.02)
    opts = SuiteOptions(concurrency=2, progress=False)
    res = suite().run(ReplicaClient([a, b]), opts)
    one = suite().run(FakeClient(), opts)
    assert [r["scores"] for r in res.records] == [r["scores"] for r in one.records]
    assert a.most == b.most == 2 and a.calls + b.calls == 16  # 2 texts in flight per replica; 2 requests per text
    assert a.calls % 2 == 0 and b.calls % 2 == 0  # both requests of a text on one replica
    assert {r["replica"] for r in res.records} == {"http://a", "http://b"} and "replica" not in one.records[0]
    assert sum(r["replica"] == "http://a" for r in res.records) * 2 == a.calls

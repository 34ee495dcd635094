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


# ------------------------------------------------------------------------------ every suite names its replica
def _suite_data(d) -> str:
    """Three items of every native generation suite (gsm8k and its variants with a few-shot pool, aime24/25,
    gpqa_diamond) in ``d``."""
    import csv
    import json

    def jsonl(name, rows):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    jsonl("gsm8k_test.jsonl", [{"question": f"Tom has {i} apples and buys {i + 3} more. How many?",
                                "answer": f"{i} + {i + 3} = {2 * i + 3}\n#### {2 * i + 3}"} for i in range(3)])
    jsonl("gsm8k_train.jsonl", [{"question": f"Ann has {i} pens and loses one. How many are left?",
                                 "answer": f"{i} - 1 = {i - 1}\n#### {i - 1}"} for i in range(10, 18)])
    for name in ("aime24", "aime25"):
        jsonl(f"{name}.jsonl", [{"id": f"{name}-{i}", "problem": f"What is {i} times {i}?", "answer": str(i * i)}
                                for i in range(3)])
    with (d / "gpqa_diamond.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Record ID", "Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
                    "Incorrect Answer 3"])
        for i in range(3):
            w.writerow([f"rec{i}", f"Which one is {i}?", f"{i}", f"{i + 1}", f"{i + 2}", f"{i + 3}"])
    return str(d)


class _ScriptedReplica(Replica):
    """A ``Replica`` around the ruler tests' scripted client (it has a tokenizer and answers from the prompt)."""

    def __init__(self, url: str):
        from test_ruler_suite import ScriptedClient

        super().__init__(url, delay=0.005)
        self.inner = ScriptedClient()

    def tokenizer(self):
        return self.inner.tokenizer()

    def info(self):
        return self.inner.info()


# the suites whose records this module checks for ``replica``: the native generation suites and ruler here, the
# fidelity suite and the lm-eval bridge in their own tests above
_REPLICA_SUITES = ("gsm8k", "gsm8k_cot", "gsm8k_chat", "aime24", "aime25", "gpqa_diamond", "ruler")


def test_every_suite_is_checked_for_the_replica_field():
    from kvbench.suites import suite_names

    assert set(suite_names()) == {*_REPLICA_SUITES, "fidelity", "lm_eval:<task>"}


@pytest.mark.parametrize("name", _REPLICA_SUITES)
def test_every_generation_suite_records_the_replica_that_served_each_item(name, tmp_path):
    import sys
    from pathlib import Path

    from kvbench.suites.registry import run_suite

    sys.path.insert(0, str(Path(__file__).parent))
    if name == "ruler":
        a, b = _ScriptedReplica("http://a"), _ScriptedReplica("http://b")
        opts = SuiteOptions(limit=1, concurrency=2, progress=False,
                            extra={"context_lengths": [512], "tasks": ["niah_single", "vt"], "depths": 2})
    else:
        a, b = Replica("http://a", delay=0.005), Replica("http://b", delay=0.005)
        opts = SuiteOptions(limit=3, repeats=2, concurrency=2, progress=False, max_tokens=4,
                            data_dir=_suite_data(tmp_path))
    res = run_suite(name, ReplicaClient([a, b]), opts)
    served = [r.get("replica") for r in res.records]
    assert len(served) >= 3 and all(r["error"] is None for r in res.records)
    assert set(served) == {"http://a", "http://b"}  # every record names one of the two, and both served
    assert (served.count("http://a"), served.count("http://b")) == (a.calls, b.calls)


# ------------------------------------------------------------------------------ --help
@pytest.mark.parametrize("command, phrases", [
    ("sweep", ("--executor", "--address", "--ray-retries", "--ray-cpus-per-group", "--ray-resources",
               "--replica-max-failures",
               "one Ray task per group", "a cell's concurrency then applies to each replica",
               "the load test never moves a failed request")),
    ("eval", ("--endpoint", "--replica-max-failures", "data-parallel replicas of one server configuration",
              "--concurrency per replica", "each record names its replica")),
    ("load", ("--base-url", "--replica-load", "--max-concurrency then applies to each replica",
              "no failover: a request that fails on a replica is counted failed")),
])
def test_help_names_the_executor_and_replica_options(command, phrases):
    from typer.testing import CliRunner

    from kvbench.harness.cli import app

    r = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "120", "TERMINAL_WIDTH": None})
    assert r.exit_code == 0, r.output
    words = " ".join(r.output.replace("│", " ").split())
    missing = [p for p in phrases if p not in words]
    assert not missing, (missing, words)

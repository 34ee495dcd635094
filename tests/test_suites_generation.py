"""Generation suites end to end against the deterministic fake client (no model)."""

from __future__ import annotations

import os

import csv
import json
import re
from pathlib import Path

import pytest

from kvbench.core.client import GenResult
from kvbench.core.records import ITEM_FIELDS
from kvbench.suites.aime import pass_at_k
from kvbench.suites.base import SuiteError, SuiteOptions
from kvbench.suites.fake import FakeClient
from kvbench.suites.registry import resolve, run_suite

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
needs_data = pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists() and not os.environ.get("CI"), reason="shared data not present")


def _opts(**kw):
    return SuiteOptions(data_dir=str(DATA), progress=False, **{"concurrency": 4, **kw})


@needs_data
def test_gsm8k_records_order_and_fewshot():
    seen = []

    def respond(req):
        seen.append(req.prompt)
        return "#### 1"

    res = run_suite("gsm8k", FakeClient(responder=respond), _opts(limit=8))
    assert [r["item_id"] for r in res.records] == [f"test-{i}" for i in range(8)]
    test_q = {json.loads(line)["question"] for line in (DATA / "gsm8k_test.jsonl").read_text().splitlines()}
    for p in seen:
        shots = re.findall(r"Question: (.*?)\nAnswer:", p, flags=re.S)
        assert len(shots) == 6  # five few-shot examples + the test question
        assert not (set(shots[:5]) & test_q), "few-shot example taken from the test split"
        assert shots[5] in test_q and p.endswith("\nAnswer:")
    for r in res.records:
        assert set(r) == set(ITEM_FIELDS) | {"error", "error_kind", "request_options", "reasoning", "retries"}  # error fields: None on answered records
        assert r["error"] is None and r["error_kind"] is None
        assert r["extracted"] == "1" and r["correct"] == (r["target"] == "1")
        assert r["seed"] is not None and r["protocol"].startswith("lm-eval:gsm8k:")
    # same items, same seeds and prompts in a second run (what makes cells comparable)
    again = run_suite("gsm8k", FakeClient(responder=lambda req: "x"), _opts(limit=8, concurrency=1))
    assert [(r["seed"], r["prompt_hash"]) for r in again.records] == [(r["seed"], r["prompt_hash"]) for r in res.records]
    assert again.summary["invalid_rate"] == 1.0 and again.summary["accuracy"] == 0.0


@needs_data
def test_gsm8k_cot_and_chat_protocols():
    prompts = []

    def respond(req):
        prompts.append(req)
        return "so 5 + 5 = 10. The answer is 10.\n\nQ: next" if req.prompt else "work\nAnswer: 10"

    cot = run_suite(resolve("gsm8k", "cot"), FakeClient(responder=respond), _opts(limit=3))
    p = prompts[0].prompt
    assert p.count("Q: ") == 9 and p.endswith("A:") and "The answer is 6." in p
    assert all(r["extracted"] == "10" for r in cot.records)
    chat = run_suite(resolve("gsm8k", "chat"), FakeClient(responder=respond), _opts(limit=3))
    assert prompts[-1].messages and "Answer: N" in prompts[-1].messages[0]["content"]
    assert all(r["extracted"] == "10" and r["scores"]["answer-line"] == float(r["target"] == "10") for r in chat.records)
    with pytest.raises(SuiteError):
        resolve("gsm8k", "nope")
    with pytest.raises(SuiteError):
        resolve("aime24", "cot")


@needs_data
def test_aime_avg_and_pass_at_k():
    answers = {json.loads(line)["problem"]: json.loads(line)["answer"] for line in (DATA / "aime24.jsonl").read_text().splitlines()}

    def respond(req):
        problem = req.messages[0]["content"].rsplit("\n\nPlease reason", 1)[0]
        a = answers[problem]
        # right on even seeds (zero-padded, inside nested braces), wrong otherwise
        return rf"... \boxed{{\text{{{a:03d}}}}}" if req.params.seed % 2 == 0 else r"\boxed{\frac{1}{2}}"

    res = run_suite("aime24", FakeClient(responder=respond), _opts(limit=5, repeats=4))
    assert len(res.records) == 20
    by = {}
    for r in res.records:
        assert r["correct"] == (r["seed"] % 2 == 0)
        by.setdefault(r["item_id"], []).append(r["correct"])
    avg = sum(sum(v) / 4 for v in by.values()) / 5
    assert res.summary["avg@4"] == pytest.approx(avg)
    assert res.summary["pass@4"] == pytest.approx(sum(any(v) for v in by.values()) / 5)
    assert len({r["seed"] for r in res.records}) == 20  # a distinct seed per (item, repeat)
    assert res.records[0]["protocol"].startswith("kvbench:aime24:") and "t0.6" in res.records[0]["protocol"]


def test_pass_at_k_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(5, 2, 5) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def _gpqa_csv(tmp_path: Path) -> Path:
    """Made-up questions in the GPQA column format."""
    rows = [
        {"Record ID": f"rec{i}", "Question": f"Which made-up constant is number {i}?", "Correct Answer": f"right-{i}",
         "Incorrect Answer 1": f"wrong-a-{i}", "Incorrect Answer 2": f"wrong-b-{i}", "Incorrect Answer 3": f"wrong-c-{i}"}
        for i in range(6)
    ]
    p = tmp_path / "gpqa_diamond.csv"
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return tmp_path


def test_gpqa_shuffle_extraction_and_invalid(tmp_path):
    d = _gpqa_csv(tmp_path)

    def respond(req):
        text = req.messages[0]["content"]
        letter = re.search(r"^([ABCD])\) right-", text, flags=re.M).group(1)
        return f"Reasoning about (A) and (B).\nAnswer: ({letter})"

    res = run_suite("gpqa_diamond", FakeClient(responder=respond), SuiteOptions(data_dir=str(d), repeats=4, progress=False))
    assert res.summary["accuracy"] == 1.0 and res.summary["invalid_rate"] == 0.0
    letters = {r["target"] for r in res.records}
    assert len(letters) > 1  # the correct answer moves between repeats
    again = run_suite("gpqa_diamond", FakeClient(responder=respond), SuiteOptions(data_dir=str(d), repeats=4, progress=False))
    assert [r["target"] for r in again.records] == [r["target"] for r in res.records]  # seeded shuffle
    vague = run_suite("gpqa_diamond", FakeClient(responder=lambda req: "Either (A) or (C), hard to say."), SuiteOptions(data_dir=str(d), progress=False))
    assert vague.summary["invalid_rate"] == 1.0 and all(r["extracted"] is None and r["correct"] is False for r in vague.records)


class _Flaky(FakeClient):
    def generate(self, request):
        n = int(re.search(r"number (\d+)", request.messages[0]["content"]).group(1))
        if n == 1:
            raise ConnectionError("server went away")
        if n == 2:
            return GenResult("Answer: A", "length", 10, 5, 0.1)
        if n == 3:
            return GenResult("", "stop", 10, 0, 0.1)
        return super().generate(request)


def test_errors_truncations_and_empties_are_counted(tmp_path):
    d = _gpqa_csv(tmp_path)
    res = run_suite("gpqa_diamond", _Flaky(responder=lambda r: "Answer: B"), SuiteOptions(data_dir=str(d), progress=False))
    assert len(res.records) == 6  # nothing dropped
    s = res.summary
    # the failed request is counted apart: rates over the 5 answered records
    assert s["error_rate"] == pytest.approx(1 / 6) and s["errors"] == 1 and s["answered"] == 5
    assert s["truncation_rate"] == pytest.approx(1 / 5)
    assert s["empty_rate"] == pytest.approx(1 / 5)  # the empty answer (the failed request is no answer)
    err = [r for r in res.records if r["finish_reason"] == "error"]
    assert len(err) == 1 and err[0]["item_id"] == "rec1" and err[0]["invalid"] is None and err[0]["correct"] is None
    assert err[0]["error_kind"] == "connection" and "server went away" in err[0]["error"] and err[0]["scores"] == {}

    class _Dead(FakeClient):
        def generate(self, request):
            raise ConnectionError("refused")

    with pytest.raises(SuiteError, match="every request failed"):
        run_suite("gpqa_diamond", _Dead(), SuiteOptions(data_dir=str(d), progress=False))


def test_bad_options_and_missing_data(tmp_path, monkeypatch):
    with pytest.raises(SuiteError):
        SuiteOptions(limit=0)
    with pytest.raises(SuiteError):
        SuiteOptions(repeats=0)
    with pytest.raises(SuiteError, match="unknown suite"):
        run_suite("mmlu", FakeClient(), SuiteOptions(progress=False))
    from kvbench.suites import data
    from kvbench.suites.data import DataError

    def offline(src):
        raise ConnectionError("no network")

    monkeypatch.setattr(data, "_load_hub", offline)  # the hub is unreachable: a clear error, quickly
    with pytest.raises(DataError, match="gpqa_diamond"):
        run_suite("gpqa_diamond", FakeClient(), SuiteOptions(data_dir=str(tmp_path), progress=False))

"""GPQA diamond data: the gated dataset's absence says exactly how to provide it, and the suite runs end to end
on a made-up CSV in the standard format (seeded shuffles per repeat, accuracy, record fields)."""

from __future__ import annotations

import csv
import re

import pytest

from kvbench.core.client import GenResult
from kvbench.suites import data
from kvbench.suites.base import SuiteOptions
from kvbench.suites.data import DataError
from kvbench.suites.fake import FakeClient
from kvbench.suites.gpqa import COLUMNS
from kvbench.suites.registry import run_suite

N = 10


def write_csv(d, n=N, record_ids=True, drop=None):
    fields = (["Record ID"] if record_ids else []) + ["Question", "Correct Answer", "Incorrect Answer 1",
                                                      "Incorrect Answer 2", "Incorrect Answer 3", "Subdomain"]
    fields = [f for f in fields if f != drop]
    with (d / "gpqa_diamond.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for i in range(n):
            w.writerow({"Record ID": f"rec{i:02d}", "Question": f"Made-up question number {i}: which one?",
                        "Correct Answer": f"the true value {i}", "Incorrect Answer 1": f"decoy one {i}",
                        "Incorrect Answer 2": f"decoy two, {i}", "Incorrect Answer 3": f"decoy three\n{i}",
                        "Subdomain": "made-up"})
    return d


def test_missing_gated_data_says_how_to_provide_it(tmp_path, monkeypatch):
    def gated(src):
        assert (src.path, src.name, src.split) == ("Idavidrein/gpqa", "gpqa_diamond", "train")
        raise PermissionError("Dataset 'Idavidrein/gpqa' is a gated dataset on the Hub. You must be authenticated")

    monkeypatch.setattr(data, "_load_hub", gated)
    with pytest.raises(DataError) as e:
        run_suite("gpqa_diamond", FakeClient(), SuiteOptions(data_dir=str(tmp_path), progress=False))
    msg = str(e.value)
    for needle in ("gated dataset on the Hub", "Idavidrein/gpqa", "config gpqa_diamond", "HF_TOKEN", "huggingface-cli login",
                   "gpqa_diamond.csv in --data-dir", "KVBENCH_DATA_DIR", ", ".join(COLUMNS)):
        assert needle in msg, needle
    assert "\n" not in msg  # the CLI prints a user error as one line
    assert COLUMNS == ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")


def test_a_csv_missing_a_column_is_named(tmp_path):
    write_csv(tmp_path, drop="Incorrect Answer 2")
    with pytest.raises(DataError, match=r"missing column\(s\) \['Incorrect Answer 2'\]"):
        run_suite("gpqa_diamond", FakeClient(), SuiteOptions(data_dir=str(tmp_path), progress=False))


def _number(req) -> int:
    return int(re.search(r"question number (\d+)", req.messages[0]["content"]).group(1))


def _shown(req) -> dict[str, str]:
    """letter -> choice text as shown in the kvbench prompt."""
    return dict(re.findall(r"^([ABCD])\) (.*?)(?=\n[ABCD]\) |\Z)", req.messages[0]["content"], flags=re.M | re.S))


class HalfRight(FakeClient):
    """Answers even-numbered questions right and odd-numbered ones wrong (a letter that is not the answer)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def generate(self, request):
        self.seen.append(request)
        shown = _shown(request)
        right = next(L for L, text in shown.items() if text.startswith("the true value"))
        letter = right if _number(request) % 2 == 0 else next(L for L in "ABCD" if L != right)
        return GenResult(f"Let me think.\nAnswer: {letter}", "stop", 40, 6, 0.01)


def test_end_to_end_on_a_made_up_csv(tmp_path):
    write_csv(tmp_path)
    opts = SuiteOptions(data_dir=str(tmp_path), repeats=4, concurrency=5, progress=False)
    client = HalfRight()
    res = run_suite("gpqa_diamond", client, opts)
    assert res.source.endswith("gpqa_diamond.csv") and len(res.records) == N * 4
    s = res.summary
    assert (s["accuracy"], s["n"], s["errors"], s["invalid_rate"]) == (0.5, N * 4, 0, 0.0)
    recs = {(r["item_id"], r["repeat"]): r for r in res.records}
    assert [r["item_id"] for r in res.records][:4] == ["rec00"] * 4  # dataset order, repeats together
    for req in client.seen:  # the letter graded right is where the true value was shown
        i = _number(req)
        shown = _shown(req)
        assert sorted(shown.values()) == sorted([f"the true value {i}", f"decoy one {i}", f"decoy two, {i}", f"decoy three\n{i}"])
    for (rid, k), r in recs.items():
        i = int(rid[3:])
        assert r["correct"] is (i % 2 == 0) and r["extracted"] in "ABCD" and r["target"] in "ABCD"
        assert (r["extracted"] == r["target"]) is r["correct"] and r["invalid"] is False
        assert r["scores"] == {"letter": float(r["correct"])} and r["finish_reason"] == "stop"
        assert (r["error"], r["error_kind"], r["reasoning"], r["retries"]) == (None, None, None, 0)
        assert r["request_options"] == {"reasoning_effort": None, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                        "max_tokens": 2048, "extra_body": None}
        assert r["protocol"].startswith("kvbench:gpqa_diamond:v1:shuffle-seeded:") and r["seed"] is not None
    # the shuffle differs between repeats of one question ...
    targets = [[recs[(f"rec{i:02d}", k)]["target"] for k in range(4)] for i in range(N)]
    assert any(len(set(t)) > 1 for t in targets)
    # ... and is the same in another run (every cell sees the same prompts) ...
    again = run_suite("gpqa_diamond", HalfRight(), opts)
    assert [(r["target"], r["prompt_hash"], r["seed"]) for r in again.records] == \
        [(r["target"], r["prompt_hash"], r["seed"]) for r in res.records]
    # ... and changes with the sampling seed
    other = run_suite("gpqa_diamond", HalfRight(), SuiteOptions(data_dir=str(tmp_path), repeats=4, seed=1, progress=False))
    assert [r["target"] for r in other.records] != [r["target"] for r in res.records]
    assert other.summary["accuracy"] == 0.5


def test_rows_without_record_ids_get_row_numbers(tmp_path):
    write_csv(tmp_path, n=3, record_ids=False)
    res = run_suite("gpqa_diamond", HalfRight(), SuiteOptions(data_dir=str(tmp_path), progress=False))
    assert [r["item_id"] for r in res.records] == ["row-0", "row-1", "row-2"]
    assert [r["correct"] for r in res.records] == [True, False, True]

"""Failed requests are counted apart from wrong answers: records, suite summaries, reports/load.py helpers,
the report's accuracy rows, paired deltas and tables (no model, no server: fake clients and constructed cells)."""

from __future__ import annotations

import json

import pytest

from kvbench.core.client import GenRequest, GenResult, RequestFailed, classify_error
from kvbench.reports.stats import paired as stats
from kvbench.reports.analysis import analyze
from kvbench.reports.load import CellData
from kvbench.reports.item_records import accuracy_suites, error_counts, error_keys, is_error, item_scores, paired_scores
from kvbench.reports.tables import accuracy_table, delta_table
from kvbench.suites.base import (GenerationTask, Item, Scored, SuiteError, SuiteOptions, is_error_record,
                                 summarize_records)
from kvbench.suites.fake import FakeClient
from kvbench.suites.runner import run_generation


# ------------------------------------------------------------------------------ a tiny suite and fake clients


class EchoTask(GenerationTask):
    """Items q0..q{n-1}, target "7"; the prompt names the item, the answer must be exactly the target."""

    name = "echo"

    def __init__(self, n: int = 10):
        self.n = n

    def load_items(self, opts):
        return [Item(f"q{i}", "7", {}) for i in range(self.n)], "inline"

    def build(self, item, repeat, params):
        return GenRequest(prompt=f"item {item.item_id}", params=params)

    def score(self, item, output):
        out = output.strip()
        ok = out == item.target
        return Scored(out if out.isdigit() else None, ok, not out.isdigit(), {"exact": float(ok)})

    def protocol(self, opts):
        return "echo:v1"


class Scripted(FakeClient):
    """Fails the items named in ``fail`` (item id -> exception to raise, or a GenResult to return)."""

    def __init__(self, fail: dict, answers: dict):
        super().__init__()
        self.fail, self.answers = fail, answers

    def generate(self, request):
        item = request.prompt.split()[-1]
        how = self.fail.get(item)
        if isinstance(how, BaseException):
            raise how
        if isinstance(how, GenResult):
            return how
        return GenResult(self.answers.get(item, "7"), "stop", 3, 1, 0.01)


def _opts(**kw):
    return SuiteOptions(progress=False, concurrency=3, **kw)


FAILS = {
    "q1": TimeoutError("read timed out"),
    "q2": GenResult("", "error", 0, 0, 0.2, error="HTTP 500: boom", error_kind="http"),
    "q3": RequestFailed("response cut off", "stream"),
    "q4": ConnectionRefusedError("refused"),
    "q5": ValueError("weird"),
}
ANSWERS = {"q8": "8", "q9": "dunno"}  # q0, q6, q7 right; q8 wrong; q9 invalid


def test_failed_requests_are_error_records_not_wrong_answers():
    res = run_generation(EchoTask(), Scripted(FAILS, ANSWERS), _opts())
    recs = {r["item_id"]: r for r in res.records}
    assert [r["item_id"] for r in res.records] == [f"q{i}" for i in range(10)]  # never dropped, dataset order
    kinds = {"q1": "timeout", "q2": "http", "q3": "stream", "q4": "connection", "q5": "other"}
    for item, kind in kinds.items():
        r = recs[item]
        assert r["error_kind"] == kind, (item, r["error"])
        assert r["error"] and r["finish_reason"] == "error"
        assert r["correct"] is None and r["invalid"] is None and r["scores"] == {} and r["extracted"] is None
        assert is_error_record(r)
    assert "read timed out" in recs["q1"]["error"] and recs["q2"]["error"] == "HTTP 500: boom"
    for item in ("q0", "q6", "q7", "q8", "q9"):
        r = recs[item]
        assert "error" in r and r["error"] is None and r["error_kind"] is None and not is_error_record(r)
    assert recs["q8"]["correct"] is False and recs["q9"]["invalid"] is True and recs["q0"]["scores"] == {"exact": 1.0}

    s = res.summary
    assert s["n"] == 10 and s["answered"] == 5 and s["errors"] == 5
    assert s["error_rate"] == pytest.approx(0.5)
    assert s["error_kinds"] == {"timeout": 1, "http": 1, "stream": 1, "connection": 1, "other": 1}
    assert s["accuracy"] == pytest.approx(3 / 5)  # not 3/10: errors are not wrong answers
    assert s["exact"] == pytest.approx(3 / 5)
    assert s["invalid_rate"] == pytest.approx(1 / 5) and s["truncation_rate"] == 0.0 and s["empty_rate"] == 0.0


def test_every_request_failing_still_raises():
    fail = {f"q{i}": TimeoutError("slow") for i in range(4)}
    with pytest.raises(SuiteError, match=r"every request failed.*\[timeout\]"):
        run_generation(EchoTask(4), Scripted(fail, {}), _opts())


def test_summary_of_older_records_and_edge_cases():
    ok = {"correct": True, "invalid": False, "finish_reason": "length", "raw_output": "7", "scores": {"m": 1.0}}
    bad = {"correct": False, "invalid": True, "finish_reason": "stop", "raw_output": "", "scores": {"m": 0.0}}
    legacy = {"correct": False, "invalid": True, "finish_reason": "error", "raw_output": "", "scores": {}}  # no "error" key
    s = summarize_records([ok, bad, legacy])
    assert (s["n"], s["answered"], s["errors"], s["error_kinds"]) == (3, 2, 1, {"other": 1})
    assert s["accuracy"] == 0.5 and s["m"] == 0.5 and s["invalid_rate"] == 0.5 and s["truncation_rate"] == 0.5
    assert s["empty_rate"] == 0.5 and s["error_rate"] == pytest.approx(1 / 3)
    only = summarize_records([legacy, {**legacy, "error": "x", "error_kind": "http"}])
    assert "accuracy" not in only and only["invalid_rate"] is None and only["error_kinds"] == {"other": 1, "http": 1}
    empty = summarize_records([])
    assert empty["n"] == 0 and empty["errors"] == 0 and empty["error_rate"] is None


def test_classify_error():
    import httpx

    assert classify_error(TimeoutError()) == "timeout"
    assert classify_error(httpx.ReadTimeout("t")) == "timeout"
    assert classify_error(httpx.RemoteProtocolError("peer closed")) == "stream"
    assert classify_error(httpx.ConnectError("refused")) == "connection"
    assert classify_error(ConnectionResetError()) == "connection"
    assert classify_error(json.JSONDecodeError("x", "doc", 0)) == "stream"
    assert classify_error(RequestFailed("x", "http")) == "http"
    assert classify_error(RequestFailed("x", "nonsense")) == "other"
    assert classify_error(ValueError("x")) == "other"
    assert isinstance(RequestFailed("x"), ConnectionError) and isinstance(RequestFailed("x"), RuntimeError)


# ------------------------------------------------------------------------------ reports on constructed cells


def _rec(suite, i, correct, *, repeat=0, error=None, legacy_error=False, invalid=None, trunc=False, out=None):
    failed = error is not None or legacy_error
    return {"suite": suite, "item_id": f"i{i}", "repeat": repeat, "correct": None if error else correct,
            "invalid": None if error else (invalid if invalid is not None else not correct),
            "finish_reason": "error" if failed else ("length" if trunc else "stop"),
            "raw_output": out if out is not None else ("" if failed else f"out{i}-{int(bool(correct))}"),
            "scores": {} if failed else {"exact": float(correct)},
            "error": error, "error_kind": "timeout" if error else None}


def _cell(key, items, aa=False):
    cfg = {"kv_dtype": "bf16" if key.startswith("base") else "fp8_e4m3", "concurrency": 1}
    if aa:
        cfg["aa_control"] = True
    return CellData(key=key, label=key, config=cfg, status="done", items=items, short=key)


N = 20
BASE_OK = [i % 3 != 0 for i in range(N)]  # 13 of 20 right


def _base():
    recs = [_rec("s", i, BASE_OK[i], trunc=(i == 4)) for i in range(N)]
    recs[5] = _rec("s", 5, None, error="HTTP 503")  # the baseline's one failed request
    recs.append(_rec("dead", 0, None, error="timed out"))  # a suite whose every request failed
    recs.append(_rec("dead", 1, None, legacy_error=True))
    return recs


def _cand():
    ok = list(BASE_OK)
    ok[1] = ok[2] = False  # two planted losses
    recs = [_rec("s", i, ok[i]) for i in range(N)]
    recs[7] = _rec("s", 7, None, error="timed out")
    recs[8] = _rec("s", 8, None, legacy_error=True)  # an older store: only finish_reason says so
    return recs


def test_load_helpers():
    base, cand = _cell("base", _base()), _cell("cand", _cand())
    assert is_error(cand.items[7]) and is_error(cand.items[8]) and not is_error(cand.items[0])
    assert error_keys(cand, "s") == {("i7", 0), ("i8", 0)} and error_keys(base, "s") == {("i5", 0)}
    assert error_counts(cand, "s") == (2, N) and error_counts(base, "dead") == (2, 2) and error_counts(base, "none") == (0, 0)
    for metric in (None, "correct", "invalid", "truncated", "exact"):
        keys = set(item_scores(cand, "s", metric))
        assert keys == {(f"i{i}", 0) for i in range(N)} - {("i7", 0), ("i8", 0)}, metric
    assert item_scores(cand, "s", "invalid")[("i9", 0)] == 1.0  # i9 is wrong in both: invalid
    b, c, dropped = paired_scores(base, cand, "s")
    assert dropped == 3 and set(b) == set(c) == {(f"i{i}", 0) for i in range(N)} - {("i5", 0), ("i7", 0), ("i8", 0)}
    assert b[("i1", 0)] == 1.0 and c[("i1", 0)] == 0.0
    b2, c2, _ = paired_scores(base, cand, "s", "truncated")
    assert b2[("i4", 0)] == 1.0 and c2[("i4", 0)] == 0.0
    assert accuracy_suites(base) == ["s", "dead"]  # every "dead" record errored: still listed
    assert accuracy_suites(cand) == ["s"]
    assert paired_scores(base, cand, "dead") == ({}, {}, 2)


def test_analysis_rows_deltas_and_tables():
    base, cand = _cell("base", _base()), _cell("cand", _cand())
    aa_items = [dict(r) for r in _base() if r["suite"] == "s"]
    aa_items[11] = _rec("s", 11, None, error="reset")  # the A/A rerun failed elsewhere: not an item-set change
    aa = _cell("base-aa", aa_items, aa=True)
    a = analyze([base, cand, aa], lambda c: None if c is base else base, baseline=base, n_boot=200)
    assert a.warnings == []  # errors on one side are not "item sets differ"

    row = {(r.cell.key, r.suite, r.metric): r for r in a.accuracy}
    rc = row[("cand", "s", "correct")]
    assert rc.n_errors == 2 and rc.error_rate == pytest.approx(2 / N)
    answered_ok = [ok for i, ok in enumerate(BASE_OK) if i not in (7, 8)]
    answered_ok[1] = answered_ok[2] = False
    assert rc.est.n == N - 2 and rc.est.mean == pytest.approx(sum(answered_ok) / (N - 2))
    assert rc.invalid_rate == pytest.approx(sum(not ok for ok in answered_ok) / (N - 2))
    rb = row[("base", "s", "correct")]
    assert rb.n_errors == 1 and rb.truncation_rate == pytest.approx(1 / (N - 1)) and rb.est.n == N - 1
    assert not any(r.suite == "dead" for r in a.accuracy)  # no answered record: no estimate

    (d,) = a.deltas
    assert d.n_error_pairs == 3 and d.d.n_pairs == N - 3 and not d.d.mismatched
    b, c, _ = paired_scores(base, cand, "s")
    ref = stats.paired_delta(b, c, n_boot=200)
    assert d.d.delta == pytest.approx(ref.delta) and d.d.delta == pytest.approx(-2 / (N - 3))
    assert (d.d.base_only, d.d.cand_only) == (2, 0)  # the failed requests are not lost items
    (aarow,) = a.aa
    assert aarow.n_error_pairs == 2 and aarow.d.n_pairs == N - 2 and aarow.output_agreement == 1.0

    t = accuracy_table(a)
    assert t.columns[-1] == "errors" and "answered" in t.note and "apart" in t.note
    by = {(r[0], r[1], r[2]): r for r in t.rows}
    assert by[("s", "correct", "cand")][-1] == "2 (10.0%)"
    assert by[("s", "correct", "base")][-1] == "1 (5.0%)"
    assert by[("dead", "correct", "base")][-1] == "2 (100.0%)" and by[("dead", "correct", "base")][5] == "—"
    dt = delta_table(a)
    assert dt.columns[-1] == "excluded (errors)" and dt.rows[0][-1] == "3" and "failed" in dt.note


def test_delta_table_without_errors_has_no_exclusion_column():
    clean = [_rec("s", i, BASE_OK[i]) for i in range(N)]
    base, cand = _cell("base", clean), _cell("cand", [dict(r) for r in clean])
    a = analyze([base, cand], lambda c: None if c is base else base, baseline=base, n_boot=200)
    assert a.deltas[0].n_error_pairs == 0 and a.accuracy[0].n_errors == 0 and a.accuracy[0].error_rate == 0.0
    assert "excluded (errors)" not in delta_table(a).columns
    assert accuracy_table(a).rows[0][-1] == "0"


def test_brief_and_eval_summary_show_errors_apart():
    from kvbench.harness.commands.eval_support import errors_text as _errors_text
    from kvbench.harness.runner import _brief

    s = summarize_records([_rec("s", 0, True), _rec("s", 1, False), _rec("s", 2, None, error="t/o")])
    assert _brief({"suites": {"gsm8k": s}}) == ": gsm8k 0.500 (1 error)"
    assert _brief({"suites": {"gsm8k": summarize_records([_rec("s", 0, True)])}}) == ": gsm8k 1.000"
    dead = summarize_records([_rec("s", 0, None, error="x"), _rec("s", 1, None, error="y")])
    assert _brief({"suites": {"gsm8k": dead}}) == ": gsm8k — (2 errors)"
    assert _errors_text(s) == "1 (33.3%: timeout 1)" and _errors_text({"n": 3}) == "-"
    assert _errors_text(summarize_records([_rec("s", 0, True)])) == "0"

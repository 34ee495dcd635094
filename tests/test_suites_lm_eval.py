"""The lm-eval bridge, and GSM8K prompts/scores identical to lm-eval's own gsm8k task.

lm-eval's installed ``gsm8k.yaml`` is copied with only its dataset pointed at the local JSONL files, run
through ``kvbench.suites.lm_eval_bridge`` against a scripted fake client, and compared with the native
``gsm8k`` suite on the same fake client: same prompts (few-shot sampling included), same scores.
"""

from __future__ import annotations

import os

from pathlib import Path

import pytest
import yaml

from kvbench.core.records import ITEM_FIELDS
from kvbench.core.io import prompt_hash
from kvbench.suites.base import SuiteOptions
from kvbench.suites.fake import FakeClient
from kvbench.suites.registry import run_suite, RunContext

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
LIMIT = 10

pytestmark = pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists() and not os.environ.get("CI"), reason="shared GSM8K data not present")


def _answers() -> dict[str, str]:
    import json

    rows = [json.loads(line) for line in (DATA / "gsm8k_test.jsonl").read_text().splitlines()[:LIMIT]]
    return {r["question"]: r["answer"].split("####")[-1].strip() for r in rows}


def _responder(req):
    """Deterministic, prompt-dependent outputs: strict-correct, flexible-only-correct, invalid, wrong."""
    question = req.prompt.rsplit("Question: ", 1)[-1].removesuffix("\nAnswer:")
    target = _answers()[question]
    kind = int(prompt_hash(req.prompt), 16) % 4
    if kind == 0:
        return f"Some work.\n#### {target}\n\nQuestion: leaked next question"
    if kind == 1:
        return f"I think it is ${target}.00 or maybe ${target}."
    if kind == 2:
        return "I do not know."
    return f"#### {int(target.replace(',', '')) + 1}"


@pytest.fixture(scope="module")
def local_task(tmp_path_factory) -> Path:
    from importlib.resources import files

    cfg = yaml.safe_load((files("lm_eval") / "tasks" / "gsm8k" / "gsm8k.yaml").read_text())
    cfg["task"] = "gsm8k_localcopy"
    cfg.pop("tag", None)
    cfg["dataset_path"] = "json"
    cfg.pop("dataset_name", None)
    cfg["dataset_kwargs"] = {"data_files": {"train": str(DATA / "gsm8k_train.jsonl"), "test": str(DATA / "gsm8k_test.jsonl")}}
    d = tmp_path_factory.mktemp("lmeval_tasks")
    (d / "gsm8k_localcopy.yaml").write_text(yaml.safe_dump(cfg))
    return d


def test_bridge_matches_native_gsm8k(local_task):
    opts = SuiteOptions(limit=LIMIT, data_dir=str(DATA), concurrency=3, progress=False)
    lm_client = FakeClient(responder=_responder)
    lm = run_suite("lm_eval:gsm8k_localcopy", lm_client, opts, RunContext(lm_eval_include=str(local_task)))
    native = run_suite("gsm8k", FakeClient(responder=_responder), opts)

    assert len(lm.records) == len(native.records) == LIMIT
    for a, b in zip(lm.records, native.records):
        assert set(a) == set(ITEM_FIELDS) | {"error", "error_kind", "request_options", "reasoning", "retries"} == set(b)  # error fields: None when answered
        assert a["error"] is None and b["error"] is None
        assert a["suite"] == "lm_eval:gsm8k_localcopy" and b["suite"] == "gsm8k"
        assert a["item_id"] == b["item_id"].removeprefix("test-")
        assert a["prompt_hash"] == b["prompt_hash"], "prompt (few-shot sampling) differs from lm-eval's"
        assert a["raw_output"] == b["raw_output"]  # stop strings applied the same way
        assert a["scores"]["exact_match,strict-match"] == b["scores"]["strict-match"]
        assert a["scores"]["exact_match,flexible-extract"] == b["scores"]["flexible-extract"]
        assert a["correct"] == b["correct"]
        assert a["protocol"].startswith("lm-eval-")
    kinds = {(r["scores"]["strict-match"], r["scores"]["flexible-extract"], r["invalid"]) for r in native.records}
    assert {(1.0, 1.0, False), (0.0, 1.0, True), (0.0, 0.0, True)} <= kinds, kinds  # every path exercised
    s = lm.summary
    assert s["n"] == LIMIT and "exact_match,strict-match" in s


def test_bridge_loglikelihood(tmp_path):
    """A tiny multiple-choice task: loglikelihood requests go through Client.score."""
    rows = [{"q": "ab", "choices": ["cd", "ef"], "label": 0}, {"q": "gh", "choices": ["ij", "kl"], "label": 1}]
    import json

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "task": "tiny_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{q}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    (tmp_path / "tiny_mc.yaml").write_text(yaml.safe_dump(cfg))
    client = FakeClient()
    res = run_suite("lm_eval:tiny_mc", client, SuiteOptions(progress=False), RunContext(lm_eval_include=str(tmp_path)))
    assert len(res.records) == 2
    for r, row in zip(res.records, rows):
        # the fake model's log-likelihoods decide the choice; recompute them independently
        from kvbench.core.client import ScoreRequest

        lls = [client.score(ScoreRequest(row["q"], " " + c)).total_logprob for c in row["choices"]]
        best = max(range(2), key=lambda i: lls[i])
        assert r["extracted"] == str(best)
        assert r["correct"] == (best == row["label"])
        assert r["finish_reason"] == "score"

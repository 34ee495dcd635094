"""The ruler suite end to end: scoring, records and summary through the suite runner, the ``kvbench eval``
options and the sweep configuration, on a scripted client (no model), and one slow run on the default model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.core.client import GenRequest, GenResult
from kvbench.harness.commands import eval as eval_cmd
from kvbench.suites.prompt_tokenizer import JsonPromptTokenizer
from kvbench.core.records import ITEM_FIELDS
from kvbench.harness.sweep.config import SweepConfigError, parse_config
from kvbench.suites.base import SuiteError, SuiteInputError, SuiteOptions
from kvbench.suites.registry import run_suite
from kvbench.suites.ruler.tasks import string_match_all
from kvbench.suites.ruler.words import ADJECTIVES, ESSAY, NOISE_LINE, NOUNS

RULER_FIELDS = ("task", "context_length", "context_tokens", "depth", "answers")
KVBENCH = str(Path(sys.executable).parent / "kvbench")


# ---------------------------------------------------------------------------------------- scorer
@pytest.mark.parametrize("output,answers,score", [
    ("", ["1234567"], 0.0),
    ("   \n", ["1234567"], 0.0),
    ("The number is 1234567.", ["1234567"], 1.0),
    ("(1234567)", ["1234567"], 1.0),
    ("1234567 1234567 1234567", ["1234567"], 1.0),  # repeating an answer counts it once
    ("12345678", ["1234567"], 0.0),  # inside a longer number: not found
    ("91234567", ["1234567"], 0.0),
    ("a1234567", ["1234567"], 0.0),
    ("id_1234567", ["1234567"], 1.0),  # underscore is a separator
    ("abcde, FGHIJ and klmno", ["ABCDE", "FGHIJ", "KLMNO", "PQRST"], 0.75),  # case-insensitive, partial
    ("OAKEN table, Oak tree", ["oak"], 1.0),
    ("an oaken table", ["oak"], 0.0),
    ("2, 3", ["1", "2", "3", "4"], 0.5),
    ("1 234 567", ["1234567"], 0.0),
])
def test_string_match_all(output, answers, score):
    got, found = string_match_all(output, answers)
    assert got == score
    assert len(found) == round(score * len(answers))


# ------------------------------------------------------------------------------ scripted client
def word_tokenizer() -> JsonPromptTokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [ESSAY, NOISE_LINE, " ".join(ADJECTIVES + NOUNS), "VAR Question Answer"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["<s>", "<unk>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return JsonPromptTokenizer(tok, "word-level")


def oracle(req: GenRequest) -> str:
    """The right answer, read from the prompt (niah: the asked keys' numbers; vt: the chain of the value)."""
    text = req.prompt if req.prompt is not None else req.messages[-1]["content"]
    m = re.search(r"magic numbers? for (.+?) mentioned in the provided text\?", text)
    if m:
        keys = re.split(r", and |, ", m.group(1))
        return " ".join(v for k in keys for v in re.findall(rf"for {re.escape(k)} is: (\d+)", text))
    value = re.search(r"assigned the value (\d+) in the text above", text).group(1)
    values = {}
    for dst, src in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", text):
        values[dst] = values.get(src[4:]) if src.startswith("VAR") else src
    return ", ".join(v for v, x in values.items() if x == value)


class ScriptedClient:
    def __init__(self, responder=oracle, max_model_len=None, with_tokenizer=True, kv_tokens=None):
        self.model_id = "scripted"
        self.kv_tokens = kv_tokens
        self._tok = word_tokenizer()
        self.responder = responder
        self.max_model_len = max_model_len
        self.requests: list[GenRequest] = []
        if not with_tokenizer:
            self.tokenizer = None

    def tokenizer(self):
        return self._tok

    def generate(self, req: GenRequest) -> GenResult:
        self.requests.append(req)
        return GenResult(self.responder(req), "stop", len(self._tok.prompt_ids(req)), 4, 0.01)

    def info(self) -> dict:
        return {"type": "scripted", "max_model_len": self.max_model_len, "capacity": {"tokens": self.kv_tokens}}

    def close(self) -> None:
        pass


def run(client, limit=1, **params):
    base = {"context_lengths": [512, 1024], "tasks": ["niah_single", "niah_multivalue", "vt"], "depths": 2}
    opts = SuiteOptions(limit=limit, concurrency=4, progress=False, extra={**base, **params})
    return run_suite("ruler", client, opts)


def test_records_carry_the_ruler_fields_and_the_summary_groups():
    res = run(ScriptedClient(), limit=2)
    # per length: niah_single 2 depths x 2 + niah_multivalue 2 x 2 + vt 2 = 10
    assert len(res.records) == 20
    for r in res.records:
        assert set(ITEM_FIELDS) <= set(r) and set(RULER_FIELDS) <= set(r)
        assert r["suite"] == "ruler" and r["correct"] is True and r["scores"] == {"ruler": 1.0}
        assert r["context_length"] - r["context_length"] // 100 <= r["context_tokens"] <= r["context_length"]
        assert r["prompt_tokens"] == r["context_tokens"]  # what the client saw
        assert r["target"] == ", ".join(r["answers"])
        assert re.fullmatch(rf"{r['task']}-L{r['context_length']}-d\d-\d", r["item_id"])
        assert (r["depth"] is None) == (r["task"] == "vt")
        assert r["protocol"].startswith("kvbench:ruler:v1:completion:haystack-auto:depths-n2:greedy")
    assert {r["depth"] for r in res.records if r["task"] == "niah_single"} == {0.0, 100.0}
    assert len({r["answers"][0] for r in res.records if r["task"] == "niah_single"}) == 8  # fresh needles per item
    s = res.summary
    assert s["accuracy"] == 1.0 and s["ruler"] == 1.0 and s["n"] == 20
    assert s["by_length"] == {"512": {"n": 10, "ruler": 1.0, "accuracy": 1.0}, "1024": {"n": 10, "ruler": 1.0, "accuracy": 1.0}}
    assert set(s["by_task"]) == {"niah_single", "niah_multivalue", "vt"}


def test_generation_budget_per_task():
    client = ScriptedClient()
    run(client)
    budgets = {}
    for req in client.requests:
        task = "vt" if "VAR" in (req.prompt or "") else "niah"
        budgets.setdefault(task, set()).add(req.params.max_tokens)
        assert req.params.temperature == 0.0
    # RULER's budgets (niah 128, vt 30), raised to the complete answer + 8 where that is longer
    assert budgets["niah"] == {128} and len(budgets["vt"]) == 1 and min(budgets["vt"]) >= 30
    res = run(ScriptedClient())
    assert all(r["answer_tokens"] <= 128 if r["task"] != "vt" else r["answer_tokens"] + 8 <= min(budgets["vt"])
               for r in res.records)
    client = ScriptedClient()
    res = run_suite("ruler", client, SuiteOptions(limit=1, progress=False, max_tokens=64,
                                                  extra={"context_lengths": [512], "tasks": ["vt"]}))
    assert {r.params.max_tokens for r in client.requests} == {64} and "max64" in res.records[0]["protocol"]
    # a budget that cannot hold the answer is refused before any request
    client = ScriptedClient()
    with pytest.raises(SuiteError, match="max_tokens 7 cannot hold a complete answer of task vt"):
        run_suite("ruler", client, SuiteOptions(limit=1, progress=False, max_tokens=7,
                                                extra={"context_lengths": [512], "tasks": ["vt"]}))
    assert not client.requests


def test_scores_follow_the_output():
    def half(req):  # the first two of the four multivalue numbers, nothing for the others
        return " ".join(oracle(req).split()[:2]) if "magic numbers for" in req.prompt else "I do not know"

    res = run(ScriptedClient(responder=half), tasks=["niah_single", "niah_multivalue"])
    by_task = res.summary["by_task"]
    assert by_task["niah_multivalue"]["ruler"] == 0.5 and by_task["niah_multivalue"]["accuracy"] == 0.0
    assert by_task["niah_single"]["ruler"] == 0.0
    assert all(r["invalid"] is False for r in res.records)


def test_same_prompts_in_every_cell():
    a, b = ScriptedClient(), ScriptedClient()
    ra, rb = run(a, limit=2), run(b, limit=2)
    key = lambda rs: {(r["item_id"], r["repeat"]): r["prompt_hash"] for r in rs}  # noqa: E731
    assert key(ra.records) == key(rb.records)


def test_context_and_tokenizer_errors():
    with pytest.raises(SuiteInputError, match="exceeds the target's context of 1000"):
        run(ScriptedClient(max_model_len=1000))
    with pytest.raises(SuiteInputError, match="needs 1152 tokens of KV cache but the target's cache holds 1100"):
        run(ScriptedClient(max_model_len=8192, kv_tokens=1100))
    assert run(ScriptedClient(max_model_len=1152, kv_tokens=1152)).summary["n"] == 10
    with pytest.raises(SuiteInputError, match="this client offers none; pass --tokenizer"):
        run(ScriptedClient(with_tokenizer=False))
    with pytest.raises(SuiteError, match="unknown task 'needle'"):
        run(ScriptedClient(), tasks=["needle"])


# ------------------------------------------------------------------------------------------ CLI
@pytest.fixture
def scripted(monkeypatch):
    clients = []

    def open_client(engine, endpoint):
        clients.append(ScriptedClient())
        return clients[-1]

    monkeypatch.setattr(eval_cmd, "_open_client", open_client)
    return clients


def test_eval_cli_writes_ruler_records(scripted, tmp_path):
    out = tmp_path / "o"
    r = CliRunner().invoke(app, ["eval", "--suite", "ruler", "--context-lengths", "512,1k", "--ruler-tasks", "niah_single,vt",
                                 "--depths", "3", "--limit", "1", "--prompt-style", "completion", "--no-progress",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    recs = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    assert len(recs) == 2 * (3 + 1)
    assert {r["context_length"] for r in recs} == {512, 1024} and all(set(RULER_FIELDS) <= set(r) for r in recs)
    summary = json.loads((out / "summary.json").read_text())["suites"]["ruler"]
    assert summary["accuracy"] == 1.0 and set(summary["by_length"]) == {"512", "1024"}


@pytest.mark.parametrize("argv,needle", [
    (["--suite", "gsm8k", "--context-lengths", "1024"], "--context-lengths applies to --suite ruler only"),
    (["--suite", "gsm8k", "--ruler-tasks", "vt"], "--ruler-tasks applies to --suite ruler only"),
    (["--suite", "ruler", "--depths", "0"], "between 1 and 101"),
    (["--suite", "ruler", "--depths", "20,120"], "[0, 100]"),
    (["--suite", "ruler", "--ruler-tasks", "niah,vt"], "unknown task 'niah'"),
    (["--suite", "ruler", "--context-lengths", "1024,big"], "'big'"),
    (["--suite", "ruler", "--haystack-file", "/nonexistent/book.txt"], "does not exist"),
    (["--suite", "ruler", "--prompt-style", "raw"], "choose one of"),
    (["--suite", "ruler", "--tokenizer", "gpt2"], "--tokenizer applies to --endpoint only"),
])
def test_eval_cli_bad_ruler_options_exit_2(scripted, argv, needle):
    r = CliRunner().invoke(app, ["eval", *argv, "--no-progress"])
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert not scripted  # refused before any client was opened


def test_eval_cli_length_below_minimum_is_a_usage_error(scripted, tmp_path):
    r = CliRunner().invoke(app, ["eval", "--suite", "ruler", "--context-lengths", "64", "--ruler-tasks", "niah_single",
                                 "--no-progress", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert "context length 64 is below the minimum of task niah_single" in r.output
    assert not (tmp_path / "o" / "items.jsonl").exists()


# ---------------------------------------------------------------------------------------- sweep
BASE = {"name": "t", "engine": {"device": "cpu"}, "axes": {"backends": ["torch"], "kv": ["bf16"], "concurrency": [1]},
        "baseline": {"kv_dtype": "bf16"}}


def test_sweep_config_takes_ruler_params(tmp_path):
    hay = tmp_path / "book.txt"
    hay.write_text(ESSAY)
    params = {"context_lengths": [1024, 4096], "depths": 3, "tasks": ["niah_single", "vt"], "haystack_file": str(hay),
              "prompt_style": "chat"}
    cfg = parse_config({**BASE, "suites": [{"name": "ruler", "limit": 2, "params": params}],
                        "gate": {"metrics": ["ruler:L4096"]}})
    (spec,) = cfg.suites
    assert spec.name == "ruler" and spec.limit == 2 and spec.params == params


def test_sweep_cell_runs_the_ruler_suite_with_its_params():
    from types import SimpleNamespace

    from kvbench.harness.cell_work import DefaultWork

    params = {"context_lengths": ["1k"], "depths": [25, 75], "tasks": ["niah_multikey", "vt"], "prompt_style": "completion"}
    cfg = parse_config({**BASE, "suites": [{"name": "ruler", "limit": 2, "params": params}]})
    records, summary = DefaultWork(cfg).suite(cfg.suites[0], ScriptedClient(), SimpleNamespace(concurrency=2), None)
    assert len(records) == 2 * 2 + 2 and summary["accuracy"] == 1.0
    assert {r["depth"] for r in records} == {25.0, 75.0, None} and {r["context_length"] for r in records} == {1024}
    assert ":depths-at25-75:" in records[0]["protocol"]


@pytest.mark.parametrize("params,needle", [
    ({"depths": 0}, "suites[0].params.depths: the number of depths must be between 1 and 101"),
    ({"depths": [50, 150]}, "suites[0].params.depths"),
    ({"tasks": ["vt", "qa"]}, "suites[0].params.tasks: unknown task 'qa'"),
    ({"context_lengths": "many"}, "suites[0].params.context_lengths"),
    ({"haystack_file": "/nonexistent/book.txt"}, "suites[0].params.haystack_file: /nonexistent/book.txt does not exist"),
    ({"length": 4096}, "suites[0].params.length: unknown option"),
])
def test_sweep_config_rejects_bad_ruler_params(params, needle):
    with pytest.raises(SweepConfigError) as e:
        parse_config({**BASE, "suites": [{"name": "ruler", "params": params}]})
    assert needle in str(e.value)


# ------------------------------------------------------------------------------ the default model
@pytest.mark.slow
def test_eval_ruler_on_the_default_model(tmp_path):
    out = tmp_path / "o"
    p = subprocess.run([KVBENCH, "eval", "--suite", "ruler", "--context-lengths", "256,512", "--ruler-tasks", "niah_single,vt",
                        "--depths", "1", "--limit", "1", "--no-progress", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    assert sorted(r["item_id"] for r in recs) == ["niah_single-L256-d0-0", "niah_single-L512-d0-0", "vt-L256-d0-0", "vt-L512-d0-0"]
    for r in recs:
        assert set(ITEM_FIELDS) <= set(r) and set(RULER_FIELDS) <= set(r)
        assert r["prompt_tokens"] == r["context_tokens"]  # the engine saw exactly the fitted prompt
        assert r["context_length"] - r["context_length"] // 100 <= r["context_tokens"] <= r["context_length"]
        assert 0.0 <= r["scores"]["ruler"] <= 1.0 and r["finish_reason"] in ("stop", "length")
        assert ":chat:" in r["protocol"]  # the default model has a chat template
    summary = json.loads((out / "summary.json").read_text())["suites"]["ruler"]
    assert set(summary["by_length"]) == {"256", "512"} and set(summary["by_task"]) == {"niah_single", "vt"}

"""``prompt_style`` of gpqa_diamond and aime: the exact chat prompts of the gpt-oss evals and simple-evals, and
their answer extraction on fixed texts (suites/eval_styles.py)."""

from __future__ import annotations

import csv
import json
import re

import pytest

from kvbench.suites.base import SuiteError, SuiteOptions
from kvbench.suites.eval_styles import extract_abcd_gpt_oss, extract_answer_simple_evals, extract_boxed_gpt_oss
from kvbench.suites.fake import FakeClient
from kvbench.suites.registry import run_suite


@pytest.mark.parametrize("text,letter", [
    ("**Answer:** C", "C"),
    ("(A) looks wrong.\nAnswer: D", "D"),  # a line starting with "Answer" outranks the earlier "(A)"
    ("answer: because", "B"),  # the grader's line pattern takes the "b" of "because"
    ("The answer is (B).", "B"),
    ("Answers – d", "D"),
    ("I pick option c.", "C"),
    ("Both (A) and (C) look plausible", "A"),  # the first bare "(X)"
    ("\\boxed{\\text{A } 2.08\\times10^{-6}}", "A"),
    ("so **B** it is", "B"),
    ("**D) the third one**", "D"),
    ("C", "C"),
    ("**D", "D"),
    ("Dunno", "D"),  # a line starting with a capital letter A-D counts
    ("Thinking about it, none fit.", None),  # last resort: the first character, here no letter
    ("", None),
])
def test_gpt_oss_abcd_grader(text, letter):
    assert extract_abcd_gpt_oss(text) == letter


@pytest.mark.parametrize("text,letter", [
    ("Reasoning...\nAnswer: B", "B"),
    ("answer: $c$", "c"),  # case kept: graded wrong against "C"
    ("Answer:(A)", None),
    ("The Answer : D, not Answer: A", "D"),  # the first match
    ("no letter", None),
])
def test_simple_evals_answer_pattern(text, letter):
    assert extract_answer_simple_evals(text) == letter


@pytest.mark.parametrize("text,answer", [
    ("so \\boxed{204}", "204"),
    ("\\boxed{1} then \\boxed{ 33 }", "33"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1"),  # up to the first closing brace
    ("\\boxed{1,204}", "204"),
    ("\\boxed{} and 17 apples, 25 pears", "25"),  # an empty box is skipped; then the last integer
    ("\\framebox{12}", "12"),
    ("nothing", ""),
])
def test_gpt_oss_aime_extraction(text, answer):
    assert extract_boxed_gpt_oss(text) == answer


def _gpqa(d):
    rows = [{"Record ID": f"r{i}", "Question": f"What is item {i}? ", "Correct Answer": f"right {i}",
             "Incorrect Answer 1": f"wrong {i}a", "Incorrect Answer 2": f"wrong {i}b", "Incorrect Answer 3": f"wrong {i}c"}
            for i in range(3)]
    with (d / "gpqa_diamond.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _client(seen, answer):
    def respond(req):
        seen.append(req)
        return answer(req.messages[0]["content"])

    return FakeClient(responder=respond)


def test_gpqa_gpt_oss_prompt_and_grading(tmp_path):
    _gpqa(tmp_path)
    seen = []

    def answer(content):  # markdown-wrapped, as gpt-oss models often write it
        return "**Answer:** " + re.search(r"^\(([ABCD])\) right", content, flags=re.M).group(1)

    opts = SuiteOptions(data_dir=str(tmp_path), repeats=2, progress=False, extra={"prompt_style": "gpt_oss"})
    res = run_suite("gpqa_diamond", _client(seen, answer), opts)
    assert res.summary["accuracy"] == 1.0 and len(res.records) == 6
    content = seen[0].messages[0]["content"]
    rec = next(r for r in res.records if r["item_id"] == "r0" and r["repeat"] == 0)
    letters = "ABCD"
    shown = [f"({L}) " for L in letters]
    assert content.startswith("What is item 0? \n\n(A) ")  # the question verbatim (trailing space kept)
    assert content.endswith("\n\nExpress your final answer as the corresponding option 'A', 'B', 'C', or 'D'.")
    assert [line[:4] for line in content.split("\n")[2:6]] == shown
    assert f"({rec['target']}) right 0" in content and len(seen[0].messages) == 1
    p = seen[0].params
    assert (p.temperature, p.max_tokens) == (1.0, 32768)  # the gpt-oss evals' defaults
    assert rec["protocol"].startswith("gpt-oss:gpqa_diamond:abcd-grader:")


def test_gpqa_simple_evals_prompt_and_grading(tmp_path):
    _gpqa(tmp_path)
    seen = []
    opts = SuiteOptions(data_dir=str(tmp_path), progress=False, extra={"prompt_style": "simple_evals"})
    res = run_suite("gpqa_diamond", _client(seen, lambda c: "Answer: a"), opts)  # lower case: never right
    assert res.summary["accuracy"] == 0.0 and res.summary["invalid_rate"] == 0.0
    content = seen[0].messages[0]["content"]
    assert content.startswith("Answer the following multiple choice question. The last line of your response should be of "
                              "the following format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think "
                              "step by step before answering.\n\nWhat is item 0? \n\nA) ")
    assert re.fullmatch(r"(?s).*\n\nA\) [^\n]+\nB\) [^\n]+\nC\) [^\n]+\nD\) [^\n]+", content)
    with pytest.raises(SuiteError, match="prompt_style 'nope'"):
        run_suite("gpqa_diamond", FakeClient(), SuiteOptions(data_dir=str(tmp_path), progress=False, extra={"prompt_style": "nope"}))


def test_aime_gpt_oss_prompt_and_grading(tmp_path):
    rows = [{"question": "Find x.", "answer": "33"}, {"question": "Find y.", "answer": "204"}]  # opencompass columns
    (tmp_path / "aime25.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []
    replies = {"Find x.": "x is 33 after all", "Find y.": "\\boxed{\\frac{204}{1}}"}
    opts = SuiteOptions(data_dir=str(tmp_path), progress=False, extra={"prompt_style": "gpt_oss"})
    res = run_suite("aime25", _client(seen, lambda c: replies[c.strip().split("\n")[0]]), opts)
    assert seen[0].messages[0]["content"] in ("\nFind x.\nPlease reason step by step, and put your final answer within \\boxed{}.\n",
                                              "\nFind y.\nPlease reason step by step, and put your final answer within \\boxed{}.\n")
    by_id = {r["item_id"]: r for r in res.records}
    # no box: the last integer (33, right); "\frac{204" is no integer: invalid
    assert (by_id["0"]["correct"], by_id["0"]["extracted"]) == (True, "33")
    assert (by_id["1"]["correct"], by_id["1"]["invalid"], by_id["1"]["extracted"]) == (False, True, "\\frac{204")
    assert (seen[0].params.temperature, seen[0].params.top_p, seen[0].params.max_tokens) == (1.0, 1.0, 32768)
    # the default style still wants a box
    res = run_suite("aime25", _client([], lambda c: replies[c.split("\n")[0]]), SuiteOptions(data_dir=str(tmp_path), progress=False))
    assert {r["item_id"]: r["invalid"] for r in res.records} == {"0": True, "1": False}

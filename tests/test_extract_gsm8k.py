"""GSM8K extraction and scoring: agreement with lm-eval's own filter and metric on adversarial outputs."""

from __future__ import annotations

import pytest

from kvbench.suites.extract import (
    GSM8K_COT_STRICT,
    GSM8K_FLEXIBLE,
    GSM8K_IGNORE,
    GSM8K_STRICT,
    INVALID,
    clean_number,
    exact_match,
    extract_answer_line,
    gsm8k_target,
    last_number,
    numbers_equal,
    regex_filter,
)

OUTPUTS = [
    "She has 3 + 4 = 7 apples.\n#### 7",
    "#### 1,234",
    "#### -5\nQuestion: next",
    "The total is $1,000.50 so\n#### $1,000.50",
    "#### 18.\n#### 19",  # several answers: take_first
    "no number here at all",
    "",
    "The answer is 42.",
    "The answer is -3,000 and then 12",
    "answer is 9.",
    "It costs $5. Then 10 more, so 15.",
    "x = 2.5, y = -0.75",
    "... 1,2,3 ... 4",
    "The answer is 7",  # cot strict needs one more character after the number
    "####18",  # no space: strict fails
    "#### .5",
    "-",
    "5",
    "A) 12 B) 13\nThe answer is 13.\n\nQ: what",
]
PATTERNS = [(GSM8K_STRICT, 0), (GSM8K_COT_STRICT, 0), (GSM8K_FLEXIBLE, -1)]


@pytest.mark.parametrize("pattern,group", PATTERNS)
def test_regex_filter_matches_lm_eval(pattern, group):
    from lm_eval.filters.extraction import RegexFilter

    ref = RegexFilter(regex_pattern=pattern, group_select=group)
    expected = [r[0] for r in ref.apply([[o] for o in OUTPUTS], [{}] * len(OUTPUTS))]
    assert [regex_filter(o, pattern, group) for o in OUTPUTS] == expected


def test_exact_match_matches_lm_eval():
    from lm_eval.api.metrics import exact_match_hf_evaluate

    preds = [regex_filter(o, GSM8K_FLEXIBLE, -1) for o in OUTPUTS] + ["$1,000", "1000.", "1000.0", INVALID, "18"]
    refs = ["7", "1,234", "-5", "1000.50", "18", "3", "0", "42", "12", "9", "15", "-0.75", "4", "7", "18", "0.5", "1", "5", "13"] + ["1000"] * 3 + ["5", "18"]
    assert len(preds) == len(refs)
    for p, r in zip(preds, refs):
        want = exact_match_hf_evaluate([p], ["blah\n#### " + r], regexes_to_ignore=list(GSM8K_IGNORE), ignore_case=True)["exact_match"]
        assert exact_match(p, r) == bool(want), (p, r)
        assert exact_match(p, "blah\n#### " + r) == bool(want), (p, r)


def test_strict_and_flexible_specifics():
    assert regex_filter("#### 1,234", GSM8K_STRICT) == "1,234"
    assert exact_match("1,234", "1234")
    assert regex_filter("so #### 18.\n#### 19", GSM8K_STRICT) == "18."
    assert exact_match("18.", "18")  # trailing period ignored, as in lm-eval
    assert not exact_match("1000.0", "1000")  # lm-eval compares strings: 1000.0 != 1000
    assert regex_filter("The answer is 42.", GSM8K_COT_STRICT) == "42"
    assert regex_filter("The answer is 7", GSM8K_COT_STRICT) == INVALID
    assert regex_filter("we get -3 then $1,000.", GSM8K_FLEXIBLE, -1) == "$1,000."
    assert regex_filter("nothing", GSM8K_FLEXIBLE, -1) == INVALID


def test_gsm8k_target():
    assert gsm8k_target("a\nb <<2*3=6>>6\n#### 6") == "6"
    assert gsm8k_target("x #### 1,000") == "1,000"
    with pytest.raises(ValueError):
        gsm8k_target("no marker")


@pytest.mark.parametrize(
    "text,want",
    [
        ("$1,234.50", "1234.5"),
        ("-3.", "-3"),
        ("007", "7"),
        ("-0.0", "0"),
        ("1,000,000", "1000000"),
        ("about -12 dollars", "-12"),
        ("none", None),
    ],
)
def test_clean_number(text, want):
    assert clean_number(text) == want


def test_answer_line_and_last_number():
    text = "Step 1: 3 + 4 = 7\nAnswer: 6 (wrong)\nLet me recheck.\nFinal answer: $1,200\nDone in 2 steps"
    assert extract_answer_line(text) == "1200"  # the last answer line, not the last number
    assert last_number(text) == "2"
    assert extract_answer_line("**Answer:** -15") == "-15"
    assert extract_answer_line("The answer is 9") == "9"
    assert extract_answer_line("no final line 12") is None
    assert extract_answer_line("Answer: none") is None
    assert numbers_equal("1,200", "1200.00")
    assert not numbers_equal("12", "1200")
    assert not numbers_equal(None, "3")

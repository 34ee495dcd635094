"""Boxed-answer (AIME) and multiple-choice letter (GPQA) extraction on adversarial strings."""

from __future__ import annotations

import pytest

from kvbench.suites.extract import extract_boxed, extract_choice, parse_int_answer


@pytest.mark.parametrize(
    "text,want",
    [
        (r"so the answer is \boxed{25}.", "25"),
        (r"first \boxed{3} then corrected: \boxed{204}", "204"),  # last box wins
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{\text{{a}{b}}} tail", r"\text{{a}{b}}"),
        (r"\fbox{7}", "7"),
        (r"\boxed {  42 }", "42"),
        (r"\boxed 42.", "42"),
        (r"complete \boxed{5} then an unclosed \boxed{6", "5"),  # an unbalanced last box is skipped
        (r"\boxed{a \{ b \} c}", r"a \{ b \} c"),  # escaped braces do not count
        ("no box here, answer 12", None),
        (r"\boxed{", None),
        ("", None),
    ],
)
def test_extract_boxed(text, want):
    assert extract_boxed(text) == want


@pytest.mark.parametrize(
    "text,want",
    [
        ("025", 25),
        ("25", 25),
        ("1,000", 1000),
        ("33.0", 33),
        (r"\text{ 7 }", 7),
        ("x = 12", 12),
        ("-4", -4),
        (r"100^\circ", 100),
        (r"\$50", 50),
        (r"\frac{1}{2}", None),
        ("2.5", None),
        ("3, 4", None),
        ("12 or 13", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_int_answer(text, want):
    assert parse_int_answer(text) == want


@pytest.mark.parametrize(
    "text,want,how",
    [
        ("Reasoning...\nAnswer: B", "B", "answer"),
        ("Answer: (B)", "B", "answer"),
        ("so the answer is B.", "B", "answer"),
        ("The correct answer is (C) because ...", "C", "answer"),
        ("Answer: A\nWait, that is wrong.\nAnswer: D", "D", "answer"),  # several answers: the last
        ("**Answer:** C", "C", "answer"),
        ("ANSWER: d is lowercase so not a letter\nAnswer: d", None, None),  # only capital letters
        (r"Therefore \boxed{C}", "C", "boxed"),
        (r"\boxed{\text{A}}", "A", "boxed"),
        ("I will go with **B**.", "B", "bold"),
        ("Thinking about it.\n(C)\n", "C", "line"),
        ("Thinking.\nD.\n", "D", "line"),
        ("Option (A) is wrong, so I pick (A)", "A", "paren"),
        ("(A) is wrong and (B) is also wrong", None, None),  # ambiguous: never a guess
        ("Answer: Both options fail", None, None),
        ("A bit of thought: the answer depends", None, None),
        ("The answer is E", None, None),  # outside the four letters
        ("", None, None),
    ],
)
def test_extract_choice(text, want, how):
    assert extract_choice(text) == (want, how)


def test_choice_rank_order():
    # an explicit answer line beats a boxed letter, which beats bold, which beats a lone letter line
    assert extract_choice("**A**\n\\boxed{B}\nAnswer: C") == ("C", "answer")
    assert extract_choice("**A**\n\\boxed{B}\nD") == ("B", "boxed")
    assert extract_choice("C\n**A**") == ("A", "bold")

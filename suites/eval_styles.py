"""Prompts and answer extraction of public eval harnesses, for the ``prompt_style`` suite param.

``gpt_oss``: the gpt-oss evals (github.com/openai/gpt-oss, ``gpt_oss/evals``): GPQA asks for the option letter
after "(A) ..." choices and grades with its ranked ABCD grader (markdown, LaTeX and bare-letter patterns, the
first pattern that matches anywhere wins, else the reply's first character after a leading ``**``); AIME wraps
the problem in newlines, asks for a boxed answer and takes the last non-empty ``boxed{...}`` /
``framebox{...}`` (up to its first ``}``, the part after its last comma), else the last integer of the reply,
compared as an integer.
``simple_evals``: simple-evals (github.com/openai/simple-evals) GPQA: the "Answer: $LETTER" instruction and
the first ``Answer: X`` match (case kept: a lower-case letter is wrong).

The graders here reproduce those semantics (tests/test_request_options_styles.py checks them on fixed texts).
"""

from __future__ import annotations

import re
from typing import Optional

from kvbench.suites.base import SuiteError, SuiteOptions


def chosen_style(opts: SuiteOptions, styles: dict, suite: str) -> str:
    """The suite's ``prompt_style`` param (default ``kvbench``), checked against ``styles``."""
    style = (opts.extra or {}).get("prompt_style", "kvbench")
    if style not in styles:
        raise SuiteError(f"{suite}: prompt_style {style!r} is not one of: {', '.join(styles)}")
    return style

# ------------------------------------------------------------------------------------------- GPQA
GPT_OSS_GPQA_TEMPLATE = "{question}\n\n(A) {A}\n(B) {B}\n(C) {C}\n(D) {D}\n\nExpress your final answer as the corresponding option 'A', 'B', 'C', or 'D'."
SIMPLE_EVALS_GPQA_TEMPLATE = (
    "Answer the following multiple choice question. The last line of your response should be of the following "
    "format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by step before answering."
    "\n\n{question}\n\nA) {A}\nB) {B}\nC) {C}\nD) {D}"
)


def gpqa_prompt(template: str, question: str, choices: list[str]) -> str:
    a, b, c, d = choices
    return template.format(question=question, A=a, B=b, C=c, D=d)


_WRAP = r"(?:\*{1,2}|_{1,2})"  # markdown emphasis: * ** _ __
_SEP = "[:\\-\u2013]"  # ':' '-' or an en dash
_NOT_WORD_BEFORE, _NOT_WORD_AFTER = r"(?<![A-Za-z0-9])", r"(?![A-Za-z0-9])"
# ranked: the first pattern (in this order) that matches anywhere in the reply gives the letter
_ABCD_PATTERNS = [
    re.compile(rf"{_WRAP}answers?\s*{_SEP}?{_WRAP}\s*([abcd])\b", re.I),  # **Answer:** C
    re.compile(rf"^\s*{_WRAP}?answer:?{_WRAP}?\s*:?\s*{_WRAP}?([abcd]){_WRAP}?\s*", re.I | re.M),  # line "Answer: C"
    re.compile(rf"\banswers?\b\s*{_SEP}?\s*\(\s*([abcd])\s*\)", re.I),  # Answer: (C)
    re.compile(rf"\banswers?\b\s*{_SEP}?\s*([abcd])\b", re.I),  # Answer - C
    re.compile(rf"\b(?:option|choice)\b\s*{_SEP}?\s*([abcd])\b", re.I),  # Option C, choice: c
    re.compile(r"\\boxed\{[^}]*?([ABCD])[^}]*\}"),  # \boxed{C}, \boxed{\text{C } ...}
    re.compile(r"\\boxed\{[^}]*?\\textbf\{[^}]*?([ABCD])[^}]*\}[^}]*\}"),
    re.compile(r"\\boxed\{[^}]*?\\text\{[^}]*?([ABCD])[^}]*\}[^}]*\}"),
    re.compile(rf"{_NOT_WORD_BEFORE}[(\[]\s*([ABCD])\s*[)\]]{_NOT_WORD_AFTER}"),  # (C) [C]
    re.compile(rf"{_NOT_WORD_BEFORE}{_WRAP}([ABCD]){_WRAP}{_NOT_WORD_AFTER}"),  # **C**
    re.compile(r"\\textbf\{[^}]*?([ABCD])[^}]*\}"),
    re.compile(rf"{_NOT_WORD_BEFORE}{_WRAP}\s*([ABCD])\)[^*_\n]+?{_WRAP}{_NOT_WORD_AFTER}"),  # **C) text**
    re.compile(rf"^\s*{_WRAP}?([ABCD]){_WRAP}?\s*[.)\-\u2013:]?\s*.*$", re.M),  # a line starting with the letter
]


def extract_abcd_gpt_oss(text: str) -> Optional[str]:
    """The gpt-oss GPQA grader's letter, or None where its answer is no letter A-D."""
    for pattern in _ABCD_PATTERNS:
        m = pattern.search(text)
        if m:
            return m.group(1).upper()
    first = text[2:3] if text.startswith("**") else text[:1]  # the grader's last resort: the first character
    return first if first in ("A", "B", "C", "D") else None


_SIMPLE_EVALS_ANSWER = re.compile(r"(?i)Answer[ \t]*:[ \t]*\$?([A-D])\$?")


def extract_answer_simple_evals(text: str) -> Optional[str]:
    """simple-evals' multiple-choice answer: the first ``Answer: X`` (letter case as written), else None."""
    m = _SIMPLE_EVALS_ANSWER.search(text)
    return m.group(1) if m else None


# ------------------------------------------------------------------------------------------- AIME
GPT_OSS_AIME_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}.\n"


def gpt_oss_aime_prompt(problem: str) -> str:
    return "\n" + problem + GPT_OSS_AIME_SUFFIX


_BOXED_LAZY = re.compile(r"boxed{(.*?)}|framebox{(.*?)}", re.S)
_DIGITS = re.compile(r"\d+")


def extract_boxed_gpt_oss(text: str) -> str:
    """The gpt-oss AIME grader's answer text ('' when the reply has neither a box nor a number)."""
    for m in reversed(list(_BOXED_LAZY.finditer(text))):
        inner = m.group(1) or m.group(2)
        if inner:
            return inner.split(",")[-1].strip()
    numbers = _DIGITS.findall(text)
    return numbers[-1] if numbers else ""


def int_or_none(text: Optional[str]) -> Optional[int]:
    """``int(text)`` as the gpt-oss grader converts it, None when that fails."""
    try:
        return int(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None

"""Answer extraction and scoring (pure functions, no model, no torch).

GSM8K follows lm-eval's ``gsm8k`` / ``gsm8k_cot`` tasks exactly (lm-eval 0.4.x task YAMLs): a regex
filter with ``take_first``, then ``exact_match`` with ``ignore_case`` and the ``regexes_to_ignore``
``[",", "\\$", "(?s).*#### ", "\\.$"]`` applied to prediction and reference alike.  AIME takes the last
``\\boxed{}`` / ``\\fbox{}`` with balanced braces and compares integers.  GPQA tries a ranked list of
patterns for the chosen letter and reports ``None`` (invalid) rather than guess.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

INVALID = "[invalid]"  # lm-eval's regex-filter fallback

# ---------------------------------------------------------------------------- lm-eval GSM8K
GSM8K_STRICT = r"#### (\-?[0-9\.\,]+)"
GSM8K_COT_STRICT = r"The answer is (\-?[0-9\.\,]+)."
GSM8K_FLEXIBLE = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"
GSM8K_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")


def regex_filter(text: str, pattern: str, group_select: int = 0, fallback: str = INVALID) -> str:
    """lm-eval's ``RegexFilter``: ``findall``, pick ``group_select`` (negative = from the end), take the
    first non-empty group of a multi-group match, strip; ``fallback`` when nothing matches."""
    if not isinstance(text, str):
        text = ""
    found = re.findall(pattern, text)
    if not found:
        return fallback
    m = found[group_select]
    if isinstance(m, tuple):
        nonempty = [g for g in m if g]
        if not nonempty:
            return fallback
        m = nonempty[0]
    return m.strip()


def normalize_exact(text: str, regexes_to_ignore: Sequence[str] = GSM8K_IGNORE, ignore_case: bool = True) -> str:
    for pat in regexes_to_ignore:
        text = re.sub(pat, "", text)
    return text.lower() if ignore_case else text


def exact_match(pred: str, ref: str, regexes_to_ignore: Sequence[str] = GSM8K_IGNORE) -> bool:
    """lm-eval ``exact_match`` with the GSM8K options (``ignore_case``, ``regexes_to_ignore``)."""
    return normalize_exact(pred, regexes_to_ignore) == normalize_exact(ref, regexes_to_ignore)


def gsm8k_target(answer: str) -> str:
    """The number after ``####`` in a GSM8K reference solution (commas kept; scoring strips them)."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####' line: {answer[-80:]!r}")
    return answer.split("####")[-1].strip()


# ------------------------------------------------------------------------ numbers / chat answer
_ANSWER_LINE = re.compile(r"(?im)^\W*(?:the\s+)?(?:final\s+)?answer\s*(?:is)?\s*[:：]?\s*\**\s*(.+?)\s*$")
_NUMBER = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?")


def clean_number(text: Optional[str]) -> Optional[str]:
    """``"$1,234.50"`` → ``"1234.5"``; ``"-3."`` → ``"-3"``; None when ``text`` holds no number."""
    if text is None:
        return None
    m = _NUMBER.search(text)
    if not m:
        return None
    s = m.group(0).replace("$", "").replace(",", "").replace(" ", "")
    neg = s.startswith("-")
    s = s.lstrip("-")
    whole, _, frac = s.partition(".")
    out = (whole.lstrip("0") or "0") + ("." + frac.rstrip("0") if frac.rstrip("0") else "")
    return "-" + out if neg and out != "0" else out


def numbers_equal(a: Optional[str], b: Optional[str]) -> bool:
    ca, cb = clean_number(a), clean_number(b)
    if ca is None or cb is None:
        return False
    try:
        return abs(float(ca) - float(cb)) < 1e-9 * max(1.0, abs(float(cb)))
    except ValueError:
        return ca == cb


def extract_answer_line(text: str) -> Optional[str]:
    """The number on the last ``Answer: N`` line (chat protocol), None when there is none."""
    for m in reversed(list(_ANSWER_LINE.finditer(text or ""))):
        num = clean_number(m.group(1))
        if num is not None:
            return num
    return None


def last_number(text: str) -> Optional[str]:
    found = _NUMBER.findall(text or "")
    return clean_number(found[-1]) if found else None


# ------------------------------------------------------------------------------- boxed answers
_BOX = re.compile(r"\\(?:boxed|fbox)\b")


def _balanced(text: str, open_at: int) -> Optional[str]:
    depth = 0
    for i in range(open_at, len(text)):
        c = text[i]
        if c == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif c == "}" and (i == 0 or text[i - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None  # unbalanced: the box never closed


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces) or ``\\boxed N``."""
    text = text or ""
    for m in reversed(list(_BOX.finditer(text))):
        j = m.end()
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            inner = _balanced(text, j)
            if inner is not None:
                return inner.strip()
        elif j > m.end():  # "\boxed 42" form
            tok = re.match(r"[^\s$]+", text[j:])
            if tok:
                return tok.group(0).rstrip(".")
    return None


_LATEX_NOISE = re.compile(r"\\text\{([^{}]*)\}|\\mathrm\{([^{}]*)\}|\\!|\\,|\\;|\^\{?\\circ\}?|\\%|%|\\?\$")


def parse_int_answer(text: Optional[str]) -> Optional[int]:
    """An integer from a boxed answer: ``"025"`` → 25, ``"1,000"`` → 1000, ``"33.0"`` → 33, ``"\\text{ 7 }"``
    → 7; None for anything that is not a single integer (fractions, expressions, several numbers)."""
    if text is None:
        return None
    s = _LATEX_NOISE.sub(lambda m: m.group(1) or m.group(2) or "", text)
    s = s.replace(",", "").replace("{", "").replace("}", "").strip()
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 25"
    m = re.fullmatch(r"([+-]?\d+)(?:\.0*)?", s)
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------------------ letter choices
def _letter_patterns(letters: str) -> list[tuple[str, re.Pattern]]:
    L = f"[{letters}]"
    end = r"(?![A-Za-z0-9])"
    return [
        ("answer", re.compile(rf"(?i:answer)\s*(?:(?i:is)\s*)?[:：]?\s*[*_]*\s*[\(\[]?\s*({L})\s*[\)\]]?{end}")),
        ("boxed", re.compile(rf"\\boxed\{{\s*(?:\\text\{{)?\s*\(?({L})\)?\s*\}}?\s*\}}")),
        ("bold", re.compile(rf"\*\*\s*\(?({L})\)?[.:)]?\s*\*\*")),
        ("line", re.compile(rf"(?m)^\s*[\(\[]?({L})[\)\]]?[.:]?\s*$")),
    ]


def extract_choice(text: str, letters: str = "ABCD") -> tuple[Optional[str], Optional[str]]:
    """(letter, pattern name) by the first pattern in rank order that matches, taking its last match:
    ``Answer: X`` / ``answer is (X)``, ``\\boxed{X}``, ``**X**``, a line holding only the letter, then
    ``(X)`` — the last one only when every parenthesised letter in the text is the same.  (None, None)
    when nothing matches: never a guess."""
    text = text or ""
    for name, pat in _letter_patterns(letters):
        found = pat.findall(text)
        if found:
            return found[-1], name
    paren = set(re.findall(rf"\(([{letters}])\)", text))
    if len(paren) == 1:
        return paren.pop(), "paren"
    return None, None

"""Haystacks of the ruler suite: a stream of words (with the whitespace after each) that needles are inserted
into at sentence boundaries, and a token index that says how many tokens of the target's tokenizer the first
k words hold.

A haystack is the built-in ``noise`` filler (one line of five neutral sentences, repeated), the built-in
``essay`` (ruler_words.ESSAY, repeated) or the natural text of a user's file (paragraphs kept, other
whitespace collapsed, never repeated: a file too short for a requested length is an error).

Placement.  The first needle of a needle task (the asked one) is the anchor: with C context tokens
(haystack and every insertion) and l its own length, it is put where the context tokens before it are
d·(C − l) for its depth d, so 0 puts it first, 1 last, and for a lone needle d is the share of haystack
before it.  Every other insertion (distractor needles, the other needles of a multi-needle task) sits where
the share of *haystack* tokens before it is its own depth; the anchor's position accounts for the ones
that land before it (one whose span would contain the anchor's spot moves to right after the anchor).  vt
has no anchor: its assignments sit at their shares of haystack, in chain order.  Positions are then moved
to the nearest sentence boundary (by estimated tokens), so no sentence is cut; the order is kept.
"""

from __future__ import annotations

import bisect
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from kvbench.suites.base import SuiteError, SuiteInputError
from kvbench.suites.ruler.words import ESSAY, NOISE_LINE

_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*$")
MIN_FILE_WORDS = 50


@dataclass
class Haystack:
    name: str
    words: list[str]
    seps: list[str]  # the whitespace after each word
    cyclic: bool  # built-in fillers repeat; a user's file does not
    _pieces: list[str] = field(default_factory=list, repr=False)
    _ends: list[int] = field(default_factory=list, repr=False)  # sentence-end word indices (one period)

    def __post_init__(self) -> None:
        self._pieces = [w + s for w, s in zip(self.words, self.seps)]
        self._ends = [i for i, (w, s) in enumerate(zip(self.words, self.seps)) if "\n" in s or _SENTENCE_END.search(w)]
        self._period_text = "".join(self._pieces)

    @property
    def period(self) -> int:
        return len(self.words)

    @property
    def max_words(self) -> Optional[int]:
        """How many words the haystack can give (None: unlimited)."""
        return None if self.cyclic else len(self.words)

    def _check(self, b: int) -> None:
        if not self.cyclic and b > len(self.words):
            raise SuiteError(f"haystack {self.name}: {b} words asked, the file holds {len(self.words)}")

    def sep(self, i: int) -> str:
        return self.seps[i % self.period]

    def chars(self, a: int, b: int) -> int:
        """Characters of words a..b-1 with their separators (an estimate's weight; exact for one period)."""
        return sum(len(self._pieces[i % self.period]) for i in range(a, b))

    def render(self, a: int, b: int) -> str:
        """Words a..b-1 joined by their own separators, without the separator after the last one."""
        if b <= a:
            return ""
        self._check(b)
        p = self.period
        if not self.cyclic:
            text = "".join(self._pieces[a:b])
        elif b - a <= 2 * p:
            text = "".join(self._pieces[i % p] for i in range(a, b))
        else:  # whole periods from the cached period text
            first, last = -(-a // p) * p, (b // p) * p
            text = ("".join(self._pieces[i % p] for i in range(a, first)) + self._period_text * ((last - first) // p)
                    + "".join(self._pieces[i % p] for i in range(last, b)))
        return text[: len(text) - len(self.sep(b - 1))]

    def is_boundary(self, k: int) -> bool:
        """Whether a sentence ends right before word k (k = 0: the start)."""
        if k == 0:
            return True
        i = (k - 1) % self.period
        j = bisect.bisect_left(self._ends, i)
        return j < len(self._ends) and self._ends[j] == i


def noise_haystack() -> Haystack:
    words = NOISE_LINE.split()
    return Haystack("noise", words, [" "] * (len(words) - 1) + ["\n"], cyclic=True)


def _from_text(name: str, text: str, cyclic: bool) -> Haystack:
    words: list[str] = []
    seps: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        ws = para.split()
        if not ws:
            continue
        words += ws
        seps += [" "] * (len(ws) - 1) + ["\n\n"]
    return Haystack(name, words, seps, cyclic)


def essay_haystack() -> Haystack:
    return _from_text("essay", ESSAY, cyclic=True)


def file_haystack(path: str) -> Haystack:
    """The natural text of a UTF-8 file; missing, unreadable or near-empty files are one clear error."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise SuiteInputError(f"ruler haystack_file: {path} does not exist or is not a file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SuiteInputError(f"ruler haystack_file: cannot read {path} as UTF-8 text ({e})") from None
    h = _from_text(f"file:{p.name}", text, cyclic=False)
    if len(h.words) < MIN_FILE_WORDS:
        raise SuiteInputError(f"ruler haystack_file: {path} holds {len(h.words)} words; a haystack needs at least "
                         f"{MIN_FILE_WORDS} (and enough for the longest context length)")
    return h


class TokenIndex:
    """Estimated token counts of haystack prefixes under one tokenizer: the words are encoded in chunks of
    ``CHUNK`` words (each distinct chunk once; a repeating filler has only a few) and a partial chunk is
    interpolated by characters.  Thread-safe; grows as longer prefixes are asked for."""

    CHUNK = 32
    WINDOW = 400  # words searched on each side for a sentence boundary

    def __init__(self, hay: Haystack, encode: Callable[[str], Sequence[int]]):
        self.hay = hay
        self._encode = encode
        self._lock = threading.Lock()
        self._cache: dict[str, int] = {}
        self._prefix: list[float] = [0.0]  # tokens before chunk j

    def _chunk_range(self, j: int) -> tuple[int, int]:
        a = j * self.CHUNK
        b = a + self.CHUNK
        if self.hay.max_words is not None:
            b = min(b, self.hay.max_words)
        return a, b

    def _chunk_tokens(self, j: int) -> int:
        a, b = self._chunk_range(j)
        text = self.hay.render(a, b)
        n = self._cache.get(text)
        if n is None:
            n = len(self._encode(text))
            self._cache[text] = n
        return n

    def cum(self, k: int) -> float:
        """Estimated tokens of the first k words."""
        if k <= 0:
            return 0.0
        j, r = divmod(k, self.CHUNK)
        with self._lock:
            while len(self._prefix) <= j + (1 if r else 0):
                self._prefix.append(self._prefix[-1] + self._chunk_tokens(len(self._prefix) - 1))
            base = self._prefix[j]
            if not r:
                return base
            a, b = self._chunk_range(j)
            whole = self._prefix[j + 1] - base
        return base + whole * self.hay.chars(a, a + r) / max(self.hay.chars(a, b), 1)

    def words_for(self, tokens: float, hi: Optional[int] = None) -> int:
        """The largest k (<= hi) whose estimated prefix holds at most ``tokens`` tokens."""
        lo, top = 0, 1
        while self.cum(top) <= tokens and (hi is None or top < hi):
            top *= 2
        if hi is not None:
            top = min(top, hi)
        if self.cum(top) <= tokens:
            return top
        while top - lo > 1:
            mid = (lo + top) // 2
            lo, top = (mid, top) if self.cum(mid) <= tokens else (lo, mid)
        return lo

    def nearest_boundary(self, tokens: float, lo: int, hi: int) -> int:
        """The sentence boundary k in [lo, hi] whose prefix estimate is closest to ``tokens``: the nearest
        boundary on each side of the word position (within ``WINDOW`` words), else the word position."""
        k = min(max(self.words_for(tokens, hi), lo), hi)
        left = next((c for c in range(k, max(lo, k - self.WINDOW) - 1, -1) if self.hay.is_boundary(c)), None)
        right = next((c for c in range(k + 1, min(hi, k + self.WINDOW) + 1) if self.hay.is_boundary(c)), None)
        found = [c for c in (left, right) if c is not None]
        if not found:
            return k
        return min(found, key=lambda c: abs(self.cum(c) - tokens))


def place(hay: Haystack, index: TokenIndex, n: int, inserts: list[tuple[float, str, int]],
          anchor: bool = True) -> tuple[str, list[int]]:
    """The context: the first ``n`` haystack words with ``inserts`` (depth fraction, text, its token count)
    placed as described in the module docstring (``anchor=False``: no anchor, every insertion at its share
    of haystack, in the given order).  Returns the text and each insertion's word index."""
    total = index.cum(n)
    at = [0] * len(inserts)
    if not anchor:
        sequence, last = list(range(len(inserts))), 0
        for i in sequence:
            at[i] = last = index.nearest_boundary(max(inserts[i][0] * total, index.cum(last)), last, n)
        return _compose(hay, n, inserts, sequence, at), at
    if not inserts:
        return hay.render(0, n), at
    f0, _, l0 = inserts[0]
    others = sorted(range(1, len(inserts)), key=lambda i: inserts[i][0])  # stable: ties keep the given order
    pos = {i: inserts[i][0] * total for i in others}  # haystack tokens before each other insertion
    goal = f0 * (total + sum(t for _, _, t in inserts) - l0)  # context tokens before the anchor
    n_before, before_tokens = 0, 0
    for i in others:
        if goal - before_tokens <= pos[i]:
            break
        n_before += 1
        before_tokens += inserts[i][2]
    if n_before and goal - before_tokens < pos[others[n_before - 1]]:
        # the goal falls inside the insertion just before the anchor: that one moves to right after it
        n_before -= 1
        before_tokens -= inserts[others[n_before]][2]
    h = min(max(goal - before_tokens, 0.0), total)
    at[0] = index.nearest_boundary(h, 0, n)
    last = 0
    for i in others[:n_before]:
        at[i] = last = index.nearest_boundary(max(pos[i], index.cum(last)), last, at[0])
    last = at[0]
    for i in others[n_before:]:
        at[i] = last = index.nearest_boundary(max(pos[i], index.cum(last)), last, n)
    return _compose(hay, n, inserts, others[:n_before] + [0] + others[n_before:], at), at


def _compose(hay: Haystack, n: int, inserts: list[tuple[float, str, int]], sequence: list[int], at: list[int]) -> str:
    """The haystack's first n words with the insertions of ``sequence`` (in that order) before word ``at[i]``."""

    def sep_at(k: int) -> str:
        return hay.sep(k - 1) if k > 0 else " "

    pieces: list[str] = []
    prev = 0
    for i in sequence:
        k = at[i]
        if k > prev:
            pieces += [hay.render(prev, k), sep_at(k)]
        pieces += [inserts[i][1], sep_at(k)]
        prev = k
    if n > prev:
        pieces.append(hay.render(prev, n))
    elif pieces:
        pieces.pop()
    return "".join(pieces)

"""The seven synthetic tasks of the ruler suite (semantics after NVIDIA RULER; wording and code are
kvbench's own) and their scorer.

Each task turns a seed into an ``Instance``: fixed prompt parts (``header`` before the context,
``question`` after it, ``answer_prefix`` that ends a completion-style prompt), the expected ``answers``, and
``context(n)``, the context at fill n.  suites/ruler/suite.py picks n so that the whole prompt has the requested
number of tokens (suites/ruler/fit.py).

- ``niah_single``: one needle ``One special magic number for <key> is: <7-digit number>.`` at the item's
  depth; the question asks for the number of <key>.  Keys are adjective-noun pairs (``quiet-harbor``).
- ``niah_multikey``: the asked needle at the item's depth and three needles with other keys (distractors)
  at random depths; one number is asked.
- ``niah_multivalue``: four needles with the same key and four numbers (the first at the item's depth);
  all four numbers are asked.
- ``niah_multiquery``: four keys with a number each (the first at the item's depth); all four are asked.
- ``vt`` (variable tracking): two chains ``VAR A = 12345.``, ``VAR B = VAR A.``, ... of four hops each at
  random positions (each chain in order); asked: every variable holding the first chain's value (five
  names); the second chain is the distractor.
- ``cwe`` (common words): a numbered list ``1. word 2. word ...`` in which ten words appear 30 times (6 below
  4096 tokens) and every other word 3 times (once below 4096); asked: the ten most common words.
- ``fwe`` (frequent words): a coded text of random six-letter words with Zipf counts
  ``floor(N / (k² ζ(2)))`` for rank k (a vocabulary of L/50 words; the text's length is set word by word by
  trimming the rarest ranks); rank 1 is the noise word ``....``; asked: the three most frequent words
  besides it (ranks 2-4).

Scoring (``string_match_all``): the fraction of expected strings found in the output, case-insensitive,
where a match must not be part of a longer run of letters or digits (``1234567`` is not found in
``12345678``, ``oak`` not in ``oaken``; RULER's plain substring test would count both).  Repeating an
answer counts it once; listing extra strings costs nothing (as in RULER).
"""

from __future__ import annotations

import math
import random
import re
import string
from dataclasses import dataclass, field
from typing import Callable, Optional

from kvbench.suites.ruler.haystack import Haystack, TokenIndex, place
from kvbench.suites.ruler.words import ADJECTIVES, COMMON_WORDS, NOUNS, pseudo_words

# generation budget per task (RULER's tokens_to_generate)
MAX_TOKENS = {"niah_single": 128, "niah_multikey": 128, "niah_multivalue": 128, "niah_multiquery": 128,
              "vt": 30, "cwe": 120, "fwe": 50}
# RULER's haystack per task when --haystack auto
AUTO_HAYSTACK = {"niah_single": "noise", "niah_multikey": "essay", "niah_multivalue": "essay",
                 "niah_multiquery": "essay", "vt": "noise"}
NIAH_SHAPES = {"niah_single": (1, 1, 1), "niah_multikey": (4, 1, 1), "niah_multivalue": (1, 4, 1),
               "niah_multiquery": (4, 1, 4)}  # (keys, values per key, keys asked)
VT_CHAINS, VT_HOPS = 2, 4
CWE_NUM = 10
FWE_ALPHA, FWE_WORDLEN, FWE_NOISE = 2.0, 6, "...."
FWE_MIN_N = 150  # from here on floor(N/k²ζ) strictly decreases over ranks 1..5 (ranks 2-4 well defined)


@dataclass
class Instance:
    task: str
    header: str
    question: str
    answer_prefix: str
    answers: list[str]
    depth: Optional[float]  # percent of the (first) asked needle, None for tasks without depth
    context: Callable[[int], str]  # fill -> context text
    lo: int  # smallest fill
    hi: Optional[int] = None  # largest fill (a finite haystack)
    per_unit: float = 1.0  # estimated tokens per fill unit
    guess: Optional[Callable[[float], int]] = None  # context tokens wanted -> fill estimate
    meta: dict = field(default_factory=dict)


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def _haystack_instance(task: str, hay: Haystack, index: TokenIndex, inserts: list[tuple[float, str, int]],
                       anchor: bool = True, **kw) -> Instance:
    def context(n: int) -> str:
        return place(hay, index, n, inserts, anchor)[0]

    inst = Instance(task=task, context=context, lo=0, hi=hay.max_words, **kw)
    inst.guess = lambda tokens: index.words_for(tokens, hay.max_words)
    inst.meta["inserts"] = [t for _, t, _ in inserts]
    return inst


def make_niah(task: str, rng: random.Random, depth: float, hay: Haystack, index: TokenIndex,
              count_tokens: Callable[[str], int]) -> Instance:
    n_keys, n_values, n_asked = NIAH_SHAPES[task]
    keys: list[str] = []
    while len(keys) < n_keys:
        k = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if k not in keys:
            keys.append(k)
    values: list[list[str]] = []
    used: set[str] = set()
    for _ in keys:
        vs = []
        while len(vs) < n_values:
            v = str(rng.randint(1_000_000, 9_999_999))
            if v not in used:
                used.add(v)
                vs.append(v)
        values.append(vs)
    asked = list(range(n_asked))  # keys[0] (and the next ones for multiquery) are asked
    first = (0, 0)  # the needle at the item's depth: the first value of the first asked key
    inserts = []
    for i, k in enumerate(keys):
        for j, v in enumerate(values[i]):
            text = f"One special magic number for {k} is: {v}."
            d = depth if (i, j) == first else rng.uniform(0.0, 100.0)
            inserts.append((d / 100.0, text, count_tokens(text)))
    query = _join([keys[i] for i in asked])
    answers = [v for i in asked for v in values[i]]
    if len(answers) == 1:
        header = ("A special magic number is hidden within the following text. Make sure to memorize it. "
                  "I will quiz you about the number afterwards.\n")
        question = f"\nWhat is the special magic number for {query} mentioned in the provided text?"
        prefix = f" The special magic number for {query} mentioned in the provided text is"
    else:
        header = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                  "I will quiz you about the numbers afterwards.\n")
        question = f"\nWhat are all the special magic numbers for {query} mentioned in the provided text?"
        prefix = f" The special magic numbers for {query} mentioned in the provided text are"
    inst = _haystack_instance(task, hay, index, inserts, header=header, question=question, answer_prefix=prefix,
                              answers=answers, depth=depth)
    inst.meta["needle"] = inserts[0][1]
    return inst


def _var_names(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        v = "".join(rng.choices(string.ascii_uppercase, k=5))
        if v not in names and v != "VAR":
            names.append(v)
    return names


def make_vt(rng: random.Random, hay: Haystack, index: TokenIndex, count_tokens: Callable[[str], int]) -> Instance:
    names = _var_names(rng, VT_CHAINS * (VT_HOPS + 1))
    values: list[str] = []
    while len(values) < VT_CHAINS:
        v = str(rng.randint(10000, 99999))
        if v not in values:
            values.append(v)
    chains = []
    for c in range(VT_CHAINS):
        vs = names[c * (VT_HOPS + 1):(c + 1) * (VT_HOPS + 1)]
        chains.append([f"VAR {vs[0]} = {values[c]}."] + [f"VAR {vs[h + 1]} = VAR {vs[h]}." for h in range(VT_HOPS)])
    # a random interleaving that keeps each chain in order, at sorted random depths
    pos = [0] * VT_CHAINS
    seq: list[str] = []
    while len(seq) < VT_CHAINS * (VT_HOPS + 1):
        c = rng.choice([i for i in range(VT_CHAINS) if pos[i] <= VT_HOPS])
        seq.append(chains[c][pos[c]])
        pos[c] += 1
    fracs = sorted(rng.random() for _ in seq)
    inserts = [(f, t, count_tokens(t)) for f, t in zip(fracs, seq)]
    value = values[0]
    n_vars = VT_HOPS + 1
    inst = _haystack_instance(
        "vt", hay, index, inserts, anchor=False,
        header="Memorize and track the chains of variable assignments hidden in the following text.\n\n",
        question=f"\nQuestion: Find all variables that are assigned the value {value} in the text above.",
        answer_prefix=(f" Answer: According to the chains of variable assignments in the text above, {n_vars} variables "
                       f"are assigned the value {value}, they are:"),
        answers=names[:n_vars], depth=None)
    inst.meta["value"] = value
    return inst


def make_cwe(rng: random.Random, length: int) -> Instance:
    freq_common, freq_rare = (30, 3) if length >= 4096 else (6, 1)
    pool = list(COMMON_WORDS)
    rng.shuffle(pool)
    common, rare = pool[:CWE_NUM], pool[CWE_NUM:]
    extra_rng = random.Random(rng.getrandbits(64))
    shuffle_seed = rng.getrandbits(64)
    taken = frozenset(COMMON_WORDS)

    def context(m: int) -> str:
        n_rare = -(-(m - CWE_NUM * freq_common) // freq_rare)
        if n_rare > len(rare):
            rare.extend(pseudo_words(extra_rng, n_rare - len(rare), taken | frozenset(rare)))
        entries = [w for w in common for _ in range(freq_common)]
        entries += [w for w in rare[:n_rare] for _ in range(freq_rare)][: m - len(entries)]
        random.Random(shuffle_seed ^ m).shuffle(entries)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries))

    return Instance(
        task="cwe",
        header=("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n"),
        question=f"\nQuestion: What are the {CWE_NUM} most common words in the list above?",
        answer_prefix=f" Answer: The top {CWE_NUM} words that appear most often in the list are:",
        answers=list(common), depth=None, context=context, lo=CWE_NUM * freq_common + freq_rare, per_unit=4.0,
        meta={"freq": (freq_common, freq_rare)})


def fwe_counts(n: int, vocab: int) -> list[int]:
    """Zipf counts floor(n / (k^alpha zeta(alpha))) for ranks k = 1..vocab."""
    zeta = math.pi ** 2 / 6 if FWE_ALPHA == 2.0 else sum(k ** -FWE_ALPHA for k in range(1, 100000))
    return [int(n / (k ** FWE_ALPHA * zeta)) for k in range(1, vocab + 1)]


def fwe_entry_counts(entries: int, vocab: int) -> list[int]:
    """Counts per rank for a text of exactly ``entries`` words: the Zipf counts of the smallest scale N whose
    total reaches ``entries``, less the surplus taken one by one from the rarest words (ranks >= 6), so the
    top five ranks keep their strictly decreasing Zipf counts."""
    lo, hi = FWE_MIN_N, max(FWE_MIN_N, 2 * entries + 16)
    while lo < hi:  # smallest N with total >= entries
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if sum(fwe_counts(mid, vocab)) < entries else (lo, mid)
    counts = fwe_counts(lo, vocab)
    surplus = sum(counts) - entries
    while surplus > 0:
        took = False
        for k in range(len(counts) - 1, 4, -1):
            if surplus and counts[k] > 0:
                counts[k] -= 1
                surplus -= 1
                took = True
        if not took:
            raise ValueError(f"fwe: cannot make a text of {entries} words from {vocab} ranks")
    return counts


def make_fwe(rng: random.Random, length: int) -> Instance:
    vocab_size = max(length // 50, 8)
    words: list[str] = []
    seen = set()
    while len(words) < vocab_size - 1:
        w = "".join(rng.choices(string.ascii_lowercase, k=FWE_WORDLEN))
        if w not in seen:
            seen.add(w)
            words.append(w)
    vocab = [FWE_NOISE] + words
    shuffle_seed = rng.getrandbits(64)

    def context(m: int) -> str:
        entries = [w for w, c in zip(vocab, fwe_entry_counts(m, len(vocab))) for _ in range(c)]
        random.Random(shuffle_seed ^ m).shuffle(entries)
        return " ".join(entries)

    return Instance(
        task="fwe",
        header=("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. "),
        question=("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                  "frequently appeared words in the above coded text?"),
        answer_prefix=" Answer: According to the coded text above, the three most frequently appeared words are:",
        answers=vocab[1:4], depth=None, context=context, lo=sum(fwe_counts(FWE_MIN_N, vocab_size)), per_unit=3.0)


def _pattern(answer: str) -> re.Pattern:
    return re.compile(r"(?<![^\W_])" + re.escape(answer.lower()) + r"(?![^\W_])")


def string_match_all(output: str, answers: list[str]) -> tuple[float, list[str]]:
    """(fraction of ``answers`` found in ``output``, the ones found) — see the module docstring."""
    if not answers:
        return 0.0, []
    text = (output or "").lower()
    found = [a for a in answers if _pattern(a).search(text)]
    return len(found) / len(answers), found

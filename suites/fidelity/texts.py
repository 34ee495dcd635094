"""Long teacher-forced texts for fidelity by position, built locally (nothing is fetched).

``text_tokens: N`` (``SuiteOptions.extra``) makes each fidelity text a short context followed by a
continuation of N tokens under the target's tokenizer (within 1%: the continuation is cut at the last
word boundary at or below N tokens), so the per-token KL covers absolute positions up to ≈ N:

* default source: GSM8K test question + solution pairs (from ``--data-dir``, as the short texts) concatenated
  in dataset order: the context is the first question (``Question: q\\nAnswer:``), the continuation its
  solution followed by ``\\n\\nQuestion: q\\nAnswer: a`` pairs; text i starts at pair i·P (P = pairs one
  text uses; wrapping around), so texts do not repeat each other while the dataset lasts;
* ``haystack_file: PATH`` (with ``text_tokens``; the same key as the ruler suite's ``--haystack-file``):
  natural text from a user file, split into words with their trailing whitespace;
  the context is 32 words, the continuation the words after them (wrapping around the file).

The protocol label names the source and length: ``gsm8k-concat-8192`` or ``haystack-<sha256[:8]>-8192``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from kvbench.suites.base import SuiteError, SuiteOptions
from kvbench.suites.fidelity.ref import Text

__all__ = ["DEFAULT_LONG_TEXTS", "LongTextSpec", "long_text_spec", "build_long_texts", "fit_to_tokens", "token_counter"]

DEFAULT_LONG_TEXTS = 4
MIN_TEXT_TOKENS = 16
HAYSTACK_CONTEXT_WORDS = 32

Counter = Callable[[str], int]


@dataclass(frozen=True)
class LongTextSpec:
    """The long-text knobs read from ``SuiteOptions.extra``: ``text_tokens`` and ``haystack_file``."""

    text_tokens: int
    haystack_file: Optional[Path] = None


def _positive_int(v, name: str) -> int:
    if isinstance(v, bool):
        raise SuiteError(f"{name} must be a positive integer, got {v!r}")
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise SuiteError(f"{name} must be a positive integer, got {v!r}") from None
    if isinstance(v, float) and not v.is_integer() or n <= 0:
        raise SuiteError(f"{name} must be a positive integer, got {v!r}")
    return n


def long_text_spec(opts: SuiteOptions) -> Optional[LongTextSpec]:
    """None unless ``extra["text_tokens"]`` is set; one clear error for a bad value or a missing file."""
    extra = opts.extra or {}
    hay = extra.get("haystack_file")
    if extra.get("text_tokens") is None:
        return None  # the short GSM8K texts (a haystack_file meant for the ruler suite is not ours to use)
    n = _positive_int(extra["text_tokens"], "fidelity text_tokens")
    if n < MIN_TEXT_TOKENS:
        raise SuiteError(f"fidelity text_tokens must be at least {MIN_TEXT_TOKENS}, got {n}")
    path = None
    if hay is not None:
        path = Path(str(hay)).expanduser()
        if not path.is_file():
            raise SuiteError(f"fidelity haystack_file not found: {path}")
    return LongTextSpec(n, path)


def _count_with(tok) -> Counter:
    try:  # a runtime Tokenizer takes add_special_tokens; a harness PromptTokenizer encodes plain text only
        tok.encode("a", add_special_tokens=False)
        return lambda s: len(tok.encode(s, add_special_tokens=False))
    except TypeError:
        return lambda s: len(tok.encode(s))


def token_counter(client, tokenizer: Optional[str] = None) -> Counter:
    """Continuation token count under the target's tokenizer, without special tokens (as ``score`` tokenizes
    a continuation): an embedded engine's own, else ``tokenizer`` (``extra["tokenizer"]``, a path or name as
    ``--tokenizer`` takes it), else the client's (``client.tokenizer()``: a server's /tokenize route)."""
    info = client.info() if hasattr(client, "info") else {}
    if tokenizer and (info or {}).get("type") != "embedded":
        from kvbench.suites.prompt_tokenizer import PromptTokenizerError, load_prompt_tokenizer

        try:
            return _count_with(load_prompt_tokenizer(str(tokenizer)))
        except PromptTokenizerError as e:
            raise SuiteError(f"fidelity: {e}") from None
    own = getattr(client, "tokenizer", None)
    if callable(own):
        try:
            return _count_with(own())
        except Exception as e:  # e.g. a server without /tokenize
            raise SuiteError(f"fidelity text_tokens needs the target's tokenizer: {e}") from None
    engine = getattr(client, "engine", None)
    if own is None and getattr(engine, "tokenizer", None) is not None:
        own = engine.tokenizer
    if own is not None and hasattr(own, "encode"):
        return _count_with(own)
    raise SuiteError("fidelity text_tokens needs the target's tokenizer (an embedded engine, a server with a "
                     "/tokenize route, or extra[\"tokenizer\"])")


def _last_fit(text: str, cuts: list[int], target: int, count: Counter) -> int:
    """The largest cut in ``cuts`` (increasing) whose prefix has at most ``target`` tokens; 0 when none."""
    lo, hi, best = 0, len(cuts) - 1, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if count(text[: cuts[mid]]) <= target:
            best, lo = cuts[mid], mid + 1
        else:
            hi = mid - 1
    return best


def fit_to_tokens(text: str, target: int, count: Counter) -> str:
    """The longest prefix of ``text`` ending at a word boundary whose token count is at most ``target``
    (binary search: a prefix's count grows with its length, up to tokenizer merges at the cut).  When that
    prefix falls more than 1% short (a coarse tokenizer, a short target) the cut moves into the next word,
    character by character."""
    if count(text) <= target:
        return text
    cuts = [m.start() for m in re.finditer(r"\s+", text)] + [len(text)]
    best = _last_fit(text, cuts, target, count)
    if count(text[:best]) < 0.99 * target:
        nxt = next((c for c in cuts if c > best), len(text))
        best = _last_fit(text, list(range(best, nxt + 1)), target, count)
    return text[:best]


def _build(contexts_and_streams: list[tuple[str, Iterator[str]]], target: int, count: Counter, label: str) -> list[Text]:
    out = []
    for i, (context, stream) in enumerate(contexts_and_streams):
        parts: list[str] = []
        total, need = 0, target * 1.03 + 8
        # grow by whole pieces until the joined text passes the target (the pieces' summed counts only estimate
        # it: tokens merge or split across the joins), then cut to the target
        for _ in range(64):
            while total < need:
                piece = next(stream)
                parts.append(piece)
                total += count(piece)
            have = count("".join(parts))
            if have > target:
                break
            need = total + (target - have) * 1.2 + 8
        else:
            raise SuiteError(f"fidelity: could not reach {target} tokens from {label}")
        cont = fit_to_tokens("".join(parts), target, count)
        if not cont.strip():
            raise SuiteError(f"fidelity: could not build a {target}-token text from {label}")
        out.append(Text(f"{label}-{i}", context, cont))
    return out


def _gsm8k_sources(opts: SuiteOptions, n: int, target: int, count: Counter) -> list[tuple[str, Iterator[str]]]:
    from kvbench.suites.gsm8k import load_gsm8k

    rows, _ = load_gsm8k(opts, "test")
    if not rows:
        raise SuiteError("fidelity: no GSM8K test rows to build long texts from")
    # pairs one text uses, estimated from the first rows, so text i starts where text i-1 ended
    sample = rows[: min(len(rows), 16)]
    per_pair = max(1.0, sum(count(f"\n\nQuestion: {r['question']}\nAnswer: {r['answer']}") for r in sample) / len(sample))
    stride = int(target / per_pair) + 1

    def stream(start: int) -> Iterator[str]:
        r = rows[start % len(rows)]
        yield " " + r["answer"]
        j = start + 1
        while True:
            r = rows[j % len(rows)]
            yield f"\n\nQuestion: {r['question']}\nAnswer: {r['answer']}"
            j += 1

    out = []
    for i in range(n):
        s = (i * stride) % len(rows)
        out.append((f"Question: {rows[s]['question']}\nAnswer:", stream(s)))
    return out


def _haystack_sources(path: Path, n: int, target: int, count: Counter) -> tuple[list[tuple[str, Iterator[str]]], str]:
    try:
        raw = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise SuiteError(f"fidelity haystack_file {path}: {e}") from None
    words = re.findall(r"\S+\s*", raw)
    if len(words) <= HAYSTACK_CONTEXT_WORDS:
        raise SuiteError(f"fidelity haystack_file {path} holds {len(words)} words; it needs more than "
                         f"{HAYSTACK_CONTEXT_WORDS}")
    sample = "".join(words[: min(len(words), 2000)])
    per_word = max(0.05, count(sample) / min(len(words), 2000))
    stride = int(target / per_word) + HAYSTACK_CONTEXT_WORDS

    def stream(start: int) -> Iterator[str]:
        j = start
        first = True
        while True:
            w = words[j % len(words)]
            yield (" " + w.lstrip()) if first else w
            first = False
            j += 1

    out = []
    for i in range(n):
        s = (i * stride) % len(words)
        ctx = "".join(words[(s + k) % len(words)] for k in range(HAYSTACK_CONTEXT_WORDS)).rstrip()
        out.append((ctx, stream(s + HAYSTACK_CONTEXT_WORDS)))
    label = "haystack-" + hashlib.sha256(raw.encode("utf-8")).hexdigest()[:8]
    return out, label


def build_long_texts(opts: SuiteOptions, spec: LongTextSpec, count: Counter,
                     max_model_len: Optional[int] = None) -> tuple[list[Text], str]:
    """(texts, protocol label) of ``opts.limit`` (default ``DEFAULT_LONG_TEXTS``) long texts; one clear error
    when a text with its context would not fit ``max_model_len`` (the target's context, when known)."""
    n = opts.limit or DEFAULT_LONG_TEXTS
    if spec.haystack_file is not None:
        sources, source = _haystack_sources(spec.haystack_file, n, spec.text_tokens, count)
    else:
        sources, source = _gsm8k_sources(opts, n, spec.text_tokens, count), "gsm8k-concat"
    label = f"{source}-{spec.text_tokens}"
    texts = _build(sources, spec.text_tokens, count, label)
    if max_model_len:
        need = max(count(t.context) + count(t.continuation) for t in texts) + 1  # + a BOS token
        if need > max_model_len:
            raise SuiteError(f"fidelity text_tokens {spec.text_tokens}: a text needs {need} tokens with its context, "
                             f"more than the target's context of {max_model_len}; use text_tokens up to "
                             f"{max_model_len - (need - spec.text_tokens)}")
    return texts, label

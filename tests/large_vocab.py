"""Test helper (no tests here): a byte-level BPE tokenizer shaped like Qwen2's (a ~150k-token vocabulary, NFC
normalizer, Qwen2's split regex, long tokens), built in a second from generated words, and prose made of
those words.

A real large-vocabulary tokenizer cannot be downloaded in tests; this one has what matters for the server's
request preparation: a large vocabulary whose longest tokens are long (runs of 128 spaces, 64 '=' or '-',
a 41-letter identifier, so that a bound from the longest token alone is weak), multi-byte (CJK) tokens, an
NFC normalizer, and the speed of the Rust tokenizer on long texts.  ``prose`` is text made of the
vocabulary's words, about 4-5 bytes per token like English under a real vocabulary.
"""

from __future__ import annotations

import random
from functools import lru_cache

QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
               r"""|\s+(?!\S)|\s+""")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LONG_WORD = "translatesAutoresizingMaskIntoConstraints"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_chars() -> dict[int, str]:
    from kvbench.core.tokenizer import _BYTE_CHARS

    return _BYTE_CHARS


def _as_tokens(text: str) -> str:
    """``text`` as a byte-level vocabulary entry (one character per UTF-8 byte)."""
    bc = _byte_chars()
    return "".join(bc[b] for b in text.encode("utf-8"))


@lru_cache(maxsize=None)
def words(n: int = 30_000, seed: int = 0) -> tuple[str, ...]:
    """``n`` distinct pronounceable words of 2-12 letters."""
    rng = random.Random(seed)
    cons, vow = "bcdfghjklmnprstvwz", "aeiou"
    out: dict[str, None] = {}
    while len(out) < n:
        w = "".join(rng.choice(cons) + rng.choice(vow) + (rng.choice(cons) if rng.random() < 0.3 else "")
                    for _ in range(rng.choice((1, 2, 2, 3, 3, 4))))
        out[w] = None
    return tuple(out)


def _vocab_entries(vocab_size: int) -> list[str]:
    """Vocabulary entries (byte-level strings), closed under prefixes so that each has a merge."""
    bc = _byte_chars()
    entries: dict[str, None] = {c: None for c in bc.values()}

    def add(text: str) -> None:
        t = _as_tokens(text)
        for i in range(2, len(t) + 1):
            entries.setdefault(t[:i], None)

    for k in range(2, 129):
        add(" " * k)
    for c in "=-#*_~":
        add(c * 64)
    add("\n" * 16)
    add(LONG_WORD)
    add(" " + LONG_WORD)
    rng = random.Random(1)
    cjk = [chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(3000)]
    for c in cjk:
        add(c)
    for i in range(0, len(cjk) - 1, 2):
        add(cjk[i] + cjk[i + 1])
    for w in words():
        if len(entries) >= vocab_size:
            break
        add(" " + w)
        add(w)
        add(w.capitalize())
    return list(entries)[:vocab_size]


@lru_cache(maxsize=None)
def tokenizer_json(vocab_size: int = 150_000) -> str:
    """The tokenizer.json definition (a string) of the Qwen2-shaped vocabulary."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import BPE

    entries = _vocab_entries(vocab_size - len(SPECIAL))
    vocab = {t: i for i, t in enumerate(entries)}
    # every entry of 2+ characters is its prefix merged with its last byte; a whole word in the vocabulary is
    # one token (ignore_merges, as Llama 3's tokenizer does), so prose is ~5 bytes per token
    merges = [(t[:-1], t[-1]) for t in sorted(entries, key=len) if len(t) > 1]
    rt = RustTokenizer(BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False,
                            ignore_merges=True))
    rt.normalizer = normalizers.NFC()
    rt.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    rt.decoder = decoders.ByteLevel()
    rt.add_special_tokens(SPECIAL)
    return rt.to_str()


def large_vocab_tokenizer(vocab_size: int = 150_000):
    """A ``kvbench.core.tokenizer.Tokenizer`` over the Qwen2-shaped vocabulary (with a chat template)."""
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    from kvbench.core.tokenizer import Tokenizer

    hf = PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(tokenizer_json(vocab_size)),
                                 eos_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    return Tokenizer(hf)


def prose(n_chars: int, seed: int = 0) -> str:
    """``n_chars`` of sentences made of the vocabulary's words (spaces, punctuation, paragraphs)."""
    rng = random.Random(seed)
    vocab = words()
    parts: list[str] = []
    size = 0
    while size < n_chars:
        sentence = " ".join(rng.choice(vocab) for _ in range(rng.randint(5, 18))).capitalize()
        sentence += rng.choice((". ", ". ", ", ", "? ", ".\n\n"))
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:n_chars]

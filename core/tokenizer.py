"""Tokenizer + chat template (shared by the engine, the suites and the load generator), from a GGUF file's metadata or a HF directory (tokenizer.json /
tokenizer_config.json).  Implements ``engine_api.TokenizerProtocol``; also an incremental detokenizer
for streaming.  Never runs code from the checkpoint (no remote code; templates render in jinja's
sandbox through transformers)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["ByteTokenBound", "Tokenizer", "IncrementalDetokenizer", "byte_token_bound", "load_tokenizer"]


class Tokenizer:
    def __init__(self, hf_tok, extra_eos: Sequence[int] = ()):
        self._tok = hf_tok
        eos = [hf_tok.eos_token_id] if hf_tok.eos_token_id is not None else []
        self.eos_token_ids: list[int] = sorted({int(i) for i in list(eos) + list(extra_eos)})
        self.bos_token_id: Optional[int] = hf_tok.bos_token_id
        self.vocab_size: int = len(hf_tok)
        self.chat_template: Optional[str] = getattr(hf_tok, "chat_template", None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def min_token_count(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` found without tokenizing (0 where none can be shown): the
        server turns away prompts that certainly cannot fit the context before it tokenizes them.  A few
        milliseconds per MB of text (see ``ByteTokenBound``)."""
        bound = self._byte_bound
        return 0 if bound is None else bound.count(text)

    def encode_capped(self, text: str, limit: int, add_special_tokens: bool = True) -> tuple[int, Optional[list[int]]]:
        """``(n, ids)``: the token count of ``text`` and its ids, the ids only when ``n <= limit`` (else None).
        A long text is tokenized by the Rust tokenizer's batch call, which releases the GIL, and its ids become
        Python integers only when they are wanted: turning millions of ids into a list holds the GIL for
        hundreds of milliseconds."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None or len(text) <= limit or backend.truncation is not None or backend.padding is not None:
            ids = self.encode(text, add_special_tokens=add_special_tokens)
            return len(ids), (ids if len(ids) <= limit else None)
        enc = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return len(enc), (list(enc.ids) if len(enc) <= limit else None)

    @cached_property
    def _byte_bound(self) -> Optional["ByteTokenBound"]:
        return _bound_or_none(byte_token_bound, self._definition())

    @cached_property
    def _token_bound(self) -> Optional[tuple[int, str]]:
        """The coarser bound of ``byte_level_token_bound`` (one longest token for all bytes)."""
        return _bound_or_none(byte_level_token_bound, self._definition())

    def _definition(self) -> Optional[dict]:
        """The tokenizer.json definition of the Rust tokenizer behind this one (None if there is none), parsed
        once for the byte bound and the byte pieces (both built as an engine starts) and let go when both are
        built: it is large (a 150k vocabulary with its merges)."""
        d = self.__dict__
        if "_definition_kept" not in d:
            d["_definition_kept"] = self._parse_definition()
        spec = d["_definition_kept"]
        if "_byte_bound" in d or "byte_pieces" in d:  # the second of the two: neither asks again
            del d["_definition_kept"]
        return spec

    def _parse_definition(self) -> Optional[dict]:
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            return None
        import json

        try:
            return json.loads(backend.to_str())
        except Exception:  # noqa: BLE001 - a definition that cannot be written out: no bound
            return None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def byte_pieces(self) -> Optional[list]:
        """For a byte-level BPE tokenizer: each token id's UTF-8 bytes (None for a special token, which
        ``decode`` skips), so that decoding is joining bytes; None for any other tokenizer, or when joining
        bytes does not give ``decode``'s text on a sample of every added token and random ids."""
        return _bound_or_none(lambda spec: byte_pieces(spec, self), self._definition())

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(list(ids))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **template_vars) -> str:
        """``template_vars`` (e.g. ``reasoning_effort``) are variables of the checkpoint's template."""
        if not self.chat_template:
            # no template in the checkpoint: a plain "role: content" transcript
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **template_vars)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_vars) -> list[int]:
        # a template already holds the special tokens it wants; the plain transcript (no template) gets the
        # tokenizer's own (a BOS: Gemma degenerates without it)
        text = self.apply_chat_template(messages, add_generation_prompt, **template_vars)
        return self.encode(text, add_special_tokens=not self.chat_template)


_KEEPING_SPLITS = ("Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")


def _bound_or_none(make, spec: Optional[dict]):
    try:
        return None if spec is None else make(spec)
    except Exception:  # noqa: BLE001 - an unusual definition: no bound, prompts are tokenized
        return None


def _byte_chars() -> dict[int, str]:
    """The character that stands for each byte 0..255 in byte-level BPE vocabularies (GPT-2's mapping)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    out = {b: chr(b) for b in keep}
    for i, b in enumerate(b for b in range(256) if b not in out):
        out[b] = chr(256 + i)
    return out


_BYTE_CHARS = _byte_chars()
_CHAR_BYTES = {c: b for b, c in _BYTE_CHARS.items()}


def _byte_level_bpe(spec: dict, normalizers: tuple[str, ...] = ()) -> Optional[tuple[dict, list]]:
    """``(vocab, added_tokens)`` of a byte-level BPE definition whose every kept byte lands in exactly one
    token; None for any other.  That holds with no normalizer (or one of ``normalizers``), a pre-tokenizer
    that only splits (ByteLevel, Digits, or Split / Punctuation that keep what they split on), a BPE model
    without unknown-token handling, and added tokens that do not strip the whitespace around them."""
    norm = spec.get("normalizer")
    if norm is not None:
        kinds = [n.get("type") for n in (norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm])]
        if not all(k in normalizers for k in kinds):
            return None
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for p in parts:
        kind = p.get("type")
        if kind in ("Split", "Punctuation") and p.get("behavior") in _KEEPING_SPLITS:
            continue
        if kind not in ("ByteLevel", "Digits"):
            return None
    if not any(p.get("type") == "ByteLevel" for p in parts):
        return None
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not vocab:
        return None
    if model.get("unk_token") is not None or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    return vocab, added


def byte_level_token_bound(spec: dict) -> Optional[tuple[int, str]]:
    """For a byte-level BPE tokenizer.json definition: ``(L, dropped)`` such that a text of C characters,
    D of them in ``dropped``, encodes to at least ceil((C - D) / L) tokens; None for any other tokenizer.

    Why: with no normalizer, a pre-tokenizer that only splits (ByteLevel, Digits, or Split / Punctuation
    that keep what they split on) and a BPE model without unknown-token handling, every UTF-8 byte of the
    text whose byte character is in the vocabulary ends up in exactly one token (prefix spaces and template
    tokens only add), and bytes whose character is missing are dropped.  When no UTF-8 continuation byte
    (0x80-0xBF) is missing, every multi-byte character keeps at least one byte, and so does every ASCII
    character outside ``dropped`` (the missing ASCII characters); so #tokens >= kept bytes / L >= kept
    characters / L, where L is the longest token in bytes (vocabulary entries are one character per byte;
    added tokens count their UTF-8 length).  Added tokens that strip surrounding whitespace (lstrip /
    rstrip) break this: None.  ``byte_token_bound`` is the finer bound the server uses.
    """
    found = _byte_level_bpe(spec)
    if found is None:
        return None
    vocab, added = found
    missing = [b for b, c in _BYTE_CHARS.items() if c not in vocab]
    if any(0x80 <= b < 0xC0 for b in missing):
        return None  # a continuation byte is dropped: a multi-byte character might vanish whole
    longest = max([len(t) for t in vocab] + [len(a["content"].encode("utf-8")) for a in added])
    return longest, "".join(chr(b) for b in missing if b < 0x80)


def byte_pieces(spec: dict, tok: "Tokenizer") -> Optional[list]:
    """``Tokenizer.byte_pieces`` from a tokenizer.json definition, checked against ``tok.decode``."""
    found = _byte_level_bpe(spec)
    dec = spec.get("decoder") or {}
    kinds = [d.get("type") for d in (dec.get("decoders", []) if dec.get("type") == "Sequence" else [dec])]
    if found is None or kinds != ["ByteLevel"]:
        return None
    vocab, added = found
    pieces: list = [b""] * tok.vocab_size
    for t, i in vocab.items():
        if 0 <= i < len(pieces):
            pieces[i] = bytes(_CHAR_BYTES[c] for c in t)  # KeyError (no fast path) for a character outside the map
    for a in added:
        if 0 <= a["id"] < len(pieces):
            pieces[a["id"]] = None if a.get("special") else a["content"].encode("utf-8")
    import random

    rng = random.Random(0)
    extra = [a["id"] for a in added if 0 <= a["id"] < len(pieces)]
    samples = [[rng.randrange(len(pieces)) for _ in range(rng.randint(1, 12))] for _ in range(200)]
    samples += [extra[k:k + 8] + [rng.randrange(len(pieces))] for k in range(0, len(extra), 8)]
    for ids in samples:
        if b"".join(pieces[i] or b"" for i in ids).decode("utf-8", "replace") != tok.decode(ids):
            return None
    return pieces


_BOUND_SLICE = 1 << 20  # characters measured per step (a few milliseconds each)


@dataclass(frozen=True)
class ByteTokenBound:
    """A lower bound on a byte-level BPE tokenizer's token count: the sum, over the UTF-8 bytes of the text,
    of 1 / (the length in bytes of the longest token that holds that byte value).

    Why it holds: each kept byte of the text lies in exactly one token (``_byte_level_bpe``), and a token of
    ``n`` bytes holds only bytes whose longest token is at least ``n`` long, so its bytes add up to at most
    1.  Bytes that the vocabulary lacks as single tokens may be dropped: they weigh 0.  This is far tighter
    than dividing by the vocabulary's longest token when that token is a run of 128 spaces but letters
    sit in tokens of at most ~40 bytes (large vocabularies are like that).

    ``nfc``: the tokenizer normalizes to NFC first, which may merge a character with the combining marks
    after it; then only ASCII bytes followed by an ASCII byte (or the end) count, as NFC leaves those as
    they are (an ASCII character composes with nothing before it, and one after it is a starter that
    blocks any composition across it).
    """

    longest: tuple[int, ...]  # per byte value: the longest token holding it, in bytes; 0: weighs nothing
    nfc: bool = False

    @cached_property
    def _weights(self):
        import numpy as np

        return np.array([1.0 / n if n else 0.0 for n in self.longest])

    def count(self, text: str) -> int:
        """The bound for ``text``, measured a slice at a time (no call holds the GIL for long)."""
        import numpy as np

        total = 0.0
        for i in range(0, len(text), _BOUND_SLICE):
            a = np.frombuffer(text[i:i + _BOUND_SLICE].encode("utf-8", "surrogatepass"), np.uint8)
            if self.nfc:  # ASCII bytes whose next byte (the next slice's first character at the end) is ASCII
                is_ascii = a < 0x80
                next_ascii = np.append(is_ascii[1:], text[i + _BOUND_SLICE:i + _BOUND_SLICE + 1] < "\x80")
                a = a[is_ascii & next_ascii]
            total += float(np.bincount(a, minlength=256) @ self._weights)
        return max(0, math.ceil(total * (1 - 1e-9) - 1e-9))


def byte_token_bound(spec: dict) -> Optional[ByteTokenBound]:
    """The ``ByteTokenBound`` of a byte-level BPE tokenizer.json definition with no normalizer or an NFC one
    (Qwen2's); None for any other tokenizer."""
    found = _byte_level_bpe(spec, normalizers=("NFC",))
    if found is None:
        return None
    vocab, added = found
    longest = [0] * 256
    added_contents = {a["content"] for a in added}
    by_len: dict[int, list[str]] = {}
    for t in vocab:
        if t not in added_contents:
            by_len.setdefault(len(t), []).append(t)
    for n in sorted(by_len, reverse=True):
        for c in set("".join(by_len[n])):
            b = _CHAR_BYTES.get(c)
            if b is None:
                return None  # not a byte-level entry
            longest[b] = max(longest[b], n)
    for content in added_contents:
        raw = content.encode("utf-8")
        for b in set(raw):
            longest[b] = max(longest[b], len(raw))
    for b, c in _BYTE_CHARS.items():
        if c not in vocab:
            longest[b] = 0  # the byte may be dropped
    nfc = spec.get("normalizer") is not None
    return ByteTokenBound(tuple(longest), nfc=nfc)


def load_tokenizer(source: str | Path, gguf_file: Optional[str] = None, extra_eos: Sequence[int] = ()) -> Tokenizer:
    """From a GGUF file (``source`` = its directory, ``gguf_file`` = its name) or a HF directory."""
    import logging

    from transformers import AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    if not gguf_file:
        return Tokenizer(AutoTokenizer.from_pretrained(str(source), trust_remote_code=False), extra_eos)
    # converting a GGUF vocabulary is slow: keep the converted tokenizer in the cache directory
    cached = _gguf_tokenizer_cache(Path(source) / gguf_file)
    if (cached / "tokenizer.json").is_file():
        try:
            return Tokenizer(AutoTokenizer.from_pretrained(str(cached), trust_remote_code=False), extra_eos)
        except Exception:  # a damaged cache entry: rebuild it
            pass
    tok = AutoTokenizer.from_pretrained(str(source), gguf_file=gguf_file, trust_remote_code=False)
    _save_atomically(tok, cached)
    return Tokenizer(tok, extra_eos)


def _gguf_tokenizer_cache(path: Path) -> Path:
    import hashlib

    from kvbench.core.io import cache_dir

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "tokenizers" / key


def _save_atomically(tok, dest: Path) -> None:
    import os
    import shutil
    import tempfile

    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-"))
        tok.save_pretrained(str(tmp))
        os.replace(tmp, dest)
    except OSError:  # read-only or racing writer: the cache is only an optimisation
        shutil.rmtree(tmp, ignore_errors=True) if "tmp" in locals() else None


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Holds back text that ends in an incomplete UTF-8 sequence, and (``holdback`` characters) text that
    might still become a stop string.
    """

    tokenizer: Tokenizer
    prompt_tail: list[int] = field(default_factory=list)  # a few prompt tokens give the first word its context
    text: str = ""  # all text produced so far (before stop-string cutting)
    _ids: list[int] = field(default_factory=list)
    _prefix: int = 0
    _read: int = 0

    def __post_init__(self) -> None:
        self._ids = list(self.prompt_tail)
        self._prefix = max(len(self._ids) - 5, 0)
        self._read = len(self._ids)
        # byte-level BPE: text is the UTF-8 of the joined token bytes, so the bytes not yet emitted are all
        # the state (the same deltas as decoding the window, at a dict lookup per token instead of two decodes)
        self._pieces = getattr(self.tokenizer, "byte_pieces", None)
        self._pending = bytearray()

    def add(self, token_id: int) -> str:
        if self._pieces is not None:
            self._pending += self._pieces[int(token_id)] or b""
            new_text = self._pending.decode("utf-8", "replace")
            if not new_text or new_text.endswith("\ufffd"):
                return ""
            self._pending.clear()
            self.text += new_text
            return new_text
        self._ids.append(int(token_id))
        prefix_text = self.tokenizer.decode(self._ids[self._prefix : self._read])
        new_text = self.tokenizer.decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Emit whatever is held back (at the end of a request)."""
        if self._pieces is not None:
            delta = self._pending.decode("utf-8", "replace")
            self._pending.clear()
            self.text += delta
            return delta
        rest = self.tokenizer.decode(self._ids[self._prefix :])
        prefix_text = self.tokenizer.decode(self._ids[self._prefix : self._read])
        delta = rest[len(prefix_text) :] if len(rest) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta

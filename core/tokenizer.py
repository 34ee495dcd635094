"""Tokenizer + chat template (shared by the engine, the suites and the load generator), from a GGUF file's metadata or a HF directory (tokenizer.json /
tokenizer_config.json).  Implements ``engine_api.TokenizerProtocol``; also an incremental detokenizer
for streaming.  Never runs code from the checkpoint (no remote code; templates render in jinja's
sandbox through transformers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["Tokenizer", "IncrementalDetokenizer", "load_tokenizer"]


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
        server turns away prompts that certainly cannot fit the context before it tokenizes them."""
        bound = self._token_bound
        if bound is None:
            return 0
        longest, dropped = bound
        kept = len(text) - sum(text.count(c) for c in dropped)
        return -(-kept // longest)

    @cached_property
    def _token_bound(self) -> Optional[tuple[int, str]]:
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            return None
        import json

        try:
            return byte_level_token_bound(json.loads(backend.to_str()))
        except Exception:  # noqa: BLE001 - an unusual definition: no bound, prompts are tokenized
            return None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

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
        # the template already holds the special tokens it wants
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **template_vars), add_special_tokens=False)


_KEEPING_SPLITS = ("Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")


def _byte_chars() -> dict[int, str]:
    """The character that stands for each byte 0..255 in byte-level BPE vocabularies (GPT-2's mapping)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    out = {b: chr(b) for b in keep}
    for i, b in enumerate(b for b in range(256) if b not in out):
        out[b] = chr(256 + i)
    return out


_BYTE_CHARS = _byte_chars()


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
    rstrip) break this: None.
    """
    if spec.get("normalizer") is not None:
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
    missing = [b for b, c in _BYTE_CHARS.items() if c not in vocab]
    if any(0x80 <= b < 0xC0 for b in missing):
        return None  # a continuation byte is dropped: a multi-byte character might vanish whole
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    longest = max([len(t) for t in vocab] + [len(a["content"].encode("utf-8")) for a in added])
    return longest, "".join(chr(b) for b in missing if b < 0x80)


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

    def add(self, token_id: int) -> str:
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
        rest = self.tokenizer.decode(self._ids[self._prefix :])
        prefix_text = self.tokenizer.decode(self._ids[self._prefix : self._read])
        delta = rest[len(prefix_text) :] if len(rest) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta

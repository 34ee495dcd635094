"""Seeded request datasets for the load generator: random lengths, fixed lengths, ShareGPT files, and
``custom`` JSONL files of ``{"prompt": text, "output_tokens": n}`` lines (the format of ``vllm bench serve
--dataset-name custom``, so both clients can send the same prompts).

A dataset yields ``LoadItem``s.  Prompts are token-id lists when the lengths must be exact (random and
fixed datasets on the completions API, which OpenAI-compatible servers accept as ``prompt``), or text
(ShareGPT, and anything sent to the chat API, decoded with a tokenizer).  Every dataset is a pure
function of its arguments and ``seed`` (plus ``salt``, which varies the prompts between cells so that a
server's prefix cache cannot carry over from one cell to the next).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, Sequence, Union

DATASETS = ("random", "fixed", "sharegpt", "custom")


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class LoadItem:
    prompt: Union[str, list[int]]
    prompt_len: Optional[int]  # known input length in tokens (None when not tokenized)
    output_len: int


def _rng(seed: int, salt: str) -> random.Random:
    digest = hashlib.sha256(f"{seed}:{salt}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def _lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {ratio}")
    lo = max(1, int(round(mean * (1 - ratio))))
    hi = max(lo, int(round(mean * (1 + ratio))))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_items(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    salt: str = "",
    vocab_size: int = 32000,
    tokenizer: Optional[TextTokenizer] = None,
    as_text: bool = False,
) -> list[LoadItem]:
    """Random token prompts with lengths uniform in ``[L(1-r), L(1+r)]`` (``r = 0``: fixed lengths).

    Token ids avoid the low and high ends of the vocabulary, where special tokens usually live.  With
    ``as_text`` the ids are decoded to text (needs ``tokenizer``); the input length then counts the
    re-encoded text, which may differ slightly from the sampled length.
    """
    if num_prompts <= 0 or input_len <= 0 or output_len <= 0:
        raise ValueError("num_prompts, input_len and output_len must be positive")
    if as_text and tokenizer is None:
        raise ValueError("text prompts from a random dataset need a tokenizer (--tokenizer, or a server with /tokenize)")
    rng = _rng(seed, salt)
    ins = _lengths(rng, input_len, range_ratio, num_prompts)
    outs = _lengths(rng, output_len, range_ratio, num_prompts)
    lo = min(256, vocab_size // 8)
    hi = max(lo + 1, vocab_size - min(1024, vocab_size // 8))
    items = []
    for n_in, n_out in zip(ins, outs):
        ids = [rng.randrange(lo, hi) for _ in range(n_in)]
        if as_text:
            text = tokenizer.decode(ids)
            items.append(LoadItem(text, len(tokenizer.encode(text)), n_out))
        else:
            items.append(LoadItem(ids, n_in, n_out))
    return items


def _sharegpt_pairs(path: Path) -> list[tuple[str, str]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read ShareGPT file {path}: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"ShareGPT file {path} must hold a JSON list of conversations")
    pairs = []
    for conv in data:
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        q, a = first.get("value"), second.get("value")
        if isinstance(q, str) and isinstance(a, str) and q.strip():
            pairs.append((q, a))
    if not pairs:
        raise ValueError(f"ShareGPT file {path} has no usable conversations (need >= 2 turns with 'value' text)")
    return pairs


def sharegpt_items(
    path: str,
    num_prompts: int,
    seed: int = 0,
    salt: str = "",
    tokenizer: Optional[TextTokenizer] = None,
    output_len: Optional[int] = None,
    max_input_len: int = 1024,
    max_total_len: int = 2048,
) -> list[LoadItem]:
    """First two turns of ShareGPT conversations (prompt, reference reply), shuffled with the seed.

    The output length is the reference reply's token count (needs a tokenizer) unless ``output_len``
    fixes it.  As in common serving benchmarks, pairs with prompts shorter than 4 tokens or over the length
    limits are skipped.
    """
    if tokenizer is None and output_len is None:
        raise ValueError("ShareGPT output lengths need a tokenizer or a fixed --output-len")
    pairs = _sharegpt_pairs(Path(path))
    _rng(seed, salt).shuffle(pairs)
    items: list[LoadItem] = []
    for q, a in pairs:
        if len(items) >= num_prompts:
            break
        n_in = len(tokenizer.encode(q)) if tokenizer else None
        n_out = output_len if output_len is not None else len(tokenizer.encode(a))
        if n_out < 1 or (n_in is not None and (n_in < 4 or n_in > max_input_len or n_in + n_out > max_total_len)):
            continue
        prompt = f"[{salt}] {q}" if salt else q
        items.append(LoadItem(prompt, n_in, n_out))
    if len(items) < num_prompts:
        raise ValueError(f"ShareGPT file {path} yields only {len(items)} usable prompts, {num_prompts} asked")
    return items


def custom_items(path: str, num_prompts: int, output_len: int, salt: str = "",
                 tokenizer: Optional[TextTokenizer] = None) -> list[LoadItem]:
    """The first ``num_prompts`` lines of a JSONL file, in file order: ``prompt`` (text, required) and
    ``output_tokens`` (optional; ``output_len`` otherwise).  Input lengths are counted with ``tokenizer``
    when there is one.  A ``salt`` is prefixed as in the ShareGPT dataset."""
    items: list[LoadItem] = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read custom dataset {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if len(items) >= num_prompts:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{n}: each line needs a non-empty 'prompt' string")
        n_out = row.get("output_tokens", output_len)
        if not isinstance(n_out, int) or isinstance(n_out, bool) or n_out < 1:
            raise ValueError(f"{path}:{n}: 'output_tokens' must be a positive integer, got {n_out!r}")
        text = f"[{salt}] {prompt}" if salt else prompt
        items.append(LoadItem(text, len(tokenizer.encode(text)) if tokenizer is not None else None, n_out))
    if len(items) < num_prompts:
        raise ValueError(f"custom dataset {path} holds {len(items)} prompts, {num_prompts} asked")
    return items

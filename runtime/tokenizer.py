"""Tokenizer + chat template: re-exported from ``kvbench.core.tokenizer`` (the engine, the suites and the
load generator share it)."""

from __future__ import annotations

from kvbench.core.tokenizer import (  # noqa: F401
    _BYTE_CHARS,
    IncrementalDetokenizer,
    Tokenizer,
    byte_level_token_bound,
    load_tokenizer,
)

__all__ = ["Tokenizer", "IncrementalDetokenizer", "load_tokenizer"]

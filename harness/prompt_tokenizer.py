"""Prompt tokenizers: re-exported from ``kvbench.suites.prompt_tokenizer`` (the suites build prompts of an exact
token length with them; the clients hand theirs out)."""

from __future__ import annotations

from kvbench.suites.prompt_tokenizer import (  # noqa: F401
    HFPromptTokenizer,
    JsonPromptTokenizer,
    PromptTokenizer,
    PromptTokenizerError,
    RemotePromptTokenizer,
    load_prompt_tokenizer,
    render_chat_template,
)

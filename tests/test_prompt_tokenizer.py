"""Prompt tokenizers (harness/prompt_tokenizer.py): the server's /tokenize route (kvbench-style and vLLM-style
servers, mocked), local tokenizer files and directories, and the errors that say to pass --tokenizer."""

from __future__ import annotations

import json

import httpx
import pytest

from kvbench.core.client import GenRequest
from kvbench.suites.prompt_tokenizer import (HFPromptTokenizer, JsonPromptTokenizer, PromptTokenizerError, RemotePromptTokenizer, load_prompt_tokenizer, render_chat_template)

TEMPLATE = ("{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MESSAGES = [{"role": "user", "content": "The grass is green. What colour is the grass?"}]


def backing_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["The grass is green . What colour is the grass ?"],
                            trainers.WordLevelTrainer(special_tokens=["<s>", "<unk>", "<|user|>", "<|end|>", "<|assistant|>"],
                                                      show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def mock_server(tok, *, chat_route: bool, info: bool, tokenize: bool = True) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        if request.url.path == "/tokenizer_info" and info:
            return httpx.Response(200, json={"chat_template": TEMPLATE, "bos_token": "<s>"})
        if request.url.path == "/tokenize" and tokenize:
            if "messages" in body:
                if not chat_route:
                    return httpx.Response(400, json={"error": "needs prompt"})
                text = render_chat_template(TEMPLATE, body["messages"], {})
                return httpx.Response(200, json={"tokens": tok.encode(text, add_special_tokens=False).ids})
            ids = tok.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True)).ids
            return httpx.Response(200, json={"tokens": ids, "count": len(ids)})
        if request.url.path == "/detokenize":
            return httpx.Response(200, json={"prompt": tok.decode(body["tokens"], skip_special_tokens=False)})
        return httpx.Response(404, json={"error": "not found"})

    return httpx.MockTransport(handler)


@pytest.mark.parametrize("chat_route,info", [(False, True), (True, False), (True, True)])
def test_remote_tokenizer_counts_what_the_server_sees(chat_route, info):
    tok = backing_tokenizer()
    remote = RemotePromptTokenizer("http://server", transport=mock_server(tok, chat_route=chat_route, info=info))
    assert remote.has_chat_template
    text = MESSAGES[0]["content"]
    assert remote.encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert remote.prompt_ids(GenRequest(prompt=text)) == tok.encode(text).ids  # with <s>
    chat = remote.prompt_ids(GenRequest(messages=MESSAGES))
    assert chat == tok.encode(render_chat_template(TEMPLATE, MESSAGES, {}), add_special_tokens=False).ids
    assert len(chat) == len(tok.encode(text, add_special_tokens=False).ids) + 3  # <|user|>, <|end|>, <|assistant|>
    assert remote.decode(remote.encode("The grass")) == "The grass"


def test_remote_without_chat_template_has_none():
    remote = RemotePromptTokenizer("http://server", transport=mock_server(backing_tokenizer(), chat_route=False, info=False))
    assert not remote.has_chat_template
    with pytest.raises(PromptTokenizerError, match="no chat template"):
        remote.prompt_ids(GenRequest(messages=MESSAGES))


def test_server_without_tokenize_route_says_to_pass_tokenizer():
    with pytest.raises(PromptTokenizerError, match="no usable /tokenize route.*pass --tokenizer"):
        RemotePromptTokenizer("http://server", transport=mock_server(backing_tokenizer(), chat_route=False, info=False,
                                                                     tokenize=False))


def test_local_tokenizer_json_and_hf_directory(tmp_path):
    tok = backing_tokenizer()
    f = tmp_path / "tokenizer.json"
    tok.save(str(f))
    j = load_prompt_tokenizer(str(f))
    assert isinstance(j, JsonPromptTokenizer) and not j.has_chat_template
    assert j.prompt_ids(GenRequest(prompt="The grass")) == tok.encode("The grass").ids

    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>")
    hf.chat_template = TEMPLATE
    d = tmp_path / "hf"
    hf.save_pretrained(str(d))
    h = load_prompt_tokenizer(str(d))
    assert isinstance(h, HFPromptTokenizer) and h.has_chat_template
    chat = h.prompt_ids(GenRequest(messages=MESSAGES))
    assert chat == tok.encode(render_chat_template(TEMPLATE, MESSAGES, {}), add_special_tokens=False).ids


def test_templateless_chat_prompt_starts_with_the_bos(tmp_path):
    """A checkpoint without a chat template (a base model such as Gemma 3 270M): chat messages become a plain
    transcript that still gets the tokenizer's BOS, as the embedded engine encodes it (Gemma degenerates
    without one); the count is the engine's own."""
    from transformers import PreTrainedTokenizerFast

    from kvbench.core.tokenizer import load_tokenizer

    tok = backing_tokenizer()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>")
    hf.save_pretrained(str(tmp_path))
    h = load_prompt_tokenizer(str(tmp_path))
    assert isinstance(h, HFPromptTokenizer) and not h.has_chat_template
    ids = h.prompt_ids(GenRequest(messages=MESSAGES))
    text = "user: " + MESSAGES[0]["content"] + "\nassistant:"
    assert ids[0] == 0 and ids == [0] + tok.encode(text, add_special_tokens=False).ids
    assert ids == load_tokenizer(str(tmp_path)).encode_chat(MESSAGES)


def test_missing_paths_and_unreachable_hub_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(PromptTokenizerError, match="no such file or directory"):
        load_prompt_tokenizer(str(tmp_path / "missing" / "tokenizer.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PromptTokenizerError, match="holds no tokenizer.json"):
        load_prompt_tokenizer(str(tmp_path / "empty"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty hub cache
    with pytest.raises(PromptTokenizerError, match="cannot be reached"):
        load_prompt_tokenizer("kvbench-test/no-such-tokenizer")

"""The ruler suite's prompts: deterministic, at the requested token length for two different tokenizers, with
needles at their stated depths, and task answers that are really the answers.  Tokenizers are built here
with the ``tokenizers`` library (a byte-level BPE trained on the built-in text and a word-level one), so
nothing is downloaded; the default model's own tokenizer is checked in a slow test."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from kvbench.suites.prompt_tokenizer import HFPromptTokenizer, JsonPromptTokenizer
from kvbench.suites.base import Item, SuiteError, SuiteOptions, item_seed, request_text
from kvbench.suites.ruler.suite import RulerTask, tolerance
from kvbench.suites.ruler.params import TASKS, parse_params
from kvbench.suites.ruler.words import ADJECTIVES, ESSAY, NOISE_LINE, NOUNS

SPECIALS = ["<s>", "<unk>", "<|user|>", "<|end|>", "<|assistant|>"]


def _corpus() -> list[str]:
    digits = " ".join(str(i) for i in range(0, 1000, 7))
    words = " ".join(ADJECTIVES + NOUNS)
    return [ESSAY, NOISE_LINE * 20, words, digits, "VAR ABCDE = VAR FGHIJ. Question: Answer: ...."] * 3


def bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def word_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(_corpus(), trainers.WordLevelTrainer(special_tokens=SPECIALS, show_progress=False))
    return tok


class ChatTok:
    """A runtime.tokenizer.Tokenizer look-alike over a ``tokenizers`` object, with a small chat template."""

    chat_template = "<|user|>\n{content}<|end|>\n<|assistant|>\n"

    def __init__(self, tok):
        self._tok = tok

    def encode(self, text, add_special_tokens=True):
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(self.chat_template.format(content=m["content"]) for m in messages)


@pytest.fixture(scope="module")
def toks():
    bpe, word = bpe_tokenizer(), word_tokenizer()
    return {"bpe": JsonPromptTokenizer(bpe, "bpe"), "word": JsonPromptTokenizer(word, "word"),
            "bpe-chat": HFPromptTokenizer(ChatTok(bpe), "bpe-chat")}


def task_of(tok, **params) -> RulerTask:
    return RulerTask(tok, parse_params(params), None)


def prepared(task: RulerTask, name: str, length: int, depth=None, seed: int = 1) -> Item:
    return task.prepare(Item(f"{name}-x", "", {"task": name, "length": length, "depth": depth}), 0, seed)


def test_two_tokenizers_really_differ(toks):
    text = "The special magic number for quiet-harbor is: 1234567."
    assert len(toks["bpe"].encode(text)) != len(toks["word"].encode(text))


@pytest.mark.parametrize("tok_name,style", [("bpe", "completion"), ("word", "completion"), ("bpe-chat", "chat")])
@pytest.mark.parametrize("name", TASKS)
def test_prompt_hits_the_length_within_one_percent(toks, tok_name, style, name):
    tok = toks[tok_name]
    task = task_of(tok, prompt_style=style)
    for length in (1024, 4096):
        item = prepared(task, name, length, 50.0 if name.startswith("niah") else None)
        req = item.data["request"]
        n = len(tok.prompt_ids(req))  # counted again, from scratch: BOS / chat template included
        assert n == item.data["context_tokens"]
        assert length - tolerance(length) <= n <= length, (name, length, n)
        if style == "chat":
            assert req.messages is not None and req.messages[0]["role"] == "user"
            assert n > len(tok.encode(req.messages[0]["content"]))  # the template's tokens are counted
        else:
            bos = 1 if tok_name == "bpe" else 0  # the BPE tokenizer adds <s>, the word-level one nothing
            assert req.prompt is not None and n == len(tok.encode(req.prompt)) + bos


def test_long_lengths(toks):
    tok = toks["word"]
    task = task_of(tok, prompt_style="completion")
    for name, length in (("niah_single", 131072), ("fwe", 32768), ("vt", 32768)):
        n = prepared(task, name, length, 100.0 if name.startswith("niah") else None).data["context_tokens"]
        assert length - tolerance(length) <= n <= length


@pytest.mark.parametrize("name", TASKS)
def test_same_seed_same_bytes_other_seed_differs(toks, name):
    depth = 25.0 if name.startswith("niah") else None
    a = prepared(task_of(toks["bpe"], prompt_style="completion"), name, 1024, depth, seed=11)
    b = prepared(task_of(toks["bpe"], prompt_style="completion"), name, 1024, depth, seed=11)  # a fresh task object
    c = prepared(task_of(toks["bpe"], prompt_style="completion"), name, 1024, depth, seed=12)
    assert request_text(a.data["request"]) == request_text(b.data["request"])
    assert a.data["answers"] == b.data["answers"]
    assert request_text(a.data["request"]) != request_text(c.data["request"])


def test_items_and_seeds_are_stable_across_cells(toks):
    """Two runs (cells) with the same options list the same ids and build the same prompts per repeat,
    whatever order the items are prepared in."""
    opts = SuiteOptions(limit=2, seed=3, repeats=2)
    t1 = task_of(toks["bpe"], context_lengths=[1024], depths=3, tasks=["niah_single", "vt"], prompt_style="completion")
    t2 = task_of(toks["bpe"], context_lengths=[1024], depths=3, tasks=["niah_single", "vt"], prompt_style="completion")
    items1, _ = t1.load_items(opts)
    items2, _ = t2.load_items(opts)
    assert [i.item_id for i in items1] == [i.item_id for i in items2]
    assert len(items1) == 3 * 2 + 2  # niah_single: 3 depths x 2; vt: 2 (no depth axis)
    assert items1[0].item_id == "niah_single-L1024-d0-0" and items1[-1].item_id == "vt-L1024-d0-1"
    texts1 = {(it.item_id, k): request_text(t1.prepare(it, k, item_seed(3, "ruler", it.item_id, k)).data["request"])
              for it in items1 for k in range(2)}
    texts2 = {(it.item_id, k): request_text(t2.prepare(it, k, item_seed(3, "ruler", it.item_id, k)).data["request"])
              for it in reversed(items2) for k in (1, 0)}
    assert texts1 == texts2
    assert texts1[("vt-L1024-d0-0", 0)] != texts1[("vt-L1024-d0-0", 1)]  # repeats draw new content


def _measured_depth(tok, context: str, needle: str) -> float:
    """Tokens of the context before the needle over the context's tokens without the needle, in percent."""
    i = context.index(needle)
    before = len(tok.encode(context[:i]))
    return 100.0 * before / (len(tok.encode(context)) - len(tok.encode(needle)))


@pytest.mark.parametrize("tok_name", ["bpe", "word"])
@pytest.mark.parametrize("name", ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"])
def test_needle_sits_at_its_depth(toks, tok_name, name):
    tok = toks[tok_name]
    task = task_of(tok, haystack="noise", prompt_style="completion")
    for length in (1024, 4096):
        for depth in (0.0, 10.0, 33.0, 50.0, 75.0, 100.0):
            inst = task.instance(name, length, depth, seed=int(depth) + length)
            n, _, req = task.fit(inst, length)
            context = inst.context(n)
            assert context in req.prompt
            got = _measured_depth(tok, context, inst.meta["needle"])
            assert abs(got - depth) <= 1.5, (name, length, depth, got)


def test_needle_depth_in_essay_and_file_text_is_within_a_sentence(toks, tmp_path):
    tok = toks["bpe"]
    text = "\n\n".join(ESSAY.split("\n\n")[::-1]) * 4  # natural text, longer than 4096 tokens
    f = tmp_path / "hay.txt"
    f.write_text(text)
    for params in ({"haystack": "essay"}, {"haystack_file": str(f)}):
        task = task_of(tok, prompt_style="completion", **params)
        longest = max(len(tok.encode(s)) for s in re.split(r"(?<=[.!?])\s+", ESSAY))
        for depth in (0.0, 25.0, 50.0, 80.0, 100.0):
            inst = task.instance("niah_single", 4096, depth, seed=7)
            n, _, _ = task.fit(inst, 4096)
            context = inst.context(n)
            got = _measured_depth(tok, context, inst.meta["needle"])
            assert abs(got - depth) <= 1.0 + 100.0 * longest / 4096, (params, depth, got)
            i = context.index(inst.meta["needle"])
            assert i == 0 or context[:i].rstrip()[-1] in ".!?"  # never inside a sentence


def _resolve_vt(prompt: str) -> tuple[dict, str]:
    values: dict[str, str] = {}
    for dst, src in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", prompt):
        if src.startswith("VAR"):
            assert src[4:] in values, f"{dst} assigned from {src} before it has a value"
            values[dst] = values[src[4:]]
        else:
            values[dst] = src
    asked = re.search(r"assigned the value (\d+) in the text above", prompt).group(1)
    return values, asked


@pytest.mark.parametrize("length", [512, 2048])
def test_vt_chains_resolve_to_the_answers(toks, length):
    task = task_of(toks["bpe"], prompt_style="completion")
    for seed in range(5):
        item = prepared(task, "vt", length, seed=seed)
        values, asked = _resolve_vt(item.data["request"].prompt)
        assert sorted(v for v, x in values.items() if x == asked) == sorted(item.data["answers"])
        assert len(item.data["answers"]) == 5
        assert len(set(values.values())) == 2  # a distractor chain with another value


@pytest.mark.parametrize("length", [1024, 4096])
def test_cwe_answers_are_the_most_common_words(toks, length):
    task = task_of(toks["bpe"], prompt_style="completion")
    for seed in range(3):
        item = prepared(task, "cwe", length, seed=seed)
        prompt = item.data["request"].prompt
        numbered = re.findall(r"(\d+)\. ([a-z]+)", prompt)
        assert [int(i) for i, _ in numbered] == list(range(1, len(numbered) + 1))
        counts = Counter(w for _, w in numbered)
        answers = item.data["answers"]
        assert len(answers) == 10
        assert min(counts[a] for a in answers) > max(c for w, c in counts.items() if w not in answers)


@pytest.mark.parametrize("length", [1024, 8192])
def test_fwe_answers_are_the_three_most_frequent_words(toks, length):
    task = task_of(toks["bpe"], prompt_style="completion")
    for seed in range(3):
        item = prepared(task, "fwe", length, seed=seed)
        prompt = item.data["request"].prompt
        body = prompt[prompt.index("coded words. ") + len("coded words. "): prompt.index("\nQuestion:")]
        counts = Counter(body.split())
        ranked = [w for w, _ in counts.most_common()]
        assert ranked[0] == "...."
        answers = item.data["answers"]
        assert set(ranked[1:4]) == set(answers)
        assert counts[ranked[3]] > counts[ranked[4]]  # no tie with the fourth most frequent word


def test_below_the_template_minimum_is_one_clear_error(toks):
    task = task_of(toks["bpe"], context_lengths=[64], tasks=["niah_single"], prompt_style="completion")
    with pytest.raises(SuiteError, match="context length 64 is below the minimum of task niah_single"):
        task.load_items(SuiteOptions(limit=1))
    task = task_of(toks["bpe"], context_lengths=[256], tasks=["cwe"], prompt_style="completion")
    with pytest.raises(SuiteError, match="below the minimum of task cwe"):
        task.load_items(SuiteOptions(limit=1))


def test_length_above_the_targets_context_is_one_clear_error(toks):
    task = RulerTask(toks["bpe"], parse_params({"context_lengths": [1024, 4096], "tasks": ["vt"]}), max_model_len=4096)
    with pytest.raises(SuiteError, match=r"context length 4096 \+ \d+ generated tokens \(vt\) exceeds the target's context of 4096"):
        task.load_items(SuiteOptions(limit=1))


def test_haystack_file_errors(toks, tmp_path):
    with pytest.raises(SuiteError, match="haystack_file: .* does not exist"):
        parse_params({"haystack_file": str(tmp_path / "missing.txt")})
    short = tmp_path / "short.txt"
    short.write_text("Too short. " * 10)
    task = task_of(toks["bpe"], haystack_file=str(short), tasks=["niah_single"], context_lengths=[1024])
    with pytest.raises(SuiteError, match="holds 20 words"):
        task.load_items(SuiteOptions(limit=1))
    medium = tmp_path / "medium.txt"
    medium.write_text(ESSAY)
    task = task_of(toks["bpe"], haystack_file=str(medium), tasks=["niah_single"], context_lengths=[512, 8192],
                   prompt_style="completion")
    with pytest.raises(SuiteError, match="too short for context length 8192"):
        task.load_items(SuiteOptions(limit=1))


@pytest.mark.parametrize("params,needle", [
    ({"depths": 0}, "between 1 and 101"),
    ({"depths": [10, 101]}, r"\[0, 100\]"),
    ({"depths": "-5,50"}, r"\[0, 100\]"),
    ({"depths": "abc"}, "count N >= 1"),
    ({"tasks": ["niah_single", "qa"]}, "unknown task 'qa'"),
    ({"context_lengths": [0]}, "between 1 and"),
    ({"context_lengths": "1024,lots"}, "'lots'"),
    ({"haystack": "poems"}, "choose one of"),
    ({"prompt_style": "base"}, "choose one of"),
    ({"needles": 3}, "unknown option"),
])
def test_bad_params_are_one_clear_error(params, needle):
    with pytest.raises(SuiteError, match=needle):
        parse_params(params)


def test_params_parse():
    p = parse_params({"context_lengths": "4k,1024,1024", "depths": 1, "tasks": "vt,niah_single"})
    assert p.context_lengths == [1024, 4096] and p.depths == [50.0] and p.tasks == ["niah_single", "vt"]
    assert parse_params({"depths": 5}).depths == [0.0, 25.0, 50.0, 75.0, 100.0]
    assert parse_params({"depths": "2"}).depths == [0.0, 100.0]
    assert parse_params({"depths": "50%"}).depths == [50.0]
    assert parse_params({"depths": "90,10"}).depths == [10.0, 90.0]
    assert parse_params({"context_lengths": ["128k"]}).context_lengths == [131072]


def test_chat_style_needs_a_chat_template(toks):
    with pytest.raises(SuiteError, match="has no chat template"):
        task_of(toks["bpe"], prompt_style="chat")
    assert task_of(toks["bpe"]).style == "completion" and task_of(toks["bpe-chat"]).style == "chat"


@pytest.mark.slow
def test_default_model_tokenizer_lengths_and_depth():
    from kvbench.runtime.default_model import default_model_path
    from kvbench.core.tokenizer import load_tokenizer

    path = default_model_path(quiet=True)
    tok = HFPromptTokenizer(load_tokenizer(path.parent, path.name), "default")
    for style in ("chat", "completion"):
        task = task_of(tok, prompt_style=style)
        for name in TASKS:
            item = prepared(task, name, 2048, 30.0 if name.startswith("niah") else None)
            assert 2048 - tolerance(2048) <= len(tok.prompt_ids(item.data["request"])) <= 2048
    inst = task_of(tok, haystack="noise").instance("niah_single", 4096, 30.0, seed=5)
    n, _, _ = task_of(tok, haystack="noise").fit(inst, 4096)
    assert abs(_measured_depth(tok, inst.context(n), inst.meta["needle"]) - 30.0) <= 1.5

"""``ruler``: synthetic long-context tasks at token lengths of the target model (RULER-style; tasks and
scoring in suites/ruler/tasks.py, haystacks in suites/ruler/haystack.py, options in suites/ruler/params.py).

Items.  For every requested length L and task, ``--limit`` items (default 5) per depth for the four needle
tasks, ``--limit`` items for vt, cwe and fwe (no depth axis).  Item ids are
``<task>-L<L>-d<depth index>-<n>`` (``d0`` for tasks without depth); the same ids and, for the same
``--sample-seed``, the same prompts in every cell.  Each (item, repeat) draws its content from
``item_seed(seed, "ruler", item_id, repeat)``; the same seed gives the same bytes.

Length.  The prompt is fitted to L tokens as the target will see them: completion prompts with the
tokenizer's special tokens (BOS), chat prompts through the chat template; the fill (haystack words, list
entries, coded words) is searched until the prompt holds between L − ⌊L/100⌋ and L tokens; the search
path depends only on the item's content, so every cell gets the same fill and the same bytes.  The record's
``context_length`` is L, ``context_tokens`` the fitted count.  A length whose prompt cannot be that short
(the template, question and needles alone are longer), a length + generation budget above the target's
context, or a haystack file too short are errors before any request is sent.

Prompt styles: ``completion`` = header + context + question + answer prefix (RULER's form); ``chat`` = one
user turn with header + context + question, no answer prefix.  Generation is greedy with the task's budget
(niah 128, vt 30, cwe 120, fwe 50 tokens, raised to the complete answer + 8 where that is longer: chat vt;
``--max-tokens`` overrides) and stops at the end of the turn.  A ``--max-tokens`` that cannot hold a task's
complete answer in the target's tokenizer (the values, and in chat the answer sentence around them) is refused
before any request; each record carries ``answer_tokens``, that answer's length.
"""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import replace
from typing import Optional

from kvbench.core import GenRequest, SamplingParams
from kvbench.suites.base import GenerationTask, Item, Scored, SuiteError, SuiteInputError, SuiteOptions, item_seed
from kvbench.suites.ruler.fit import BelowMinimum, TooShort, fit_length
from kvbench.suites.ruler.haystack import Haystack, TokenIndex, essay_haystack, file_haystack, noise_haystack
from kvbench.suites.ruler.params import DEFAULT_LIMIT, DEPTH_TASKS, RulerParams, parse_params
from kvbench.suites.ruler.tasks import (AUTO_HAYSTACK, MAX_TOKENS, Instance, make_cwe, make_fwe, make_niah, make_vt,
                                        string_match_all)

log = logging.getLogger(__name__)
NAME = "ruler"
ANSWER_ROOM = 8  # tokens beyond a complete answer in a task's own budget: the model's wording, the end of turn


def tolerance(length: int) -> int:
    """How far below the requested length a prompt may end (1%)."""
    return length // 100


class RulerTask(GenerationTask):
    name = NAME
    default_params = SamplingParams(max_tokens=128, temperature=0.0)
    applies_limit = True  # --limit counts items per (task, length, depth); the runner must not cut the list

    def __init__(self, tokenizer, params: RulerParams, max_model_len: Optional[int] = None,
                 kv_tokens: Optional[int] = None):
        """``tokenizer``: a suites.prompt_tokenizer.PromptTokenizer of the target; ``max_model_len`` its
        context and ``kv_tokens`` its KV cache size in tokens, where known (checked against the lengths)."""
        self.tok = tokenizer
        self.p = params
        self.max_model_len = max_model_len
        self.kv_tokens = kv_tokens
        if params.prompt_style is None:
            self.style = "chat" if tokenizer.has_chat_template else "completion"
        else:
            self.style = params.prompt_style
        if self.style == "chat" and not tokenizer.has_chat_template:
            raise SuiteInputError(f"ruler prompt_style chat: the tokenizer ({tokenizer.name}) has no chat template; "
                                  "use --prompt-style completion")
        self._hay: dict[str, tuple[Haystack, TokenIndex]] = {}
        self._lock = threading.Lock()
        self._max_tokens: Optional[int] = None
        self._budgets: dict[str, int] = {}  # per-task budgets without --max-tokens (fit_budgets)

    # ------------------------------------------------------------------------------ haystacks
    def haystack_kind(self, task: str) -> str:
        if self.p.haystack_file:
            return "file"
        return AUTO_HAYSTACK[task] if self.p.haystack == "auto" else self.p.haystack

    def haystack(self, task: str) -> tuple[Haystack, TokenIndex]:
        kind = self.haystack_kind(task)
        with self._lock:
            if kind not in self._hay:
                builtin = {"noise": noise_haystack, "essay": essay_haystack}
                hay = file_haystack(self.p.haystack_file) if kind == "file" else builtin[kind]()
                self._hay[kind] = (hay, TokenIndex(hay, self.tok.encode))
            return self._hay[kind]

    # ------------------------------------------------------------------------------ instances
    def instance(self, task: str, length: int, depth: Optional[float], seed: int) -> Instance:
        rng = random.Random(seed)
        count = lambda text: len(self.tok.encode(text))  # noqa: E731
        if task in DEPTH_TASKS:
            hay, index = self.haystack(task)
            return make_niah(task, rng, 50.0 if depth is None else depth, hay, index, count)
        if task == "vt":
            hay, index = self.haystack(task)
            return make_vt(rng, hay, index, count)
        if task == "cwe":
            return make_cwe(rng, length)
        return make_fwe(rng, length)

    def request(self, inst: Instance, n: int, params: SamplingParams) -> GenRequest:
        body = inst.header + inst.context(n) + inst.question
        if self.style == "chat":
            return GenRequest(messages=[{"role": "user", "content": body}], params=params)
        return GenRequest(prompt=body + inst.answer_prefix, params=params)

    def fit(self, inst: Instance, length: int) -> tuple[int, int, GenRequest]:
        """(fill, prompt tokens, request) for ``length``; SuiteError when it cannot be done."""
        params = SamplingParams()
        memo: dict[int, int] = {}

        def count(n: int) -> int:
            if n not in memo:
                memo[n] = len(self.tok.prompt_ids(self.request(inst, n, params)))
            return memo[n]

        guess = None  # the search must depend on the instance alone: the same fill in every cell
        if inst.guess is not None:
            guess = inst.guess(max(length - count(inst.lo), 0))
        try:
            n, tokens = fit_length(count, length, inst.lo, inst.hi, tolerance(length), guess, inst.per_unit)
        except BelowMinimum as e:
            raise SuiteInputError(f"ruler: context length {length} is below the minimum of task {inst.task} for this "
                                  f"tokenizer and {self.style} prompts: its prompt needs {e.minimum} tokens without "
                                  "any filler; use a longer length or drop the task (--ruler-tasks)") from None
        except TooShort as e:
            raise SuiteInputError(f"ruler haystack_file: {self.p.haystack_file} is too short for context length {length} "
                                  f"(task {inst.task}): all of its text gives a {e.reached}-token prompt; use a longer "
                                  "file or the built-in haystacks") from None
        except SuiteError as e:
            raise SuiteError(f"ruler: task {inst.task} at length {length}: {e}") from None
        return n, tokens, self.request(inst, n, params)

    # ------------------------------------------------------------------------------ answer budgets
    def budget(self, task: str) -> int:
        """max_tokens when given, else the task's own budget, raised to hold its complete answer (``fit_budgets``)."""
        if self._max_tokens is not None:
            return self._max_tokens
        return self._budgets.get(task, MAX_TOKENS[task])

    def fit_budgets(self, seed: int) -> None:
        """Each task's budget without --max-tokens: RULER's (niah 128, vt 30, ...), or the complete answer plus
        ``ANSWER_ROOM`` tokens where that is longer (a chat model restating vt's sentence needs ~55 tokens)."""
        self._budgets = {}
        for task in self.p.tasks:
            depth = self.p.depths[0] if task in DEPTH_TASKS else None
            inst = self.instance(task, self.p.context_lengths[0], depth, item_seed(seed, NAME, f"{task}-budget", 0))
            self._budgets[task] = max(MAX_TOKENS[task], self.answer_tokens(inst) + ANSWER_ROOM)

    def answer_tokens(self, inst: Instance) -> int:
        """Tokens of the shortest complete answer, in the target's tokenizer: the values after the prompt's answer
        prefix (completion prompts end with it), or in chat the answer sentence with its values (chat models
        restate the question's phrase before the values)."""
        values = ", ".join(inst.answers)
        if self.style == "chat":
            phrase = inst.answer_prefix.strip().removeprefix("Answer:").strip()
            return len(self.tok.encode(f"{phrase} {values}."))
        return len(self.tok.encode(f" {values}"))

    def check_budget(self, inst: Instance, length: int) -> None:
        """Refuse a generation budget that cannot hold the task's answers (every answer would be cut off)."""
        need, have = self.answer_tokens(inst), self.budget(inst.task)
        if need > have:
            raise SuiteInputError(
                f"ruler: max_tokens {have} cannot hold a complete answer of task {inst.task} at length {length}: "
                f"{need} tokens with this tokenizer ({self.style} prompts, {len(inst.answers)} value(s)); raise "
                f"max_tokens to at least {need} (with room for the model's own wording), or leave it unset for the "
                f"task's budget, which holds it")

    def _longer_context(self, need: int) -> str:
        """How the target gets a context of ``need`` tokens: a bigger KV cache when the cache is what cut its
        context, else a longer --max-model-len (the embedded engine refuses one above the model's own)."""
        if self.kv_tokens and self.kv_tokens <= self.max_model_len:
            return f"a KV cache of at least {need} tokens (it holds {self.kv_tokens}; raise --kv-budget-gb / --mem-fraction)"
        return (f"--max-model-len {need} or more where the model supports it (the embedded engine refuses more than "
                f"the model's max_position_embeddings)")

    # ------------------------------------------------------------------------------ GenerationTask

    def load_items(self, opts: SuiteOptions) -> tuple[list[Item], str]:
        self._max_tokens = opts.max_tokens
        limit = opts.limit if opts.limit is not None else DEFAULT_LIMIT
        self.fit_budgets(opts.seed)
        if self.max_model_len:
            for length in self.p.context_lengths:
                for task in self.p.tasks:
                    if length + self.budget(task) > self.max_model_len:
                        raise SuiteInputError(
                            f"ruler: context length {length} + {self.budget(task)} generated tokens ({task}) exceeds the "
                            f"target's context of {self.max_model_len} tokens; use lengths up to "
                            f"{self.max_model_len - self.budget(task)}, or {self._longer_context(length + self.budget(task))}")
        else:
            log.warning("ruler: the target reports no max_model_len; lengths are not checked against its context")
        if self.kv_tokens:
            need = max(length + self.budget(task) for length in self.p.context_lengths for task in self.p.tasks)
            if need > self.kv_tokens:
                raise SuiteInputError(f"ruler: the longest request needs {need} tokens of KV cache but the target's cache "
                                      f"holds {self.kv_tokens}; raise --kv-budget-gb / --mem-fraction or use shorter lengths")
        items: list[Item] = []
        for length in self.p.context_lengths:
            for task in self.p.tasks:
                depths = list(enumerate(self.p.depths)) if task in DEPTH_TASKS else [(0, None)]
                first = len(items)
                for di, depth in depths:
                    for n in range(limit):
                        iid = f"{task}-L{length}-d{di}-{n}"
                        items.append(Item(iid, "", {"task": task, "length": length, "depth": depth}))
                # fit one instance per (task, length) now: bad lengths and short files fail before any request
                first = items[first]
                inst = self.instance(task, length, first.data["depth"], item_seed(opts.seed, NAME, first.item_id, 0))
                self.fit(inst, length)
                self.check_budget(inst, length)
        hay = self.p.haystack_file or self.p.haystack
        return items, f"synthetic (ruler tasks {','.join(self.p.tasks)}; haystack {hay}; tokenizer {self.tok.name})"

    def prepare(self, item: Item, repeat: int, seed: int) -> Item:
        d = item.data
        inst = self.instance(d["task"], d["length"], d["depth"], seed)
        n, tokens, req = self.fit(inst, d["length"])
        need = self.answer_tokens(inst)
        if need > self.budget(d["task"]):
            log.warning("ruler: %s needs %d answer tokens, above max_tokens %d: its answer will be cut off",
                        item.item_id, need, self.budget(d["task"]))
        data = {**d, "answers": inst.answers, "context_tokens": tokens, "fill": n, "request": req, "answer_tokens": need}
        return Item(item.item_id, ", ".join(inst.answers), data)

    def build(self, item: Item, repeat: int, params: SamplingParams) -> GenRequest:
        req: GenRequest = item.data["request"]
        if self._max_tokens is None:
            params = replace(params, max_tokens=self.budget(item.data["task"]))
        return replace(req, params=params)

    def score(self, item: Item, output: str) -> Scored:
        frac, found = string_match_all(output, item.data["answers"])
        return Scored(extracted=", ".join(found) if found else None, correct=frac == 1.0,
                      invalid=not (output or "").strip(), scores={"ruler": frac})

    def record_fields(self, item: Item) -> dict:
        d = item.data
        return {"task": d["task"], "context_length": d["length"], "context_tokens": d.get("context_tokens"),
                "depth": d["depth"], "answers": list(d.get("answers") or []), "answer_tokens": d.get("answer_tokens")}

    def describe_params(self, opts: SuiteOptions) -> str:
        budget = (f"max{opts.max_tokens}" if opts.max_tokens is not None else
                  "max-" + "-".join(f"{t}{self.budget(t)}" for t in self.p.tasks))
        t = self.params(opts, 0).temperature
        return f"{'greedy' if t == 0 else f't{t:g}'}:{budget}"

    def protocol(self, opts: SuiteOptions) -> str:
        hay = "file" if self.p.haystack_file else self.p.haystack
        return f"kvbench:ruler:v1:{self.style}:haystack-{hay}:depths-{self.p.depth_spec}:{self.describe_params(opts)}"

    def extra_summary(self, records: list[dict], opts: SuiteOptions) -> dict:
        def group(key: str) -> dict:
            out: dict = {}
            for r in records:
                out.setdefault(str(r.get(key)), []).append(r)
            return {k: {"n": len(rs), "ruler": sum(r["scores"].get("ruler", 0.0) for r in rs) / len(rs),
                        "accuracy": sum(bool(r.get("correct")) for r in rs) / len(rs)} for k, rs in out.items()}

        by_length = group("context_length")
        return {"by_length": dict(sorted(by_length.items(), key=lambda kv: int(kv[0]))), "by_task": group("task")}


def make_ruler(client, opts: SuiteOptions) -> RulerTask:
    """The suite for ``client``: its tokenizer (or ``params.tokenizer`` for an HTTP target) and context."""
    from kvbench.suites.prompt_tokenizer import PromptTokenizerError, load_prompt_tokenizer

    params = parse_params(opts.extra)
    info = client.info() if hasattr(client, "info") else {}
    own = getattr(client, "tokenizer", None)
    embedded = info.get("type") == "embedded"
    try:
        if params.tokenizer and not embedded:
            tok = load_prompt_tokenizer(params.tokenizer)
        elif own is not None:
            if params.tokenizer:
                log.info("ruler: the embedded engine uses its own tokenizer; tokenizer=%s ignored", params.tokenizer)
            tok = own()
        else:
            raise SuiteInputError("the ruler suite needs the target's tokenizer and this client offers none; "
                                  "pass --tokenizer (a tokenizer.json, an HF directory or a hub name)")
    except PromptTokenizerError as e:
        raise SuiteInputError(f"ruler: {e}") from None
    mml = info.get("max_model_len")
    kv = (info.get("capacity") or {}).get("tokens") if isinstance(info.get("capacity"), dict) else None
    return RulerTask(tok, params, int(mml) if mml else None, int(kv) if kv else None)

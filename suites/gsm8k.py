"""GSM8K: lm-eval's ``gsm8k`` (5-shot) and ``gsm8k_cot`` (8-shot) protocols, and a chat zero-shot protocol.

``gsm8k`` reproduces lm-eval 0.4's task (v3.0): ``Question: {q}\\nAnswer: {a}\\n\\n`` five times, few-shot
examples drawn from the *train* split by one ``random.Random(1234)`` advanced through the test items in
order (as lm-eval's default sampler with its default few-shot seed does, so ``--limit N`` prompts equal
lm-eval's first N), then ``Question: {q}\\nAnswer:``; greedy, stop at ``Question:``, ``</s>``,
``<|im_end|>``, 256 new tokens.  ``gsm8k_cot`` uses lm-eval's eight fixed chain-of-thought exemplars
(read from the installed lm-eval's task YAML, so they stay byte-identical) in ``Q: ...\\nA: ...`` form.
Both are scored by strict-match and flexible-extract exactly as lm-eval scores them; the record's
``correct`` is strict-match.
"""

from __future__ import annotations

import random
from typing import Optional

from kvbench.core import GenRequest, SamplingParams
from kvbench.suites.base import GenerationTask, Item, Scored, SuiteError, SuiteOptions
from kvbench.suites.data import HubSource, load_rows
from kvbench.suites.extract import (
    GSM8K_COT_STRICT,
    GSM8K_FLEXIBLE,
    GSM8K_STRICT,
    INVALID,
    exact_match,
    extract_answer_line,
    gsm8k_target,
    last_number,
    numbers_equal,
    regex_filter,
)

LM_EVAL_STOP = ("Question:", "</s>", "<|im_end|>")
LM_EVAL_COT_STOP = ("Q:", "</s>", "<|im_end|>")
FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed


def load_gsm8k(opts: SuiteOptions, split: str) -> tuple[list[dict], str]:
    return load_rows(
        opts.data_dir,
        (f"gsm8k_{split}", f"gsm8k/{split}", f"gsm8k-{split}"),
        HubSource("openai/gsm8k", "main", split),
        required=("question", "answer"),
    )


def _test_rows(opts: SuiteOptions) -> tuple[list[dict], str]:
    rows, source = load_gsm8k(opts, "test")
    if opts.limit is not None:
        rows = rows[: opts.limit]
    return rows, source


def _items(rows: list[dict]) -> list[Item]:
    return [Item(f"test-{i}", gsm8k_target(r["answer"]), {"question": r["question"]}) for i, r in enumerate(rows)]


class Gsm8k(GenerationTask):
    name = "gsm8k"
    num_fewshot = 5
    default_params = SamplingParams(max_tokens=256, temperature=0.0, stop=LM_EVAL_STOP)
    strict_pattern = GSM8K_STRICT

    def load_items(self, opts: SuiteOptions) -> tuple[list[Item], str]:
        rows, source = _test_rows(opts)
        pool, pool_source = load_gsm8k(opts, "train")
        test_qs = {r["question"] for r in rows}
        if any(p["question"] in test_qs for p in pool):
            raise SuiteError(f"few-shot pool {pool_source} contains test questions; refusing to run")
        rnd = random.Random(FEWSHOT_SEED)
        items = _items(rows)
        for it in items:  # one generator advanced in test order, as lm-eval does
            it.data["fewshot"] = [(p["question"], p["answer"]) for p in rnd.sample(pool, self.num_fewshot)]
        return items, f"{source} (few-shot: {pool_source})"

    def prompt(self, item: Item) -> str:
        shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in item.data["fewshot"])
        return f"{shots}Question: {item.data['question']}\nAnswer:"

    def build(self, item: Item, repeat: int, params: SamplingParams) -> GenRequest:
        return GenRequest(prompt=self.prompt(item), params=params)

    def score(self, item: Item, output: str) -> Scored:
        strict = regex_filter(output, self.strict_pattern)
        flexible = regex_filter(output, GSM8K_FLEXIBLE, group_select=-1)
        s = exact_match(strict, item.target)
        return Scored(
            extracted=None if strict == INVALID else strict,
            correct=s,
            invalid=strict == INVALID,
            scores={"strict-match": float(s), "flexible-extract": float(exact_match(flexible, item.target))},
        )

    def protocol(self, opts: SuiteOptions) -> str:
        return f"lm-eval:gsm8k:v3.0:{self.num_fewshot}shot-train-seed{FEWSHOT_SEED}:{self.describe_params(opts)}"


def cot_exemplars() -> list[tuple[str, str]]:
    """lm-eval's eight ``gsm8k_cot`` exemplars, read from the installed package's task YAML."""
    try:
        from importlib.resources import files

        import yaml

        text = (files("lm_eval") / "tasks" / "gsm8k" / "gsm8k-cot.yaml").read_text()
    except Exception as e:
        raise SuiteError(f"gsm8k_cot needs lm-eval installed (pip install 'kvbench[eval]'): {e}") from None
    samples = yaml.safe_load(text)["fewshot_config"]["samples"]
    if len(samples) != 8:
        raise SuiteError(f"lm-eval's gsm8k-cot.yaml has {len(samples)} exemplars, expected 8")
    return [(s["question"], s["target"]) for s in samples]


class Gsm8kCot(Gsm8k):
    name = "gsm8k_cot"
    num_fewshot = 8
    default_params = SamplingParams(max_tokens=256, temperature=0.0, stop=LM_EVAL_COT_STOP)
    strict_pattern = GSM8K_COT_STRICT

    def load_items(self, opts: SuiteOptions) -> tuple[list[Item], str]:
        rows, source = _test_rows(opts)
        shots = cot_exemplars()
        items = _items(rows)
        for it in items:
            it.data["fewshot"] = shots
        return items, source

    def prompt(self, item: Item) -> str:
        shots = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in item.data["fewshot"])
        return f"{shots}Q: {item.data['question']}\nA:"

    def protocol(self, opts: SuiteOptions) -> str:
        return f"lm-eval:gsm8k_cot:v3.0:8shot-fixed:{self.describe_params(opts)}"


CHAT_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    '"Answer: N" where N is the final numerical answer.\n\n'
)


class Gsm8kChat(GenerationTask):
    """Zero-shot chat protocol: the answer is the number on the last ``Answer: N`` line."""

    name = "gsm8k_chat"
    default_params = SamplingParams(max_tokens=512, temperature=0.0)

    def load_items(self, opts: SuiteOptions) -> tuple[list[Item], str]:
        rows, source = _test_rows(opts)
        return _items(rows), source

    def build(self, item: Item, repeat: int, params: SamplingParams) -> GenRequest:
        return GenRequest(messages=[{"role": "user", "content": CHAT_INSTRUCTION + item.data["question"]}], params=params)

    def score(self, item: Item, output: str) -> Scored:
        ans: Optional[str] = extract_answer_line(output)
        ok = numbers_equal(ans, item.target)
        return Scored(
            extracted=ans,
            correct=ok,
            invalid=ans is None,
            scores={"answer-line": float(ok), "last-number": float(numbers_equal(last_number(output), item.target))},
        )

    def protocol(self, opts: SuiteOptions) -> str:
        return f"kvbench:gsm8k_chat:v1:0shot-answer-line:{self.describe_params(opts)}"

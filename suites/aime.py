"""AIME 2024 / 2025: chat prompt asking for a boxed answer, last balanced ``\\boxed{}``, integer compare.

K samples per problem (``--repeats K``, temperature 0.6, top-p 0.95, seeded per (problem, sample)) give
avg@K (mean correctness over all samples) and pass@K (share of problems with at least one correct sample;
the unbiased estimator 1 - C(n-c, k)/C(n, k) with k = n).

``params: {prompt_style: gpt_oss}`` sends the gpt-oss evals' prompt (the problem between newlines, then the
boxed-answer request) and grades as they do (suites/eval_styles.py: last non-empty ``boxed{}`` up to its first
``}``, else the reply's last integer), at temperature 1.0 with 32768 tokens by default.  Their AIME 2025 data
is opencompass/AIME2025 (a ``question`` column, accepted as well as ``problem`` in a ``--data-dir`` file).
"""

from __future__ import annotations

from collections import defaultdict
from math import comb

from kvbench.core import GenRequest, SamplingParams
from kvbench.suites import eval_styles as styles
from kvbench.suites.base import GenerationTask, Item, Scored, SuiteOptions
from kvbench.suites.data import HubSource, load_rows
from kvbench.suites.extract import extract_boxed, parse_int_answer

PROMPT_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
# style -> default sampling (the harness each style comes from runs with these)
PROMPT_STYLES = {
    "kvbench": SamplingParams(max_tokens=4096, temperature=0.6, top_p=0.95),
    "gpt_oss": SamplingParams(max_tokens=32768, temperature=1.0),
}

HUB = {
    "aime24": HubSource("HuggingFaceH4/aime_2024", None, "train"),
    "aime25": HubSource("MathArena/aime_2025", None, "train"),
}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


class Aime(GenerationTask):
    default_params = PROMPT_STYLES["kvbench"]
    style = "kvbench"

    def __init__(self, name: str):
        if name not in HUB:
            raise ValueError(f"unknown AIME suite {name!r}; choose one of {sorted(HUB)}")
        self.name = name

    def base_params(self, opts: SuiteOptions) -> SamplingParams:
        return PROMPT_STYLES[styles.chosen_style(opts, PROMPT_STYLES, self.name)]

    def load_items(self, opts: SuiteOptions) -> tuple[list[Item], str]:
        self.style = styles.chosen_style(opts, PROMPT_STYLES, self.name)
        rows, source = load_rows(opts.data_dir, (self.name, f"aime_20{self.name[-2:]}"), HUB[self.name], required=("answer",))
        items = []
        for i, r in enumerate(rows):
            problem = r.get("problem", r.get("question"))
            if problem is None:
                raise ValueError(f"{source}: row {i} has neither a 'problem' nor a 'question' column")
            target = parse_int_answer(str(r["answer"]))
            if target is None:
                raise ValueError(f"{source}: row {i} answer {r['answer']!r} is not an integer")
            items.append(Item(str(r.get("id", i)), str(target), {"problem": problem}))
        return items, source

    def build(self, item: Item, repeat: int, params: SamplingParams) -> GenRequest:
        if self.style == "gpt_oss":
            content = styles.gpt_oss_aime_prompt(item.data["problem"])
        else:
            content = item.data["problem"] + PROMPT_SUFFIX
        return GenRequest(messages=[{"role": "user", "content": content}], params=params)

    def score(self, item: Item, output: str) -> Scored:
        if self.style == "gpt_oss":
            text = styles.extract_boxed_gpt_oss(output)
            value = styles.int_or_none(text)
            ok = value is not None and value == int(item.target)
            return Scored(extracted=text or None, correct=ok, invalid=value is None, scores={"boxed-int": float(ok)})
        boxed = extract_boxed(output)
        value = parse_int_answer(boxed)
        ok = value is not None and value == int(item.target)
        return Scored(extracted=boxed, correct=ok, invalid=boxed is None, scores={"boxed-int": float(ok)})

    def protocol(self, opts: SuiteOptions) -> str:
        if styles.chosen_style(opts, PROMPT_STYLES, self.name) == "gpt_oss":
            return f"gpt-oss:{self.name}:boxed-or-last-int:k{opts.repeats}:{self.describe_params(opts)}"
        return f"kvbench:{self.name}:v1:boxed-int:k{opts.repeats}:{self.describe_params(opts)}"

    def extra_summary(self, records: list[dict], opts: SuiteOptions) -> dict:
        by_item: dict[str, list[bool]] = defaultdict(list)
        for r in records:
            by_item[r["item_id"]].append(bool(r["correct"]))
        k = opts.repeats
        if not by_item or min(len(v) for v in by_item.values()) < k:
            return {}
        return {
            f"avg@{k}": sum(sum(v) / len(v) for v in by_item.values()) / len(by_item),
            f"pass@{k}": sum(pass_at_k(len(v), sum(v), k) for v in by_item.values()) / len(by_item),
        }

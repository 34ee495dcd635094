"""GPQA diamond: four choices shuffled per repeat by a seeded RNG, the answer letter extracted, ``invalid``
when none is found (never a guess).

``params: {prompt_style: ...}`` picks the prompt and the grader (suites/eval_styles.py):
``kvbench`` (default): a final ``Answer: X`` line requested, the letter found by a ranked list of patterns;
``gpt_oss``: the gpt-oss evals' prompt and ABCD grader, temperature 1.0 and 32768 tokens by default;
``simple_evals``: simple-evals' prompt and ``Answer: X`` pattern.

Data (gated): the hub dataset ``Idavidrein/gpqa`` (config ``gpqa_diamond``, split ``train``) with a token, or
a CSV with the standard columns (``Question``, ``Correct Answer``, ``Incorrect Answer 1..3``, optionally
``Record ID``) in ``--data-dir`` as ``gpqa_diamond.csv``; ``HOW_TO_GET`` says so when neither is there.
"""

from __future__ import annotations

import random

from kvbench.core import GenRequest, SamplingParams
from kvbench.suites import eval_styles as styles
from kvbench.suites.base import GenerationTask, Item, Scored, SuiteOptions
from kvbench.suites.data import DataError, HubSource, load_rows
from kvbench.suites.extract import extract_choice

LETTERS = "ABCD"
COLUMNS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
INSTRUCTION = (
    "Answer the following multiple choice question. The last line of your response must have the form "
    "'Answer: X' (without quotes) where X is one of A, B, C or D. Think step by step before answering."
)
HUB = HubSource("Idavidrein/gpqa", "gpqa_diamond", "train")
HOW_TO_GET = (
    "GPQA is a gated dataset; provide it in one of two ways: (1) from the Hugging Face hub: accept the dataset's "
    "terms at https://huggingface.co/datasets/Idavidrein/gpqa, then export HF_TOKEN=<a read token> or run "
    "`huggingface-cli login` (kvbench loads dataset Idavidrein/gpqa, config gpqa_diamond, split train; needs the "
    "`datasets` package: pip install 'kvbench[eval]'); or (2) as a local file: put gpqa_diamond.csv in --data-dir "
    "(or $KVBENCH_DATA_DIR; a sweep's data_dir) with the columns "
    + ", ".join(COLUMNS) + " (Record ID optional), one row per question"
)
# style -> default sampling (the harness each style comes from runs with these)
PROMPT_STYLES = {
    "kvbench": SamplingParams(max_tokens=2048, temperature=0.0),
    "gpt_oss": SamplingParams(max_tokens=32768, temperature=1.0),
    "simple_evals": SamplingParams(max_tokens=2048, temperature=0.0),
}


def shuffle_choices(correct: str, incorrect: list[str], seed: int) -> tuple[list[str], str]:
    """(choices in shown order, letter of the correct one) for one repeat."""
    choices = [correct, *incorrect]
    order = list(range(len(choices)))
    random.Random(seed).shuffle(order)
    shown = [choices[j] for j in order]
    return shown, LETTERS[order.index(0)]


class GpqaDiamond(GenerationTask):
    name = "gpqa_diamond"
    default_params = PROMPT_STYLES["kvbench"]
    style = "kvbench"

    def base_params(self, opts: SuiteOptions) -> SamplingParams:
        return PROMPT_STYLES[styles.chosen_style(opts, PROMPT_STYLES, self.name)]

    def load_items(self, opts: SuiteOptions) -> tuple[list[Item], str]:
        self.style = styles.chosen_style(opts, PROMPT_STYLES, self.name)
        try:
            rows, source = load_rows(opts.data_dir, ("gpqa_diamond", "gpqa"), HUB, required=COLUMNS)
        except DataError as e:
            raise DataError(f"{e}. {HOW_TO_GET}") from None  # the CLI prints a user error as one line
        items = []
        for i, r in enumerate(rows):
            raw = [str(r[c]) for c in COLUMNS[1:]]
            if any(not c.strip() for c in raw):
                raise DataError(f"{source}: row {i} has an empty answer choice")
            rid = str(r.get("Record ID") or f"row-{i}")
            data = {"question": str(r["Question"]).strip(), "correct": raw[0].strip(), "incorrect": [c.strip() for c in raw[1:]],
                    # verbatim texts: the gpt-oss and simple-evals prompts send the file's values unchanged
                    "raw_question": str(r["Question"]), "raw_correct": raw[0], "raw_incorrect": raw[1:]}
            items.append(Item(rid, "", data))
        return items, source

    def prepare(self, item: Item, repeat: int, seed: int) -> Item:
        d = item.data
        raw = self.style != "kvbench"
        correct, incorrect = (d["raw_correct"], d["raw_incorrect"]) if raw else (d["correct"], d["incorrect"])
        shown, letter = shuffle_choices(correct, incorrect, seed)
        return Item(item.item_id, letter, {**d, "choices": shown})

    def build(self, item: Item, repeat: int, params: SamplingParams) -> GenRequest:
        d = item.data
        if self.style == "gpt_oss":
            content = styles.gpqa_prompt(styles.GPT_OSS_GPQA_TEMPLATE, d["raw_question"], d["choices"])
        elif self.style == "simple_evals":
            content = styles.gpqa_prompt(styles.SIMPLE_EVALS_GPQA_TEMPLATE, d["raw_question"], d["choices"])
        else:
            opts = "\n".join(f"{L}) {c}" for L, c in zip(LETTERS, d["choices"]))
            content = f"{INSTRUCTION}\n\n{d['question']}\n\n{opts}"
        return GenRequest(messages=[{"role": "user", "content": content}], params=params)

    def score(self, item: Item, output: str) -> Scored:
        if self.style == "gpt_oss":
            letter = styles.extract_abcd_gpt_oss(output)
        elif self.style == "simple_evals":
            letter = styles.extract_answer_simple_evals(output)
        else:
            letter, _pattern = extract_choice(output, LETTERS)
        ok = letter == item.target
        return Scored(extracted=letter, correct=ok, invalid=letter is None, scores={"letter": float(ok)})

    def protocol(self, opts: SuiteOptions) -> str:
        style = styles.chosen_style(opts, PROMPT_STYLES, self.name)
        if style == "gpt_oss":
            return f"gpt-oss:gpqa_diamond:abcd-grader:shuffle-seeded:{self.describe_params(opts)}"
        if style == "simple_evals":
            return f"simple-evals:gpqa_diamond:answer-pattern:shuffle-seeded:{self.describe_params(opts)}"
        return f"kvbench:gpqa_diamond:v1:shuffle-seeded:answer-line:{self.describe_params(opts)}"

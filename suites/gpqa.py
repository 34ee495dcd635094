"""GPQA diamond: four choices shuffled per repeat by a seeded RNG, a final ``Answer: X`` line requested,
the letter extracted by a ranked list of patterns, and ``invalid`` when none matches (never a guess).

Data: the gated hub dataset ``Idavidrein/gpqa`` (config ``gpqa_diamond``) or a CSV with the standard
columns (``Question``, ``Correct Answer``, ``Incorrect Answer 1..3``, ``Record ID``) in ``--data-dir``
as ``gpqa_diamond.csv``.
"""

from __future__ import annotations

import random

from kvbench.harness.client import GenRequest, SamplingParams
from kvbench.suites.base import GenerationTask, Item, Scored, SuiteOptions
from kvbench.suites.data import HubSource, load_rows
from kvbench.suites.extract import extract_choice

LETTERS = "ABCD"
COLUMNS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
INSTRUCTION = (
    "Answer the following multiple choice question. The last line of your response must have the form "
    "'Answer: X' (without quotes) where X is one of A, B, C or D. Think step by step before answering."
)


def shuffle_choices(correct: str, incorrect: list[str], seed: int) -> tuple[list[str], str]:
    """(choices in shown order, letter of the correct one) for one repeat."""
    choices = [correct, *incorrect]
    order = list(range(len(choices)))
    random.Random(seed).shuffle(order)
    shown = [choices[j] for j in order]
    return shown, LETTERS[order.index(0)]


class GpqaDiamond(GenerationTask):
    name = "gpqa_diamond"
    default_params = SamplingParams(max_tokens=2048, temperature=0.0)

    def load_items(self, opts: SuiteOptions) -> tuple[list[Item], str]:
        rows, source = load_rows(
            opts.data_dir, ("gpqa_diamond", "gpqa"), HubSource("Idavidrein/gpqa", "gpqa_diamond", "train"), required=COLUMNS
        )
        items = []
        for i, r in enumerate(rows):
            choices = [str(r[c]).strip() for c in COLUMNS[1:]]
            if any(not c for c in choices):
                raise ValueError(f"{source}: row {i} has an empty answer choice")
            rid = str(r.get("Record ID") or f"row-{i}")
            items.append(Item(rid, "", {"question": str(r["Question"]).strip(), "correct": choices[0], "incorrect": choices[1:]}))
        return items, source

    def prepare(self, item: Item, repeat: int, seed: int) -> Item:
        shown, letter = shuffle_choices(item.data["correct"], item.data["incorrect"], seed)
        return Item(item.item_id, letter, {**item.data, "choices": shown})

    def build(self, item: Item, repeat: int, params: SamplingParams) -> GenRequest:
        opts = "\n".join(f"{L}) {c}" for L, c in zip(LETTERS, item.data["choices"]))
        content = f"{INSTRUCTION}\n\n{item.data['question']}\n\n{opts}"
        return GenRequest(messages=[{"role": "user", "content": content}], params=params)

    def score(self, item: Item, output: str) -> Scored:
        letter, _pattern = extract_choice(output, LETTERS)
        ok = letter == item.target
        return Scored(extracted=letter, correct=ok, invalid=letter is None, scores={"letter": float(ok)})

    def protocol(self, opts: SuiteOptions) -> str:
        return f"kvbench:gpqa_diamond:v1:shuffle-seeded:answer-line:{self.describe_params(opts)}"

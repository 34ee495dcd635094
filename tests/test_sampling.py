"""runtime/sampling.py ``sample``: the chosen tokens' log-probs are the raw distribution's at those tokens, read
with the argmax where every row took it (one copy to the host) and gathered otherwise."""

from __future__ import annotations

import pytest
import torch

from kvbench.core import SamplingParams
from kvbench.runtime.sampling import SampleRow, sample


def _rows(kinds, vocab):
    g = torch.Generator().manual_seed(3)
    out = []
    for k in kinds:
        if k == "greedy":
            out.append(SampleRow(SamplingParams(max_tokens=4, temperature=0.0), None))
        elif k == "banned":
            out.append(SampleRow(SamplingParams(max_tokens=4, temperature=0.0), None, banned=(0, 1, 2)))
        elif k == "forced":
            out.append(SampleRow(SamplingParams(max_tokens=4, temperature=0.0), None, forced=vocab - 1))
        else:
            out.append(SampleRow(SamplingParams(max_tokens=4, temperature=1.0), g))
    return out


@pytest.mark.parametrize("kinds", [["greedy"] * 5, ["greedy", "banned", "forced", "draw", "greedy"], ["draw"] * 4, []],
                         ids=["all-greedy", "mixed", "draws", "empty"])
def test_chosen_logprobs_are_the_raw_distributions(kinds):
    torch.manual_seed(0)
    vocab = 300
    logits = torch.randn(len(kinds), vocab) * 3
    logits[:, 0] += 20  # the banned ids hold the argmax: a banned row takes another token
    rows = _rows(kinds, vocab)
    out = sample(logits, rows, [2] * len(kinds))
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert len(out.token_ids) == len(out.logprobs) == len(kinds)
    for i, (k, t) in enumerate(zip(kinds, out.token_ids)):
        assert out.logprobs[i] == ref[i, t].item()  # exact, either path
        assert out.greedy[i] == (t == int(ref[i].argmax()))
        assert out.top_ids[i] == ref[i].topk(2).indices.tolist()
        if k == "greedy":
            assert t == 0 and out.greedy[i]
        if k == "banned":
            assert t not in (0, 1, 2) and not out.greedy[i]
        if k == "forced":
            assert t == vocab - 1
    assert all(isinstance(t, int) for t in out.token_ids)


def test_large_vocabulary_ids_survive_the_host_copy():
    """The ids ride in one float64 copy with the log-probs: a large vocabulary's come back exact."""
    logits = torch.full((2, 200_000), -5.0)
    logits[0, 199_999] = 9.0
    logits[1, 131_071] = 9.0
    out = sample(logits, _rows(["greedy", "greedy"], 200_000))
    assert out.token_ids == [199_999, 131_071] and out.greedy == [True, True]

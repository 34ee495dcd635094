"""Top-k and gathered log-probs taken in the engine as rows are computed (no [T, V] tensor) equal what full rows
give, and the fidelity suite gets the same figures from either path (suites/fidelity/suite.py, runtime/engine.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbench.core.client import ScoreRequest
from kvbench.harness.engine_client import EngineClient
from kvbench.runtime.config import EngineConfig
from kvbench.suites.base import SuiteOptions
from kvbench.suites.fidelity.suite import FidelitySuite, Reference
from kvbench.suites.fidelity.ref import Text, topk_from_full

MODEL = "synthetic:llama-3.2-1b,layers=2,hidden=64,heads=2,kv_heads=1,head_dim=32,intermediate_size=128,vocab=600"


@pytest.fixture(scope="module")
def client():
    c = EngineClient(EngineConfig(model=MODEL, device="cpu", kv_budget_gb=0.01, max_model_len=512, max_num_batched_tokens=64))
    yield c
    c.close()


def _texts(opts=None):
    return [Text(f"t{i}", f"Question {i}: how many apples? ", "There are " + "many " * (5 + 7 * i) + f"{i} apples.")
            for i in range(3)]


def test_engine_topk_and_gather_equal_full_rows(client):
    t = _texts()[2]
    full = client.score(ScoreRequest(t.context, t.continuation, full_distribution=True))
    rows = full.full_logprobs.numpy()
    assert rows.shape[0] == len(full.token_ids) > 64  # several chunks of the 64-token prefill budget
    ids, vals = topk_from_full(rows, 16)
    gather = np.random.default_rng(0).integers(0, rows.shape[1], (rows.shape[0], 5))
    red = client.score(ScoreRequest(t.context, t.continuation, top_k=4, full_distribution=True, full_top_k=16, gather_ids=gather))
    assert red.full_logprobs is None  # no [T, V] rows
    assert np.array_equal(np.asarray(red.top_ids), ids)
    assert np.allclose(np.asarray(red.top_logprobs), vals, atol=1e-6)
    assert np.allclose(red.gathered_logprobs.numpy(), np.take_along_axis(rows, gather, axis=-1), atol=1e-6)
    assert red.logprobs == pytest.approx(full.logprobs, abs=1e-6)
    with pytest.raises(ValueError, match="gather_ids must be"):
        client.engine.score([1, 2], [3, 4], gather_ids=[[1]])


def test_full_rows_are_one_tensor_not_views_of_chunks(client):
    t = _texts()[1]
    res = client.score(ScoreRequest(t.context, t.continuation, full_distribution=True))
    full = res.full_logprobs
    assert isinstance(full, torch.Tensor) and full.is_contiguous()
    assert full.untyped_storage().nbytes() == full.numel() * 4  # its own storage, nothing else kept alive
    assert torch.allclose(full.exp().sum(-1), torch.ones(full.shape[0]), atol=1e-4)


class FullRowsOnly:
    """The engine client as a client that knows nothing of full_top_k / gather_ids (full rows every time)."""

    def __init__(self, c):
        self.c, self.model_id = c, c.model_id

    def score(self, r):
        return self.c.score(ScoreRequest(r.context, r.continuation, r.top_k, r.full_distribution))

    def generate(self, r):
        return self.c.generate(r)

    def close(self):
        pass


def test_suite_figures_do_not_depend_on_where_rows_are_reduced(client, tmp_path):
    opts = SuiteOptions(progress=False, concurrency=1)  # one text at a time: the same batches on both paths
    reduced = FidelitySuite(Reference("r", lambda: FullRowsOnly(client)), tmp_path / "a", top_k=16, greedy_tokens=4,
                            texts=_texts).run(client, opts)
    full = FidelitySuite(Reference("r", lambda: FullRowsOnly(client)), tmp_path / "b", top_k=16, greedy_tokens=4,
                         texts=_texts).run(FullRowsOnly(client), opts)
    for a, b in zip(reduced.records, full.records):
        assert a["protocol"] == b["protocol"] and "kl=top16+tail" in a["protocol"]
        for k in ("kl_mean", "top1_agree", "nll_ref", "nll_cand"):
            assert a["scores"][k] == pytest.approx(b["scores"][k], abs=1e-6), k
    assert reduced.summary["kl_mean"] < 1e-6  # the same engine on both sides


def test_exact_rows_budget_bounds_texts_in_flight():
    import threading
    import time

    from kvbench.suites.fidelity.ref import RowBudget

    budget, lock, state = RowBudget(100), threading.Lock(), {"now": 0, "max": 0}

    def text(chars: int, nbytes: int) -> None:
        with budget.hold(chars) as learn:
            learn(nbytes)
            with lock:
                state["now"] += 1
                state["max"] = max(state["max"], state["now"])
            time.sleep(0.05)
            with lock:
                state["now"] -= 1

    text(10, 100)  # the first text runs alone and teaches 10 bytes per character
    assert budget.held == 0 and budget.per_char == 10
    threads = [threading.Thread(target=text, args=(5, 50)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert state["max"] == 2  # 50 bytes each under a 100-byte cap
    text(1000, 10000)  # larger than the cap: still runs (alone)
    assert budget.held == 0

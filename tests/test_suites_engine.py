"""Fidelity on the real default model (CPU): exact full-vocabulary KL vs the top-k + tail approximation.

Two in-process engines (bf16 reference, nvfp4 candidate with unit scales), two short texts.
"""

from __future__ import annotations

import os

from pathlib import Path

import pytest

from kvbench.suites.base import SuiteOptions
from kvbench.suites.fidelity.suite import FidelitySuite, Reference

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists() and not os.environ.get("CI"), reason="shared data not present"),
]


def test_fidelity_exact_vs_topk_on_default_model(tmp_path):
    from kvbench.harness.engine_client import EngineClient
    from kvbench.runtime.config import EngineConfig

    ref_cfg = EngineConfig(kv_budget_gb=0.05, max_model_len=1024)
    cand = EngineClient(EngineConfig(kv_dtype="nvfp4", kv_budget_gb=0.05, max_model_len=1024))
    try:
        suite = FidelitySuite(Reference("bf16-test", lambda: EngineClient(ref_cfg)), tmp_path, top_k=64, greedy_tokens=8, exact=True)
        res = suite.run(cand, SuiteOptions(limit=2, data_dir=str(DATA), progress=False, concurrency=2))
        # the cache written by the exact run feeds an approximate run with no reference engine at all
        approx = FidelitySuite(Reference("bf16-test", lambda: pytest.fail("reference should come from the cache")), tmp_path,
                               top_k=64, greedy_tokens=8).run(cand, SuiteOptions(limit=2, data_dir=str(DATA), progress=False))
    finally:
        cand.close()
    for r, a in zip(res.records, approx.records):
        s = r["scores"]
        assert "kl=full" in r["protocol"] and "kl=top64+tail" in a["protocol"]
        assert s["n_tokens"] > 20
        assert s["kl_mean"] > 1e-4  # nvfp4 with unit scales is visibly off
        assert s["kl_mean_topk"] <= s["kl_mean"] * (1 + 1e-6)
        assert s["kl_mean_topk"] > 0.8 * s["kl_mean"]  # the cached approximation is close to exact
        assert a["scores"]["kl_mean"] == pytest.approx(s["kl_mean_topk"], rel=0.05)
        assert 0.0 <= s["top1_agree"] <= 1.0 and s["ppl_ref"] > 1.0

"""Helpers of the GPU test files (``pytest -m gpu``): the largest per-token KL divergence of two sets of full
log-prob rows, and flashinfer's skip-or-fail (the ``quiet_gpu`` fixture is in tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch


def kl_max(p: torch.Tensor, q: torch.Tensor) -> float:
    """max over rows of KL(p || q), ``p`` / ``q`` log-prob rows [T, V] (on any device)."""
    p, q = p.double().cpu(), q.double().cpu()
    return float((p.exp() * (p - q)).sum(-1).max())


def need_flashinfer() -> None:
    """Skip (reason shown) where flashinfer does not import; with ``KVBENCH_REQUIRE_FLASHINFER=1`` (a machine
    that carries it) fail instead, so a broken install cannot pass as a skip."""
    from kvbench.runtime.attention.registry import backend_class

    ok, why = backend_class("flashinfer").available()
    if not ok:
        if os.environ.get("KVBENCH_REQUIRE_FLASHINFER") == "1":
            pytest.fail(f"KVBENCH_REQUIRE_FLASHINFER=1 but flashinfer is not available: {why}")
        pytest.skip(f"flashinfer is not importable here: {why}")

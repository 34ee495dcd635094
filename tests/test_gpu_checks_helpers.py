"""The GPU tests' helpers (tests/gpu_checks.py) on the CPU: ``kl_max`` is 0 only for equal rows and NaN for NaN
input (so every ``<`` / ``>`` check on it fails), and ``need_flashinfer`` fails instead of skipping where
``KVBENCH_REQUIRE_FLASHINFER=1`` says the machine carries flashinfer."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_checks import kl_max, need_flashinfer  # noqa: E402


def test_kl_max_is_zero_only_for_equal_rows_and_nan_for_nan():
    p = torch.log_softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    assert kl_max(p, p) == 0.0
    q = p.clone()
    q[2] = torch.log_softmax(torch.randn(50), dim=-1)
    assert kl_max(p, q) > 1e-3
    q[1, 3] = float("nan")
    bad = kl_max(p, q)
    assert math.isnan(bad) and not bad < 1e9 and not bad > 0


def test_need_flashinfer_fails_when_required_and_missing(monkeypatch):
    from kvbench.runtime.attention import registry

    cls = registry.backend_class("flashinfer")
    monkeypatch.setattr(cls, "available", classmethod(lambda c: (False, "not installed (test)")))
    monkeypatch.setenv("KVBENCH_REQUIRE_FLASHINFER", "1")
    with pytest.raises(pytest.fail.Exception, match="KVBENCH_REQUIRE_FLASHINFER=1 but flashinfer is not available"):
        need_flashinfer()
    monkeypatch.delenv("KVBENCH_REQUIRE_FLASHINFER")
    with pytest.raises(pytest.skip.Exception, match="flashinfer is not importable here: not installed"):
        need_flashinfer()

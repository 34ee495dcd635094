"""The kernels' e2m1 rounding (``_triton_utils.e2m1_code``, from the float's bits) against
``formats.quantize_e2m1`` and the seven-threshold version it replaced, on every tie and e2m1 value with 64
neighbours on each side, both signs, the special values, and a stride through all 2³² float32 bit patterns:
on the CPU in Triton's interpreter, and on a GPU (``-m gpu``) with the hardware's FMA and compares."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kvbench.kernels._triton_utils import e2m1_code, e2m1_code_by_thresholds
from kvbench.kernels.formats import E2M1_VALUES, quantize_e2m1

TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@triton.jit
def _codes(X, A, B, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(X + i, mask=m, other=0.0)
    tl.store(A + i, e2m1_code(x), mask=m)
    tl.store(B + i, e2m1_code_by_thresholds(x), mask=m)


def _inputs(stride: int) -> np.ndarray:
    points = np.array(TIES + E2M1_VALUES + (7.0, 8.0, 16.0, 1e30, 2.0**-126, 2.0**-149), dtype=np.float32)
    bits = points.view(np.int32)[:, None] + np.arange(-64, 65, dtype=np.int32)[None, :]
    near = bits[bits >= 0].astype(np.int32).view(np.float32)
    special = np.array([0.0, np.inf, np.nan, 3.4028235e38], dtype=np.float32)
    every = np.arange(0, 2**32, stride, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([near, special])
    return np.concatenate([x, -x, every])


def _check(device: str, stride: int) -> None:
    x = torch.from_numpy(_inputs(stride)).to(device)
    a = torch.full(x.shape, -1, dtype=torch.int32, device=device)
    b = torch.full_like(a, -1)
    block = 4096
    _codes[(triton.cdiv(x.numel(), block),)](x, a, b, x.numel(), BLOCK=block)
    ref = quantize_e2m1(x.cpu()).to(torch.int32)
    a, b = a.cpu(), b.cpu()
    for name, got in (("from the bits", a), ("by thresholds", b)):
        bad = (got != ref).nonzero().flatten()
        seen = ", ".join(f"{x[i].item()!r} -> {got[i].item()} (ref {ref[i].item()})" for i in bad[:5])
        assert bad.numel() == 0, f"e2m1 {name}: {bad.numel()} of {x.numel()} differ, e.g. {seen}"
    # the set reaches every code and both sides of every tie
    assert set(ref.unique().tolist()) == set(range(16))


def test_e2m1_code_matches_the_format_on_cpu():
    _check("cpu", 4099)


def test_e2m1_check_detects_a_wrong_tie():
    """The comparison is not vacuous: a rounding that sends the 2.5 tie up is caught."""
    x = torch.tensor([2.5, -2.5, 2.4999998], dtype=torch.float32)
    wrong = torch.tensor([5, 13, 4], dtype=torch.int32)
    assert (wrong != quantize_e2m1(x).to(torch.int32)).tolist() == [True, True, False]


@pytest.mark.gpu
def test_e2m1_code_matches_the_format_on_gpu():
    _check("cuda", 257)

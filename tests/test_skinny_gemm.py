"""``kernels/skinny_gemm.py``, the few-row Triton GEMM, on the CPU through Triton's interpreter: against a float64
product on fresh random inputs (output poisoned with NaN first; NaN never passes), with and without split-K
(partials added by the last program of a strip, counters left at zero), bias, K-major and row-major weights,
ragged shapes; its default tiling; the operands it refuses."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module loads (tests/conftest.py)

import pytest  # noqa: E402
import torch  # noqa: E402

from kvbench.kernels import skinny_gemm as S  # noqa: E402


def _rel(out, ref) -> float:
    e = ((out.double() - ref).norm() / ref.norm()).item()
    return e if e == e else float("inf")


@pytest.mark.parametrize("m,n,k,plan", [
    (1, 96, 200, None),
    (5, 70, 130, S.Plan(16, 32, 32, 3)),  # ragged N and K, 3 parts: the last one short
    (16, 64, 256, S.Plan(16, 32, 32, 4)),
    (33, 40, 64, S.Plan(64, 16, 16, 2)),
    (64, 48, 96, S.Plan(64, 32, 32, 1)),
])
@pytest.mark.parametrize("kmajor", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_against_float64(m, n, k, plan, kmajor, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k + kmajor)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / 8).bfloat16()
    if kmajor:
        w = w.t().contiguous().t()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    S.linear(x, w, b, p=plan, out=out)
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    torch_out = torch.nn.functional.linear(x.float(), w.float(), b.float() if bias else None).bfloat16()
    assert _rel(out, ref) <= 1.05 * _rel(torch_out, ref) + 1e-6 and _rel(out, ref) < 4e-3
    locks, _ = S.reserve(x.device)
    assert int(locks.abs().sum()) == 0  # each strip's last program reset its counter
    again = S.linear(x, w, b, p=plan)
    assert torch.equal(again, out)  # the sum's order is fixed: the same bits every run


def test_fp16_and_a_nan_never_passes():
    x, w = torch.randn(3, 64).half(), torch.randn(32, 64).half()
    out = S.linear(x, w)
    assert _rel(out, x.double() @ w.double().t()) < 2e-3
    x[0, 0] = float("nan")
    assert _rel(S.linear(x, w), x.double() @ w.double().t()) == float("inf")


def test_default_plan():
    p = S.plan(64, 6144, 4096, sms=132)  # Llama-3-8B's q/k/v: 96 strips of 64 columns, no split
    assert (p.bm, p.bn, p.bk, p.split, p.stages, p.tma) == (64, 64, 128, 1, 5, True)
    assert (S.plan(64, 4096, 4096, sms=132).bn, S.plan(64, 4096, 4096, sms=132).split) == (32, 1)  # o: 128 strips
    assert (S.plan(64, 4096, 14336, sms=132).bn, S.plan(64, 4096, 14336, sms=132).split) == (64, 2)  # down
    assert (S.plan(64, 28672, 4096, sms=132).bn, S.plan(64, 28672, 4096, sms=132).split) == (256, 1)  # gate/up
    assert S.plan(3, 4096, 14336, sms=132, kmajor=False).bm == 16
    assert not S.plan(3, 4096, 14336, sms=132, kmajor=False).tma


def test_refused_operands():
    x, w = torch.randn(4, 32).bfloat16(), torch.randn(16, 32).bfloat16()
    for bad_x, bad_w in [(x.float(), w.float()), (x, w.half()), (torch.randn(S.MAX_ROWS + 1, 32).bfloat16(), w),
                         (x[:, ::2], w[:, ::2]), (x, torch.randn(16, 48).bfloat16())]:
        assert not S.supported(bad_x, bad_w)
        with pytest.raises(ValueError, match="skinny_gemm.linear: x .* needs 2-D bf16/fp16 operands"):
            S.linear(bad_x, bad_w)


def test_one_buffer_per_device(monkeypatch):
    """``cuda`` and ``cuda:N`` of the current device share the buffers reserved before a CUDA-graph capture (a
    second set, allocated inside the capture, is what an engine naming its device ``cuda`` once hit)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert S._key(torch.device("cuda")) == S._key(torch.device("cuda", 0)) == ("cuda", 0)
    assert S._key(torch.device("cuda", 1)) == ("cuda", 1) and S._key(torch.device("cpu")) == ("cpu", None)
    a = S.reserve(torch.device("cpu"))
    assert S.reserve(torch.device("cpu"), 10) is a or S.reserve(torch.device("cpu"))[1] is a[1]


def test_rows_where_it_runs_ahead_of_blas():
    assert [m for m in range(0, 70) if S.ahead_of_blas(m)] == list(range(1, 17)) + list(range(33, S.MAX_ROWS + 1))


def test_a_grown_buffer_keeps_the_old_one():
    """A larger partial-sum buffer replaces the device's, and the old one stays allocated: a CUDA graph captured
    before may still write to it."""
    cpu = torch.device("cpu")
    _, old = S.reserve(cpu)
    _, new = S.reserve(cpu, old.numel() + 1)
    assert new.numel() > old.numel() and S.reserve(cpu)[1] is new
    assert any(t is old for t in S._RETIRED)

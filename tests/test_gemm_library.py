"""``EngineConfig.gemm_library``: torch's BLAS library for the engine's linear layers on a CUDA GPU, checked and
applied (runtime/gemm_library.py); the flag every engine command takes."""

from __future__ import annotations

import pytest
import torch

from kvbench.runtime import ConfigError, EngineConfig
from kvbench.runtime import gemm_library as G


def test_choices_and_errors():
    assert EngineConfig().gemm_library == "cublas"
    assert EngineConfig(gemm_library="cublaslt").gemm_library == "cublaslt"
    for bad in ("hipblaslt", "auto"):
        with pytest.raises(ConfigError, match=f"gemm_library='{bad}' is not supported; choose one of: cublas, cublaslt, "
                                              "triton"):
            EngineConfig(gemm_library=bad)


def test_applied_on_cuda_only(monkeypatch):
    from types import SimpleNamespace

    state, calls = ["Cublas"], []

    def fake(*a):  # torch's getter / setter, with a state of its own (a CPU build may not keep a CUDA choice)
        calls.append(a)
        if a:
            state[0] = a[0].capitalize()
        return SimpleNamespace(name=state[0])

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", fake)
    reserved = []
    monkeypatch.setattr("kvbench.kernels.skinny_gemm.reserve", reserved.append)  # no CUDA device here
    cc = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cc[0])
    from kvbench.kernels import _triton_utils as U
    from kvbench.kernels.skinny_gemm import hopper

    hopper.cache_clear()
    G.apply("cublaslt", torch.device("cpu"))
    assert calls == []  # a CPU engine leaves torch's choice alone
    G.apply("cublaslt", torch.device("cuda", 0))  # only the setting: no CUDA device is needed to make it
    assert calls == [(), ("cublaslt",)] and state == ["Cublaslt"]
    G.apply("cublaslt", torch.device("cuda", 0))  # already the library: read, not set again
    assert calls[2:] == [()]
    G.apply("cublas", torch.device("cuda", 0))
    assert calls[3:] == [(), ("cublas",)] and state == ["Cublas"]
    assert not G._TRITON[0]
    G.apply("triton", torch.device("cuda", 0))  # the Triton GEMM for few rows, cuBLAS for the rest
    assert calls[5:] == [()] and state == ["Cublas"] and G._TRITON[0] and reserved == [torch.device("cuda", 0)]
    assert U._PDL[0]  # the step's kernels launched as programmatic dependents on a Hopper GPU
    cc[0] = (8, 0)
    hopper.cache_clear()
    G.apply("triton", torch.device("cuda", 1))
    assert G._TRITON[0] and not U._PDL[0]  # no programmatic dependent launch before compute capability 9
    hopper.cache_clear()
    G.apply("cublaslt", torch.device("cpu"))  # a CPU engine leaves the choice alone
    assert G._TRITON[0]
    G.apply("cublaslt", torch.device("cuda", 0))
    assert not G._TRITON[0] and state == ["Cublaslt"] and not U._PDL[0]


def test_linear_is_torch_off_the_gpu(monkeypatch):
    """On CPU tensors (and for what the kernel does not take, and outside a CUDA-graph capture) ``linear`` is
    ``F.linear``, whatever the choice."""
    monkeypatch.setattr(G, "_TRITON", [True])
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    assert torch.equal(G.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    x3 = torch.randn(2, 3, 8)
    assert torch.equal(G.linear(x3, w), torch.nn.functional.linear(x3, w))


def test_engine_flag():
    from typer.testing import CliRunner

    from kvbench.harness.cli import app

    r = CliRunner().invoke(app, ["serve", "--gemm-library", "rocblas", "--device", "cpu"])
    assert r.exit_code == 2 and "gemm_library='rocblas' is not supported" in r.output, r.output

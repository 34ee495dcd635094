"""Suite-wide setup.  The suite runs on CPU: Triton kernels run in its interpreter.  ``triton.jit`` reads
``TRITON_INTERPRET`` when a kernel module is imported, so it is set here, before any test module imports
one; setting it per test module made the outcome depend on which module the run imported first.  (The sm_90
compile test runs its compiler in a subprocess with the interpreter off.)

Tests marked ``gpu`` (tests/test_gpu_*.py) run the compiled kernels on a CUDA device: ``pytest -m gpu``
selects only them and then leaves the interpreter off (unless ``TRITON_INTERPRET`` was set by the caller).
Where there is no CUDA device, or the interpreter is on because the CPU tests run in the same process,
they are skipped with the reason in the ``-ra`` summary."""

import os

import pytest

_CALLER_INTERPRET = os.environ.get("TRITON_INTERPRET")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread per worker: the workers already fill the cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.pop("COLUMNS", None)  # pytest-xdist sets its own terminal's width (80) in the workers; tables follow it
os.environ.setdefault("TRITON_INTERPRET", "1")

GPU_SKIP_REASON = "needs a CUDA device: run `pytest -m gpu` on a GPU machine"
GPU_INTERPRETER_REASON = ("the Triton interpreter is on for the CPU tests in this run: run `pytest -m gpu` "
                          "alone for the GPU tests")


def selects_only_gpu(markexpr: str) -> bool:
    """Whether ``-m markexpr`` keeps tests marked ``gpu`` and drops unmarked ones."""
    if not markexpr:
        return False
    try:
        from _pytest.mark.expression import Expression

        expr = Expression.compile(markexpr)
        return bool(expr.evaluate(lambda name, **kw: name == "gpu")) and not expr.evaluate(lambda name, **kw: False)
    except Exception:  # noqa: BLE001 - another pytest: the plain spelling
        return markexpr.strip() == "gpu"


def pytest_configure(config):
    if _CALLER_INTERPRET is None and selects_only_gpu(config.getoption("markexpr", "") or ""):
        os.environ["TRITON_INTERPRET"] = "0"  # before any test module imports a kernel


def gpu_skip_reason():
    """Why ``gpu`` tests cannot run in this process (None: they can)."""
    import torch

    if not torch.cuda.is_available():
        return GPU_SKIP_REASON
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return GPU_INTERPRETER_REASON
    return None


# Test files that time themselves, start servers that other tests' load would slow past a deadline, or run a Ray
# cluster: `make test` runs them alone after the rest has run on several workers (pytest-xdist).
SERIAL_FILES = frozenset({
    "test_conformance_sglang.py", "test_conformance_vllm.py", "test_loadgen_repeats.py", "test_out_dirs.py",
    "test_package.py", "test_replicas.py", "test_report_screenshot.py", "test_report_consistency.py",
    "test_request_options_http.py", "test_server_long_prompts.py", "test_server_prep.py", "test_serving_spread.py",
    "test_silent_steps.py", "test_targets_server.py", "test_sweep_ray.py", "test_sweep_parallel.py",
    "test_server_real.py", "test_replicas_failover.py", "test_replicas_launch.py", "test_loadgen_server.py", "test_loadgen_http.py", "test_loadgen_overhead.py", "test_server_cli.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    reason = gpu_skip_reason() if gpu else None
    if reason:
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture()
def quiet_gpu():
    """GPU tests: quantized caches' unit-scale warnings silenced, the CUDA cache freed after each test."""
    import logging

    import torch

    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)
    torch.cuda.empty_cache()

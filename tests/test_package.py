"""The package installs as one namespace `kvbench`, with no top-level `kernels`/`runtime` modules."""

import importlib.util
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("serve", "eval", "load", "sweep", "report", "compare", "gate", "bench", "capacity", "formats")


def test_namespace_imports_outside_the_repo(tmp_path):
    code = (
        "import importlib.util, kvbench.harness, kvbench.kernels.formats, kvbench.runtime.kv_cache, "
        "kvbench.suites, kvbench.reports, kvbench.configs;"
        "print(all(importlib.util.find_spec(n) is None for n in ('kernels', 'runtime', 'harness', 'suites')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_cli_help_is_fast_and_lists_commands(tmp_path):
    kvbench = Path(sys.executable).parent / "kvbench"
    t0 = time.perf_counter()
    out = subprocess.run([str(kvbench), "--help"], cwd=tmp_path, capture_output=True, text=True, check=True)
    elapsed = time.perf_counter() - t0
    for c in COMMANDS:
        assert c in out.stdout
    assert elapsed < 1.5, f"kvbench --help took {elapsed:.2f}s"
    # no heavy imports at start-up
    probe = "import sys, kvbench.harness.cli; print(sorted(m for m in ('torch','pandas','matplotlib','transformers') if m in sys.modules))"
    mods = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert mods.stdout.strip() == "[]"


def test_formats_and_capacity_commands(tmp_path):
    kvbench = str(Path(sys.executable).parent / "kvbench")
    fm = json.loads(subprocess.run([kvbench, "formats", "--json"], capture_output=True, text=True, check=True).stdout)
    assert {r["name"]: r["bytes_per_element"] for r in fm}["nvfp4"] == 0.5625
    cap = subprocess.run([kvbench, "capacity", "--model-shape", "llama-3-8b", "--kv-budget-gb", "40", "--context", "4096", "--json"],
                         capture_output=True, text=True, check=True)
    rows = {r["kv_dtype"]: r for r in json.loads(cap.stdout)}
    assert rows["bf16"]["max_concurrency"] == 80 and rows["fp8_e4m3"]["max_concurrency"] == 160
    assert rows["nvfp4"]["bytes_vs_first"] == 9 / 32
    bad = subprocess.run([kvbench, "capacity", "--model-shape", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "known:" in bad.stderr


@pytest.mark.slow
def test_wheel_contains_the_namespace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    whl = next(tmp_path.glob("kvbench-*.whl"))
    names = zipfile.ZipFile(whl).namelist()
    assert "kvbench/runtime/kv_cache.py" in names and "kvbench/kernels/formats.py" in names
    assert "kvbench/configs/default.yaml" in names or not (ROOT / "configs" / "default.yaml").exists()
    assert not any(n.startswith(("runtime/", "kernels/", "harness/")) for n in names)

"""`kvbench eval`'s long-context flags: misplaced or bad values are one clear line with exit 2, before any
model loads (so these run in a second each)."""

import subprocess
import sys
from pathlib import Path

import pytest

KVBENCH = str(Path(sys.executable).parent / "kvbench")


@pytest.mark.parametrize("argv,needle", [
    (["--suite", "gsm8k", "--position-buckets", "256"], "--position-buckets applies to --suite fidelity only"),
    (["--suite", "gsm8k", "--fidelity-text-tokens", "4096"], "--fidelity-text-tokens applies to --suite fidelity"),
    (["--suite", "fidelity", "--fidelity-text-tokens", "0"], "--fidelity-text-tokens must be positive"),
    (["--suite", "fidelity", "--haystack-file", "x.txt"], "--haystack-file applies to --suite ruler only"),
    (["--suite", "gsm8k", "--context-lengths", "1024"], "--context-lengths applies to --suite ruler only"),
    (["--suite", "ruler", "--depths", "150"], "depth"),
    (["--suite", "ruler", "--ruler-tasks", "niah_nope"], "unknown task"),
])
def test_misplaced_or_bad_long_context_flags(tmp_path, argv, needle):
    out = subprocess.run([KVBENCH, "eval", *argv, "--out", str(tmp_path / "o")], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert needle in " ".join(out.stderr.split()), out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "o" / "items.jsonl").exists()


DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.mark.slow
@pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").is_file(), reason="needs ../shared/data")
def test_long_fidelity_flags_reach_the_suite(tmp_path):
    import json

    out = subprocess.run([KVBENCH, "eval", "--suite", "fidelity", "--fidelity-text-tokens", "600", "--position-buckets",
                          "256", "--limit", "1", "--kv-dtype", "fp8_e5m2", "--kv-scales", "calibrate", "--data-dir",
                          str(DATA), "--no-progress", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())["suites"]["fidelity"]
    buckets = summary["by_position"]
    assert [(b["lo"], b["hi"]) for b in buckets][:3] == [(0, 256), (256, 512), (512, 1024)]
    assert sum(b["n_tokens"] for b in buckets) == summary["n_tokens"]
    assert 590 <= summary["n_tokens"] <= 600
    assert all(b["kl_mean"] >= 0 for b in buckets)
    rec = json.loads((tmp_path / "o" / "items.jsonl").read_text().splitlines()[0])
    assert ":texts=gsm8k-concat-600:" in rec["protocol"], rec["protocol"]

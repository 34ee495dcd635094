"""`kvbench sweep` command line: usage errors exit 2 with the config error, --dry-run lists the cells."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from kvbench.harness.cli import app

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def invoke(*args: str):
    return CliRunner().invoke(app, ["sweep", *args])


def test_dry_run_lists_the_matrix(tmp_path):
    r = invoke(str(CONFIGS / "default.yaml"), "--dry-run", "--out", str(tmp_path / "run"))
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 11 and lines[-1] == f"10 cells -> {tmp_path / 'run'}"
    acc = "[accuracy: ruler, fidelity]"
    assert sum(acc in line for line in lines) == 4  # one per format + the A/A control
    assert sum(line.endswith(" [load]") for line in lines) == 9 and lines[-2].endswith(f"{acc} [A/A]")
    assert "bf16/unit torch c=8 A/A" in lines[-2]
    assert not (tmp_path / "run").exists()
    r = invoke(str(CONFIGS / "default.yaml"), "--dry-run", "--only", "kv_dtype=nvfp4,concurrency=4")
    assert r.exit_code == 0 and r.output.strip().splitlines()[0].endswith("nvfp4/calibrate torch c=4  [load]")


def test_usage_errors_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("axes:\n  kv: [bf16]\n  concurrency: [1, 4]\naccuracy_concurrency: 2\n")
    r = invoke(str(bad))
    assert r.exit_code == 2 and "accuracy_concurrency: 2 is not one of the concurrency levels [1, 4]" in r.output
    r = invoke(str(CONFIGS / "default.yaml"), "--only", "kvdtype=bf16")
    assert r.exit_code == 2 and "unknown cell key 'kvdtype'" in r.output
    r = invoke(str(CONFIGS / "default.yaml"), "--data-dir", str(tmp_path / "nope"))
    assert r.exit_code == 2 and "is not a directory" in r.output
    r = invoke(str(tmp_path / "missing.yaml"))
    assert r.exit_code == 2 and "no such config file" in r.output

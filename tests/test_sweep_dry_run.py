"""`kvbench sweep --dry-run` says what each cell runs (suites, load test, A/A control) and refuses a model
path that names nothing before anything starts."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from kvbench.harness.cli import app


def _config(tmp_path, **over) -> str:
    raw = {
        "name": "t", "model": "synthetic:tiny", "engine": {"device": "cpu", "dtype": "float32"},
        "targets": [{"name": "embedded", "type": "embedded"}],
        "axes": {"backends": ["torch"], "kv": [{"dtype": "bf16"}, {"dtype": "fp8_e4m3"}], "concurrency": [1, 4]},
        "accuracy_concurrency": 4,
        "suites": [{"name": "gsm8k", "limit": 2}, {"name": "fidelity", "limit": 1}],
        "baseline": {"kv_dtype": "bf16"},
    }
    raw.update(over)
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(raw))
    return str(p)


def dry_run(tmp_path, **over):
    r = CliRunner().invoke(app, ["sweep", _config(tmp_path, **over), "--dry-run", "--out", str(tmp_path / "run")])
    return r, [ln for ln in r.stdout.splitlines() if ln.strip()]


def test_each_cell_says_what_it_runs(tmp_path):
    r, lines = dry_run(tmp_path)
    assert r.exit_code == 0, r.stdout + r.stderr
    cells = lines[:-1]
    assert lines[-1] == f"5 cells -> {tmp_path / 'run'}"
    assert [ln.split("  ", 1)[1] for ln in cells] == [
        "bf16/unit torch c=1  [load]",
        "bf16/unit torch c=4  [accuracy: gsm8k, fidelity] [load]",
        "fp8_e4m3/unit torch c=1  [load]",
        "fp8_e4m3/unit torch c=4  [accuracy: gsm8k, fidelity] [load]",
        "bf16/unit torch c=2 A/A  [accuracy: gsm8k, fidelity] [A/A]",
    ]
    assert not (tmp_path / "run").exists()


def test_load_off_and_accuracy_only_cells(tmp_path):
    r, lines = dry_run(tmp_path, load={"enabled": False}, accuracy_concurrency=2, aa_control=False)
    assert r.exit_code == 0, r.stdout + r.stderr
    tags = [ln.split("torch ", 1)[1] for ln in lines[:-1]]
    assert tags == ["c=2  [accuracy: gsm8k, fidelity]", "c=1  [nothing to run]", "c=4  [nothing to run]"] * 2


def test_a_model_path_that_names_nothing_stops_the_dry_run(tmp_path):
    missing = tmp_path / "no-such-model"
    r, _ = dry_run(tmp_path, model=str(missing))
    assert r.exit_code == 2, r.stdout
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert err == [f"kvbench sweep: error: model: --model {missing}: no such file or directory"], r.stderr
    (tmp_path / "empty").mkdir()
    r, _ = dry_run(tmp_path, model=str(tmp_path / "empty"))
    assert r.exit_code == 2 and "neither config.json" in r.stderr, r.stderr

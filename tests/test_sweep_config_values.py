"""Sweep config values beyond the key check: the `engine:` sections are validated as EngineConfigs (so a
bad value fails the config, --dry-run included, instead of every cell), the run name is a plain directory
name, and an empty file is not a sweep."""

from __future__ import annotations

import copy

import pytest
import yaml
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.harness.sweep.config import SweepConfigError, load_config, parse_config

BASE = {
    "name": "t",
    "engine": {"device": "cpu", "kv_budget_gb": 0.25},
    "axes": {"kv": ["bf16", "fp8_e4m3"], "concurrency": [1]},
    "suites": [{"name": "gsm8k_chat", "limit": 2}],
}


def error_of(raw) -> str:
    with pytest.raises(SweepConfigError) as e:
        parse_config(raw)
    return str(e.value)


@pytest.mark.parametrize("key,value,needle", [
    ("kv_budget_gb", "abc", "engine.kv_budget_gb: kv_budget_gb must be a positive number"),
    ("page_size", -4, "engine.page_size: page_size must be a positive integer, got -4"),
    ("page_size", 24, "engine.page_size: page_size must be a positive power of two"),
    ("device", "quantum", "engine.device: device='quantum' is not supported; choose cpu, cuda or cuda:N"),
    ("max_running", "8", "engine.max_running"),
    ("mem_fraction", 2, "engine.mem_fraction"),
    ("kv_layout", "hnd", "engine.kv_layout"),
    ("dtype", "float64", "engine.dtype"),
    ("enforce_eager", "no", "engine.enforce_eager"),
])
def test_engine_values_are_checked(key, value, needle):
    raw = copy.deepcopy(BASE)
    raw["engine"][key] = value
    assert needle in error_of(raw)


def test_target_engine_values_are_checked_with_their_path():
    raw = copy.deepcopy(BASE)
    raw["targets"] = [{"name": "a", "type": "embedded"}, {"name": "b", "type": "embedded", "engine": {"page_size": 0}}]
    assert "targets[1].engine.page_size: page_size must be a positive integer" in error_of(raw)
    raw["targets"][1]["engine"] = {"device": "cuda:1"}  # overrides a valid top-level value: fine
    assert parse_config(raw).target("b").engine == {"device": "cuda:1"}
    raw["engine"]["device"] = "tpu"  # top level is checked even when every target overrides it
    raw["targets"] = [{"name": "b", "type": "embedded", "engine": {"device": "cpu"}}]
    assert "engine.device" in error_of(raw)


def test_engine_errors_stop_the_dry_run(tmp_path):
    raw = copy.deepcopy(BASE)
    raw["engine"]["kv_budget_gb"] = "abc"
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    r = CliRunner().invoke(app, ["sweep", str(cfg), "--dry-run", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "kvbench sweep: error: bad.yaml: engine.kv_budget_gb: kv_budget_gb must be a positive number (GiB), got 'abc'" in r.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["../../etc", "a/b", "..", ".", "a\\b", "/abs"])
def test_name_must_be_a_plain_directory_name(name):
    raw = copy.deepcopy(BASE)
    raw["name"] = name
    assert "name:" in error_of(raw) and "not a plain directory name" in error_of(raw)


def test_plain_names_pass():
    raw = copy.deepcopy(BASE)
    raw["name"] = "fp8-vs-bf16_v2.1"
    assert parse_config(raw).name == "fp8-vs-bf16_v2.1"


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"])
def test_empty_file_is_not_a_sweep(tmp_path, text):
    p = tmp_path / "empty.yaml"
    p.write_text(text)
    with pytest.raises(SweepConfigError, match="empty.yaml: config: expected a mapping, got an empty file"):
        load_config(p)
    r = CliRunner().invoke(app, ["sweep", str(p), "--dry-run"])
    assert r.exit_code == 2 and "got an empty file" in r.output


def test_out_must_not_be_a_file(tmp_path):
    raw = copy.deepcopy(BASE)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, dry in ((afile, False), (afile, True), (afile / "run", False)):
        r = CliRunner().invoke(app, ["sweep", str(cfg), "--out", str(out), *(["--dry-run"] if dry else [])])
        assert r.exit_code == 2, r.output
        assert "is not a directory" in r.output and "Traceback" not in r.output
        assert isinstance(r.exception, SystemExit)  # typer.Exit(2), not a FileExistsError
    assert afile.read_text() == "x"

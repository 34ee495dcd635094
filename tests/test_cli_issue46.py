"""What a new user trying the command line ran into (issue 46): a --max-model-len that an error advised and
the engine then cut silently, a KV format the capacity table took without looking, ``<bool>`` after every
switch in ``--help``, the gate's workflow-command lines outside CI, and help cut to 80 columns in a pipe."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from typer.main import get_command
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.runtime.config import ConfigError, EngineConfig

sys.path.insert(0, str(Path(__file__).parent))
from test_reports_load import make_run  # noqa: E402

KVBENCH = str(Path(sys.executable).with_name("kvbench"))
# a model of 1024 positions (max_position_embeddings), small enough for a real ruler run on CPU; its byte
# tokenizer puts a niah_single prompt at 337 tokens or more, and 128 B of bf16 KV per token
MODEL = ("synthetic:llama-3-8b,layers=1,hidden=64,heads=2,kv_heads=1,head_dim=32,intermediate_size=64,vocab=300,"
         "max_position_embeddings=1024")
RULER = ["eval", "--suite", "ruler", "--model", MODEL, "--device", "cpu", "--ruler-tasks", "niah_single",
         "--prompt-style", "completion", "--limit", "1"]


def kvbench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("GITHUB_ACTIONS", "COLUMNS", "TERMINAL_WIDTH")}
    return subprocess.run([KVBENCH, *args], capture_output=True, text=True, timeout=300, env={**full, **(env or {})})


# ------------------------------------------------------------------------------ --max-model-len
def test_context_length_refuses_more_than_the_model_has():
    from kvbench.runtime.config import context_length

    assert context_length(None, 8192) == 8192
    assert context_length(8000, 8192) == 8000
    with pytest.raises(ConfigError, match=r"8320 is above the longest context m supports: 8192 tokens .*give at most 8192"):
        context_length(8320, 8192, "m")


def test_a_cache_smaller_than_the_context_is_announced():
    from kvbench.runtime.config import context_in_cache

    assert context_in_cache(8192, 10_000, None) == (8192, None)
    n, note = context_in_cache(8192, 464, None)
    assert n == 464 and "the KV cache holds 464 tokens, fewer than the model's context of 8192" in note
    n, note = context_in_cache(1000, 464, 1000)
    assert n == 464 and "fewer than --max-model-len 1000" in note and "--kv-budget-gb" in note


def test_engine_refuses_max_model_len_above_the_model(caplog):
    from kvbench.runtime.engine import Engine

    with pytest.raises(ConfigError, match="give at most 1024"):
        Engine(EngineConfig(model=MODEL, device="cpu", kv_budget_gb=0.01, max_model_len=1040))
    with caplog.at_level(logging.WARNING, logger="kvbench.runtime"):
        e = Engine(EngineConfig(model=MODEL, device="cpu", kv_budget_gb=0.00003))  # 15 pages of 16 tokens
    try:
        assert e.max_model_len == 240
        assert any("the KV cache holds 240 tokens, fewer than the model's context of 1024" in r.getMessage()
                   for r in caplog.records)
    finally:
        e.shutdown()


def test_eval_refuses_a_max_model_len_the_model_cannot_take(tmp_path):
    r = kvbench(*RULER, "--context-lengths", "400", "--max-model-len", "1100", "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr
    assert "--max-model-len (max_model_len) 1100 is above the longest context" in r.stderr
    assert "give at most 1024" in r.stderr
    assert not (tmp_path / "o").exists()


def test_the_advised_max_model_len_is_accepted(tmp_path):
    r = kvbench(*RULER, "--context-lengths", "400", "--max-model-len", "450", "--out", str(tmp_path / "a"))
    assert r.returncode == 2, r.stderr
    m = re.search(r"use lengths up to 322, or --max-model-len (\d+) or more", r.stderr)
    assert m, r.stderr
    assert int(m.group(1)) == 400 + 128
    r = kvbench(*RULER, "--context-lengths", "400", "--max-model-len", m.group(1), "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "b").is_dir()


def test_a_context_cut_by_the_cache_advises_a_bigger_cache(tmp_path):
    r = kvbench(*RULER, "--context-lengths", "400", "--kv-budget-gb", "0.00006", "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr
    assert "the KV cache holds 496 tokens, fewer than the model's context of 1024 tokens" in r.stderr
    assert "a KV cache of at least 528 tokens (it holds 496; raise --kv-budget-gb / --mem-fraction)" in r.stderr


# ------------------------------------------------------------------------------ capacity --kv-dtype
@pytest.mark.parametrize("flag", ["--kv-dtype", "--kv-cache-dtype"])
def test_capacity_refuses_an_unknown_kv_dtype(flag):
    r = CliRunner().invoke(app, ["capacity", flag, "fp9"])
    assert r.exit_code == 2, r.stdout
    assert "unknown KV format 'fp9'; supported: bf16, fp16, fp8_e4m3, fp8_e5m2, nvfp4" in r.stderr
    assert "auto, fp8" in r.stderr  # the engine spellings it takes too


@pytest.mark.parametrize("value", ["fp8", "auto", "fp4_e2m1", "FP8_E4M3", "nvfp4"])
def test_capacity_takes_the_engine_spellings(value):
    r = CliRunner().invoke(app, ["capacity", "--kv-dtype", value, "--json"])
    assert r.exit_code == 0, r.stderr
    r = CliRunner().invoke(app, ["capacity", "--kv-cache-dtype", value, "--kv-dtype-skip-layers", "0", "--json"])
    assert r.exit_code == 0, r.stderr


# ------------------------------------------------------------------------------ --help
def command_paths(cmd: click.Command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and group under ``cmd``, as argument lists (``()`` is kvbench itself)."""
    out = [path]
    for name, sub in getattr(cmd, "commands", {}).items():
        out += command_paths(sub, (*path, name))
    return out


PATHS = command_paths(get_command(app))


def test_every_command_is_walked():
    assert {("capacity",), ("gate",), ("eval",), ("bench", "kernels"), ()} <= set(PATHS)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "kvbench")
def test_switches_show_no_bool_placeholder_and_nothing_is_cut(path):
    r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": None, "TERMINAL_WIDTH": None})
    assert r.exit_code == 0, r.stdout
    assert "<bool>" not in r.stdout
    assert "…" not in r.stdout


def test_switch_rows_have_no_type_but_values_do():
    out = CliRunner().invoke(app, ["capacity", "--help"]).stdout
    (json_row,) = [ln for ln in out.splitlines() if "--json" in ln]
    assert re.search(r"--json\s+Print JSON instead of a table", json_row), json_row
    assert re.search(r"--context\s+<int>\s+Tokens per sequence", out)


def test_piped_help_is_whole():
    """A pipe (a file, a CI log): the long option names and every help word appear uncut."""
    r = kvbench("capacity", "--help")
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout
    assert "--kv-dtype-skip-layers,--kv-cache-dtype-skip-layers" in r.stdout
    assert "--tp,--tensor-parallel-size" in r.stdout
    words = " ".join(r.stdout.replace("│", " ").split())
    assert "(fewer kv heads than GPUs: replicated, one per GPU; MLA latents: whole on each GPU)" in words
    r = kvbench("gate", "--help")
    assert "…" not in r.stdout and "(GITHUB_ACTIONS=true)" in r.stdout


def test_columns_still_sets_the_help_width():
    r = kvbench("capacity", "--help", env={"COLUMNS": "100"})
    assert r.returncode == 0 and max(len(ln) for ln in r.stdout.splitlines()) == 100


# ------------------------------------------------------------------------------ gate annotations
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("gate46") / "run", drops={"bf16": 0.0, "nvfp4": 0.3}, concurrency=(1,),
                    n_gsm8k=60, n_aime=10)


def gate(*args: str, github: bool = False):
    env = {"GITHUB_ACTIONS": "true" if github else None, "GITHUB_STEP_SUMMARY": None}
    return CliRunner().invoke(app, ["gate", *map(str, args)], env=env)


def workflow_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.match(r"::(notice|warning|error)\b", ln)]


def test_gate_prints_no_workflow_commands_off_ci(run):
    r = gate(run, "--candidate", "kv_dtype=nvfp4")
    assert r.exit_code == 1, r.stdout
    assert workflow_lines(r.stdout) == []
    assert r.stdout.strip().splitlines()[-1].startswith("kvbench gate: FAIL (exit 1) ")
    r = gate(run / "missing")
    assert r.exit_code == 2
    assert workflow_lines(r.stdout) == [] and r.stderr.startswith("kvbench gate: error: ")


def test_gate_annotates_under_github_actions(run):
    r = gate(run, "--candidate", "kv_dtype=nvfp4", github=True)
    assert r.exit_code == 1
    assert r.stdout.strip().splitlines()[-1].startswith("::error title=kvbench gate::FAIL (exit 1) ")
    r = gate(run / "missing", github=True)
    assert r.exit_code == 2
    assert [ln.split("::")[1] for ln in workflow_lines(r.stdout)] == ["error title=kvbench gate"]


def test_gate_annotations_flag_wins(run):
    r = gate(run, "--candidate", "kv_dtype=nvfp4", "--annotations")
    assert r.stdout.strip().splitlines()[-1].startswith("::error title=kvbench gate::FAIL")
    r = gate(run, "--candidate", "kv_dtype=nvfp4", "--no-annotations", github=True)
    assert workflow_lines(r.stdout) == [] and r.stdout.strip().splitlines()[-1].startswith("kvbench gate: FAIL")
    r = gate(run / "missing", "--no-annotations", github=True)
    assert r.exit_code == 2 and workflow_lines(r.stdout) == []

"""docs/config.md documents every key the sweep config parsers accept, in the section about it, so the
reference cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvbench.core.kv_config import kv_option_names

from kvbench.core.request_options import REQUEST_KEYS
from kvbench.harness import cell_diagnostics
from kvbench.harness.launch import options as launch_options
from kvbench.harness.sweep import axes as sweep_axes
from kvbench.harness.sweep import config as sweep_config
from kvbench.harness.sweep import specs as sweep_specs
from kvbench.harness.sweep.config import SweepConfigError
from kvbench.suites.ruler import params as ruler_params

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def sections() -> dict[str, str]:
    """Heading (lower case, without #) -> the text under it, up to the next heading of any level."""
    out: dict[str, str] = {}
    parts = re.split(r"^#{2,3} (.+)$", DOC.read_text(), flags=re.M)
    for title, body in zip(parts[1::2], parts[2::2]):
        out[title.strip().lower()] = body
    return out


def allowed_keys(parse, *args) -> tuple[str, ...]:
    """The keys a parser accepts, read from its own 'unknown key' error."""
    with pytest.raises(SweepConfigError) as e:
        parse(*args)
    m = re.search(r"allowed keys: (.+)$", str(e.value))
    assert m, str(e.value)
    return tuple(k.strip() for k in m.group(1).split(","))


def expected() -> dict[str, tuple[str, ...]]:
    return {
        "top level": sweep_config._TOP_KEYS,
        "engine": sweep_config._engine_keys(),
        "targets": (*sweep_specs._TARGET_KEYS, *launch_options.option_names()),
        "axes": (*sweep_config._AXES_KEYS, *sweep_axes._KV_KEYS, *kv_option_names(),
                 *allowed_keys(sweep_axes.parse_backend_entry, {"zz": 1}, "b"),
                 *allowed_keys(sweep_axes.parse_combos, [{"zz": 1}], "axes.combos")),
        "suites": (*sweep_specs._SUITE_KEYS, *ruler_params.PARAM_KEYS),
        "request options": REQUEST_KEYS,
        "load": sweep_specs._LOAD_KEYS,
        "slo": sweep_specs.SLO_KEYS,
        "baseline": sweep_specs.CELL_KEYS,
        "gate": sweep_specs._GATE_KEYS,
        "diagnostics": cell_diagnostics.DIAG_KEYS,
    }


@pytest.mark.parametrize("section", list(expected()))
def test_every_key_is_documented_in_its_section(section):
    text = sections().get(section)
    assert text is not None, f"docs/config.md has no section '{section}'"
    keys = expected()[section]
    assert len(keys) >= 3
    missing = [k for k in keys if f"`{k}`" not in text]
    assert not missing, f"docs/config.md section '{section}' does not document: {missing}"


def test_launch_placeholders_are_documented():
    text = sections()["targets"]
    missing = [p for p in launch_options.placeholders() if f"`{{{p}}}`" not in text]
    assert not missing, missing


def test_documented_keys_exist():
    """Every key in the first column of a key table is one the parsers accept (no stale rows)."""
    accepted = {k for keys in expected().values() for k in keys}
    rows = re.findall(r"^\| `([a-z_]+)` \|", DOC.read_text(), flags=re.M)
    assert len(rows) > 80
    stale = sorted(set(rows) - accepted)
    assert not stale, stale


def test_load_off_is_documented_and_parses():
    assert "load: {enabled: false}" in DOC.read_text()
    cfg = sweep_config.parse_config({"load": {"enabled": False}})
    assert cfg.load.enabled is False


def test_executor_and_replica_flags_are_documented():
    """Every flag of `kvbench sweep`, `eval` and `load` about where cells run (the executor, Ray) or about
    data-parallel replicas appears in docs/config.md's command-line section, and every such flag it names exists."""
    from typer.main import get_command

    from kvbench.harness.cli import app

    text = sections()["command line: where the cell groups run"]
    commands = get_command(app).commands
    flags = {}
    for name in ("sweep", "eval", "load"):
        for p in commands[name].params:
            if p.param_type_name == "option" and re.search(r"\b(ray|replicas?|executor)\b", p.help or "", re.I):
                flags[(name, p.opts[0])] = p.opts
    assert {("sweep", "--executor"), ("sweep", "--address"), ("sweep", "--replica-max-failures"), ("eval", "--endpoint"),
            ("eval", "--replica-max-failures"), ("load", "--base-url"), ("load", "--replica-load")} <= set(flags)
    missing = [f"{cmd} {flag}" for (cmd, flag) in flags if f"`{flag}" not in text]
    assert not missing, f"docs/config.md 'Command line' section does not document: {missing}"
    named = set(re.findall(r"`(--[a-z-]+)", text))
    known = {o for opts in flags.values() for o in opts} | {"--parallel", "--devices", "--dry-run", "--resume",
                                                            "--concurrency", "--max-concurrency", "--max-retries"}
    assert named <= known, sorted(named - known)

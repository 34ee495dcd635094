"""One error style: every user error is one line `kvbench <command>: error: ...` on stderr, exit 2, no
traceback, no rich panel; tables and warnings as the command line prints them."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.harness.cli_errors import command_path
from kvbench.harness.errors import UserError, fail

KVBENCH = str(Path(sys.executable).parent / "kvbench")
BOX = re.compile("[\u2500-\u257f]")  # box-drawing characters: a rich panel or table


def _root():
    import typer.main

    return typer.main.get_command(app)


def _leaves(cmd=None, path=()):
    """(path, click command) of every command the app registers, sub-typers included."""
    cmd = cmd or _root()
    subs = getattr(cmd, "commands", None)
    if isinstance(subs, dict):
        for name, sub in sorted(subs.items()):
            yield from _leaves(sub, (*path, name))
    else:
        yield path, cmd


LEAVES = list(_leaves())


def _dummy_args(cmd) -> list[str]:
    """A value for each required argument, so that the option under test is what fails."""
    return ["x" for p in cmd.params if p.param_type_name == "argument" and p.required]


def _bad_value_option(cmd):
    """An option taking a number (int or float): a value that cannot parse is a usage error."""
    for p in cmd.params:
        if p.param_type_name != "option" or p.is_flag or p.count or p.hidden:
            continue
        if p.bare_type() in ("int", "float"):
            return next(o for o in p.opts if o.startswith("--"))
    return None


def check_one_error_line(r, cmd: str) -> str:
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert re.match(rf"^{re.escape(cmd)}: error: \S", lines[0]), lines[0]
    text = r.stdout + r.stderr
    assert "Traceback" not in text and not BOX.search(text), text
    return lines[0]


def test_every_command_is_walked():
    names = {" ".join(p) for p, _ in LEAVES}
    assert {"sweep", "eval", "serve", "load", "report", "compare", "gate", "capacity", "formats",
            "bench kernels", "bench mla"} <= names, names


@pytest.mark.parametrize("path", [p for p, _ in LEAVES], ids=lambda p: " ".join(p))
def test_unknown_option_is_one_line(path):
    cmd = dict(LEAVES)[path]
    r = CliRunner().invoke(app, [*path, "--no-such-option-xyz", *_dummy_args(cmd)])
    line = check_one_error_line(r, "kvbench " + " ".join(path))
    assert "--no-such-option-xyz" in line


@pytest.mark.parametrize("path", [p for p, c in LEAVES if _bad_value_option(c)], ids=lambda p: " ".join(p))
def test_bad_option_value_is_one_line(path):
    cmd = dict(LEAVES)[path]
    opt = _bad_value_option(cmd)
    r = CliRunner().invoke(app, [*path, *_dummy_args(cmd), opt, "not-a-value"])
    line = check_one_error_line(r, "kvbench " + " ".join(path))
    assert opt in line or "not-a-value" in line, line


def test_some_commands_have_value_options():
    assert len([p for p, c in LEAVES if _bad_value_option(c)]) >= 6


@pytest.mark.parametrize("argv,cmd,needle", [
    (["sweep"], "kvbench sweep", "Missing argument"),
    (["sweep", "missing.yaml"], "kvbench sweep", "missing.yaml"),
    (["sweep", "missing.yaml", "--dry-run"], "kvbench sweep", "missing.yaml"),
    (["report", "/nonexistent"], "kvbench report", "/nonexistent"),
    (["compare", "/nonexistent/a", "/nonexistent/b", "--out", "OUT"], "kvbench compare", "/nonexistent/a"),
    (["gate", "/nonexistent"], "kvbench gate", "/nonexistent"),
    (["capacity", "--context", "0"], "kvbench capacity", "--context must be > 0"),
    (["capacity", "--model-shape", "no-such-shape"], "kvbench capacity", "no-such-shape"),
    (["no-such-command"], "kvbench", "no-such-command"),
])
def test_existing_errors_are_one_line(tmp_path, monkeypatch, argv, cmd, needle):
    monkeypatch.chdir(tmp_path)
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    r = CliRunner().invoke(app, argv)
    assert needle in check_one_error_line(r, cmd)


def test_installed_command_stderr_is_one_line(tmp_path):
    """The real entry point: stderr holds exactly the error line, stdout nothing."""
    r = subprocess.run([KVBENCH, "capacity", "--context", "abc"], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert re.fullmatch(r"kvbench capacity: error: Invalid value for '--context': [^\n]*\n", r.stderr), r.stderr
    r = subprocess.run([KVBENCH, "sweep", str(tmp_path / "missing.yaml")], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 2 and re.fullmatch(r"kvbench sweep: error: [^\n]*missing\.yaml[^\n]*\n", r.stderr), r.stderr


def test_github_actions_annotation(tmp_path):
    env = {"GITHUB_ACTIONS": "true"}
    r = CliRunner().invoke(app, ["capacity", "--context", "0"], env=env)
    line = check_one_error_line(r, "kvbench capacity")
    assert r.stdout.strip().splitlines() == [f"::error::{line}"]
    r = CliRunner().invoke(app, ["capacity", "--context", "0"], env={"GITHUB_ACTIONS": "false"})
    check_one_error_line(r, "kvbench capacity")
    assert "::error" not in r.stdout
    # under GitHub Actions the gate writes its own annotation: not a second one
    r = CliRunner().invoke(app, ["gate", str(tmp_path / "nope")], env=env)
    check_one_error_line(r, "kvbench gate")
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("::error")] == [
        ln for ln in r.stdout.splitlines() if ln.startswith("::error title=kvbench gate::")] != []


def test_user_error_from_a_command(monkeypatch):
    import kvbench.harness.commands.capacity as cap

    def boom(*a, **k):
        fail("a message\nover two lines")

    monkeypatch.setattr(cap, "capacity_rows", boom)
    r = CliRunner().invoke(app, ["capacity"])
    assert check_one_error_line(r, "kvbench capacity") == "kvbench capacity: error: a message over two lines"
    with pytest.raises(UserError, match="x"):
        fail("x")


def test_ctrl_c_exits_130_without_traceback(monkeypatch):
    import kvbench.harness.commands.capacity as cap

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cap, "capacity_rows", interrupted)
    r = CliRunner().invoke(app, ["capacity"])
    assert r.exit_code == 130 and "Traceback" not in r.stdout + r.stderr, (r.stdout, r.stderr)


def test_help_and_exit_codes_pass_through():
    r = CliRunner().invoke(app, ["--help"])
    assert r.exit_code == 0 and "Usage: kvbench" in r.stdout
    r = CliRunner().invoke(app, ["bench", "kernels", "--help"])
    assert r.exit_code == 0 and "--layout" in r.stdout
    r = CliRunner().invoke(app, ["formats"])
    assert r.exit_code == 0 and "nvfp4" in r.stdout


def test_warnings_are_printed_once(monkeypatch):
    import kvbench.harness.commands.capacity as cap

    real = cap.capacity_rows

    def warns(*a, **k):
        for _ in range(3):
            warnings.warn("test warning printed once 7f3a", UserWarning)
        warnings.warn("test warning printed once 7f3a", UserWarning)  # another line, same text
        return real(*a, **k)

    monkeypatch.setattr(cap, "capacity_rows", warns)
    r = CliRunner().invoke(app, ["capacity"])
    assert r.exit_code == 0, r.stderr
    assert r.stderr.count("test warning printed once 7f3a") == 1, r.stderr
    assert "kvbench: warning: test warning printed once 7f3a" in r.stderr


def test_tables_are_not_wrapped_or_cut_off_a_terminal():
    r = CliRunner().invoke(app, ["capacity", "--kv-budget-gb", "100000", "--context", "3"])
    assert r.exit_code == 0
    rows = [ln for ln in r.stdout.splitlines() if "nvfp4" in ln]
    assert len(rows) == 1 and "182,044,444" in rows[0] and "2,912,711,104" in rows[0], r.stdout
    assert "\u2026" not in r.stdout
    r = CliRunner().invoke(app, ["formats"])
    assert "\u2026" not in r.stdout and all(len([ln for ln in r.stdout.splitlines() if f"│ {n} " in ln]) == 1
                                            for n in ("bf16", "nvfp4"))


def test_command_path_resolution():
    root = _root()
    assert command_path(root, ["bench", "kernels", "--quick"]) == "kvbench bench kernels"
    assert command_path(root, ["--version"]) == "kvbench"
    assert command_path(root, ["sweep", "configs/x.yaml", "--dry-run"]) == "kvbench sweep"
    assert command_path(root, ["nope"]) == "kvbench"


def test_unit_scale_warning_is_printed_once_per_process(tmp_path):
    """Three engines with unit-scale fp8 KV in one process: the warning (raised and logged) shows once.
    In a subprocess: pytest's own logging capture would hide the logged copy."""
    script = tmp_path / "three_engines.py"
    script.write_text(
        "import sys\n"
        "import kvbench.harness.commands.capacity as cap\n"
        "from kvbench.harness.cli import main\n"
        "from kvbench.runtime.scales import unit_scales\n"
        "real = cap.capacity_rows\n"
        "def engines(*a, **k):\n"
        "    for _ in range(3):\n"
        "        unit_scales('fp8_e4m3', 2)\n"
        "    return real(*a, **k)\n"
        "cap.capacity_rows = engines\n"
        "sys.argv = ['kvbench', 'capacity']\n"
        "main()\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("with unit scales") == 1, r.stderr
    assert r.stderr.startswith("kvbench: warning: KV format fp8_e4m3 with unit scales"), r.stderr

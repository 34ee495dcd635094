"""A user's first mistakes get one clear line and exit code 2, not a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

KVBENCH = str(Path(sys.executable).parent / "kvbench")


@pytest.mark.parametrize("argv,needle", [
    (["eval", "--suite", "gsm8k", "--limit", "1", "--model", "/nonexistent/model"], "cannot resolve model"),
    (["serve", "--model", "/nonexistent/model", "--port", "1"], "cannot resolve model"),
    (["eval", "--suite", "gsm8k", "--limit", "1", "--kv-dtype", "int4"], "--kv-dtype"),
])
def test_bad_engine_input_is_one_clear_error(tmp_path, argv, needle):
    out = subprocess.run([KVBENCH, *argv, *(["--out", str(tmp_path / "o")] if argv[0] == "eval" else [])],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvbench {argv[0]}: error: "), out.stderr


def test_debug_env_shows_the_traceback(tmp_path):
    out = subprocess.run([KVBENCH, "serve", "--model", "/nonexistent/model", "--port", "1"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env={**__import__("os").environ, "KVBENCH_DEBUG": "1"})
    assert out.returncode != 0 and "Traceback" in out.stderr

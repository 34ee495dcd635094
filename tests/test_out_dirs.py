"""Output directories: checked before any work, earlier eval results never overwritten silently or with an
empty run, and the temporary files of interrupted atomic writes cleaned up."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.core import io as kio
from kvbench.core import store
from kvbench.harness.cli import app
from kvbench.harness.commands import eval as eval_cmd
from kvbench.suites.fake import FakeClient

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
needs_data = pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists() and not os.environ.get("CI"),
                                reason="shared data not present")


def invoke(*args):
    r = CliRunner().invoke(app, [*map(str, args)])
    return r.exit_code, r.stdout + (r.stderr or ""), r


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"^kvbench [a-z ]+: error: ", line)]


@pytest.fixture
def no_model(monkeypatch):
    """Any attempt to open the engine (load the model) fails the test."""

    def open_client(engine, endpoint):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(eval_cmd, "_open_client", open_client)


@pytest.fixture
def fake(monkeypatch):
    opened = []

    def open_client(engine, endpoint):
        c = FakeClient(noise=0.0, responder=None)
        opened.append(c)
        return c

    monkeypatch.setattr(eval_cmd, "_open_client", open_client)
    return opened


def _old_results(d: Path) -> dict[str, bytes]:
    d.mkdir(parents=True, exist_ok=True)
    (d / "items.jsonl").write_text('{"suite": "gsm8k", "item_id": "old", "correct": true}\n')
    (d / "summary.json").write_text(json.dumps({"suites": {"gsm8k": {"n": 1, "accuracy": 1.0}}, "error": None}))
    return {n: (d / n).read_bytes() for n in ("items.jsonl", "summary.json")}


def _unchanged(d: Path, before: dict[str, bytes]) -> bool:
    return {n: (d / n).read_bytes() for n in before} == before


# ------------------------------------------------------------------------------------ eval: usage errors
@pytest.mark.parametrize("kind", ["missing", "file"])
def test_eval_bad_data_dir_fails_before_the_model_loads(tmp_path, no_model, kind):
    data = tmp_path / "data"
    if kind == "file":
        data.write_text("x")
    old = _old_results(tmp_path / "out")
    code, text, _ = invoke("eval", "--suite", "gsm8k", "--limit", "1", "--data-dir", data, "--out", tmp_path / "out",
                           "--overwrite")
    assert code == 2, text
    lines = error_lines(text)
    assert len(lines) == 1 and "--data-dir" in lines[0] and str(data) in lines[0], text
    assert "Traceback" not in text
    assert _unchanged(tmp_path / "out", old)


def test_eval_out_is_a_file(tmp_path, no_model):
    f = tmp_path / "afile"
    f.write_text("keep me")
    code, text, _ = invoke("eval", "--suite", "gsm8k", "--limit", "1", "--out", f)
    assert code == 2, text
    assert error_lines(text) == [f"kvbench eval: error: --out {f} is not a directory"]
    code, text, _ = invoke("eval", "--suite", "gsm8k", "--limit", "1", "--out", f / "sub")
    assert code == 2 and len(error_lines(text)) == 1 and "is not a directory" in text, text
    assert f.read_text() == "keep me"


@pytest.mark.parametrize("held", [("items.jsonl",), ("summary.json",), ("items.jsonl", "summary.json")])
def test_eval_refuses_an_out_holding_results(tmp_path, no_model, held):
    out = tmp_path / "out"
    out.mkdir()
    for n in held:
        (out / n).write_text("old\n")
    code, text, _ = invoke("eval", "--suite", "gsm8k", "--limit", "1", "--out", out)
    assert code == 2, text
    lines = error_lines(text)
    assert len(lines) == 1 and "--overwrite" in lines[0] and all(n in lines[0] for n in held), text
    assert all((out / n).read_text() == "old\n" for n in held)


def test_eval_accepts_an_empty_or_unrelated_out(tmp_path, fake, monkeypatch):
    # an existing directory without results (or a fresh one) is fine; here the engine then fails early
    def info():
        raise RuntimeError("engine died")

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(FakeClient, "info", lambda self: info(), raising=False)
    code, text, _ = invoke("eval", "--suite", "gsm8k", "--limit", "1", "--out", out, "--no-progress")
    assert code == 1, text  # got past the checks, failed in the run
    assert len(fake) == 1 and fake[0].closed
    # nothing finished: nothing written, not even an empty items.jsonl / summary.json
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_eval_failed_run_with_overwrite_keeps_the_old_results(tmp_path, fake, monkeypatch):
    out = tmp_path / "out"
    old = _old_results(out)
    monkeypatch.setattr(FakeClient, "info", lambda self: (_ for _ in ()).throw(RuntimeError("engine died")), raising=False)
    code, text, _ = invoke("eval", "--suite", "gsm8k", "--limit", "1", "--out", out, "--overwrite", "--no-progress")
    assert code == 1 and "engine died" in text, text
    assert _unchanged(out, old)
    assert not list(out.glob(".*.tmp"))


def test_eval_missing_suite_data_with_overwrite_keeps_the_old_results(tmp_path, fake, monkeypatch):
    # the data directory exists but lacks the suite's file, and the hub cannot be reached: a DataError
    import kvbench.suites.data as data

    def no_hub(src):
        raise ConnectionError("offline")

    monkeypatch.setattr(data, "_load_hub", no_hub)
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    old = _old_results(out)
    code, text, _ = invoke("eval", "--suite", "gsm8k", "--limit", "1", "--data-dir", empty, "--out", out, "--overwrite",
                           "--no-progress")
    assert code == 1, text
    assert _unchanged(out, old)


@needs_data
def test_eval_overwrite_replaces_results(tmp_path, fake):
    out = tmp_path / "out"
    old = _old_results(out)
    args = ["eval", "--suite", "gsm8k", "--limit", "2", "--data-dir", DATA, "--out", out, "--max-tokens", "8", "--no-progress"]
    code, text, _ = invoke(*args)
    assert code == 2 and _unchanged(out, old), text
    code, text, _ = invoke(*args, "--overwrite")
    assert code == 0, text
    items = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    assert len(items) == 2 and {i["item_id"] for i in items}.isdisjoint({"old"})
    assert json.loads((out / "summary.json").read_text())["suites"]["gsm8k"]["n"] == 2


def test_eval_bad_out_via_subprocess_is_fast(tmp_path):
    """The installed command: one line, exit 2, and no model load (well under the ~8 s it takes)."""
    import time

    kvbench = str(Path(sys.executable).parent / "kvbench")
    f = tmp_path / "afile"
    f.write_text("")
    t0 = time.monotonic()
    r = subprocess.run([kvbench, "eval", "--suite", "gsm8k", "--limit", "1", "--data-dir", "/nonexistent/kvbench-data",
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["kvbench eval: error: --data-dir /nonexistent/kvbench-data does not exist"]
    r = subprocess.run([kvbench, "eval", "--suite", "gsm8k", "--limit", "1", "--out", str(f)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"kvbench eval: error: --out {f} is not a directory"], r.stderr
    assert time.monotonic() - t0 < 6
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------ report / compare
def test_report_out_is_a_file(tmp_path, monkeypatch):
    import kvbench.reports.load as load

    def no_work(*a, **k):
        raise AssertionError("the run was loaded before --out was checked")

    monkeypatch.setattr(load, "load_run", no_work)
    run = tmp_path / "run"
    run.mkdir()
    f = tmp_path / "afile"
    f.write_text("")
    code, text, _ = invoke("report", run, "--out", f)
    assert code == 2, text
    assert error_lines(text) == [f"kvbench report: error: --out {f} is not a directory"]
    # the default RUN/report, when that is a file
    (run / "report").write_text("")
    code, text, _ = invoke("report", run)
    assert code == 2 and len(error_lines(text)) == 1 and "is not a directory" in text, text


def test_compare_out_is_a_file(tmp_path, monkeypatch):
    import kvbench.reports.compare as compare

    def no_work(*a, **k):
        raise AssertionError("the runs were loaded before --out was checked")

    monkeypatch.setattr(compare, "load_runs", no_work)
    f = tmp_path / "afile"
    f.write_text("")
    code, text, _ = invoke("compare", tmp_path / "a", tmp_path / "b", "--out", f)
    assert code == 2, text
    assert error_lines(text) == [f"kvbench compare: error: --out {f} is not a directory"]


# ------------------------------------------------------------------------------------ store helpers
def test_check_out_dir(tmp_path, monkeypatch):
    assert store.check_out_dir(tmp_path) == tmp_path
    assert store.check_out_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # nothing is created
    f = tmp_path / "f"
    f.write_text("")
    for bad in (f, f / "sub", f / "sub" / "deeper"):
        with pytest.raises(store.OutDirError, match="is not a directory"):
            store.check_out_dir(bad, "--out")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="^--run f is not a directory$"):  # a ValueError too, named after the flag
        store.check_out_dir("f", "--run")


def _kill_mid_write(target: Path) -> None:
    """A child process SIGKILLed inside atomic_write_bytes, after its temporary file exists."""
    code = (
        "import os, signal, sys\n"
        "from kvbench.core import io as kio\n"
        "kio.os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)\n"
        "kio.atomic_write_text(sys.argv[1], 'new')\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=60)
    assert r.returncode == -9, r.stderr


def test_remove_stale_temp_files_after_sigkill(tmp_path):
    cell = tmp_path / "cells" / "abc"
    cell.mkdir(parents=True)
    (cell / "summary.json").write_text("old")
    _kill_mid_write(cell / "summary.json")
    _kill_mid_write(tmp_path / "manifest.json")
    stale = sorted(cell.glob(".summary.json.*.tmp"))
    assert len(stale) == 1 and (cell / "summary.json").read_text() == "old"
    assert len(list(tmp_path.glob(".manifest.json.*.tmp"))) == 1
    # look-alikes and other files are kept
    keep = [cell / ".summary.json.tmp", cell / ".summary.json.toolong12.tmp", cell / "x.abcdefgh.tmp",
            cell / ".summary.json.ABCDEFGH.tmp", cell / ".summary.json.abcdefgh.tmp.bak", cell / "items.jsonl"]
    for p in keep:
        p.write_text("k")
    (cell / ".d.abcdefgh.tmp").mkdir()  # a directory with a matching name is not touched
    (cell / ".l.abcdefgh.tmp").symlink_to(cell / "items.jsonl")  # nor a symlink

    top = list(tmp_path.glob(".manifest.json.*.tmp"))
    assert kio.remove_stale_temp_files(tmp_path) == top  # not recursive: the top level only
    assert not top[0].exists() and stale[0].exists()
    removed = kio.remove_stale_temp_files(tmp_path, recursive=True)
    assert removed == stale and not stale[0].exists()
    assert all(p.exists() for p in keep) and (cell / ".d.abcdefgh.tmp").is_dir() and (cell / ".l.abcdefgh.tmp").is_symlink()
    assert (cell / "summary.json").read_text() == "old"
    assert kio.remove_stale_temp_files(tmp_path, recursive=True) == []
    assert kio.remove_stale_temp_files(tmp_path / "missing") == []
    # and the target can be written again
    kio.atomic_write_text(cell / "summary.json", "new")
    assert (cell / "summary.json").read_text() == "new"

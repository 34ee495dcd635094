"""The sweep runner with a fake target and fake cell work (no model): files per cell, failures recorded,
one target launch per group, resume rules, fidelity reference sharing, atomic writes."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import pytest

from kvbench.core import io as store_mod  # the atomic writes (a crash mid-write is simulated there)
from kvbench.harness.matrix import expand
from kvbench.harness.runner import run_sweep
from kvbench.core.store import RunStore
from kvbench.core.io import atomic_write_json
from kvbench.harness.sweep.config import SweepConfigError, parse_config
from kvbench.harness.targets import TargetSession


def make_sweep(kv=("bf16", "fp8_e4m3"), conc=(1, 4), suites=("gsm8k_chat", "fidelity"), **over):
    raw = {
        "name": "fake",
        "axes": {"kv": [{"dtype": k, "scales": "unit"} for k in kv], "concurrency": list(conc)},
        "suites": [{"name": s, "limit": 3} for s in suites],
        "load": {"num_prompts": 2},
        "baseline": {"kv_dtype": kv[0]},
        "aa_control": False,  # the runner mechanics below; test_aa_control_runs_last_in_a_fresh_engine covers it
    }
    raw.update(over)
    return parse_config(raw)


class FakeClient:
    def __init__(self, tag: str):
        self.model_id, self.tag, self.closed = "fake-model", tag, False

    def close(self):
        self.closed = True


class Harness:
    """Fake opener + fake work that record what the runner asked for."""

    def __init__(self, fail=lambda cell, suite: False, fail_open=lambda cfg: False):
        self.opened, self.closed, self.flushes, self.calls = [], [], [], []
        self.fail, self.fail_open = fail, fail_open
        self.ref_clients = []

    @contextmanager
    def opener(self, spec, cell_config, engine_kwargs, log_path):
        tag = f"{cell_config['kv_dtype']}/{cell_config['prefill_backend']}"
        if self.fail_open(cell_config):
            raise RuntimeError(f"cannot start {tag}")
        self.opened.append(tag)
        client = FakeClient(tag)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(f"log of {tag}\n")
        try:
            yield TargetSession(client, "fake-model", url="http://fake",
                                capacity=lambda: {"kv_dtype": cell_config["kv_dtype"], "tokens": 100},
                                flush=lambda: self._flush(tag, log_path), log_path=log_path)
        finally:
            self.closed.append(tag)

    def _flush(self, tag, log_path):
        self.flushes.append(tag)
        with open(log_path, "a") as f:
            f.write(f"flush {len(self.flushes)}\n")

    # CellWork
    def suite(self, spec, client, cell, fidelity):
        self.calls.append(("suite", cell.key, spec.name))
        if self.fail(cell, spec.name):
            raise ValueError(f"planted failure in {spec.name}")
        if spec.name == "fidelity":  # like the real suite: the reference client is made on a cache miss only
            cached = fidelity.cache_dir / f"{fidelity.label.replace(':', '_')}.ref"
            if not cached.exists():
                ref = fidelity.make_client()
                self.ref_clients.append((ref.tag, fidelity.label))
                ref.close()
                cached.write_text("ref")
            assert not client.closed  # closing a borrowed reference never closes the cell's client
        recs = [{"suite": spec.name, "item_id": str(i), "repeat": 0, "correct": i % 2 == 0} for i in range(spec.limit)]
        return recs, {"accuracy": 2 / 3, "n": spec.limit}

    def load(self, base_url, model_id, cell):
        self.calls.append(("load", cell.key, cell.concurrency))
        return {"output_throughput": 10.0 * cell.concurrency}, [{"request_id": f"{cell.key}-{i}", "success": True} for i in range(2)]


def test_aa_control_runs_last_in_a_fresh_engine(tmp_path):
    """On by default: the baseline's accuracy suites once more, at half the accuracy concurrency, in an engine
    of its own opened last; no load test."""
    cfg, h = make_sweep(conc=(1, 4), accuracy_concurrency=4, aa_control=True), Harness()
    out = run_sweep(cfg, tmp_path / "run", work=h, opener=h.opener, progress=False)
    cells = expand(cfg)
    aa = cells[-1]
    assert out.ok and aa.config["aa_control"] is True and aa.config["concurrency"] == 2 and aa.key in out.done
    assert h.opened == ["bf16/torch", "fp8_e4m3/torch", "bf16/torch"]  # a fresh engine, opened last
    assert [c for c in h.calls if c[1] == aa.key] == [("suite", aa.key, "gsm8k_chat"), ("suite", aa.key, "fidelity")]
    st = RunStore(tmp_path / "run")
    assert len((st.cell_dir(aa.key) / "items.jsonl").read_text().splitlines()) == 6
    assert not (st.cell_dir(aa.key) / "requests.jsonl").exists()


def test_every_cell_written(tmp_path):
    cfg, h = make_sweep(), Harness()
    out = run_sweep(cfg, tmp_path / "run", work=h, opener=h.opener, progress=False)
    cells = expand(cfg)
    assert out.ok and sorted(out.done) == sorted(c.key for c in cells) and not out.skipped
    st = RunStore(tmp_path / "run")
    for c in cells:
        d = st.cell_dir(c.key)
        assert st.status(c.key) == "done"
        meta = json.loads((d / "cell.json").read_text())
        assert meta == {"key": c.key, "label": c.label, "config": c.config}
        summary = st.read_json(c.key, "summary")
        assert summary["error"] is None and summary["load"]["output_throughput"] == 10.0 * c.concurrency
        assert st.read_json(c.key, "capacity")["kv_dtype"] == c.config["kv_dtype"]
        assert len(st.read_requests(c.key)) == 2
        if c.concurrency == 1:  # accuracy_concurrency defaults to the first level
            assert {r["suite"] for r in st.read_items(c.key)} == {"gsm8k_chat", "fidelity"}
            assert set(summary["suites"]) == {"gsm8k_chat", "fidelity"}
        else:
            assert not (d / "items.jsonl").exists() and summary["suites"] == {}
        # the launch output goes to the group's first cell, then each cell gets what was logged during it
        first = c.concurrency == cfg.concurrency[0]
        assert (d / "server.log").read_text().startswith("log of") == first
        assert (d / "server.log").read_text().count("flush") == 2
    # one launch per (kv format) group, closed again; a flush before the suites and before the load test
    assert h.opened == ["bf16/torch", "fp8_e4m3/torch"] and h.closed == h.opened
    assert len(h.flushes) == 2 * len(cells)
    m = st.manifest()
    assert m["config"] == cfg.to_dict() and m["name"] == "fake"
    assert {"sha", "dirty"} <= set(m["git"]) and "python" in m["versions"] and "cpu_count" in m["device"]
    assert m["runs"][0]["done"] == 4 and m["runs"][0]["finished"] >= m["runs"][0]["started"]
    assert [c["key"] for c in m["cells"]] == [c.key for c in cells]


def test_failed_cell_is_recorded_and_the_sweep_goes_on(tmp_path):
    h = Harness(fail=lambda cell, suite: cell.config["kv_dtype"] == "fp8_e4m3" and suite == "fidelity")
    cfg = make_sweep()
    out = run_sweep(cfg, tmp_path / "run", work=h, opener=h.opener, progress=False)
    bad = [c for c in expand(cfg) if c.config["kv_dtype"] == "fp8_e4m3" and c.concurrency == 1][0]
    assert out.failed == [bad.key] and len(out.done) == 3
    st = RunStore(tmp_path / "run")
    assert st.status(bad.key) == "failed"
    summary = st.read_json(bad.key, "summary")
    assert summary["error"] == "ValueError: planted failure in fidelity"
    assert summary["suites"]["gsm8k_chat"]["n"] == 3  # what finished before the failure is kept
    assert [r["suite"] for r in st.read_items(bad.key)] == ["gsm8k_chat"] * 3
    assert "planted failure" in (st.cell_dir(bad.key) / "error.txt").read_text()
    # the failing cell's group still ran its other concurrency level on the same launch
    assert h.opened == ["bf16/torch", "fp8_e4m3/torch"]


def test_load_test_with_no_successful_request_fails_the_cell(tmp_path):
    h = Harness()
    h.load = lambda base_url, model_id, cell: ({"completed": 0}, [{"request_id": "r", "success": False, "error": "HTTP 500: boom"}])
    out = run_sweep(make_sweep(conc=(1,)), tmp_path / "run", work=h, opener=h.opener, progress=False)
    assert len(out.failed) == 2
    st = RunStore(tmp_path / "run")
    s = st.read_json(out.failed[0], "summary")
    assert s["error"] == "RuntimeError: load test: all 1 requests failed; first error: HTTP 500: boom"
    assert len(st.read_requests(out.failed[0])) == 1  # the failed requests are kept for the report


def test_target_that_does_not_start_fails_its_cells_only(tmp_path):
    h = Harness(fail_open=lambda cfg: cfg["kv_dtype"] == "bf16")
    cfg = make_sweep()
    out = run_sweep(cfg, tmp_path / "run", work=h, opener=h.opener, progress=False)
    # both bf16 cells, and the fp8 cell whose fidelity reference (bf16) cannot start; fp8 at c=4 runs
    cells = {(c.config["kv_dtype"], c.concurrency): c.key for c in expand(cfg)}
    assert out.done == [cells["fp8_e4m3", 4]] and len(out.failed) == 3
    st = RunStore(tmp_path / "run")
    for key in out.failed:
        assert st.status(key) == "failed"
        assert "cannot start bf16/torch" in st.read_json(key, "summary")["error"]
    assert "failed to start" in st.read_json(cells["bf16", 1], "summary")["error"]


def test_existing_run_needs_resume_and_the_same_config(tmp_path):
    h = Harness()
    run_sweep(make_sweep(), tmp_path / "run", work=h, opener=h.opener, progress=False)
    with pytest.raises(SweepConfigError, match="already holds a run; pass --resume"):
        run_sweep(make_sweep(), tmp_path / "run", work=h, opener=h.opener, progress=False)
    with pytest.raises(SweepConfigError, match="different config.*differs in: axes|different config.*kv"):
        run_sweep(make_sweep(kv=("bf16", "nvfp4")), tmp_path / "run", resume=True, work=h, opener=h.opener, progress=False)


def test_resume_skips_done_cells_and_redoes_the_rest(tmp_path):
    cfg = make_sweep()
    h1 = Harness(fail=lambda cell, suite: cell.config["kv_dtype"] == "fp8_e4m3")
    first = run_sweep(cfg, tmp_path / "run", work=h1, opener=h1.opener, progress=False)
    st = RunStore(tmp_path / "run")
    # simulate a crash in the middle of a done cell: status back to running
    crashed = first.done[-1]
    st.set_status(crashed, "running")
    h2 = Harness()
    second = run_sweep(cfg, tmp_path / "run", resume=True, work=h2, opener=h2.opener, progress=False)
    redo = set(first.failed) | {crashed}
    assert set(second.done) == redo and set(second.skipped) == set(first.done) - {crashed}
    assert {k for _, k, *_ in h2.calls} == redo
    assert all(st.status(c.key) == "done" for c in expand(cfg))
    for key in first.failed:  # a redone cell keeps nothing of its failed attempt
        assert not (st.cell_dir(key) / "error.txt").exists() and st.read_json(key, "summary")["error"] is None
    runs = st.manifest()["runs"]
    assert [r["resume"] for r in runs] == [False, True] and runs[1]["skipped"] == len(second.skipped)


def test_only_runs_the_selected_cells(tmp_path):
    h = Harness()
    out = run_sweep(make_sweep(), tmp_path / "run", only="concurrency=4", work=h, opener=h.opener, progress=False)
    assert len(out.done) == 2 and {c for k, c in [(x[1], x[2]) for x in h.calls if x[0] == "load"]} == {4}
    assert not any(x[0] == "suite" for x in h.calls)  # accuracy runs at concurrency 1 only


def test_fidelity_reference_uses_the_bf16_cell_or_opens_it(tmp_path):
    h = Harness()
    run_sweep(make_sweep(conc=(1,)), tmp_path / "a", work=h, opener=h.opener, progress=False)
    # bf16 cell: computed with its own client (no extra launch); fp8 cell: from the run's cache
    assert [t for t, _ in h.ref_clients] == ["bf16/torch"] and "bf16" in h.ref_clients[0][1]
    assert h.opened == ["bf16/torch", "fp8_e4m3/torch"]
    # fp8 first: the bf16 reference is launched on demand, and closed as soon as the suite is done with it
    h = Harness()
    run_sweep(make_sweep(kv=("fp8_e4m3", "bf16"), conc=(1,)), tmp_path / "c", work=h, opener=h.opener, progress=False)
    assert h.opened == ["fp8_e4m3/torch", "bf16/torch", "bf16/torch"]
    assert h.closed == ["bf16/torch", "fp8_e4m3/torch", "bf16/torch"]
    h2 = Harness()
    run_sweep(make_sweep(kv=("nvfp4",), conc=(1,), axes={"backends": ["triton"], "kv": ["nvfp4"], "concurrency": [1]}),
              tmp_path / "b", work=h2, opener=h2.opener, progress=False)
    assert h2.opened == ["nvfp4/triton", "bf16/torch"]  # the reference is bf16 on the torch backend


def test_atomic_write_leaves_the_old_file_on_a_crash(tmp_path, monkeypatch):
    path = tmp_path / "cells" / "k" / "summary.json"
    atomic_write_json(path, {"v": 1})

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(store_mod.os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        atomic_write_json(path, {"v": 2, "big": "x" * 100000})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"v": 1}
    assert os.listdir(path.parent) == ["summary.json"]  # no temp file left behind

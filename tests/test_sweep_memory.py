"""A sweep does not accumulate engines: every engine of a cell group (and a fidelity reference engine opened for a
cell) is freed by the time the next group starts, so a sweep's peak memory is its largest group's, not the sum
(docs/performance.md "Memory").  A tiny synthetic model, three cell groups (fp8, bf16, the A/A control) with the
fidelity suite and a load test through the in-process HTTP server; the fp8 group comes first, so its fidelity
suite opens the bf16 reference engine itself."""

from __future__ import annotations

import json

import weakref
from pathlib import Path

import pytest

from kvbench.core.memory import clear_callable_caches, peak_rss_bytes, release_memory, rss_bytes

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
MODEL = "synthetic:llama-3.2-1b,layers=1,hidden=64,heads=2,kv_heads=1,head_dim=32,intermediate_size=128,vocab=512"

pytestmark = pytest.mark.timeout(300)


def _config():
    from kvbench.harness.sweep.config import parse_config

    return parse_config({
        "name": "memory-guard", "model": MODEL,
        "engine": {"device": "cpu", "dtype": "float32", "kv_budget_gb": 0.02, "max_model_len": 2048, "max_running": 2},
        "axes": {"kv": [{"dtype": "fp8_e4m3", "scales": "unit"}, "bf16"], "concurrency": [1]},
        "suites": [{"name": "fidelity", "limit": 1, "params": {"top_k": 8, "greedy_tokens": 2}}],
        "load": {"num_prompts": 1, "input_len": 8, "output_len": 2, "warmup": 0, "metrics_interval_s": 0},
        "baseline": {"kv_dtype": "bf16"}, "data_dir": str(DATA),
    })


class Tracker:
    """Weak references to every Engine built, and how many were alive at chosen moments."""

    def __init__(self, monkeypatch):
        from kvbench.runtime import engine as engine_mod

        self.engines: list[weakref.ref] = []
        self.seen: list[tuple[str, int]] = []
        init = engine_mod.Engine.__init__

        def tracked(engine, *a, **kw):
            init(engine, *a, **kw)
            self.engines.append(weakref.ref(engine))

        monkeypatch.setattr(engine_mod.Engine, "__init__", tracked)

    def alive(self) -> int:
        return sum(r() is not None for r in self.engines)

    def note(self, moment: str) -> None:
        self.seen.append((moment, self.alive()))


def _run(tmp_path, monkeypatch):
    from kvbench.harness.cell_work import DefaultWork
    from kvbench.harness.runner import run_sweep
    from kvbench.harness.targets import open_target

    tracker = Tracker(monkeypatch)
    cfg = _config()
    if not (DATA / "gsm8k_test.jsonl").exists():  # a fresh clone without ../shared: fidelity texts of our own
        rows = [{"question": f"Tom has {i} apples and buys {i + 3} more. How many now?",
                 "answer": f"Tom has {i} + {i + 3} = {2 * i + 3} apples.\n#### {2 * i + 3}"} for i in range(8)]
        (tmp_path / "data").mkdir(exist_ok=True)
        (tmp_path / "data" / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg.data_dir = str(tmp_path / "data")

    def opener(spec, cell_config, engine_kwargs, log_path, **kw):
        if not Path(log_path).stem.startswith("reference-"):
            tracker.note(f"group {cell_config['kv_dtype']} starts")
        return open_target(spec, cell_config, engine_kwargs, log_path, **kw)

    class Work(DefaultWork):
        def load(self, base_url, model_id, cell):  # after the cell's fidelity suite: its reference engine is gone
            tracker.note(f"load test of {cell.config['kv_dtype']}")
            return super().load(base_url, model_id, cell)

    out = run_sweep(cfg, tmp_path / "run", progress=False, opener=opener, work=Work(cfg))
    assert out.ok, out.failed
    tracker.note("end")
    return tracker


def test_no_engine_outlives_its_cell_group(tmp_path, monkeypatch):
    tracker = _run(tmp_path, monkeypatch)
    assert len(tracker.engines) == 4  # fp8, its bf16 reference, bf16, the A/A control
    assert tracker.seen == [
        ("group fp8_e4m3 starts", 0),
        ("load test of fp8_e4m3", 1),  # the reference engine was released once the reference was computed
        ("group bf16 starts", 0),
        ("load test of bf16", 1),
        ("group bf16 starts", 0),  # the A/A control (no load test)
        ("end", 0),
    ], tracker.seen


def test_release_memory_gives_freed_pages_back():
    import numpy as np

    clear_callable_caches()
    base = rss_bytes()
    blocks = [np.ones(2**17) for _ in range(400)]  # 400 MB in 1 MB blocks (malloc'd, not mmapped, past the threshold)
    assert rss_bytes() - base > 300e6
    del blocks
    release_memory()
    assert rss_bytes() - base < 150e6
    assert peak_rss_bytes() >= rss_bytes()

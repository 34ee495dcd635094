"""Synthetic runs written through core/store.py, and reading them back (reports/load.py).

``make_run`` is shared with the gate and report tests: it writes a run directory with the exact record
schemas of docs/design.md §10, from seeded random numbers, with a planted accuracy drop per KV format.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from kvbench.core.store import RunStore
from kvbench.core.io import canonical_key
from kvbench.reports.load import RunLoadError, load_run, select
from kvbench.reports.item_records import accuracy_suites, item_scores, suite_metrics

DEFAULT_DROPS = {"bf16": 0.0, "fp8_e4m3": 0.02, "nvfp4": 0.35}
BYTES_PER_ELEMENT = {"bf16": 2.0, "fp16": 2.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "nvfp4": 0.5625}


def _cell_config(kv, conc, aa=False):
    cfg = {
        "model": "smollm2-135m",
        "target": "embedded",
        "prefill_backend": "torch",
        "decode_backend": "torch",
        "kv_dtype": kv,
        "kv_scales": "unit" if kv in ("bf16", "fp16") else "calibrate",
        "concurrency": conc,
    }
    if aa:
        cfg["aa_control"] = True
    return cfg


def _items(kv, drop, rng_base, rng, n_gsm8k, n_aime, k_aime, kl_scale, truncate_extra, symmetric=False):
    """Baseline outcomes come from ``rng_base`` (the same stream in every cell); ``drop`` flips answers."""
    recs = []
    for i in range(n_gsm8k):
        base_ok, base_inv, base_trunc, u = (rng_base.random() < 0.6, rng_base.random() < 0.1,
                                            rng_base.random() < 0.03, rng_base.random())
        flip = rng.random() < drop
        ok = (not base_ok if symmetric else False) if flip else base_ok
        invalid = (not ok) and (base_inv if not flip else rng.random() < 0.1)
        trunc = base_trunc or rng.random() < truncate_extra
        recs.append({
            "suite": "gsm8k", "item_id": f"gsm8k-{i}", "repeat": 0, "seed": None, "prompt_hash": f"{i:016x}",
            "raw_output": f"... #### {i if ok else i + 1}", "extracted": None if invalid else str(i if ok else i + 1),
            "target": str(i), "correct": ok, "invalid": invalid, "finish_reason": "length" if trunc else "stop",
            "prompt_tokens": 120, "output_tokens": 80, "latency_s": 0.5,
            "scores": {"strict-match": float(ok), "flexible-extract": float(ok or u < 0.3)},
            "protocol": "lm-eval-gsm8k-5shot",
        })
    for i in range(n_aime):
        p = rng_base.random()
        for r in range(k_aime):
            base_ok = rng_base.random() < p
            flip = rng.random() < drop
            ok = (not base_ok if symmetric else False) if flip else base_ok
            recs.append({
                "suite": "aime24", "item_id": f"aime24-{i}", "repeat": r, "seed": 1000 + r, "prompt_hash": f"a{i:015x}",
                "raw_output": f"\\boxed{{{int(ok)}}}", "extracted": str(int(ok)), "target": "1", "correct": ok,
                "invalid": False, "finish_reason": "stop", "prompt_tokens": 200, "output_tokens": 400, "latency_s": 2.0,
                "scores": {"correct": float(ok)}, "protocol": "aime-boxed",
            })
    for i in range(8):
        n_tok = 50 + 10 * i
        kl = 0.0 if kv == "bf16" else kl_scale * (0.5 + rng.random())
        recs.append({
            "suite": "fidelity", "item_id": f"fid-{i}", "repeat": 0, "seed": None, "prompt_hash": f"f{i:015x}",
            "raw_output": "", "extracted": None, "target": "", "correct": None, "invalid": False,
            "finish_reason": "stop", "prompt_tokens": n_tok, "output_tokens": 0, "latency_s": 0.1,
            "scores": {"kl_mean": kl, "kl_p99": 4 * kl, "kl_max": 10 * kl, "top1_agree": 1.0 - kl,
                       "nll_ref": 1.5, "nll_cand": 1.5 + kl, "ppl_ref": math.exp(1.5), "ppl_cand": math.exp(1.5 + kl),
                       "first_divergence": 64 if kl == 0 else 10 + i, "n_tokens": n_tok},
            "protocol": "fidelity-teacher-forced",
        })
    return recs


def _requests(kv, conc, rng, n=24):
    speed = {"bf16": 1.0, "fp16": 1.0, "fp8_e4m3": 1.15, "fp8_e5m2": 1.15, "nvfp4": 1.3}.get(kv, 1.0)
    recs, t = [], 0.0
    for j in range(n):
        ttft = (0.05 + 0.01 * conc) * (0.8 + 0.4 * rng.random()) / speed
        tpot = (0.01 + 0.002 * conc) * (0.8 + 0.4 * rng.random()) / speed
        out = 32
        itl = [tpot] * (out - 1)
        lat = ttft + tpot * (out - 1)
        recs.append({"request_id": f"r{j}", "success": True, "error": None, "prompt_tokens": 64, "output_tokens": out,
                     "start_s": t, "ttft_s": ttft, "latency_s": lat, "itl_s": itl, "tpot_s": tpot})
        if (j + 1) % conc == 0:
            t += lat
    return recs


def make_run(root: Path, drops=None, concurrency=(1, 4, 16), aa=True, n_gsm8k=60, n_aime=10, k_aime=4,
             seed=0, gate=None, kl_scale=0.02, truncate_extra=None, failed=(), aa_flip=0.02) -> Path:
    """Write a synthetic run; returns its path.  ``drops[kv]`` is the chance a correct answer turns wrong."""
    drops = dict(DEFAULT_DROPS if drops is None else drops)
    truncate_extra = truncate_extra or {}
    store = RunStore(root)
    config = {"baseline": "kv_dtype=bf16", "accuracy_concurrency": concurrency[0]}
    if gate is not None:
        config["gate"] = gate
    store.write_manifest({"config": config, "git_sha": "0" * 40, "device": "cpu (synthetic)", "date": "2026-01-01"})
    cells = [(kv, c, False) for kv in drops for c in concurrency]
    if aa:
        cells.append(("bf16", concurrency[0], True))
    for n, (kv, conc, is_aa) in enumerate(cells):
        cfg = _cell_config(kv, conc, is_aa)
        key = canonical_key(cfg)
        store.init_cell(key, cfg, label=f"{kv} c={conc}" + (" A/A" if is_aa else ""))
        if kv in failed:
            store.write_json(key, "summary", {"suites": {}, "load": {}, "capacity": {}, "error": "RuntimeError: boom"})
            store.set_status(key, "failed")
            continue
        rng = random.Random(f"{seed}-{kv}-{conc}-{is_aa}")
        if conc == concurrency[0]:
            rng_base = random.Random(seed)  # same base answers in every cell: paired data
            drop = drops[kv] if not is_aa else aa_flip  # A/A: a little nondeterminism, both directions
            store.write_items(key, _items(kv, drop, rng_base, rng, n_gsm8k, n_aime, k_aime,
                                          kl_scale if kv != "bf16" else 0.0, truncate_extra.get(kv, 0.0), symmetric=is_aa))
        if not is_aa:
            store.write_requests(key, _requests(kv, conc, rng))
        bpt = 2 * 30 * 3 * 64 * BYTES_PER_ELEMENT[kv]
        cap = {"kv_dtype": kv, "page_size": 16, "num_pages": int(2**30 // (bpt * 16)),
               "tokens": int(2**30 // (bpt * 16)) * 16, "bytes_per_token": bpt, "kv_bytes": 2**30,
               "context_len": 2048, "max_concurrency": int(2**30 // (bpt * 16)) * 16 // 2048}
        store.write_json(key, "capacity", cap)
        store.write_json(key, "summary", {"suites": {}, "load": {}, "capacity": cap, "error": None})
        store.set_status(key, "done")
    return root


# ------------------------------------------------------------------------------------- tests


def test_load_run_reads_every_cell(tmp_path):
    run = load_run(make_run(tmp_path / "run"))
    assert len(run.cells) == 3 * 3 + 1
    assert all(c.done for c in run.cells)
    with_items = [c for c in run.cells if c.items]
    assert len(with_items) == 4  # one accuracy cell per format + the A/A control
    assert run.config["baseline"] == "kv_dtype=bf16"
    c = with_items[0]
    assert accuracy_suites(c) == ["gsm8k", "aime24"]
    assert suite_metrics(c, "gsm8k") == ["correct", "flexible-extract", "strict-match"]
    assert len(item_scores(c, "aime24")) == 40
    assert len(item_scores(c, "fidelity", "kl_mean")) == 8
    assert item_scores(c, "fidelity") == {}  # correct is null for fidelity


def test_select_resolves_and_hides_aa_control(tmp_path):
    run = load_run(make_run(tmp_path / "run"))
    assert len(select(run.cells, "kv_dtype=bf16")) == 3
    base = select(run.cells, "kv_dtype=bf16", need_items=True)
    assert len(base) == 1 and not base[0].aa_control
    aa = select(run.cells, "kv_dtype=bf16,aa_control=true", need_items=True)
    assert len(aa) == 1 and aa[0].aa_control
    assert len(select(run.cells, {"concurrency": 4})) == 3
    with pytest.raises(RunLoadError, match="unknown selector key"):
        select(run.cells, "kv_type=bf16")
    with pytest.raises(RunLoadError, match="key=value"):
        select(run.cells, "bf16")


def test_short_labels_use_varying_keys(tmp_path):
    run = load_run(make_run(tmp_path / "run"))
    labels = {c.short for c in run.cells}
    assert "fp8_e4m3 calibrate c=4" in labels
    assert "bf16 unit c=1 (A/A)" in labels


def test_failed_and_unfinished_cells_are_not_selected(tmp_path):
    root = make_run(tmp_path / "run", failed=("nvfp4",))
    store = RunStore(root)
    key = [c.key for c in store.cells() if c.config["kv_dtype"] == "fp8_e4m3" and c.config["concurrency"] == 1][0]
    store.set_status(key, "running")
    run = load_run(root)
    assert select(run.cells, "kv_dtype=nvfp4") == []
    assert select(run.cells, "kv_dtype=fp8_e4m3", need_items=True) == []
    assert [c.error for c in run.cells if c.config["kv_dtype"] == "nvfp4"][0] == "RuntimeError: boom"


def test_bad_runs_get_clear_errors(tmp_path):
    with pytest.raises(RunLoadError, match="not found"):
        load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunLoadError, match="manifest"):
        load_run(tmp_path / "empty")
    root = make_run(tmp_path / "run", drops={"bf16": 0.0}, concurrency=(1,), aa=False)
    cell = next((root / "cells").iterdir())
    (cell / "items.jsonl").write_text('{"suite": "gsm8k"}\n{broken\n')
    with pytest.raises(RunLoadError, match="invalid JSON"):
        load_run(root)
    json.loads((root / "manifest.json").read_text())  # untouched


def test_a_run_without_cells_says_so(tmp_path):
    """A sweep killed before its first cell wrote cell.json: selecting says the run has no cells, instead of
    calling the selector's keys unknown."""
    root = make_run(tmp_path / "run", drops={"bf16": 0.0}, concurrency=(1,), aa=False)
    for cell in (root / "cells").iterdir():
        (cell / "cell.json").unlink()
    run = load_run(root)
    assert run.cells == []
    with pytest.raises(RunLoadError, match="no cells yet"):
        select(run.cells, "kv_dtype=bf16")

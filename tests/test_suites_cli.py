"""`kvbench eval` wiring (flags, outputs, errors) with the fake client standing in for the engine."""

from __future__ import annotations

import os

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.harness.commands import eval as eval_cmd
from kvbench.core.records import ITEM_FIELDS
from kvbench.suites.fake import FakeClient

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


@pytest.fixture
def fake(monkeypatch):
    opened = []

    def open_client(engine, endpoint):
        c = FakeClient(noise=0.0 if engine.kv_dtype == "bf16" else 0.5, responder=None)
        opened.append((engine, endpoint, c))
        return c

    monkeypatch.setattr(eval_cmd, "_open_client", open_client)
    return opened


@pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists() and not os.environ.get("CI"), reason="shared data not present")
def test_eval_gsm8k_writes_records(tmp_path, fake):
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["eval", "--suite", "gsm8k", "--limit", "3", "--data-dir", str(DATA), "--out", str(out),
                                 "--max-tokens", "8", "--no-progress"])
    assert r.exit_code == 0, r.output
    items = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    # every record also holds "error" / "error_kind" (None when the request was answered)
    assert len(items) == 3 and all(set(i) == set(ITEM_FIELDS) | {"error", "error_kind", "request_options", "reasoning", "retries"} and i["error"] is None for i in items)
    assert all(i["output_tokens"] <= 8 and "max8" in i["protocol"] for i in items)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) >= {"suites", "load", "capacity", "error"} and summary["error"] is None
    assert summary["suites"]["gsm8k"]["n"] == 3
    assert fake[0][2].closed


@pytest.mark.skipif(not (DATA / "gsm8k_test.jsonl").exists() and not os.environ.get("CI"), reason="shared data not present")
def test_eval_fidelity_reference_is_bf16_torch(tmp_path, fake, monkeypatch):
    made = []

    class Ref(FakeClient):
        def __init__(self, cfg):
            made.append(cfg)
            super().__init__()

    import kvbench.harness.engine_client as ec

    monkeypatch.setattr(ec, "EngineClient", Ref)
    args = ["eval", "--suite", "fidelity", "--limit", "2", "--data-dir", str(DATA), "--fidelity-cache", str(tmp_path / "c"),
            "--greedy-tokens", "4", "--no-progress", "--out", str(tmp_path / "o")]
    r = CliRunner().invoke(app, args + ["--kv-dtype", "fp8_e4m3", "--kv-scales", "calibrate", "--backend", "triton"])
    assert r.exit_code == 0, r.output
    assert len(made) == 1
    cfg = made[0]
    assert (cfg.kv_dtype, cfg.kv_scales, cfg.prefill_backend, cfg.decode_backend) == ("bf16", "unit", "torch", "torch")
    s = json.loads((tmp_path / "o" / "summary.json").read_text())["suites"]["fidelity"]
    assert s["kl_mean"] > 0 and s["n"] == 2
    # the bf16 candidate is the reference configuration itself: no second engine, KL exactly zero
    r = CliRunner().invoke(app, args + ["--fidelity-cache", str(tmp_path / "c2")])
    assert r.exit_code == 2 and "--overwrite" in r.output  # results already there: refused, not replaced
    r = CliRunner().invoke(app, args + ["--fidelity-cache", str(tmp_path / "c2"), "--overwrite"])
    assert r.exit_code == 0, r.output
    assert len(made) == 1
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["suites"]["fidelity"]["kl_max"] == 0.0


def test_eval_bad_input(tmp_path, fake):
    r = CliRunner().invoke(app, ["eval", "--suite", "nope"])
    assert r.exit_code == 2 and "unknown suite" in r.output
    r = CliRunner().invoke(app, ["eval", "--suite", "aime24", "--protocol", "cot"])
    assert r.exit_code == 2
    r = CliRunner().invoke(app, ["eval", "--suite", "gsm8k", "--limit", "0"])
    assert r.exit_code == 2
    r = CliRunner().invoke(app, ["eval", "--suite", "gpqa_diamond", "--data-dir", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_fidelity_table(tmp_path):
    from kvbench.core.io import atomic_write_json
    from kvbench.suites.fidelity.table import table

    fid = {"kl_mean": 0.0123, "kl_p99": 0.2, "kl_max": 1.5, "top1_agree": 0.97, "ppl_ref": 2.0, "ppl_cand": 2.1,
           "first_divergence": 12.5, "n_tokens": 300}
    for kv, sc in (("fp8_e4m3", "calibrate"), ("bf16", "unit")):
        atomic_write_json(tmp_path / kv / "summary.json", {"suites": {"fidelity": fid}, "error": None,
                          "engine": {"kv_dtype": kv, "kv_scales": sc, "prefill_backend": "torch", "decode_backend": "torch"}})
    lines = table([tmp_path / "fp8_e4m3", tmp_path / "bf16"]).splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| fp8_e4m3 | calibrate | torch | 1.23e-02 | 2.00e-01 | 1.500 | 97.00% |")
    assert lines[3].startswith("| bf16 | - | torch |")
    atomic_write_json(tmp_path / "bad" / "summary.json", {"suites": {}, "error": "boom"})
    with pytest.raises(SystemExit):
        table([tmp_path / "bad"])


def test_fidelity_paired(tmp_path):
    from kvbench.core.io import atomic_write_jsonl
    from kvbench.suites.fidelity.table import paired

    keys = ("kl_mean", "nll_cand", "top1_agree", "first_divergence")
    for name, kls in (("a", [0.1, 0.3]), ("b", [0.0, 0.0])):
        atomic_write_jsonl(tmp_path / name / "items.jsonl",
                           [{"item_id": f"t{i}", "scores": {**{k: 1.0 for k in keys}, "kl_mean": v, "first_divergence": 4 * i}}
                            for i, v in enumerate(kls)])
    out = paired(tmp_path / "a", tmp_path / "b")
    assert "kl_mean: +0.2000 ± 0.1000" in out and "nll_cand: +0.0000 ± 0.0000" in out
    assert out.rstrip().endswith("[0, 4]")

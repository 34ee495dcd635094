"""Report and gate on a run written by the real sweep runner (fake target and fake cell work, no model):
the manifest, config, baseline and gate sections are the runner's own."""

from __future__ import annotations

import random
from contextlib import contextmanager

from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.harness.runner import run_sweep
from kvbench.harness.sweep.config import parse_config
from kvbench.harness.targets import TargetSession

N = 200


class _Client:
    model_id = "fake-model"

    def close(self):
        pass


class _Work:
    """Answers: the bf16 cell is right on 60% of items; nvfp4 loses a planted 30% of those."""

    def suite(self, spec, client, cell, fidelity):
        kv = cell.config["kv_dtype"]
        base, flips = random.Random(0), random.Random(kv)
        if spec.name == "fidelity":
            recs = [{"suite": "fidelity", "item_id": f"f{i}", "repeat": 0, "correct": None, "invalid": False,
                     "finish_reason": "stop", "scores": {"kl_mean": 0.0 if kv == "bf16" else 0.05, "kl_p99": 0.1,
                     "kl_max": 0.2, "top1_agree": 0.97, "nll_ref": 1.0, "nll_cand": 1.02, "ppl_ref": 2.72,
                     "ppl_cand": 2.77, "first_divergence": 12.0, "n_tokens": 40.0}} for i in range(6)]
            return recs, {"kl_mean": 0.05}
        recs = []
        for i in range(spec.limit):
            ok = base.random() < 0.6 and not (kv == "nvfp4" and flips.random() < 0.3)
            recs.append({"suite": spec.name, "item_id": str(i), "repeat": 0, "seed": None, "prompt_hash": "x",
                         "raw_output": str(ok), "extracted": str(ok), "target": "True", "correct": ok, "invalid": False,
                         "finish_reason": "stop", "prompt_tokens": 10, "output_tokens": 5, "latency_s": 0.1,
                         "scores": {}, "protocol": "fake"})
        return recs, {"accuracy": sum(r["correct"] for r in recs) / len(recs), "n": len(recs)}

    def load(self, base_url, model_id, cell):
        c = cell.concurrency
        reqs = [{"request_id": str(i), "success": True, "error": None, "prompt_tokens": 8, "output_tokens": 4,
                 "start_s": 0.1 * (i // c), "ttft_s": 0.02 * c, "latency_s": 0.02 * c + 0.03, "itl_s": [0.01] * 3,
                 "tpot_s": 0.01} for i in range(4 * c)]
        return {"duration_s": 0.1 * 4 + 0.05, "output_throughput": 16 * c / 0.45}, reqs


@contextmanager
def _opener(spec, cell_config, engine_kwargs, log_path):
    yield TargetSession(_Client(), "fake-model", url="http://fake",
                        capacity=lambda: {"kv_dtype": cell_config["kv_dtype"], "page_size": 16, "num_pages": 10,
                                          "tokens": 160 if cell_config["kv_dtype"] == "bf16" else 560,
                                          "bytes_per_token": 100.0, "kv_bytes": 16000, "context_len": 64,
                                          "max_concurrency": 2},
                        flush=lambda: None, log_path=None)


def test_report_and_gate_on_a_runner_written_run(tmp_path):
    sweep = parse_config({
        "name": "fake",
        "axes": {"kv": [{"dtype": "bf16", "scales": "unit"}, {"dtype": "nvfp4", "scales": "unit"}], "concurrency": [1, 2]},
        "suites": [{"name": "gsm8k_chat", "limit": N}, {"name": "fidelity", "limit": 6}],
        "load": {"num_prompts": 2},
        "baseline": {"kv_dtype": "bf16"},
        "gate": {"max_drop": {"gsm8k_chat": 0.4}, "max_kl_mean": 0.01},
    })
    run = tmp_path / "run"
    outcome = run_sweep(sweep, run, work=_Work(), progress=False, opener=_opener)
    assert outcome.ok and len(outcome.done) == 5  # 2 formats x 2 concurrencies + the A/A control (default)

    r = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "rep"), "--bootstrap", "500"])
    assert r.exit_code == 0, r.stdout
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| gsm8k_chat | nvfp4 c=1 | bf16 c=1 | 200 |" in md  # delta row: candidate, baseline, pairs
    assert {p.stem for p in (tmp_path / "rep").glob("*.png")} == {"accuracy", "deltas", "accuracy_throughput", "fidelity",
                                                                      "serving", "latency", "capacity"}

    gate = lambda *a: CliRunner().invoke(app, ["gate", str(run), *a])  # noqa: E731
    res = gate("--candidate", "kv_dtype=nvfp4")  # baseline and thresholds from the run's config
    assert res.exit_code == 1, res.stdout
    assert "Overall: FAIL — `kvbench gate" in md and "A/A control: bf16 c=2 (A/A)" in md  # the report's word
    assert "### nvfp4 c=1: **FAIL**" in md
    last = res.stdout.strip().splitlines()[-1]
    assert "fidelity KL" in last and "gsm8k_chat accuracy" not in last  # δ = 0.4 from the config holds
    loose = ("--max-kl", "0.1", "--max-ppl-ratio", "1.5")  # the fake's fidelity within looser limits
    assert gate("--candidate", "kv_dtype=nvfp4", *loose).exit_code == 0
    assert gate("--candidate", "kv_dtype=nvfp4", *loose, "--max-drop", "0.05").exit_code == 1


def test_candidate_controls_reach_the_gate_and_the_report(tmp_path):
    """``aa_control: all`` through the real runner: the candidate's own control is its noise floor in the gate,
    and the report's A/A table compares each control with the cell it reruns."""
    from kvbench.reports.gate.check import GateThresholds, run_gate
    from kvbench.reports.load import load_run

    sweep = parse_config({
        "name": "fake",
        "axes": {"kv": [{"dtype": "bf16", "scales": "unit"}, {"dtype": "nvfp4", "scales": "unit"}], "concurrency": [1, 2]},
        "suites": [{"name": "gsm8k_chat", "limit": N}],
        "load": {"num_prompts": 2},
        "baseline": {"kv_dtype": "bf16"},
        "aa_control": "all",
    })
    run = tmp_path / "run"
    outcome = run_sweep(sweep, run, work=_Work(), progress=False, opener=_opener)
    assert outcome.ok and len(outcome.done) == 6  # 2 formats x 2 concurrencies + a control of each
    result = run_gate(load_run(run), "kv_dtype=bf16", None, GateThresholds())
    acc = next(c for c in result.checks if c.kind == "accuracy")
    assert [n.subject for n in acc.noises] == ["the baseline", "the candidate"]
    assert list(result.cand_aa.values())[0].config["kv_dtype"] == "nvfp4"
    r = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "rep"), "--bootstrap", "200"])
    assert r.exit_code == 0, r.stdout
    md = (tmp_path / "rep" / "report.md").read_text()
    aa = md[md.index("### A/A controls"):]
    assert "| gsm8k_chat | nvfp4 c=2 (A/A) | nvfp4 c=1 |" in aa  # compared with its own original
    assert "| gsm8k_chat | bf16 c=2 (A/A) | bf16 c=1 |" in aa
    assert "1 candidate(s) have an A/A control of their own" in md

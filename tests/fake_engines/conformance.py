"""Helpers of the conformance sweeps (tests/test_conformance_*.py): a fake model directory, a made-up AIME /
GPQA data directory whose right answers the fakes can find, running a sweep through the real runner, and
reading back what every cell wrote."""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
FAKE_SGLANG = HERE / "fake_sglang.py"
FAKE_VLLM = HERE / "fake_vllm.py"
PYTHON = sys.executable
MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096}
BUDGET_MIB = 1024  # FAKE_KV_BUDGET_MIB default


def bytes_per_token(kv_bytes: float) -> float:
    c = MODEL_CONFIG
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * kv_bytes


def expected_tokens(kv_bytes: float, tp: int = 1) -> int:
    """The fakes' KV pool at the default memory fraction."""
    return int(BUDGET_MIB * 2**20 * tp // bytes_per_token(kv_bytes))


def make_model(root: Path, name: str = "fake-model") -> Path:
    d = Path(root) / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return d


# AIME rows: the fake answers the ANSWER=N marker; the third row's marker is wrong on purpose
AIME = [("a1", "Find x. ANSWER=42", 42), ("a2", "Find y. ANSWER=7", 7), ("a3", "Find z. ANSWER=5", 6)]
# GPQA rows: the fake picks the option holding CORRECT; the third row marks a wrong option
GPQA = [("g1", "Which one?", "CORRECT alpha", ["beta", "gamma", "delta"]),
        ("g2", "Pick one.", "CORRECT one", ["two", "three", "four"]),
        ("g3", "Choose.", "right", ["CORRECT wrong", "other", "another"])]
EXPECTED_CORRECT = {("aime25", "a1"): True, ("aime25", "a2"): True, ("aime25", "a3"): False,
                    ("gpqa_diamond", "g1"): True, ("gpqa_diamond", "g2"): True, ("gpqa_diamond", "g3"): False}


def make_data(root: Path) -> Path:
    d = Path(root) / "data"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "aime25.jsonl", "w") as f:
        for rid, problem, answer in AIME:
            f.write(json.dumps({"id": rid, "problem": problem, "answer": str(answer)}) + "\n")
    with open(d / "gpqa_diamond.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Record ID", "Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"])
        for rid, q, right, wrong in GPQA:
            w.writerow([rid, q, right, *wrong])
    return d


def run(raw: dict, out: Path, **kw):
    from kvbench.harness.runner import run_sweep
    from kvbench.harness.sweep.config import parse_config

    return run_sweep(parse_config(raw), out, progress=False, **kw)


@dataclass
class CellResult:
    key: str
    config: dict
    status: Optional[str]
    summary: dict
    capacity: Optional[dict]
    items: list = field(default_factory=list)
    requests: list = field(default_factory=list)
    server_log: str = ""

    @property
    def group(self) -> tuple:
        c = self.config
        return (c["model"], c["target"], c["prefill_backend"], c["decode_backend"], c["kv_dtype"])


def _jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def read_cells(run_dir: Path) -> list[CellResult]:
    manifest = json.loads((Path(run_dir) / "manifest.json").read_text())
    out = []
    for c in manifest["cells"]:
        d = Path(run_dir) / "cells" / c["key"]
        status = (d / "status").read_text().strip() if (d / "status").exists() else None
        summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
        cap = json.loads((d / "capacity.json").read_text()) if (d / "capacity.json").exists() else None
        log = (d / "server.log").read_text() if (d / "server.log").exists() else ""
        out.append(CellResult(c["key"], c["config"], status, summary, cap, _jsonl(d / "items.jsonl"), _jsonl(d / "requests.jsonl"), log))
    return out


def fake_args(log_text: str) -> list[dict]:
    """The ``FAKE_ARGS`` records a fake printed (one per launch)."""
    return [json.loads(line.split("FAKE_ARGS ", 1)[1]) for line in log_text.splitlines() if line.startswith("FAKE_ARGS ")]


def request_log(path: Path) -> list[dict]:
    return _jsonl(Path(path))

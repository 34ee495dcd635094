"""Sweep config validation: every bad key or value is named, with the allowed choices."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from kvbench.harness.sweep.config import SweepConfigError, load_config, parse_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

BASE = {
    "name": "t",
    "engine": {"device": "cpu"},
    "axes": {"backends": ["torch"], "kv": [{"dtype": "bf16"}, {"dtype": "fp8_e4m3", "scales": "calibrate"}], "concurrency": [1, 4]},
    "suites": [{"name": "gsm8k_chat", "limit": 4}, "fidelity"],
    "load": {"num_prompts": 4, "request_rate": "inf"},
    "baseline": {"kv_dtype": "bf16"},
    "gate": {"max_drop": {"gsm8k_chat": 0.05}},
}


def with_(path: str, value):
    raw = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    d = raw
    for p in parents:
        d = d[int(p)] if isinstance(d, list) else d.setdefault(p, {})
    if isinstance(d, list):
        d[int(last)] = value
    else:
        d[last] = value
    return raw


def error_of(raw) -> str:
    with pytest.raises(SweepConfigError) as e:
        parse_config(raw)
    return str(e.value)


def test_base_config_parses_with_defaults():
    cfg = parse_config(copy.deepcopy(BASE))
    assert cfg.models == ["default"]
    assert [t.type for t in cfg.targets] == ["embedded"]
    assert cfg.backends == [("torch", "torch")]
    assert [(k.dtype, k.scales) for k in cfg.kv] == [("bf16", "unit"), ("fp8_e4m3", "calibrate")]
    assert cfg.accuracy_concurrency == 1  # the first level by default
    assert math.isinf(cfg.load.request_rate)
    assert cfg.to_dict()["load"]["request_rate"] == "inf"  # JSON-safe


@pytest.mark.parametrize(
    "path,value,needles",
    [
        ("colour", 1, ["config", "'colour'", "allowed keys", "axes"]),
        ("axes.kv.1", {"dtype": "fp9"}, ["axes.kv[1].dtype", "'fp9'", "bf16, fp16, fp8_e4m3, fp8_e5m2, nvfp4"]),
        ("axes.kv.0", {"dtype": "bf16", "scales": "magic"}, ["axes.kv[0].scales", "unit, checkpoint, calibrate"]),
        ("axes.kv.0", {"dtype": "bf16", "sclaes": "unit"}, ["axes.kv[0]", "'sclaes'", "scales"]),
        ("axes.backends", ["torch", "cuda"], ["axes.backends[1]", "'cuda'", "torch, triton, flashinfer"]),
        ("axes.backends", ["triton+flashinfer+torch"], ["axes.backends[0]", "PREFILL+DECODE"]),
        ("axes.concurrency", [1, 0], ["axes.concurrency[1]", ">= 1"]),
        ("axes.concurrency", [1, 1], ["axes.concurrency", "duplicate"]),
        ("axes.speed", [1], ["axes", "'speed'", "backends, kv, concurrency"]),
        ("accuracy_concurrency", 0, ["accuracy_concurrency", ">= 1"]),  # off the load axis is allowed: accuracy-only cells
        ("engine.kv_dtype", "fp8_e4m3", ["engine", "'kv_dtype'", "allowed keys"]),
        ("engine.warp_speed", True, ["engine", "'warp_speed'"]),
        ("suites.0", {"name": "mmlu"}, ["suites[0].name", "'mmlu'", "gsm8k", "lm_eval:<task>"]),
        ("suites.0", {"name": "gsm8k", "limt": 3}, ["suites[0]", "'limt'", "limit"]),
        ("suites.0", {"name": "gsm8k", "repeats": 0}, ["suites[0].repeats", ">= 1"]),
        ("load.request_rate", 0, ["load.request_rate", "> 0"]),
        ("load.range_ratio", 1.5, ["load.range_ratio", "[0, 1)"]),
        ("load.dataset", "sharegpt", ["load.dataset_path", "sharegpt"]),
        ("load.rps", 3, ["load", "'rps'", "num_prompts"]),
        ("slo.ttfb_ms", 3, ["slo", "'ttfb_ms'", "ttft_ms, tpot_ms, e2el_ms"]),
        ("baseline.kv_dtype", "nvfp4", ["baseline.kv_dtype", "'nvfp4'", "bf16, fp8_e4m3"]),
        ("baseline.format", "bf16", ["baseline", "'format'", "kv_dtype"]),
        ("gate.max_drop", {"aime24": 0.1}, ["gate.max_drop.aime24", "gsm8k_chat, fidelity"]),
        ("gate.confidence", 1.5, ["gate.confidence", "[0.5, 1)"]),
        ("gate.metrics", ["mmlu"], ["gate.metrics[0]", "'mmlu'", "gsm8k_chat, fidelity"]),
        ("gate.max_drop", -0.1, ["gate.max_drop", ">= 0"]),
        ("targets", [{"name": "s", "type": "server", "launch": "serve --port 1"}], ["targets[0].launch", "{port}"]),
        ("targets", [{"name": "s", "type": "docker"}], ["targets[0].type", "embedded, server, endpoint"]),
        ("targets", [{"name": "e", "type": "endpoint", "base_url": "localhost:8000"}], ["targets[0].base_url", "http"]),
        ("targets", [{"name": "e", "type": "endpoint"}], ["targets[0].base_url", "non-empty string"]),
        ("targets", [{"name": "e", "type": "embedded", "launch": "x {port}"}], ["targets[0].launch", "server targets only"]),
        ("targets", [{"name": "a", "type": "embedded"}, {"name": "a", "type": "embedded"}], ["targets", "unique"]),
        ("targets", [{"name": "s", "type": "server", "launch": "x {port}", "flush_cache": "DELETE /x"}], ["targets[0].flush_cache", "POST /path"]),
    ],
)
def test_bad_values_name_the_key_and_the_choices(path, value, needles):
    msg = error_of(with_(path, value))
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def test_not_a_mapping():
    assert "expected a mapping" in error_of(["a", "b"])
    assert "axes.kv" in error_of(with_("axes.kv", []))


def test_load_config_file_errors(tmp_path):
    with pytest.raises(SweepConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("axes: [unclosed\n")
    with pytest.raises(SweepConfigError, match="invalid YAML"):
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("axes:\n  kv: [fp9]\n")  # (fp8, the engines' spelling of fp8_e4m3, is accepted)
    with pytest.raises(SweepConfigError, match=r"typo.yaml: axes.kv\[0\].dtype: 'fp9' is not allowed"):
        load_config(typo)


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_are_valid(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.name
    assert cfg.targets and cfg.kv and cfg.concurrency


def test_default_config_is_the_cpu_matrix():
    cfg = load_config(CONFIGS / "default.yaml")
    assert [k.dtype for k in cfg.kv] == ["bf16", "fp8_e4m3", "nvfp4"]
    assert all(k.scales == "calibrate" for k in cfg.kv if k.dtype != "bf16")
    assert cfg.backends == [("torch", "torch")]
    assert cfg.concurrency == [1, 4, 16]
    assert cfg.engine["device"] == "cpu"
    assert {s.name for s in cfg.suites} == {"fidelity", "ruler"}  # the suites this model is discriminative on
    assert cfg.load.enabled and cfg.baseline == {"kv_dtype": "bf16"}


def test_gate_section_is_what_the_gate_reads():
    from kvbench.reports.gate.check import GateThresholds, merge_gate_config

    raw = with_("gate", {"max_drop": 0.03, "max_kl_mean": 0.2, "metrics": ["gsm8k_chat:accuracy"], "confidence": 0.9})
    t = merge_gate_config(GateThresholds(), parse_config(raw).to_dict()["gate"])
    assert (t.default_max_drop, t.max_kl_mean, t.metrics, t.confidence) == (0.03, 0.2, ["gsm8k_chat:accuracy"], 0.9)
    t = merge_gate_config(GateThresholds(), parse_config(copy.deepcopy(BASE)).to_dict()["gate"])
    assert t.drop_for("gsm8k_chat") == 0.05

"""What driving a real vLLM needed beyond the engine itself: the same prompts for both load clients (a custom
JSONL dataset in ``vllm bench serve``'s format), model paths that differ between machines (``${VAR:-default}``),
the GPU in a server sweep's provenance, a report that counts the manifest's cells, and the default model as an
HF directory for engines that load those (tools/gguf_to_hf.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench.harness.config_checks import SweepConfigError
from kvbench.harness.loadgen.run import LoadConfig, build_items, load_settings
from kvbench.harness.loadgen.datasets import custom_items
from kvbench.harness.sweep.config import expand_env, parse_config
from kvbench.reports.compare import device_text, run_meta


def test_custom_dataset_reads_vllm_bench_jsonl(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "one two", "output_tokens": 7}\n\n{"prompt": "three"}\n{"prompt": "four", "output_tokens": 3}\n')
    items = custom_items(str(f), 3, output_len=5)
    assert [(i.prompt, i.output_len, i.prompt_len) for i in items] == [("one two", 7, None), ("three", 5, None), ("four", 3, None)]
    cfg = LoadConfig(num_prompts=2, warmup=1, dataset="custom", dataset_path=str(f), output_len=5, salt="s")
    built = build_items(cfg, None)
    assert [i.prompt for i in built] == ["[s] one two", "[s] three", "[s] four"]  # salted as ShareGPT prompts are
    assert load_settings(cfg)["input_len"] is None  # the file's lengths, not --input-len
    with pytest.raises(ValueError, match="holds 3 prompts, 4 asked"):
        custom_items(str(f), 4, output_len=5)
    f.write_text('{"prompt": "x", "output_tokens": 0}\n')
    with pytest.raises(ValueError, match="p.jsonl:1: 'output_tokens' must be a positive integer"):
        custom_items(str(f), 1, output_len=5)
    f.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="needs a non-empty 'prompt'"):
        custom_items(str(f), 1, output_len=5)
    with pytest.raises(ValueError, match="needs dataset_path"):
        LoadConfig(dataset="custom")


def test_model_paths_take_environment_variables(monkeypatch):
    monkeypatch.delenv("KVB_TEST_MODEL", raising=False)
    assert expand_env("${KVB_TEST_MODEL:-/models/x}", "model") == "/models/x"
    with pytest.raises(SweepConfigError, match=r"\$\{KVB_TEST_MODEL\} is not set"):
        expand_env("${KVB_TEST_MODEL}/hf", "model")
    monkeypatch.setenv("KVB_TEST_MODEL", "/data/smol")
    assert expand_env("${KVB_TEST_MODEL}/hf", "model") == "/data/smol/hf"
    cfg = parse_config({"name": "t", "model": "${KVB_TEST_MODEL:-/nowhere}", "targets": [
        {"name": "v", "type": "endpoint", "base_url": "http://127.0.0.1:1"}]})
    assert cfg.models == ["/data/smol"]


def test_recipe_for_the_real_vllm_parses_with_its_default_path(monkeypatch):
    from kvbench.harness.sweep.config import load_config

    monkeypatch.delenv("KVBENCH_SMOL_HF", raising=False)
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "vllm-fp8-kv-smol.yaml"))
    assert cfg.models == ["/tmp/kvb-vllm/smol-hf"] and [k.scales for k in cfg.kv] == ["unit", "unit", "calibrate"]


def test_the_report_header_names_the_gpu_and_counts_planned_cells(tmp_path):
    text = device_text({"host": "h", "cpu": "AMD EPYC", "cpu_count": 16, "gpus": ["NVIDIA H200"], "gpu_memory_mib": [143771],
                        "driver": "580.159.04"})
    assert text == "NVIDIA H200 (143771 MiB), driver 580.159.04; CPU AMD EPYC ×16; host h"
    assert device_text({"cpu": "x", "cpu_count": 2}).startswith("no GPU seen")
    assert device_text({"gpus": ["A", "A"], "gpu_memory_mib": [1, 1]}).startswith("A (1 MiB) ×2")

    class Run:  # a run killed while its second server started: one cell folder, three cells planned
        path, manifest, config = tmp_path, {"cells": [{"key": "a"}, {"key": "b"}, {"key": "c"}]}, {}
        cells = [type("C", (), {"key": "a", "status": "done"})()]
        done_cells = cells

    rows = dict(run_meta(Run()))
    assert rows["cells"] == "1 done, 0 failed, 2 unfinished, of 3"


def test_gguf_to_hf_writes_a_directory_engines_load(tmp_path):
    """The default model's GGUF as an HF directory: the architecture named, no GGUF quantization left in the
    config, bf16 weights that transformers loads and that agree with the GGUF-loaded model."""
    from kvbench.runtime.default_model import default_model_path
    from kvbench.tools.gguf_to_hf import check, convert

    gguf = Path(default_model_path(quiet=True))
    out = tmp_path / "smol-hf"
    info = convert(gguf, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert info["params"] == 134_515_008 and (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    assert check(gguf, out) < 0.5  # bf16 rounding of the dequantized weights, on logits of magnitude ~20

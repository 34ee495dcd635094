"""The external-engine recipes (configs/sglang-gpt-oss-fp8.yaml, configs/vllm-fp8-kv.yaml) load, expand to the
expected cells and render the launch commands the engines take; --dry-run lists both."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.harness.matrix import expand, groups
from kvbench.harness.sweep.config import load_config
from kvbench.harness.targets import render_launch

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def launches(cfg) -> dict[str, list[str]]:
    """label of each group's first cell -> its launch command, split into arguments."""
    return {g[0].label: shlex.split(render_launch(cfg.target(g[0].config["target"]), g[0].config, 30000))
            for g in groups(expand(cfg))}


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, (name, args)
    return args[args.index(name) + 1]


def test_sglang_gpt_oss_recipe_is_the_pr_matrix():
    cfg = load_config(CONFIGS / "sglang-gpt-oss-fp8.yaml")
    cells = expand(cfg)
    assert [(c.label, c.run_accuracy, c.run_load) for c in cells] == [
        ("bf16/unit triton c=1000", True, False), ("bf16/unit triton c=768", False, True),
        ("bf16/unit trtllm_mha c=1000", True, False), ("bf16/unit trtllm_mha c=768", False, True),
        ("fp8_e4m3/unit triton+trtllm_mha c=1000", True, False), ("fp8_e4m3/unit triton+trtllm_mha c=768", False, True),
        ("bf16/unit triton c=500 A/A", True, False)]
    # evals: high reasoning effort at temperature 1.0, the gpt-oss protocol, 8 repeats
    (t,) = cfg.targets
    assert t.engine_kind == "sglang" and t.tp_size == 1 and t.flush_cache == "POST /flush_cache"
    assert t.request == {"reasoning_effort": "high", "temperature": 1.0}
    assert [(s.name, s.repeats, s.params) for s in cfg.suites] == [
        ("gpqa_diamond", 8, {"prompt_style": "gpt_oss"}), ("aime25", 8, {"prompt_style": "gpt_oss"})]
    # the serving benchmark: max concurrency 768, 15 requests/s Poisson, 1536 prompts
    ld = cfg.load
    assert (cfg.concurrency, ld.num_prompts, ld.request_rate, ld.burstiness) == ([768], 1536, 15.0, 1.0)
    assert not math.isinf(ld.request_rate) and cfg.accuracy_concurrency == 1000
    cmds = launches(cfg)
    hybrid = cmds["fp8_e4m3/unit triton+trtllm_mha c=1000"]
    assert hybrid[:3] == ["python", "-m", "sglang.launch_server"]
    assert flag(hybrid, "--kv-cache-dtype") == "fp8_e4m3"
    assert flag(hybrid, "--prefill-attention-backend") == "triton"
    assert flag(hybrid, "--decode-attention-backend") == "trtllm_mha"
    assert (flag(hybrid, "--model-path"), flag(hybrid, "--tp-size"), flag(hybrid, "--port")) == ("openai/gpt-oss-120b", "1", "30000")
    assert flag(hybrid, "--reasoning-parser") == "gpt-oss" and "--quantization-param-path" not in hybrid
    trt = cmds["bf16/unit trtllm_mha c=1000"]
    assert (flag(trt, "--kv-cache-dtype"), flag(trt, "--prefill-attention-backend"), flag(trt, "--decode-attention-backend")) == (
        "bf16", "trtllm_mha", "trtllm_mha")


def test_vllm_fp8_recipe_calibrates_only_the_fp8_cells():
    cfg = load_config(CONFIGS / "vllm-fp8-kv.yaml")
    cells = expand(cfg)
    assert len(cells) == 2 * 2 * 3 + 1
    cmds = launches(cfg)
    assert len(cmds) == 5  # 4 (backend, kv) servers + the A/A control's
    for label, args in cmds.items():
        fp8 = label.startswith("fp8_e4m3/calibrate")
        assert args[:2] == ["vllm", "serve"] and flag(args, "--tensor-parallel-size") == "1"
        assert flag(args, "--kv-cache-dtype") == ("fp8_e4m3" if fp8 else "auto")
        assert ("--calculate-kv-scales" in args) == fp8
        assert flag(args, "--attention-backend") == ("FLASH_ATTN" if "FLASH_ATTN" in label else "FLASHINFER")
    (t,) = cfg.targets
    assert t.engine_kind == "vllm" and t.flush_cache == "POST /reset_prefix_cache" and t.env == {"VLLM_SERVER_DEV_MODE": "1"}


def test_recipes_dry_run_cleanly(tmp_path):
    for name, n_cells, hybrid_flags in (
            ("sglang-gpt-oss-fp8", 7, "--kv-cache-dtype fp8_e4m3 --prefill-attention-backend triton --decode-attention-backend trtllm_mha"),
            ("vllm-fp8-kv", 13, "--kv-cache-dtype fp8_e4m3 --attention-backend FLASH_ATTN --calculate-kv-scales")):
        r = CliRunner().invoke(app, ["sweep", str(CONFIGS / f"{name}.yaml"), "--dry-run", "--out", str(tmp_path / name)])
        assert r.exit_code == 0, r.output
        lines = r.output.strip().splitlines()
        assert lines[-1] == f"{n_cells} cells -> {tmp_path / name}"
        cmds = [line for line in lines if line.startswith("  $ ")]
        assert len(cmds) == len([line for line in lines if line.startswith("launch for ")])
        assert any(hybrid_flags in c and "--port <port>" in c for c in cmds), cmds
        assert not (tmp_path / name).exists()


def test_the_sglang_recipe_runs_end_to_end_against_the_fake_sglang(tmp_path):
    """The recipe as written (its launch flags through the fake's copy of sglang's argparse, combos, the
    accuracy-only cells, the request options), with the model, data and load made small."""
    import sys

    import yaml

    sys.path.insert(0, str(Path(__file__).parent / "fake_engines"))
    from conformance import FAKE_SGLANG, PYTHON, fake_args, make_data, make_model, read_cells, run

    raw = yaml.safe_load((CONFIGS / "sglang-gpt-oss-fp8.yaml").read_text())
    t = raw["targets"][0]
    t["launch"] = t["launch"].replace("python -m sglang.launch_server", f"{PYTHON} {FAKE_SGLANG}")
    t["health_timeout_s"] = 30
    t["request"]["max_tokens"] = 256  # the fake model's context is 4096 tokens
    raw.update(model=str(make_model(tmp_path)), data_dir=str(make_data(tmp_path)))
    raw["load"].update(num_prompts=8, request_rate="inf", input_len=16, output_len=8, warmup=0, timeout_s=30)
    out = run(raw, tmp_path / "run")
    cells = {(c.config["prefill_backend"], c.config["decode_backend"], c.config["kv_dtype"], c.config["concurrency"]): c
             for c in read_cells(tmp_path / "run")}
    assert out.ok and len(cells) == 7, out.failed
    for (pre, dec, kv, conc), c in cells.items():
        if conc == 768:  # load cells: requests, no items; queueing read from the server's /metrics
            assert len(c.requests) == 8 and not c.items and c.summary["load"]
            assert c.summary["load"]["server_metrics"]["available"], "the recipe must start sglang with --enable-metrics"
            assert c.capacity["engine"] == "sglang" and c.capacity["tokens"] > 0
            continue
        assert not c.requests and c.summary["load"] is None and len(c.items) == 2 * 3 * 8  # 2 suites x 3 items x 8 repeats
        assert c.summary["suites"]["aime25"]["accuracy"] == 2 / 3
        assert c.summary["suites"]["gpqa_diamond"]["accuracy"] == 2 / 3  # the gpt-oss prompt, graded its way
        opts = c.items[0]["request_options"]
        assert (opts["reasoning_effort"], opts["temperature"]) == ("high", 1.0)
        if c.config.get("aa_control"):
            continue
        (launch,) = fake_args(c.server_log)
        a = launch["args"]
        assert (a["kv_cache_dtype"], a["prefill_attention_backend"], a["decode_attention_backend"]) == (kv, pre, dec)
        assert (a["reasoning_parser"], a["tp_size"]) == ("gpt-oss", 1)
    assert set(cells) >= {("triton", "trtllm_mha", "fp8_e4m3", 1000), ("triton", "trtllm_mha", "fp8_e4m3", 768)}


def test_the_vllm_recipe_runs_end_to_end_against_the_fake_vllm(tmp_path):
    """The vLLM recipe's launches (--attention-backend names, --calculate-kv-scales on the fp8 cells only,
    the dev-mode prefix-cache reset) through the fake's copy of vLLM's flags; suites and load made small."""
    import sys

    import yaml

    sys.path.insert(0, str(Path(__file__).parent / "fake_engines"))
    from conformance import FAKE_VLLM, PYTHON, fake_args, make_data, make_model, read_cells, run

    raw = yaml.safe_load((CONFIGS / "vllm-fp8-kv.yaml").read_text())
    t = raw["targets"][0]
    t["launch"] = t["launch"].replace("vllm serve", f"{PYTHON} {FAKE_VLLM} serve")
    t["health_timeout_s"] = 30
    raw.update(model=str(make_model(tmp_path)), data_dir=str(make_data(tmp_path)), aa_control=False,
               suites=[{"name": "gpqa_diamond", "max_tokens": 64}], gate={"max_drop": {"gpqa_diamond": 0.05}})
    raw["axes"]["concurrency"] = [1, 2]
    raw["accuracy_concurrency"] = 2
    raw["load"].update(num_prompts=4, prompts_per_concurrency=0, input_len=16, output_len=8, warmup=0)
    out = run(raw, tmp_path / "run")
    cells = read_cells(tmp_path / "run")
    assert out.ok and len(cells) == 8, out.failed
    launched = [a["args"] for c in cells for a in fake_args(c.server_log)]
    assert len(launched) == 4
    seen = set()
    for a in launched:
        fp8 = a["kv_cache_dtype"] == "fp8_e4m3"
        assert a["kv_cache_dtype"] in ("fp8_e4m3", "auto") and a["calculate_kv_scales"] == fp8
        seen.add((a["attention_backend"], a["kv_cache_dtype"]))
    assert seen == {("FLASHINFER", "auto"), ("FLASHINFER", "fp8_e4m3"), ("FLASH_ATTN", "auto"), ("FLASH_ATTN", "fp8_e4m3")}


def test_the_smol_vllm_recipe_launches_the_fake_with_every_flag_the_real_run_used(tmp_path, monkeypatch):
    """configs/vllm-fp8-kv-smol.yaml ran on a real vLLM 0.26 (docs/external-engines.md "A real vLLM"): its launch
    line (--max-num-seqs, --gpu-memory-utilization, --enforce-eager, --seed, --calculate-kv-scales on one fp8
    entry) passes the fake's copy of vLLM's argparse, and the admission limit it sets caps the reported
    concurrency."""
    import sys

    import yaml

    sys.path.insert(0, str(Path(__file__).parent / "fake_engines"))
    from conformance import FAKE_VLLM, PYTHON, fake_args, make_model, read_cells, run

    raw = yaml.safe_load((CONFIGS / "vllm-fp8-kv-smol.yaml").read_text())
    t = raw["targets"][0]
    t["launch"] = t["launch"].replace("vllm serve", f"{PYTHON} {FAKE_VLLM} serve")
    t["health_timeout_s"] = 30
    monkeypatch.setenv("KVBENCH_SMOL_HF", str(make_model(tmp_path)))
    raw.update(aa_control=False, suites=[], gate=None, accuracy_concurrency=2)
    raw["axes"]["concurrency"] = [2]
    raw["load"].update(num_prompts=4, prompts_per_concurrency=0, input_len=16, output_len=8, warmup=0)
    raw.pop("gate")
    out = run(raw, tmp_path / "run")
    cells = read_cells(tmp_path / "run")
    assert out.ok and len(cells) == 3, out.failed
    launched = sorted(((a["args"]["kv_cache_dtype"], a["args"]["calculate_kv_scales"], a["args"]["max_num_seqs"],
                        a["args"]["enforce_eager"]) for c in cells for a in fake_args(c.server_log)))
    assert launched == [("auto", False, 128, True), ("fp8_e4m3", False, 128, True), ("fp8_e4m3", True, 128, True)]
    assert all(c.capacity["max_num_seqs"] == 128 and c.capacity["max_concurrency"] <= 128 for c in cells)


def test_the_engine_against_vllm_sweep_expands_both_engines_on_one_shape(tmp_path, monkeypatch):
    """configs/vllm-vs-kvbench-8b.yaml: the same 12 load cells for vLLM (dummy weights, FLASH_ATTN) and kvbench
    serve (synthetic shape, triton) at the same KV memory; paths from the environment, expanded in the launch."""
    (tmp_path / "dummy").mkdir()
    (tmp_path / "dummy" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    monkeypatch.setenv("KVBENCH_LLAMA8B_DUMMY", str(tmp_path / "dummy"))
    monkeypatch.setenv("KVBENCH_SMOL_HF", "/models/smol-tok")
    r = CliRunner().invoke(app, ["sweep", str(CONFIGS / "vllm-vs-kvbench-8b.yaml"), "--dry-run", "--out", str(tmp_path / "r")])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert lines[-1].startswith("12 cells")
    cmds = [ln for ln in lines if ln.startswith("  $ ")]
    assert sum("--tokenizer /models/smol-tok" in c and "--kv-cache-memory-bytes 42949672960" in c for c in cmds) == 2
    assert sum("kvbench serve --model synthetic:llama-3-8b,vocab=49152" in c and "--kv-budget-gb 40" in c for c in cmds) == 2
    assert any("--kv-cache-dtype fp8 " in c for c in cmds) and any("--kv-dtype fp8_e4m3" in c for c in cmds)

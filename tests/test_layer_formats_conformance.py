"""Conformance of per-layer KV formats with vLLM: a sweep whose KV entries keep layers in bf16 reaches the fake
vLLM (tests/fake_engines/fake_vllm.py: ``--kv-cache-dtype-skip-layers`` as vLLM's argparse takes it,
``nargs="+"`` of layer indices and ``sliding_window``) verbatim, only for the entries that set a skip set, and
the capacity record follows the server's mixed KV pool; SGLang, which has no such flag, is refused when the
config loads."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fake_engines"))
from conformance import (BUDGET_MIB, FAKE_SGLANG, FAKE_VLLM, MODEL_CONFIG, PYTHON, expected_tokens, fake_args,  # noqa: E402
                         make_model, read_cells, run)

pytestmark = pytest.mark.timeout(120)

LAUNCH = (f"{PYTHON} {FAKE_VLLM} serve {{model}} --kv-cache-dtype {{kv_dtype}} --attention-backend {{attention_backend}} "
          "--max-num-seqs 4 --host {host} --port {port}")
SKIP_FLAG = {"kv_skip_layers": "--kv-cache-dtype-skip-layers {value}"}
LOAD = {"num_prompts": 4, "input_len": 16, "output_len": 4, "metrics_interval_s": 0, "timeout_s": 30}


def vllm_target(tmp_path: Path, **kw) -> dict:
    return {"name": "vllm", "type": "server", "launch": LAUNCH, "health_timeout_s": 20,
            "env": {"VLLM_SERVER_DEV_MODE": "1"}, "flush_cache": "POST /reset_prefix_cache",
            "kv_dtype_map": {"bf16": "bfloat16"}, "option_flags": SKIP_FLAG, **kw}


def test_skip_layers_reach_vllm_verbatim(tmp_path):
    model = make_model(tmp_path)  # 4 layers, 2 kv heads, head_dim 64
    raw = {"name": "skip", "model": str(model), "targets": [vllm_target(tmp_path)],
           "axes": {"backends": ["FLASHINFER"], "concurrency": [2],
                    "kv": ["fp8_e4m3", {"dtype": "fp8_e4m3", "kv_dtype_skip_layers": "3,0"}]},
           "load": LOAD, "aa_control": False}
    outcome = run(raw, tmp_path / "run")
    cells = read_cells(tmp_path / "run")
    assert outcome.ok and len(cells) == 2 and all(c.status == "done" for c in cells), [c.summary.get("error") for c in cells]
    by_skip = {(c.config.get("options") or {}).get("kv_dtype_skip_layers"): c for c in cells}
    assert set(by_skip) == {None, "0,3"}
    [plain] = fake_args(by_skip[None].server_log)
    [skip] = fake_args(by_skip["0,3"].server_log)
    assert plain["args"]["kv_cache_dtype_skip_layers"] == [] and "--kv-cache-dtype-skip-layers" not in plain["argv"]
    assert skip["args"]["kv_cache_dtype_skip_layers"] == ["0", "3"]
    i = skip["argv"].index("--kv-cache-dtype-skip-layers")
    assert skip["argv"][i + 1:i + 3] == ["0", "3"]  # one word per layer, as vLLM's nargs="+" takes them
    assert skip["args"]["kv_cache_dtype"] == plain["args"]["kv_cache_dtype"] == "fp8_e4m3"

    per_layer = 2 * MODEL_CONFIG["num_key_value_heads"] * MODEL_CONFIG["head_dim"]  # K and V elements of one layer
    mixed_bpt = 2 * per_layer * 2 + 2 * per_layer * 1  # layers 0 and 3 in bf16, 1 and 2 in fp8
    cap = by_skip["0,3"].capacity
    assert cap["tokens"] == BUDGET_MIB * 2**20 // (mixed_bpt * 16) * 16  # whole 16-token blocks of the mixed pool
    assert by_skip[None].capacity["tokens"] == expected_tokens(1)
    assert cap["bytes_per_token"] == pytest.approx(mixed_bpt, rel=1e-3)


def test_placeholder_renders_what_vllm_parses():
    """``{kv_skip_layers}`` in the launch: ranges expanded, sliding_window last; the fake vLLM's argparse (vLLM's
    flag shape) takes the rendered words."""
    sys.path.insert(0, str(FAKE_VLLM.parent))
    import fake_vllm

    from kvbench.harness.launch.options import render_command
    from kvbench.harness.matrix import expand
    from kvbench.harness.sweep.config import parse_config

    raw = {"model": "/m", "targets": [{"name": "vllm", "type": "server", "option_flags": {},
                                       "launch": LAUNCH + " --kv-cache-dtype-skip-layers {kv_skip_layers}"}],
           "axes": {"backends": ["FLASHINFER"], "kv": [{"dtype": "fp8_e4m3", "kv_dtype_skip_layers": "swa,5,0-2"}]}}
    sweep = parse_config(raw)
    cmd = render_command(sweep.targets[0], expand(sweep)[0].config, 8000)
    argv = shlex.split(cmd)[2:]  # after python and the fake's path
    args = fake_vllm.parser("latest").parse_args(argv)
    assert args.kv_cache_dtype_skip_layers == ["0", "1", "2", "5", "sliding_window"]


def test_sglang_refuses_skip_layers():
    from kvbench.harness.sweep.config import SweepConfigError, parse_config

    launch = (f"{PYTHON} {FAKE_SGLANG} --model-path {{model}} --kv-cache-dtype {{kv_dtype}} --host {{host}} "
              "--port {port}")
    raw = {"model": "/m", "targets": [{"name": "sg", "type": "server", "engine_kind": "sglang", "launch": launch}],
           "axes": {"kv": ["fp8_e4m3", {"dtype": "fp8_e4m3", "kv_dtype_skip_layers": [0, 1, 31]}]}}
    with pytest.raises(SweepConfigError) as e:
        parse_config(raw)
    msg = str(e.value)
    assert msg.startswith("axes.kv[1].kv_dtype_skip_layers: kv_skip_layers '0,1,31' does not reach target 'sg' "
                          "(targets[0]): sglang has no flag for it"), msg
    assert "vLLM has --kv-cache-dtype-skip-layers" in msg
    raw["axes"]["kv"] = ["fp8_e4m3"]  # the same target without the skip entry is fine
    assert parse_config(raw).targets[0].engine_kind == "sglang"

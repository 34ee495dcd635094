"""vLLM / SGLang spellings of the engine flags: each alias gives the same EngineConfig (and the same cell key)
as kvbench's own spelling; external engines' backend names are refused naming the flag and the engine."""

from __future__ import annotations

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from kvbench.core.formats import ENGINE_ALIASES, canonical_format, format_names
from kvbench.harness.launch.options import EXTERNAL_BACKENDS, external_backend_engines
from kvbench.harness.options import ENGINE_ALIAS_PARAMS, ENGINE_PARAMS, engine_options
from kvbench.core.io import canonical_key

_seen: list = []
_app = typer.Typer()


@_app.command("run")
@engine_options
def _run(engine) -> None:
    _seen.append(engine)


@_app.command("other")
def _other() -> None:  # a second command keeps "run" a subcommand
    pass


def config_of(*argv):
    _seen.clear()
    r = CliRunner().invoke(_app, ["run", "--device", "cpu", *map(str, argv)])
    assert r.exit_code == 0, r.output
    return _seen[-1]


def error_of(*argv) -> str:
    _seen.clear()
    r = CliRunner().invoke(_app, ["run", "--device", "cpu", *map(str, argv)])
    assert r.exit_code == 2 and not _seen, r.output
    return " ".join(r.output.replace("│", " ").split())


PAIRS = [
    (["--kv-cache-dtype", "fp8"], ["--kv-dtype", "fp8_e4m3"]),
    (["--kv-cache-dtype", "fp8_e5m2"], ["--kv-dtype", "fp8_e5m2"]),
    (["--kv-cache-dtype", "fp4_e2m1"], ["--kv-dtype", "nvfp4"]),
    (["--kv-cache-dtype", "nvfp4"], ["--kv-dtype", "nvfp4"]),
    (["--kv-cache-dtype", "bfloat16"], ["--kv-dtype", "bf16"]),
    (["--kv-cache-dtype", "float16"], ["--kv-dtype", "fp16"]),
    (["--kv-cache-dtype", "auto"], ["--kv-dtype", "bf16"]),
    (["--kv-cache-dtype", "auto", "--dtype", "float16"], ["--kv-dtype", "fp16", "--dtype", "float16"]),
    (["--kv-cache-dtype", "auto", "--dtype", "float32"], ["--kv-dtype", "bf16", "--dtype", "float32"]),
    (["--kv-dtype", "FP8"], ["--kv-dtype", "fp8_e4m3"]),
    (["--attention-backend", "triton"], ["--backend", "triton"]),
    (["--attention-backend", "TRITON"], ["--backend", "triton"]),
    (["--prefill-attention-backend", "triton"], ["--prefill-backend", "triton"]),
    (["--decode-attention-backend", "triton"], ["--decode-backend", "triton"]),
    (["--backend", "triton", "--decode-attention-backend", "torch"], ["--prefill-backend", "triton", "--decode-backend", "torch"]),
    (["--max-num-seqs", "7"], ["--max-running", "7"]),
    (["--gpu-memory-utilization", "0.5"], ["--mem-fraction", "0.5"]),
    (["--mem-fraction-static", "0.5"], ["--mem-fraction", "0.5"]),
    (["--block-size", "32"], ["--page-size", "32"]),
    (["--context-length", "2048"], ["--max-model-len", "2048"]),
    (["--kv-cache-dtype-skip-layers", "31 0 1"], ["--kv-dtype-skip-layers", "0,1,31"]),
]


@pytest.mark.parametrize("alias,canonical", PAIRS)
def test_alias_gives_the_same_engine_config_and_key(alias, canonical):
    a, c = config_of(*alias), config_of(*canonical)
    assert a == c
    assert canonical_key(a.to_dict()) == canonical_key(c.to_dict())


def test_every_alias_is_exercised():
    used = {a[i] for a, _ in PAIRS for i in range(0, len(a), 2)}
    flags = {opt.param_decls[0] for _, _, opt in ENGINE_ALIAS_PARAMS.values()}
    assert flags <= used, flags - used
    assert {f for f, _, _ in ENGINE_ALIAS_PARAMS.values()} <= set(ENGINE_PARAMS)


def test_alias_values_change_the_config():
    base = config_of()
    assert (base.kv_dtype, base.max_running, base.page_size, base.max_model_len) == ("bf16", 64, 16, None)
    cfg = config_of("--kv-cache-dtype", "fp8", "--max-num-seqs", "3", "--block-size", "64", "--context-length", "512",
                    "--gpu-memory-utilization", "0.4", "--attention-backend", "triton")
    assert (cfg.kv_dtype, cfg.max_running, cfg.page_size, cfg.max_model_len, cfg.mem_fraction) == ("fp8_e4m3", 3, 64, 512, 0.4)
    assert (cfg.prefill_backend, cfg.decode_backend) == ("triton", "triton")


def test_engine_alias_table_names_registered_formats():
    assert set(ENGINE_ALIASES.values()) <= set(format_names())
    assert canonical_format("fp8") == "fp8_e4m3" and canonical_format("NVFP4") == "nvfp4"
    assert canonical_format("auto", "float16") == "fp16" and canonical_format("auto", "bfloat16") == "bf16"
    with pytest.raises(ValueError, match="engine spellings: auto, fp8"):
        canonical_format("fp9")


@pytest.mark.parametrize("flag,value,engine", [
    ("--attention-backend", "trtllm_mha", "sglang"),
    ("--attention-backend", "FLASH_ATTN", "vllm"),
    ("--prefill-attention-backend", "fa3", "sglang"),
    ("--decode-backend", "flashmla", "sglang and vllm"),
    ("--backend", "TRITON_ATTN", "vllm"),
])
def test_external_backend_names_are_refused_naming_flag_and_engine(flag, value, engine):
    text = error_of(flag, value)
    assert f"'{flag}'" in text and f"{value}: " in text and f"{engine} attention backend" in text, text
    assert "the embedded engine runs torch, triton, flashinfer" in text and "docs/external-engines.md" in text, text


def test_unknown_names_still_list_the_choices():
    assert "--kv-cache-dtype" in error_of("--kv-cache-dtype", "fp9") and "fp8_e4m3" in error_of("--kv-cache-dtype", "fp9")
    text = error_of("--attention-backend", "warp")
    assert "--attention-backend" in text and "warp" in text and "torch" in text, text


def test_conflicting_spellings_are_refused():
    text = error_of("--kv-dtype", "bf16", "--kv-cache-dtype", "fp8")
    assert "--kv-dtype bf16 and --kv-cache-dtype fp8" in text, text
    text = error_of("--gpu-memory-utilization", "0.5", "--mem-fraction-static", "0.6")
    assert "--gpu-memory-utilization 0.5 and --mem-fraction-static 0.6" in text, text
    assert config_of("--max-running", "5", "--max-num-seqs", "5").max_running == 5  # agreeing: fine


def test_external_backend_table():
    assert external_backend_engines("TRTLLM_MHA") == ("sglang",)
    assert external_backend_engines("flash_attn") == ("vllm",) and external_backend_engines("torch") == ()
    assert all(n == n.lower() for n in EXTERNAL_BACKENDS)


def test_real_commands_carry_the_aliases():
    from kvbench.harness.cli import app

    cmd = get_command(app)
    for name in ("serve", "eval"):
        opts = {o for p in cmd.commands[name].params for o in p.opts}
        assert {"--kv-cache-dtype", "--attention-backend", "--max-num-seqs", "--gpu-memory-utilization",
                "--block-size", "--context-length", "--kv-dtype", "--backend"} <= opts, name
    conc = next(p for p in cmd.commands["eval"].params if p.name == "concurrency")
    assert set(conc.opts) == {"--concurrency", "--max-concurrency"}


def test_sweep_kv_entries_take_engine_spellings_with_the_same_cell_keys():
    from kvbench.harness.matrix import expand
    from kvbench.harness.sweep.config import parse_config

    def keys(kv):
        raw = {"engine": {"device": "cpu"}, "axes": {"backends": ["torch"], "kv": kv, "concurrency": [1]}}
        return [c.key for c in expand(parse_config(raw))]

    assert keys(["fp8", {"dtype": "bfloat16"}, "FP4_E2M1"]) == keys(["fp8_e4m3", {"dtype": "bf16"}, "nvfp4"])
